"""Run the logreg Flower app on an existing Ray cluster (subprocess of test_ray_cluster.py).

Usage: python -m tests.ray_cluster_job ADDRESS OUT_DIR
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

import ray
from flwr.simulation import run_simulation

from flwr_corrnoise.apps.logreg import logreg_apps
from flwr_corrnoise.apps.logreg_task import LogRegSetup, logistic_gradient
from flwr_corrnoise.flower import make_client_app


def main() -> None:
    address, out = sys.argv[1], sys.argv[2]
    logging.getLogger("flwr").setLevel(logging.ERROR)
    setup = LogRegSetup(num_learners=3, dim=6, rounds=3, tau=2, mechanism="toeplitz",
                        test_size=100, seed=5)
    server_app, _ = logreg_apps(setup, out, progress=False)

    def gradient_factory(context):
        # runs inside the Ray actor: record which cluster hosts the virtual learners
        pid = int(context.node_config["partition-id"])
        with open(os.path.join(out, f"gcs-{pid}.txt"), "w") as fh:
            fh.write(ray.get_runtime_context().gcs_address)
        return logistic_gradient(setup, pid)

    client_app = make_client_app(gradient_factory, config_defaults=setup.to_run_config())
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=setup.num_learners,
        # one ClientApp actor on the head's 2 CPUs: an actor is a process that imports
        # Flower, Ray and the app (≈ 5–6 s of CPU); the point here is the cluster
        backend_config={"client_resources": {"num_cpus": 2},
                        "init_args": {"address": address, "logging_level": "ERROR",
                                      "log_to_driver": False}},
    )
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
