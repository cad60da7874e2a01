"""The main job (README command 1): what correlated noise buys, in about a minute.

``flwr-corrnoise simulate`` runs online logistic regression with local DP on a task a
single global model learns well (:data:`DEMO`: 10 learners, d = 20, 20 rounds of τ = 50
local steps, the reference app's ``shared`` data), at one budget (ε, δ) = (2, 10⁻³) per
learner, for three methods: no noise, independent noise (Liu et al.) and BLT correlated
noise (the library's default mechanism). It shows:

* every method on ``seeds`` seeds (new data and new noise each) on the in-process engine
  (:func:`flwr_corrnoise.engine.run_inprocess`, the same learner and server code as the
  Flower apps), drawn as the mean and the min–max band over the seeds;
* one configuration (``flower``: BLT, the first seed) end to end on Flower's simulation
  engine (Ray, the reference ServerApp and ClientApp), drawn as markers on its band, and
  checked against the in-process run of the same seed (the same final model, to float
  rounding: the engines share every step);
* ``accuracy.png`` (test accuracy and online loss against the round, with the budget on
  the figure), ``curves.csv``, ``summary.csv``, and the Flower run's results directory
  (``flwr-corrnoise report`` reads it).

The step size η of each method is tuned for this setting on seeds that are not plotted
(:data:`ETAS`, ``python -m experiments.demo --tune``): noise needs a smaller step, and a
comparison at one η for all would show the step size, not the noise.

Experiment code, not installed: it writes files, draws with matplotlib and sets process-wide
environment variables (Flower's telemetry off, Ray's accelerator warning off), none of which a
library may do to its user's process. The apps it runs are the library's reference app
(:mod:`flwr_corrnoise.apps.logreg`).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flwr_corrnoise.apps.logreg import logreg_apps
from flwr_corrnoise.apps.logreg_task import LogRegEvaluator, LogRegSetup
from flwr_corrnoise.report import colour

from .logreg import run_logreg_inprocess

#: the demo's setting: a task a global model learns well (≈ 0.89 without noise), a horizon
#: of N = 1000 local steps per learner, and the budget every private learner keeps
DEMO = LogRegSetup(num_learners=10, dim=20, rounds=20, tau=50, labels="shared",
                   epsilon=2.0, delta=1e-3, test_size=1000)

#: η per method, tuned by ``python -m experiments.demo --tune`` (final accuracy, mean over
#: the tuning seeds 100–102, grid 0.01 0.03 0.1 0.3 1; every grid point's score is in
#: docs/results-demo-tuning.csv, written by ``python -m simulations.doc_numbers
#: demo-tuning``): each method at its best step size. The other correlated mechanisms take
#: BLT's (their noise is within 5 % of it)
ETAS = {"none": 1.0, "independent": 0.01, "blt": 0.1, "optimized": 0.1, "toeplitz": 0.1,
        "tree": 0.1, "efficient-tree": 0.1}


def eta_of(method: str) -> float:
    """The demo's η of a method; a mechanism without its own tuned η takes BLT's."""
    return ETAS.get(method, ETAS["blt"])


TUNING_SEEDS = (100, 101, 102)
TUNING_GRID = (0.01, 0.03, 0.1, 0.3, 1.0)
METHODS = ("none", "independent", "blt")
NAMES = {"none": "no noise", "independent": "independent noise (Liu et al.)",
         "blt": "correlated noise (BLT)", "optimized": "correlated noise (optimized)",
         "toeplitz": "correlated noise (Toeplitz)", "tree": "correlated noise (tree)",
         "efficient-tree": "correlated noise (efficient tree)"}

BACKEND = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False},
}


@dataclass
class DemoResult:
    """What :func:`run_demo` made: curves per method and seed, the Flower run's check."""

    out: Path
    setup: LogRegSetup
    #: method → seed → rows of the evaluator (round, test-accuracy, online-loss, …)
    curves: dict[str, dict[int, list[dict[str, float]]]] = field(default_factory=dict)
    flower_method: str | None = None
    flower_seed: int | None = None
    #: largest |x_flower − x_inprocess| over the final model's coordinates
    flower_difference: float = float("nan")
    flower_dir: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    failure: BaseException | None = None

    def final_accuracies(self, method: str) -> np.ndarray:
        return np.array([rows[-1]["test-accuracy"] for rows in self.curves[method].values()])


def label(method: str) -> str:
    return "noiseless" if method == "none" else method


def setup_for(method: str, seed: int, base: LogRegSetup = DEMO) -> LogRegSetup:
    """One run of the demo: the method, its tuned η, new data and noise per seed."""
    return base.with_(mechanism=method, eta=eta_of(method), seed=seed, data_seed=seed)


