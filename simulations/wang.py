"""Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized
Online Learning", Sec. 4 and Appendix B: private decentralized online multiclass logistic regression
with PD-FTGL, PD-OCG and PD-OGD, plus an empirical regret-rate check.

Full size: ``docs/results-wang.md`` lists the exact commands that produced its tables, e.g.

    nice -n 10 python -m simulations.wang main --datasets letter --steps 30000 \
        --algorithms pd-ftgl --tune-start 0.01 1 --out results/wang30-letter-pd-ftgl
    nice -n 10 python -m simulations.wang sweeps --datasets letter --steps 15000 \
        --sweep-clip 1 --sweep-mult 0.1 --out results/wang-sweeps
    nice -n 10 python -m simulations.wang rate --datasets letter --rate-eps inf 1000 \
        --rate-mults 0.01 --out results/wang-rate-hi
    python -m simulations.wang plots --merge results/wang-* --out results/wang --docs

Toy size (what the tests run): add ``--synthetic --steps 300 --tune-steps 100`` (a generated
3-class problem, named on every row).

Setting (Wang et al., Sec. 4.1): ``K = {X ∈ R^{q×p} : ‖X‖_* ≤ τ}``, ``τ = R = 10``, α = 0, complete
graph with ``n = 9`` (``P = J/n``, Metropolis–Hastings; lazy MH on other graphs), ε = 10,
per-example gradients clipped to Frobenius norm ``C``. ``C`` and ``h`` (PD-OGD: its step) as
the theoretical value times a multiplier are tuned by the final average loss on a seed not
used later (1000): by default (``--tune adaptive``, issue 24) on the full horizon, with line
searches on a ×10 grid that widen until the optimum is interior; ``--tune grid`` is the
paper's fixed grid ({0.01, 0.1, 1, 10} × ``--mults``) on ``--tune-steps`` rounds (what the
earlier runs used: 2000 rounds, where no private method beats playing zero).
Data: letter (Debian's r-cran-mlbench or the user's LIBSVM file; 10n copies shuffled and split,
so ``T = 150000``) and poker (the user's LIBSVM file, else the exact synthesizer — a stand-in,
named so). Metric: ``AL(t, i) = (1/(tn)) Σ_{s≤t} Σ_j f_{s,j}(X_i(s))`` averaged over learners.

Outputs in ``--out``: ``main.csv`` (AL curves), ``main-summary.csv`` (final AL, ms per round,
ε per accountant, chosen C and multiplier), ``tuning.csv``, ``sweeps.csv``, ``rate.csv``,
``timing.csv`` (CPU ms per round) and PNG plots; ``report`` prints them as markdown tables;
``--docs`` copies them to ``docs/`` (``results-wang-*.csv``, ``figures/wang-*.png``), which
``docs/results-wang.md`` discusses.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import experiments.tasks  # noqa: F401  (registers the letter and poker tasks)
from flwr_corrnoise.decentralized.engine import build_from_config
from flwr_corrnoise.decentralized.multiclass import MulticlassTask
from flwr_corrnoise.decentralized.protocol import Inbox, NodeAlgorithm
from flwr_corrnoise.decentralized.sets import NuclearBall
from simulations.wang_tables import report, slopes

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("pd-ftgl", "pd-ocg", "pd-ogd")
NAMES = {"pd-ftgl": "PD-FTGL", "pd-ocg": "PD-OCG", "pd-ogd": "PD-OGD",
         "pd-ogd-per-datum": "PD-OGD (per-datum noise)",
         "pd-ftgl-exact": "PD-FTGL (exact calibration)",
         "pd-ocg-exact": "PD-OCG (exact calibration)"}
CLIPS = (0.01, 0.1, 1.0, 10.0)
MULTS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
#: the user's own data files (LIBSVM or UCI format) by data set, from --letter-path/--poker-path
DATA_PATHS: dict[str, str] = {}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- one run --------------------------------------------------------------------------------
def config(dataset: str, algorithm: str, steps: int, **over: Any) -> dict[str, Any]:
    """The kebab-case config every engine shares (the CLI and the relay take the same keys)."""
    alg = "pd-ogd" if algorithm.startswith("pd-ogd") else algorithm.removesuffix("-exact")
    cfg: dict[str, Any] = {"algorithm": alg, "graph": "complete", "num-nodes": 9,
                           "steps": steps, "horizon": steps, "epsilon": 10.0, "set": "nuclear",
                           "set-size": 10.0, "alpha": 0.0, "seed": 0, "data-seed": 0}
    if dataset == "synthetic":
        cfg.update({"task": "synthetic-multiclass", "dim": 4, "classes": 3, "samples": 600})
    else:
        cfg["task"] = dataset
        if DATA_PATHS.get(dataset):
            cfg["data-path"] = DATA_PATHS[dataset]
    if algorithm == "pd-ogd-per-datum":
        cfg["ogd-accounting"] = "per-datum"
    if algorithm.endswith("-exact"):  # same ε, calibrated with the exact gossip sensitivity
        cfg["calibration"] = "exact"
    cfg.update(over)
    return cfg


def stream(algo: NodeAlgorithm, steps: int, seed: int, checkpoints: Sequence[int],
           label: str = "") -> dict[str, Any]:
    """Run ``steps`` rounds without keeping every decision (150000 × 9 × 416 would not fit),
    through the same protocol calls as the in-process engine; evaluate the played decisions
    on all learners' examples each round. Returns AL at the checkpoints ``[c, n]``, the
    cumulative network loss per learner, and the CPU seconds spent in the algorithm only."""
    task = algo.task
    if not isinstance(task, MulticlassTask):
        raise TypeError("the Wang et al. experiments need a MulticlassTask")
    graph, nodes = algo.graph, np.arange(algo.num_nodes)
    state = algo.init(nodes, seed, algo.default_privacy(nodes))
    cum = np.zeros(algo.num_nodes)
    marks = set(int(c) for c in checkpoints)
    curve, algo_s, last = [], 0.0, time.perf_counter()
    for t in range(steps):
        t0 = time.process_time()  # CPU time: the machine is shared, wall time is not ours
        out, state = algo.release(state)
        state = algo.update(state, Inbox.gather(graph, nodes, out))
        algo_s += time.process_time() - t0
        cum += task.network_loss(state["played"], t)
        if t + 1 in marks:
            curve.append(cum / (t + 1))
        if time.perf_counter() - last > 10:
            last = time.perf_counter()
            log(f"  {label or algo.name}: round {t + 1}/{steps}, AL {cum.mean() / (t + 1):.4f}")
    return {"curve": np.array(curve), "cum": cum, "seconds": algo_s,
            "epsilon": algo.epsilon(state, steps), "state": state}


def checkpoints_for(steps: int, count: int = 60) -> list[int]:
    pts = np.unique(np.round(np.geomspace(1, steps, count)).astype(int))
    return sorted(set(pts.tolist()) | {steps})


def build(cfg: dict[str, Any]) -> NodeAlgorithm:
    return build_from_config(cfg)[1]


# -- tuning ---------------------------------------------------------------------------------
def tune(dataset: str, algorithm: str, steps: int, clips: Iterable[float],
         mults: Iterable[float], rows: list[dict[str, Any]], **over: Any) -> tuple[float, float]:
    """Grid over (C, multiplier) on seed 1000 (never used for the reported runs)."""
    best: tuple[float, float, float] | None = None
    key = "step-scale" if algorithm.startswith("pd-ogd") else "h-scale"
    for C in clips:
        for m in mults:
            algo = build(config(dataset, algorithm, steps, clip=C, **{key: m}, **over))
            try:
                res = stream(algo, steps, 1000, [steps], f"tune {algorithm} C={C} m={m}")
                al = float(res["cum"].mean() / steps)
            except FloatingPointError:
                al = math.inf
            rows.append({"dataset": algo.task.name, "algorithm": NAMES[algorithm], "clip": C,
                         "multiplier": m, "rounds": steps, "final_AL": al})
            if best is None or al < best[0]:
                best = (al, C, m)
    assert best is not None
    log(f"tuned {dataset} {algorithm}: C={best[1]}, multiplier={best[2]} (AL {best[0]:.4f})")
    return best[1], best[2]


def tune_adaptive(dataset: str, algorithm: str, steps: int, C0: float, m0: float,
                  rows: list[dict[str, Any]], factor: float = 10.0, max_moves: int = 6,
                  **over: Any) -> tuple[float, float]:
    """(C, multiplier) by line searches on a log grid (steps ×``factor``) that **widen until
    the optimum is interior**: the best value of each coordinate has both neighbours
    evaluated and worse, or ``max_moves`` moves in one direction were made (then the row is
    marked ``edge``: e.g. "the larger h the better" = playing ~0 wins). Multiplier first (at
    ``C0``), then C (at the best multiplier), then the multiplier again if C moved.

    Every evaluation is a full ``steps``-round run on seed 1000 (not used for the reported
    runs): tuning on the horizon of the reported run, where the ordering is decided — a
    short tuning horizon favours "do not move" (no private method beats the zero decision
    in the first few thousand rounds)."""
    key = "step-scale" if algorithm.startswith("pd-ogd") else "h-scale"
    cache: dict[tuple[float, float], float] = {}
    first_row = len(rows)

    def f(C: float, m: float) -> float:
        C, m = float(f"{C:.6g}"), float(f"{m:.6g}")
        if (C, m) not in cache:
            algo = build(config(dataset, algorithm, steps, clip=C, **{key: m}, **over))
            try:
                res = stream(algo, steps, 1000, [steps], f"tune {algorithm} C={C:g} m={m:g}")
                al = float(res["cum"].mean() / steps)
            except FloatingPointError:
                al = math.inf
            cache[(C, m)] = al
            rows.append({"dataset": algo.task.name, "algorithm": NAMES[algorithm], "clip": C,
                         "multiplier": m, "rounds": steps, "final_AL": al, "seed": 1000})
            log(f"  tune {dataset} {algorithm}: C={C:g} m={m:g} → AL {al:.4f}")
        return cache[(C, m)]

    def line(fixed: float, start: float, which: str) -> tuple[float, bool]:
        val = (lambda x: f(fixed, x)) if which == "m" else (lambda x: f(x, fixed))
        best, fb = start, val(start)
        up, down = val(start * factor), val(start / factor)
        if min(up, down) >= fb:
            return best, True
        direction = factor if up < down else 1 / factor
        best, fb = start * direction, min(up, down)
        for _ in range(max_moves - 1):
            nxt = best * direction
            fn = val(nxt)
            if fn >= fb:
                return best, True
            best, fb = nxt, fn
        return best, False

    m, m_in = line(C0, m0, "m")
    C, c_in = line(m, C0, "C")
    if C != C0:
        m, m_in = line(C, m, "m")
    interior = m_in and c_in
    for r in rows[first_row:]:
        r["chosen"] = (float(f"{C:.6g}"), float(f"{m:.6g}")) == (r["clip"], r["multiplier"])
        r["optimum_interior"] = interior
    log(f"tuned {dataset} {algorithm}: C={C:g}, multiplier={m:g} "
        f"(AL {f(C, m):.4f}, {'interior' if interior else 'EDGE of the searched range'})")
    return float(f"{C:.6g}"), float(f"{m:.6g}")


def tuning_rows(dirs: Sequence[str], reported: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Tuning evaluations run as separate ``--tune none --run-seed 1000`` processes (one per
    grid point, in parallel): their summary rows as ``tuning.csv`` rows, the point the
    reported run (``reported``, the merged main-summary) uses marked ``chosen``, and
    ``optimum_interior`` true iff that point has a smaller and a larger multiplier among the
    evaluated ones and both are worse."""
    rows = [r for d in dirs if (Path(d) / "main-summary.csv").exists()
            for r in read_csv(Path(d) / "main-summary.csv")]
    out: list[dict[str, Any]] = []
    for r in rows:
        same = [q for q in rows if q["dataset"] == r["dataset"]
                and q["algorithm"] == r["algorithm"] and q["clip"] == r["clip"]]
        rep = [q for q in reported if q["dataset"] == r["dataset"]
               and q["algorithm"] == r["algorithm"]]
        chosen = bool(rep) and (float(rep[0]["clip"]), float(rep[0]["multiplier"])) == (
            float(r["clip"]), float(r["multiplier"]))
        m, al = float(r["multiplier"]), float(r["final_AL"])
        lower = [float(q["final_AL"]) for q in same if float(q["multiplier"]) < m]
        upper = [float(q["final_AL"]) for q in same if float(q["multiplier"]) > m]
        out.append({"dataset": r["dataset"], "algorithm": r["algorithm"], "clip": r["clip"],
                    "multiplier": r["multiplier"], "rounds": r["rounds"], "final_AL": al,
                    "seed": r["seed"], "chosen": chosen,
                    "optimum_interior": bool(lower and upper and min(lower) > al
                                             and min(upper) > al)})
    return out


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# -- experiment: Figs. 1-2 ------------------------------------------------------------------
def main_experiment(args: argparse.Namespace) -> None:
    out = Path(args.out)
    curves, summary, tuning = [], [], []
    algos = args.algorithms
    for dataset in args.datasets:
        for algorithm in algos:
            if args.tune == "none":  # the given setting, e.g. an earlier tuning's choice
                C, m = args.tune_start
            elif args.tune == "adaptive":
                C, m = tune_adaptive(dataset, algorithm, args.tune_steps or args.steps,
                                     args.tune_start[0], args.tune_start[1], tuning,
                                     factor=args.tune_factor, lmo=args.lmo)
            else:
                C, m = tune(dataset, algorithm, args.tune_steps or args.steps, args.clips,
                            args.mults, tuning, lmo=args.lmo)
            key = "step-scale" if algorithm.startswith("pd-ogd") else "h-scale"
            for seed in range(args.run_seed, args.run_seed + args.seeds):
                cfg = config(dataset, algorithm, args.steps, clip=C, lmo=args.lmo, **{key: m})
                algo = build(cfg)
                cps = checkpoints_for(args.steps)
                log(f"{dataset} {algorithm} seed {seed}: T={args.steps}")
                res = stream(algo, args.steps, seed, cps, f"{dataset} {algorithm} s{seed}")
                name = algo.task.name
                for t, al in zip(cps, res["curve"], strict=True):
                    curves.append({"dataset": name, "algorithm": NAMES[algorithm],
                                   "seed": seed, "t": t, "AL": float(al.mean())})
                row = {"dataset": name, "algorithm": NAMES[algorithm], "seed": seed,
                       "rounds": args.steps, "n": algo.num_nodes, "epsilon_target": 10.0,
                       "clip": C, "multiplier": m,
                       "final_AL": float(res["cum"].mean() / args.steps),
                       "ms_per_round": 1000 * res["seconds"] / args.steps,
                       "accuracy": float(algo.task.accuracy(res["state"]["x"]).mean())}
                for label, eps in res["epsilon"].items():
                    row[f"eps {label}"] = float(np.max(eps))
                for attr in ("L", "gossip_steps", "h"):
                    if hasattr(algo, attr):
                        row[attr] = getattr(algo, attr)
                if hasattr(algo, "scale_for"):
                    row["laplace_scale"] = float(res["state"]["scale"][0])
                summary.append(row)
                log(f"  final AL {row['final_AL']:.4f}, {row['ms_per_round']:.3f} ms/round")
    write_csv(out / "main.csv", curves)
    write_csv(out / "main-summary.csv", summary)
    write_csv(out / "tuning.csv", tuning)
    plot_main(out)


