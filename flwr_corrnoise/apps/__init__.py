"""The library's reference Flower app, built on the public API: the logistic-regression
learner on synthetic streams (:mod:`~flwr_corrnoise.apps.logreg`, its task in
:mod:`~flwr_corrnoise.apps.logreg_task`), which ``flwr run`` (``examples/logreg-app``), the
deployment in ``deploy/`` and the experiments in ``experiments/`` and ``simulations/`` use."""