def run_inprocess(setup: LogRegSetup) -> tuple[list[dict[str, float]], np.ndarray]:
    """The evaluator's rows of every round and the final model, on the in-process engine."""
    evaluator = LogRegEvaluator(setup, regret=False)  # the regret's fits: not plotted
    result = run_logreg_inprocess(setup, evaluate=evaluator)
    return evaluator.rows, np.asarray(result.params[0])


def run_flower(setup: LogRegSetup, target: Path) -> np.ndarray:
    """One run on Flower's simulation engine (Ray); the final model it saved."""
    # this process is the demo's own (the CLI's `simulate`), so its environment is ours to set
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.ERROR)
    server_app, client_app = logreg_apps(setup, str(target), progress=True, regret=False)
    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=setup.num_learners, backend_config=flower_backend())
    return np.load(target / "final_model.npy")


def flower_backend() -> dict:
    """:data:`BACKEND`: a fresh local Ray of 2 CPUs, or — where ``RAY_ADDRESS`` names a
    running cluster, which ``ray.init`` joins when it is given no address — that cluster,
    whose CPUs are its own (``ray.init`` refuses ``num_cpus`` when it joins one)."""
    if os.environ.get("RAY_ADDRESS"):
        init_args = {k: v for k, v in BACKEND["init_args"].items() if k != "num_cpus"}
        return {"client_resources": dict(BACKEND["client_resources"]), "init_args": init_args}
    return BACKEND


