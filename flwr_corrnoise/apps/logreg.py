"""The reference Flower app: online logistic regression on synthetic(α, β) streams with
correlated-noise local DP (Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online
Federated Learning With Correlated Noise") Sec. V-A setting), built only from the public API.

It is library, not experiment code, because processes that can import only installed code
run it: ``flwr run`` on ``examples/logreg-app`` and the SuperNodes of ``deploy/``. Its task
(configuration, data, gradient, server-side evaluation) is
:mod:`flwr_corrnoise.apps.logreg_task`.

``flwr run .`` uses the module-level :data:`server_app` and :data:`client_app` (see
``[tool.flwr.app.components]`` in ``pyproject.toml``), which read the experiment from
``context.run_config`` (kebab-case keys, :class:`~flwr_corrnoise.apps.logreg_task.LogRegSetup`).
:func:`logreg_apps` builds the same pair around a given setup, for
``flwr.simulation.run_simulation`` (which takes no run config).

Server-side run-config keys besides the experiment's: ``results-dir``; ``min-learners``
(the fewest connected learners a round starts with; the first round always waits for
all ``num-learners``); ``round-timeout``
(seconds the server waits for a round's replies; learners that have not answered by then
are left out of that round — a dropped or late learner never blocks the run) and
``checkpoint-dir`` (save the server's progress after every round and resume from it when
the run is started again: see :mod:`flwr_corrnoise.flower.checkpoint`) and
``max-idle-rounds`` (the run fails after that many rounds without an update).

The ServerApp writes ``history.csv`` (one row per round: test accuracy and loss, online
loss, round optimum, privacy), ``privacy.csv`` (ε spent per learner and round),
``summary.json`` and ``final_model.npy`` to ``results-dir``; ``flwr-corrnoise report
RESULTS_DIR`` prints and plots them.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..flower import CorrNoiseFedAvg, make_client_app
from ..flower.checkpoint import ServerCheckpoint, fingerprint
from ..settings_keys import lookup, reading
from .logreg_task import LogRegEvaluator, LogRegSetup, initial_parameters, logistic_gradient

log = logging.getLogger(__name__)

DEFAULT_RESULTS = "results/logreg-flower"
DEFAULT_ROUND_TIMEOUT = 3600.0


def _setup(base: LogRegSetup | None, run_config: Mapping[str, Any]) -> LogRegSetup:
    merged = {**(base or LogRegSetup()).to_run_config(), **dict(run_config)}
    return LogRegSetup.from_run_config(merged)


def wait_for_nodes(grid: Grid, count: int, timeout: float = 300.0) -> list[int]:
    """Block until ``count`` SuperNodes are connected.

    Why: FedAvg sizes its sample from the nodes connected *when the round starts*; in a
    simulation the virtual SuperNodes register concurrently with the ServerApp, so the
    first round could otherwise run with fewer learners than configured.
    """
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} of {count} learners connected")
        time.sleep(0.05)
    return nodes


def write_results(
    out: Path, setup: LogRegSetup, evaluator: LogRegEvaluator, strategy: CorrNoiseFedAvg,
    final: list[np.ndarray], seconds: float,
) -> dict[str, Any]:
    """history.csv, summary.json and final_model.npy in ``out``; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    rows = evaluator.rows
    keys = sorted({k for row in rows for k in row}, key=lambda k: (k != "round", k))
    with open(out / "history.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    np.save(out / "final_model.npy", final[0])
    summary = {
        "setup": setup.as_dict(),
        **evaluator.summary(),
        "seconds": seconds,
        "learners": {str(k): v for k, v in strategy.privacy.items()},
        "rounds_with_errors": [r for r in strategy.rounds if r["errors"] or r["rejected"]],
        "participation": [[int(i) for i in r["learners"]] for r in strategy.rounds],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    with open(out / "privacy.csv", "w", newline="") as fh:  # ε per learner per round
        writer = csv.writer(fh)
        writer.writerow(["round", "learner", "epsilon-spent"])
        for entry in strategy.rounds:
            for who, spent in sorted(entry.get("epsilon-spent", {}).items()):
                writer.writerow([entry["round"], who, spent])
    return summary


def logreg_apps(
    setup: LogRegSetup | None = None, results_dir: str | None = None, progress: bool = True,
    regret: bool = True,
) -> tuple[ServerApp, ClientApp]:
    """A (ServerApp, ClientApp) pair for the experiment; ``setup`` overrides defaults and
    is itself overridden by ``context.run_config``. ``regret=False``: the server's
    evaluator skips the per-round optimum (the dynamic regret is then NaN)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        with reading(context.run_config, "run config"):  # a near-miss key is an error
            s = _setup(setup, context.run_config)
            max_idle = lookup(context.run_config, "max-idle-rounds", "run config")
        out = Path(str(context.run_config.get("results-dir", results_dir or DEFAULT_RESULTS)))
        wait_for_nodes(grid, s.num_learners)
        ckpt_dir = str(context.run_config.get("checkpoint-dir", ""))
        key = fingerprint({k: v for k, v in s.as_dict().items() if k != "rounds"})
        strategy = CorrNoiseFedAvg(
            local_steps=s.tau,
            learning_rate=s.eta,
            server_learning_rate=s.eta_g,
            privacy=s.settings(),
            fraction_train=s.fraction_train,
            # after the first round, go on with whoever is connected: a learner that crashed
            # must not stall the others (it rejoins when it is back)
            min_available_nodes=int(context.run_config.get("min-learners", 1)),
            checkpoint=ServerCheckpoint(ckpt_dir, key) if ckpt_dir else None,
            # a run whose learners all refuse fails instead of ending with x^0
            max_idle_rounds=max_idle,
        )
        evaluator = LogRegEvaluator(s, progress=progress, label=f"flower {s.label}",
                                    regret=regret)

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            row = evaluator(server_round, arrays.to_numpy_ndarrays())
            return MetricRecord({k: float(v) for k, v in row.items() if np.isfinite(v)})

        start = time.perf_counter()
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial_parameters(s)),
            num_rounds=s.rounds,
            timeout=float(context.run_config.get("round-timeout", DEFAULT_ROUND_TIMEOUT)),
            evaluate_fn=evaluate_fn,
        )
        evaluator.rows = [dict(e) for e in strategy.evaluations]  # with rounds before a restart
        final = result.arrays.to_numpy_ndarrays()
        summary = write_results(out, s, evaluator, strategy, final, time.perf_counter() - start)
        print(
            f"flwr-corrnoise: {s.label}: final accuracy {summary['final_accuracy']:.3f}; "
            f"results in {out.resolve()}",
            flush=True,
        )

    def gradient_factory(context: Context):
        s = _setup(setup, context.run_config)
        return logistic_gradient(s, int(context.node_config["partition-id"]))

    defaults = setup.to_run_config() if setup is not None else LogRegSetup().to_run_config()
    client_app = make_client_app(gradient_factory, config_defaults=defaults)
    return server_app, client_app


server_app, client_app = logreg_apps()
