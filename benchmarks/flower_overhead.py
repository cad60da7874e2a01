"""Seconds per round on Flower's Ray simulation: plain FedAvg vs CorrNoiseFedAvg.

    python benchmarks/flower_overhead.py --rounds 30 --repeats 2

Both runs use the same 20-learner logistic-regression setting (d = 100, τ = 4, synthetic
data of Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated Learning With
Correlated Noise") on Flower's Ray backend. "plain" is Flower's own
``flwr.serverapp.strategy.FedAvg`` with a ClientApp taking τ noiseless local SGD steps; "corrnoise"
is ``CorrNoiseFedAvg`` with ``make_client_app`` (clipping, optimized correlated noise, state in
``context.state``, privacy checks and reports). Per-round time is the interval between consecutive
``evaluate_fn`` calls; we report the median over rounds 2..R (round 1 includes actor start-up). The
runs alternate (plain, corrnoise, plain, ...) and the ratio is taken within each pair, so machine
noise affects both sides alike.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from flwr_corrnoise.apps.logreg import wait_for_nodes
from flwr_corrnoise.apps.logreg_task import LogRegSetup, initial_parameters, logistic_gradient
from flwr_corrnoise.flower import CorrNoiseFedAvg, make_client_app
from flwr_corrnoise.mechanisms import mechanism_names
from flwr_corrnoise.settings import NOISELESS

BACKEND = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False},
}


def plain_apps(setup: LogRegSetup, marks: list[float]) -> tuple[ServerApp, ClientApp]:
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        grad = logistic_gradient(setup, int(context.node_config["partition-id"]))
        pos = int(context.state["pos"]["p"]) if "pos" in context.state else 0
        params = msg.content["arrays"].to_numpy_ndarrays()
        x = params[0].astype(np.float64)
        for t in range(setup.tau):
            x = x - setup.eta * grad([x], pos + t)[0]
        context.state["pos"] = MetricRecord({"p": pos + setup.tau})
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": setup.tau})}),
                       reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, setup.num_learners)
        FedAvg(fraction_evaluate=0.0, min_available_nodes=setup.num_learners).start(
            grid=grid, initial_arrays=ArrayRecord(initial_parameters(setup)),
            num_rounds=setup.rounds,
            evaluate_fn=lambda r, a: marks.append(time.perf_counter()) and None,
        )

    return server, client


def corrnoise_apps(setup: LogRegSetup, marks: list[float]) -> tuple[ServerApp, ClientApp]:
    client = make_client_app(
        lambda context: logistic_gradient(setup, int(context.node_config["partition-id"])),
        config_defaults=setup.to_run_config(),
    )
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, setup.num_learners)
        CorrNoiseFedAvg(local_steps=setup.tau, learning_rate=setup.eta, privacy=setup.settings(),
                        min_available_nodes=setup.num_learners).start(
            grid=grid, initial_arrays=ArrayRecord(initial_parameters(setup)),
            num_rounds=setup.rounds,
            evaluate_fn=lambda r, a: marks.append(time.perf_counter()) and None,
        )

    return server, client


def backend(ray_address: str = "", num_cpus: int | None = None,
            client_cpus: float = 1.0) -> dict:
    """:data:`BACKEND` (a fresh local Ray of ``num_cpus`` CPUs, 2 by default), or the same
    actors on the running Ray cluster at ``ray_address`` (joining a cluster takes no
    ``num_cpus``: its CPUs are its own). ``client_cpus`` is Flower's
    ``client_resources.num_cpus``: Flower runs (the cluster's CPUs) / ``client_cpus``
    ClientApp actors, each a process that imports Flower, Ray and the app."""
    if ray_address:
        init_args = {"address": ray_address, "logging_level": "ERROR", "log_to_driver": False}
    else:
        init_args = {**BACKEND["init_args"]}
        if num_cpus is not None:
            init_args["num_cpus"] = num_cpus
    return {"client_resources": {**BACKEND["client_resources"], "num_cpus": client_cpus},
            "init_args": init_args}


def per_round(build, setup: LogRegSetup, ray_address: str = "",
              client_cpus: float = 1.0) -> float:
    marks: list[float] = []
    server, client = build(setup, marks)
    run_simulation(server_app=server, client_app=client, num_supernodes=setup.num_learners,
                   backend_config=backend(ray_address, client_cpus=client_cpus))
    return statistics.median(np.diff(marks[1:]))


def client_side_ms(setup: LogRegSetup, rounds: int) -> tuple[float, float]:
    """Milliseconds per learner-round spent in the learner's own code, outside Flower:
    ours (load state from ``context.state``, τ clipped noisy steps, save state) and the
    plain client's τ SGD steps. Shows how much of a round our code can account for."""
    from flwr.app import Context, RecordDict

    from flwr_corrnoise.flower import CorrNoiseLearner

    grad = logistic_gradient(setup, 0)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config=setup.to_run_config())
    x = initial_parameters(setup)
    config = {"local-steps": setup.tau, "learning-rate": setup.eta}
    start = time.perf_counter()
    for _ in range(rounds):
        CorrNoiseLearner(ctx, grad, config_defaults=setup.to_run_config()).train(x, config)
    ours = (time.perf_counter() - start) / rounds
    start = time.perf_counter()
    for r in range(rounds):
        z = x[0].copy()
        for t in range(setup.tau):
            z = z - setup.eta * grad([z], r * setup.tau + t)[0]
    plain = (time.perf_counter() - start) / rounds
    return 1e3 * ours, 1e3 * plain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mechanism", default="optimized", choices=[NOISELESS, *mechanism_names()])
    p.add_argument("--ray-address", default="", help="run on this existing Ray cluster "
                   "(2 CPUs free) instead of a fresh local Ray per simulation")
    p.add_argument("--client-cpus", type=float, default=1.0, help="Flower's "
                   "client_resources.num_cpus: Ray runs (CPUs) / this many ClientApp actors")
    args = p.parse_args()
    if args.rounds < 3:
        p.error("--rounds must be ≥ 3 (the median is over rounds 2..R)")
    logging.getLogger("flwr").setLevel(logging.ERROR)
    setup = LogRegSetup(rounds=args.rounds, mechanism=args.mechanism, test_size=10)
    setup.settings().calibration()  # build the factorization outside the timed rounds
    ratios = []
    for rep in range(args.repeats):
        plain = per_round(plain_apps, setup, args.ray_address, args.client_cpus)
        ours = per_round(corrnoise_apps, setup, args.ray_address, args.client_cpus)
        ratios.append(ours / plain)
        print(f"repeat {rep + 1}: plain FedAvg {plain:.3f} s/round, CorrNoiseFedAvg "
              f"({args.mechanism}) {ours:.3f} s/round, ratio {ours / plain:.2f}", flush=True)
    print(f"median ratio over {args.repeats} pairs: {statistics.median(ratios):.2f}")
    ours_ms, plain_ms = client_side_ms(setup, args.rounds)
    print(f"learner code per learner-round, outside Flower: ours {ours_ms:.2f} ms, plain "
          f"{plain_ms:.2f} ms (× {setup.num_learners} learners = "
          f"{setup.num_learners * (ours_ms - plain_ms) / 1e3:.3f} s extra per round if serial)")


if __name__ == "__main__":
    main()