def run_demo(
    out: Path,
    *,
    methods: Sequence[str] = METHODS,
    seeds: int = 5,
    flower: str | None = "blt",
    base: LogRegSetup = DEMO,
    say=None,
) -> DemoResult:
    """Every method on ``seeds`` seeds in process, ``flower``'s first seed on Flower's
    simulation engine too; writes the figure and the CSVs to ``out``."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if flower is not None and flower not in methods:
        raise ValueError(f"the Flower run's method {flower!r} is not among {list(methods)}")
    out.mkdir(parents=True, exist_ok=True)
    res = DemoResult(out=out, setup=base)
    seed_list = list(range(1, seeds + 1))
    # the in-process seeds run in a thread while Flower's engine starts Ray and its actors
    # (seconds of waiting, most of the Flower run's time at this size)
    worker = threading.Thread(target=_inprocess_all, args=(res, methods, seed_list, say),
                              name="demo-inprocess")
    worker.start()
    try:
        if flower is not None:
            _flower_check(res, flower, seed_list[0], say)
    finally:
        worker.join()
    if res.failure is not None:
        raise res.failure
    write_csv(res)
    plot(res, out / "accuracy.png")
    return res


def _inprocess_all(res: DemoResult, methods: Sequence[str], seeds: list[int], say) -> None:
    """Every method on every seed on the in-process engine, into ``res.curves``."""
    try:
        start = time.perf_counter()
        total, done = len(methods) * len(seeds), 0
        for method in methods:
            res.curves[method] = {}
            for seed in seeds:
                rows, _ = run_inprocess(setup_for(method, seed, res.setup))
                res.curves[method][seed] = rows
                done += 1
            accs = res.final_accuracies(method)
            elapsed = time.perf_counter() - start
            say(f"[in process {done}/{total}] {label(method):<11} η = "
                f"{eta_of(method):<5g} final accuracy {accs.mean():.3f} (min "
                f"{accs.min():.3f}, max {accs.max():.3f}, {len(seeds)} seeds)  {elapsed:.0f} s; "
                f"about {elapsed / done * (total - done):.0f} s left")
        res.seconds["inprocess"] = time.perf_counter() - start
    except BaseException as err:  # re-raised by run_demo, in its own thread
        res.failure = err


def _flower_check(res: DemoResult, method: str, seed: int, say) -> None:
    """``method`` on ``seed`` end to end on Flower's simulation engine, and its final model
    against the in-process run of the same seed."""
    setup = setup_for(method, seed, res.setup)
    res.flower_method, res.flower_seed = method, seed
    res.flower_dir = res.out / label(method)
    say(f"[Flower] simulation engine (Ray): {setup.num_learners} learners, {setup.rounds} "
        f"rounds, {setup.label}, seed {seed} — the reference ServerApp and ClientApp end "
        f"to end (Ray takes a few seconds to start)")
    t = time.perf_counter()
    flower_model = run_flower(setup, res.flower_dir)
    res.seconds["flower"] = time.perf_counter() - t
    _, inproc_model = run_inprocess(setup)
    res.flower_difference = float(np.max(np.abs(flower_model - inproc_model)))
    say(f"[Flower] done in {res.seconds['flower']:.0f} s; its final model equals the "
        f"in-process run's of the same seed to {res.flower_difference:.1e}")




def write_csv(res: DemoResult) -> None:
    """``curves.csv`` (every round of every run) and ``summary.csv`` (per method)."""
    with open(res.out / "curves.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "seed", "eta", "round", "test-accuracy", "online-loss"])
        for method, by_seed in res.curves.items():
            for seed, rows in by_seed.items():
                for row in rows:
                    w.writerow([label(method), seed, eta_of(method), int(row["round"]),
                                row["test-accuracy"], row.get("online-loss", "")])
    with open(res.out / "summary.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "epsilon", "delta", "eta", "seeds", "final_accuracy_mean",
                    "final_accuracy_min", "final_accuracy_max"])
        for method in res.curves:
            accs = res.final_accuracies(method)
            private = method != "none"
            w.writerow([label(method), res.setup.epsilon if private else "",
                        res.setup.delta if private else "", eta_of(method), len(accs),
                        f"{accs.mean():.4f}", f"{accs.min():.4f}", f"{accs.max():.4f}"])


def plot(res: DemoResult, path: Path) -> None:
    """Test accuracy and online loss against the round: the mean over the seeds, the
    min–max band, the Flower run as markers; the budget and the setting in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res.setup
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for method, by_seed in res.curves.items():
        c = colour(label(method))
        runs = list(by_seed.values())
        rounds = np.array([row["round"] for row in runs[0]])
        acc = np.array([[row["test-accuracy"] for row in rows] for rows in runs])
        accs = acc[:, -1]
        name = NAMES.get(method, method)
        ax1.plot(rounds, acc.mean(0), color=c, lw=2,
                 label=f"{name}: {accs.mean():.2f} (η = {eta_of(method):g})")
        ax1.annotate(f"{accs.mean():.2f}", (rounds[-1], acc.mean(0)[-1]), color=c,
                     xytext=(4, 0), textcoords="offset points", va="center",
                     fontsize="small")
        ax1.fill_between(rounds, acc.min(0), acc.max(0), color=c, alpha=0.18, lw=0)
        online = np.array([[row["online-loss"] for row in rows if "online-loss" in row]
                           for rows in runs])
        ax2.plot(rounds[: online.shape[1]], online.mean(0), color=c, lw=2, label=name)
        ax2.fill_between(rounds[: online.shape[1]], online.min(0), online.max(0), color=c,
                         alpha=0.18, lw=0)
    if res.flower_dir is not None and (res.flower_dir / "history.csv").exists():
        with open(res.flower_dir / "history.csv") as fh:
            rows = list(csv.DictReader(fh))
        c = colour(label(res.flower_method or ""))
        ax1.plot([float(r["round"]) for r in rows], [float(r["test-accuracy"]) for r in rows],
                 "o", color=c, mfc="white", ms=5,
                 label=f"the same on Flower's simulation engine (seed {res.flower_seed})")
    ax1.set(xlabel="round", ylabel="test accuracy of the global model",
            ylim=(0.45, 1.0))
    ax2.set(xlabel="round", ylabel="online loss f^r(x^r)", yscale="log")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.legend(loc="lower right", fontsize="small", title="final accuracy, mean",
               title_fontsize="small")
    seeds = len(next(iter(res.curves.values())))
    fig.suptitle(
        f"Every private learner at (ε, δ) = ({s.epsilon:g}, {s.delta:g}) over its "
        f"{s.rounds * s.tau} local steps  —  {s.num_learners} learners, d = {s.dim}, "
        f"{s.rounds} rounds × τ = {s.tau}; mean and min–max over {seeds} seeds",
        fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune(methods: Sequence[str] = METHODS, grid: Sequence[float] = TUNING_GRID,
         seeds: Sequence[int] = TUNING_SEEDS, base: LogRegSetup = DEMO) -> dict[str, float]:
    """The η of each method with the best mean final accuracy over ``seeds`` (not the
    plotted seeds); prints every grid point."""
    best: dict[str, float] = {}
    for method in methods:
        scores = {}
        for eta in grid:
            accs = [run_inprocess(base.with_(mechanism=method, eta=eta, seed=s,
                                             data_seed=s))[0][-1]["test-accuracy"]
                    for s in seeds]
            scores[eta] = float(np.mean(accs))
            print(f"{label(method):<12} η = {eta:<5g} final accuracy {scores[eta]:.3f}",
                  flush=True)
        best[method] = max(scores, key=lambda e: scores[e])
    print("ETAS =", best)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", action="store_true",
                        help="tune η per method on the tuning seeds and print it")
    parser.add_argument("--out", default="results/demo")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.tune:
        tune()
        return 0
    run_demo(Path(args.out), seeds=args.seeds)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
