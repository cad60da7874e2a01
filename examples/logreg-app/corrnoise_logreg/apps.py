"""ServerApp and ClientApp of the logistic-regression experiment (read from run config)."""

from flwr_corrnoise.apps.logreg import client_app, server_app

__all__ = ["client_app", "server_app"]
