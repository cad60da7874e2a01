"""Flower app components for `flwr run` (the implementation is in flwr_corrnoise)."""