def plot_main(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(out / "main.csv")
    summ = read_csv(out / "main-summary.csv")
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.8 * len(datasets)), squeeze=False)
    for ax_row, ds in zip(axes, datasets, strict=True):
        for alg in dict.fromkeys(r["algorithm"] for r in rows if r["dataset"] == ds):
            sel = [r for r in rows if r["dataset"] == ds and r["algorithm"] == alg]
            ts = sorted({int(r["t"]) for r in sel})
            al = [np.mean([float(r["AL"]) for r in sel if int(r["t"]) == t]) for t in ts]
            ax_row[0].plot(ts, al, label=alg)
        ax_row[0].set_xscale("log")
        ax_row[0].set_yscale("log")
        ax_row[0].set_xlabel("round t")
        ax_row[0].set_ylabel("average loss AL(t)")
        ax_row[0].set_title(f"{ds}: ε = 10, complete graph, n = 9", fontsize=9)
        ax_row[0].legend(fontsize=8)
        s = [r for r in summ if r["dataset"] == ds]
        algs = list(dict.fromkeys(r["algorithm"] for r in s))
        ms = [np.mean([float(r["ms_per_round"]) for r in s if r["algorithm"] == a]) for a in algs]
        ax_row[1].bar(range(len(algs)), ms)
        ax_row[1].set_xticks(range(len(algs)), algs, fontsize=7, rotation=15)
        ax_row[1].set_ylabel("ms per round (all 9 learners, one core)")
        ax_row[1].set_title(f"{ds}: runtime", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "wang-main.png", dpi=120)
    plt.close(fig)


