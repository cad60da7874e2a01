"""Helpers for tests that run Flower's real simulation engine (Ray)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation

BACKEND: dict[str, Any] = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False},
}


def simulate(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    backend: dict[str, Any] | None = None,
) -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=num_supernodes,
        backend_config=backend or BACKEND,
    )


def read_results(out: Path) -> tuple[np.ndarray, dict[str, Any]]:
    return np.load(out / "final_model.npy"), json.loads((out / "summary.json").read_text())


def local_sgd(setup: Any, learner: int, r: int, x: np.ndarray) -> np.ndarray:
    """τ plain SGD steps of ``learner`` in round ``r`` from ``x`` (the unmodified app that
    the per-round and central variants wrap), for replays in tests."""
    from flwr_corrnoise.apps.logreg_task import logistic_gradient

    grad, z = logistic_gradient(setup, learner), np.array(x, dtype=np.float64)
    for t in range(setup.tau):
        z = z - setup.eta * grad([z], r * setup.tau + t)[0]
    return z


def fingerprint(reply: Any) -> dict[str, Any]:
    """Everything in a reply except the values of its arrays: the neighbouring-stream
    tests compare these (record names, array names, shapes and dtypes, every metric and
    config value, error codes and reasons)."""
    from flwr.app import ArrayRecord

    if reply.has_error():
        return {"error": (reply.error.code, reply.error.reason)}
    out: dict[str, Any] = {"records": sorted(reply.content.keys())}
    for name, rec in reply.content.items():
        if isinstance(rec, ArrayRecord):
            out[name] = [(k, tuple(a.shape), a.dtype) for k, a in rec.items()]
        else:
            out[name] = dict(rec)
    return out
