"""The main job: a small Flower simulation of paper 000's experiment, on Ray.

``flwr-corrnoise simulate`` runs the logistic-regression app (20 learners, d = 100, τ = 4)
on Flower's Ray simulation engine once per method (default: noiseless, independent noise,
optimized correlated noise at (ε, δ) = (2, 10⁻³)), then writes a comparison plot and
prints where everything went. Defaults finish in about two minutes on 2 cores.

Experiment code, not installed: it writes files, draws with matplotlib and sets process-wide
environment variables (Flower's telemetry off, Ray's accelerator warning off), none of which a
library may do to its user's process. The apps it runs are the library's reference app
(:mod:`flwr_corrnoise.apps.logreg`).
"""

from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path

from flwr_corrnoise.apps.logreg import logreg_apps
from flwr_corrnoise.apps.logreg_task import LogRegSetup

BACKEND = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False},
}


def run_demo(
    out: Path,
    rounds: int = 60,
    methods: tuple[str, ...] = ("none", "independent", "optimized"),
    epsilon: float = 2.0,
    delta: float = 1e-3,
    eta: float = 0.05,
    learners: int = 20,
) -> list[Path]:
    """Run one Flower simulation per method; return the result directories."""
    # this process is the demo's own (the CLI's `simulate`), so its environment is ours to set
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.ERROR)
    dirs = []
    for i, method in enumerate(methods, 1):
        setup = LogRegSetup(num_learners=learners, rounds=rounds, mechanism=method,
                            epsilon=epsilon, delta=delta, eta=eta)
        target = out / ("noiseless" if method == "none" else method)
        print(f"[{i}/{len(methods)}] Flower simulation (Ray), {learners} learners, {rounds} "
              f"rounds: {setup.label}", file=sys.stderr, flush=True)
        server_app, client_app = logreg_apps(setup, str(target), progress=True)
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=learners, backend_config=BACKEND)
        dirs.append(target)
    plot_histories(dirs, out / "accuracy.png")
    return dirs


def plot_histories(dirs: list[Path], path: Path) -> None:
    """Test accuracy and online loss vs round, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for d in dirs:
        with open(d / "history.csv") as fh:
            rows = list(csv.DictReader(fh))
        r = [float(row["round"]) for row in rows]
        ax1.plot(r, [float(row["test-accuracy"]) for row in rows], label=d.name)
        online = [(float(row["round"]), float(row["online-loss"])) for row in rows
                  if row.get("online-loss")]
        ax2.plot([a for a, _ in online], [b for _, b in online], label=d.name)
    ax1.set(xlabel="round", ylabel="test accuracy", title="global model x^r")
    ax2.set(xlabel="round", ylabel="online loss f^r(x^r)", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