# -- experiment: Appendix B sweeps ----------------------------------------------------------
def tuned(out: Path, dataset_name: str, algorithm: str) -> tuple[float, float]:
    """(C, multiplier) chosen by the main experiment (``main-summary.csv``)."""
    path = out / "main-summary.csv"
    if path.exists():
        for r in read_csv(path):
            if r["dataset"] == dataset_name and r["algorithm"] == NAMES[algorithm]:
                return float(r["clip"]), float(r["multiplier"])
    return 1.0, 1.0


def sweeps_experiment(args: argparse.Namespace) -> None:
    out = Path(args.out)
    dataset = args.datasets[0]
    name = build(config(dataset, "pd-ftgl", 10)).task.name
    settings: list[tuple[str, dict[str, Any]]] = []
    for eps in (2.5, 5.0, 10.0):
        settings.append(("privacy", {"epsilon": eps}))
    for n in args.sizes:
        settings.append(("size", {"num-nodes": n}))
    for eps in (10.0, 1000.0):
        for graph in ("complete", "cycle", "watts-strogatz"):
            settings.append(("topology", {"graph": graph, "epsilon": eps}))
    rows: list[dict[str, Any]] = []
    done: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for sweep, over in settings:
        for algorithm in ("pd-ftgl", "pd-ocg"):
            C, m = tuned(out, name, algorithm)
            C = args.sweep_clip if args.sweep_clip else C
            m = args.sweep_mult if args.sweep_mult else m
            cfg = config(dataset, algorithm, args.steps, clip=C, **{"h-scale": m}, **over)
            key = (algorithm, cfg["graph"], cfg["num-nodes"], cfg["epsilon"])
            if key in done:  # the same run in another panel (e.g. ε = 10, n = 9, complete)
                rows += [{**r, "sweep": sweep} for r in done[key]]
                continue
            algo = build(cfg)
            cps = checkpoints_for(args.steps, 30)
            res = stream(algo, args.steps, 0, cps, f"{sweep} {over} {algorithm}")
            rho = getattr(algo, "rho", float("nan"))
            row = {"sweep": sweep, "dataset": algo.task.name, "algorithm": NAMES[algorithm],
                   "graph": cfg["graph"], "n": algo.num_nodes, "epsilon": cfg["epsilon"],
                   "clip": C, "h_multiplier": m,
                   "rho": rho, "L": algo.L, "gossip_steps": algo.gossip_steps,
                   "rounds": args.steps, "final_AL": float(res["cum"].mean() / args.steps),
                   "ms_per_round": 1000 * res["seconds"] / args.steps}
            done[key] = [{**row, "t": t, "AL": float(al.mean())}
                         for t, al in zip(cps, res["curve"], strict=True)]
            rows += done[key]
            write_csv(out / "sweeps.csv", rows)  # after every run: partial results survive
            log(f"  {sweep} {over} {algorithm}: AL {row['final_AL']:.4f}")
    write_csv(out / "sweeps.csv", rows)
    plot_sweeps(out)


