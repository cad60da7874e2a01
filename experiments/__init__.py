"""Experiment code of the repository, *not* part of the installed ``flwr_corrnoise`` package.

Paper reproductions and what only they need: dataset-specific loaders (MNIST/Fashion-MNIST
search paths, mushrooms, letter, poker) and their decentralized task registrations
(:mod:`experiments.tasks`), Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online
Federated Learning With Correlated Noise") CNN (:mod:`experiments.cnn`), the in-process sweep driver
of the logistic-regression experiment (:mod:`experiments.logreg`), the relay's results files
(:mod:`experiments.relay`) and the demo behind ``flwr-corrnoise simulate``
(:mod:`experiments.demo`). The runnable scripts that write the figures are in ``simulations/``.

Import it from the repository root (``python -m simulations.…``, ``python -m pytest``); the
``flwr-corrnoise`` console script finds it in the source checkout it was installed from
(``pip install -e .``). Why it is kept out of the wheel: docs/architecture.md, "What is library
and what is experiment".
"""
