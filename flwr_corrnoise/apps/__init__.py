"""Ready-made Flower apps built on the public API (used by ``flwr run .`` and the
experiments in ``simulations/``)."""