def plot_sweeps(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(out / "sweeps.csv")
    panels = [("privacy", "epsilon", None), ("size", "n", None),
              ("topology", "graph", "10.0"), ("topology", "graph", "1000.0")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    ds = rows[0]["dataset"] if rows else ""
    for col, (sweep, key, eps) in enumerate(panels):
        for r_i, alg in enumerate(("PD-FTGL", "PD-OCG")):
            ax = axes[r_i, col]
            sel = [r for r in rows if r["sweep"] == sweep and r["algorithm"] == alg
                   and (eps is None or r["epsilon"] == eps)]
            for val in dict.fromkeys(r[key] for r in sel):
                pts = [r for r in sel if r[key] == val]
                ax.plot([int(r["t"]) for r in pts], [float(r["AL"]) for r in pts],
                        label=f"{key} = {val}")
            ax.set_xscale("log")
            ax.set_yscale("log")
            title = f"{alg}: {sweep}" + (f" (ε = {eps})" if eps else "")
            ax.set_title(f"{title}\n{ds}", fontsize=8)
            ax.set_xlabel("round t")
            ax.set_ylabel("AL(t)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "wang-sweeps.png", dpi=110)
    plt.close(fig)


# -- experiment: regret rate ----------------------------------------------------------------
def comparator_loss(task: MulticlassTask, K: NuclearBall, steps: int, iters: int) -> float:
    """``min_{X∈K} (1/n) Σ_{t<T} Σ_j f_{t,j}(X)`` by accelerated projected gradient (FISTA)
    on the pooled examples of the first ``T`` rounds; the loss is ``β = max‖e‖²/2``-smooth."""
    idx = task.indices[:, :steps].reshape(-1)
    E, lab = task.X[idx][None], task.y[idx][None]
    beta = 0.5 * float((np.linalg.norm(task.X, axis=1) ** 2).max())
    x = np.zeros((1, task.dim))
    yk, tk = x.copy(), 1.0
    for _ in range(iters):
        g = task.grad(yk, E, lab)
        x_new = K.project(yk - g / beta)
        t_new = (1 + math.sqrt(1 + 4 * tk * tk)) / 2
        yk = x_new + (tk - 1) / t_new * (x_new - x)
        x, tk = x_new, t_new
    return float(task.loss(x, E, lab)[0]) * steps  # mean over T·n examples × T = Σ_t mean_j


def bounds(algorithm: str, n: int, d: int, G: float, R: float, T: int, L: int,
           eps: float) -> float:
    """Corollary 3.7 (PD-FTGL) / 3.10 (PD-OCG), convex case, evaluated numerically."""
    lg = 2 + math.log2(T)
    if algorithm == "pd-ftgl":
        return 7 * n * G * R * math.sqrt(L * T * lg) + 4 * n * d * G * R * lg**1.5 * math.sqrt(
            T / L) / eps
    return 21 * n * G * R * T**0.75 + 4 * n * d * G * R * T**0.25 * lg**2 / eps


def rate_experiment(args: argparse.Namespace) -> None:
    """Regret of each learner against the best fixed X in hindsight, for several T.

    ``C = G``, the loss's true Lipschitz bound ``√2 max‖e‖`` (clipping never binds, so the
    corollaries apply as stated), the corollaries' ``L`` and ``h`` times each of
    ``--rate-mults`` (a constant multiplier changes constants, not the rate in T)."""
    out = Path(args.out)
    dataset = args.datasets[0]
    rows = []
    for T in args.horizons:
        base = build(config(dataset, "pd-ftgl", T))
        task = base.task
        assert isinstance(task, MulticlassTask) and isinstance(base.K, NuclearBall)
        G = math.sqrt(2) * float(np.linalg.norm(task.X, axis=1).max())
        opt = comparator_loss(task, base.K, T, args.opt_iters)
        for algorithm, eps, mult, seed in itertools.product(
                ("pd-ftgl", "pd-ocg"), args.rate_eps, args.rate_mults, range(args.seeds)):
            algo = build(config(dataset, algorithm, T, clip=G, epsilon=eps,
                                **{"h-scale": mult}))
            res = stream(algo, T, seed, [T], f"rate {algorithm} T={T} ε={eps} ×{mult}")
            regret = task.num_nodes * (res["cum"] - opt)  # Σ_t Σ_j, per learner
            rows.append({"dataset": task.name, "algorithm": NAMES[algorithm], "T": T,
                         "epsilon": eps, "h_multiplier": mult, "seed": seed,
                         "L": algo.L, "G": G, "optimum": opt,
                         "regret_mean": float(regret.mean()),
                         "regret_max": float(regret.max()),
                         "bound": bounds(algorithm, task.num_nodes, algo.dim, G,
                                         algo.R, T, algo.L, eps)})
            log(f"  T={T} {algorithm} ε={eps} ×{mult}: regret {regret.mean():.1f}")
    write_csv(out / "rate.csv", rows)
    plot_rate(out)


def plot_rate(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_csv(out / "rate.csv")
    sl = slopes(rows)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (alg, eps, mult), s in sl.items():
        sel = [r for r in rows
               if (r["algorithm"], r["epsilon"], r["h_multiplier"]) == (alg, eps, mult)]
        Ts = sorted({int(r["T"]) for r in sel})
        reg = [np.mean([float(r["regret_mean"]) for r in sel if int(r["T"]) == T]) for T in Ts]
        bnd = [float(next(r["bound"] for r in sel if int(r["T"]) == T)) for T in Ts]
        line = ax.plot(Ts, reg, "o-", label=f"{alg}, ε={eps}, h×{mult}: slope {s:.2f}")[0]
        ax.plot(Ts, bnd, "--", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("T")
    ax.set_ylabel("regret of a learner (dashed: corollary bound)")
    ax.set_title(f"regret vs T, {rows[0]['dataset'] if rows else ''}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "wang-rate.png", dpi=120)
    plt.close(fig)


# -- docs -------------------------------------------------------------------------------------
def timing_experiment(args: argparse.Namespace) -> None:
    """CPU milliseconds per round (``time.process_time``: the machine is shared, so wall time
    measures the neighbours' load) of each algorithm, configured for horizon ``--steps``,
    over the first ``--timing-rounds`` rounds (whole blocks, so block-end work is included)."""
    out = Path(args.out)
    rows = []
    for dataset in args.datasets:
        for algorithm in args.algorithms:
            algo = build(config(dataset, algorithm, args.timing_rounds, horizon=args.steps,
                                lmo=args.lmo))
            res = stream(algo, args.timing_rounds, 0, [], f"timing {dataset} {algorithm}")
            rows.append({"dataset": algo.task.name, "algorithm": NAMES[algorithm],
                         "horizon": args.steps, "rounds": args.timing_rounds,
                         "L": getattr(algo, "L", 1), "n": algo.num_nodes, "dim": algo.dim,
                         "cpu_ms_per_round": 1000 * res["seconds"] / args.timing_rounds})
            log(f"  timing {dataset} {algorithm}: {rows[-1]['cpu_ms_per_round']:.3f} ms/round")
    write_csv(out / "timing.csv", rows)


def copy_to_docs(out: Path, tag: str = "") -> None:
    """CSVs to ``docs/results-wang[-tag]-*.csv``, plots to ``docs/figures/wang[-tag]-*.png``
    (a tag keeps another run's files, e.g. the issue-24 rerun beside the earlier one)."""
    docs = ROOT / "docs"
    (docs / "figures").mkdir(parents=True, exist_ok=True)
    t = f"-{tag}" if tag else ""
    for name in ("main.csv", "main-summary.csv", "tuning.csv", "sweeps.csv", "rate.csv",
                 "timing.csv"):
        if (out / name).exists():
            shutil.copy(out / name, docs / f"results-wang{t}-{name}")
    for name in ("wang-main.png", "wang-sweeps.png", "wang-rate.png"):
        if (out / name).exists():
            shutil.copy(out / name, docs / "figures" / name.replace("wang-", f"wang{t}-", 1))


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=("main", "sweeps", "rate", "timing", "plots",
                                                "report"))
    p.add_argument("--datasets", nargs="+", default=["letter", "poker"])
    p.add_argument("--algorithms", nargs="+", default=[*ALGOS, "pd-ogd-per-datum"],
                   choices=sorted(NAMES), help="main: which algorithms (and variants)")
    p.add_argument("--letter-path", default=None,
                   help="LIBSVM letter.scale or UCI letter-recognition.data (default: Debian's)")
    p.add_argument("--poker-path", default=None,
                   help="LIBSVM poker/poker.t or UCI poker-hand CSV (default: synthesized)")
    p.add_argument("--synthetic", action="store_true",
                   help="use the generated 3-class stand-in for every dataset (tests)")
    p.add_argument("--steps", type=int, default=150000)
    p.add_argument("--tune-steps", type=int, default=0,
                   help="tuning horizon (default 0: the full --steps, on tuning seed 1000)")
    p.add_argument("--tune", choices=("adaptive", "grid", "none"), default="adaptive",
                   help="adaptive: line searches on a ×--tune-factor log grid that widen until "
                        "the optimum is interior; grid: the fixed --clips × --mults grid; "
                        "none: run --tune-start as given")
    p.add_argument("--tune-start", type=float, nargs=2, default=[0.1, 1.0],
                   metavar=("C", "MULT"), help="adaptive tuning's starting point")
    p.add_argument("--tune-factor", type=float, default=10.0)
    p.add_argument("--lmo", choices=("power", "lanczos", "svd"), default="svd",
                   help="PD-OCG's top-singular-pair method (results agree to ~1e-12 per LMO; "
                        "svd is the fastest on these small matrices, see benchmarks/pd_ocg_lmo.py)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--run-seed", type=int, default=0,
                   help="first seed of the reported runs (1000 with --tune none: one tuning "
                        "evaluation per process, to run a tuning grid's points in parallel)")
    p.add_argument("--timing-rounds", type=int, default=4000)
    p.add_argument("--clips", type=float, nargs="+", default=list(CLIPS))
    p.add_argument("--mults", type=float, nargs="+", default=list(MULTS))
    p.add_argument("--sweep-clip", type=float, default=None,
                   help="sweeps: C for every run (default: the main experiment's choice)")
    p.add_argument("--sweep-mult", type=float, default=None,
                   help="sweeps: h multiplier for every run (default: the main's choice)")
    p.add_argument("--sizes", type=int, nargs="+", default=[9, 16, 25])
    p.add_argument("--horizons", type=int, nargs="+",
                   default=[1000, 2000, 4000, 8000, 16000, 32000])
    p.add_argument("--rate-eps", type=float, nargs="+", default=[10.0, 1000.0])
    p.add_argument("--rate-mults", type=float, nargs="+", default=[1.0, 0.01],
                   help="h multipliers of the rate check (1 = the corollaries' h)")
    p.add_argument("--opt-iters", type=int, default=300)
    p.add_argument("--out", default="results/wang")
    p.add_argument("--docs", action="store_true", help="copy CSVs and plots to docs/")
    p.add_argument("--docs-tag", default="", help="docs file names: results-wang-TAG-*.csv")
    p.add_argument("--merge", nargs="*", default=[],
                   help="plots: first merge the CSVs of these output folders into --out")
    p.add_argument("--tuning-from", nargs="*", default=[],
                   help="plots --merge: folders of single tuning evaluations (--tune none "
                        "--run-seed 1000) whose summaries go to tuning.csv, not main-summary")
    args = p.parse_args(argv)
    if args.synthetic:
        args.datasets = ["synthetic"]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    DATA_PATHS.update({k: v for k, v in (("letter", args.letter_path),
                                         ("poker", args.poker_path)) if v})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.experiment == "main":
        main_experiment(args)
    elif args.experiment == "sweeps":
        sweeps_experiment(args)
    elif args.experiment == "rate":
        rate_experiment(args)
    elif args.experiment == "timing":
        timing_experiment(args)
    elif args.experiment == "report":
        print(report(Path(args.out)))
    else:
        out = Path(args.out)
        if args.merge:  # experiments run in parallel processes into folders, merged here
            for name in ("main.csv", "main-summary.csv", "tuning.csv", "sweeps.csv",
                         "rate.csv", "timing.csv"):
                rows = [r for d in args.merge if (Path(d) / name).exists()
                        for r in read_csv(Path(d) / name)]
                if name == "tuning.csv":  # tuning points run as their own processes
                    rows += tuning_rows(args.tuning_from, read_csv(out / "main-summary.csv"))
                write_csv(out / name, rows)
        for fn, name in ((plot_main, "main.csv"), (plot_sweeps, "sweeps.csv"),
                         (plot_rate, "rate.csv")):
            if (out / name).exists():
                fn(out)
    if args.docs:
        copy_to_docs(Path(args.out), args.docs_tag)


if __name__ == "__main__":
    main()
