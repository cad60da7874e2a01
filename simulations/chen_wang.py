"""Paper 003 (Chen & Wang), Sec. VII-A: decentralized LDP online logistic regression on
"mushrooms" — Fig. 1, Table I and an empirical rate check.

Full size (5 learners on a ring, w_ij = 0.3, T = 2000, 5 seeds):

    nice -n 10 python -m simulations.chen_wang --out results/chen-wang --docs

Toy size (what the tests run):

    python -m simulations.chen_wang --steps 60 --seeds 1 --tune-grid 0.5 1 --synthetic \\
        --table-multipliers 1 3 --out /tmp/cw

Setting (003 Sec. VII-A): learners 1–3 hold the class-0 samples, 4–5 the class-1 samples;
each step every learner draws one sample of its shard (with replacement); loss
``(1−b)aᵀθ − log s(aᵀθ) + (r/2)‖θ‖²`` with ``r = --reg``; Algorithm 1 with
``ϱ_t^i = (t+1)^{0.1+0.01i}``, ``λ_t = (t+1)^{−0.77}``, ``γ_t = (t+1)^{−0.65}``, Θ = {‖θ‖ ≤ 10⁵}.
``θ_t^*`` minimizes ``F_t`` (all learners' data up to ``t``) by Newton's method (the paper's
"noise-free centralized gradient descent", run to convergence). Baselines: DSGD with
Algorithm 1's step and noise; DOLA and PDOP with 003's noise (``0.35/(t+1)``,
``0.5·0.98^t``) and step sizes tuned by doubling on ``--tune-grid`` × their base (largest
that does not diverge and has the smallest final error on a tuning seed not used later).
Besides the paper's noise, ``--equal-budget`` reruns the baselines with their noise scaled so
that each learner's budget over T *under the baselines' own (per-step summation)
accounting* equals Algorithm 1's tight budget.

Outputs in ``--out``: ``fig1.csv`` (mean/std of tracking error and regret per evaluated step,
per algorithm), ``epsilon.csv`` (cumulative ε per learner and accountant), ``table1.csv``,
``rate.csv``, ``fig1.png``, ``table1.png``, ``rate.png``; ``--docs`` writes
``docs/results-chen-wang.md`` and copies CSVs and plots to ``docs/``.
"""

from __future__ import annotations

import argparse
import csv
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from experiments.data.mushrooms import RAW_ROW_NORM, ROW_NORM, load_mushrooms, split_by_class
from flwr_corrnoise.decentralized.baselines import DOLA, DSGD, PDOP
from flwr_corrnoise.decentralized.chen_wang import ChenWang, StepSizes
from flwr_corrnoise.decentralized.chen_wang_privacy import (
    CONTRACTIVE,
    PER_DATUM,
    PER_STEP,
    THM5,
    TIGHT,
    baseline_epsilon_per_datum,
    baseline_epsilon_per_step,
    chen_wang_epsilon,
    gradient_constants,
)
from flwr_corrnoise.decentralized.engine import run
from flwr_corrnoise.decentralized.graphs import laplacian_weights, ring
from flwr_corrnoise.decentralized.tasks import LogisticTask

ROOT = Path(__file__).resolve().parents[1]
N = 5
NAMES = {"chen-wang": "Algorithm 1 (Chen & Wang)", "chen-wang-tuned": "Algorithm 1, λ₀ tuned",
         "dsgd": "DSGD", "dola": "DOLA", "pdop": "PDOP"}
BASES = {"chen-wang-tuned": 1.0, "dsgd": 1.0, "dola": 0.1, "pdop": 0.5}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data and the optimum -----------------------------------------------------------------
def load_data(args: argparse.Namespace) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """003's split of mushrooms, or a generated stand-in with the same shape (named).

    Sets ``args.feature_bound``, the row-norm bound the rows have *by construction* (√22 raw
    one-hot, 1 normalized), which :func:`make_task` declares."""
    args.feature_bound = ROW_NORM
    if not args.synthetic:
        try:
            X, y, source = load_mushrooms(args.data_path, normalize=not args.raw_rows)
            if args.raw_rows:
                source += ", raw one-hot rows (‖a‖² = 22)"
                args.feature_bound = RAW_ROW_NORM
            return split_by_class(X, y, N), source
        except (FileNotFoundError, ImportError) as err:
            log(f"mushrooms not available ({err}); using the synthetic stand-in")
    rng = np.random.default_rng(12345)
    m, d = (8124, 112) if not args.small_standin else (600, 20)
    attrs = rng.integers(0, 5, size=(m, 22))  # 22 categorical attributes, one-hot ≈ 112 cols
    X = np.zeros((m, d))
    cols = (np.arange(22) * (d // 22))[None, :] + attrs % max(1, d // 22)
    X[np.arange(m)[:, None], np.minimum(cols, d - 1)] = 1.0
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    w = rng.normal(size=d) * 3
    y = (rng.random(m) < 1 / (1 + np.exp(-X @ w))).astype(float)
    return split_by_class(X, y, N), f"synthetic stand-in ({m}×{d}, NOT mushrooms)"


def make_task(shards: list, args: argparse.Namespace, seed: int) -> LogisticTask:
    """The task with its *declared* feature bound (set by :func:`load_data` from how the rows
    were built), never the data's maximum row norm — the ε reported must hold for every
    neighbouring stream, not just this one."""
    return LogisticTask(shards, reg=args.reg, horizon=args.steps, seed=seed,
                        feature_bound=getattr(args, "feature_bound", ROW_NORM),
                        name="mushrooms")


class Optimum:
    """θ*_t = argmin F_t, F_t the average over learners of their mean loss on data 0..t
    (damped Newton, warm-started; tolerance ‖∇F_t‖ ≤ 1e-9)."""

    def __init__(self, task: LogisticTask) -> None:
        self.task = task
        self.theta = np.zeros(task.dim)

    def weights(self, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        Xs, ys, ws = [], [], []
        for i, (X, y) in enumerate(self.task.shards):
            counts = np.bincount(self.task.indices[i, : t + 1].ravel(), minlength=X.shape[0])
            nz = np.flatnonzero(counts)
            Xs.append(X[nz])
            ys.append(y[nz])
            ws.append(counts[nz] / ((t + 1) * self.task.batch_size * self.task.num_nodes))
        return np.concatenate(Xs), np.concatenate(ys), np.concatenate(ws)

    def objective(self, thetas: np.ndarray, t: int) -> np.ndarray:
        X, y, w = self.weights(t)
        z = X @ thetas.T
        data = (np.logaddexp(0, z) - y[:, None] * z) * w[:, None]
        return data.sum(0) + 0.5 * self.task.reg * np.sum(thetas * thetas, axis=1)

    def solve(self, t: int) -> np.ndarray:
        """Damped Newton (backtracking on F_t): plain Newton diverges on the raw one-hot rows,
        where the data are nearly separable and θ* is large."""
        X, y, w = self.weights(t)
        th = self.theta.copy()
        r = self.task.reg

        def f(v: np.ndarray) -> float:
            z = X @ v
            return float(np.sum(w * (np.logaddexp(0, z) - y * z)) + 0.5 * r * v @ v)

        for _ in range(200):
            z = X @ th
            s = 0.5 * (1 + np.tanh(0.5 * z))
            g = X.T @ (w * (s - y)) + r * th
            if np.linalg.norm(g) < 1e-9:
                break
            H = (X * (w * s * (1 - s))[:, None]).T @ X + r * np.eye(X.shape[1])
            step = np.linalg.solve(H, g)
            f0, a = f(th), 1.0
            while f(th - a * step) > f0 - 0.25 * a * (g @ step) and a > 1e-10:
                a *= 0.5
            if a <= 1e-10 and np.linalg.norm(g) < 1e-6:
                break  # no representable decrease left: converged to float precision
            th = th - a * step
        else:
            raise RuntimeError(f"Newton did not converge at t = {t} "
                               f"(‖∇F‖ = {np.linalg.norm(g):.2g})")
        self.theta = th
        return th


def eval_grid(T: int) -> np.ndarray:
    pts = np.unique(np.concatenate([np.round(np.logspace(0, math.log10(T), 50)) - 1,
                                    np.linspace(0, T - 1, 41).round()]).astype(int))
    return pts[(pts >= 0) & (pts < T)]


def optimum_path(task: LogisticTask, grid: np.ndarray) -> np.ndarray:
    opt = Optimum(task)
    return np.stack([opt.solve(int(t)) for t in grid])


def metrics(task: LogisticTask, decisions: np.ndarray, grid: np.ndarray, stars: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over learners of ‖θ_{t+1}^i − θ*_t‖², F_t(θ_{t+1}^i) − F_t(θ*_t), and
    ‖mean_i θ_{t+1}^i − θ*_t‖ (Table I's criterion)."""
    opt = Optimum(task)
    err, reg, mean_err = [], [], []
    for t, star in zip(grid, stars, strict=True):
        th = decisions[t + 1]
        err.append(np.mean(np.sum((th - star) ** 2, axis=1)))
        f = opt.objective(np.vstack([th, star[None]]), int(t))
        reg.append(np.mean(f[:-1]) - f[-1])
        mean_err.append(np.linalg.norm(th.mean(0) - star))
    return np.array(err), np.array(reg), np.array(mean_err)


# -- algorithms ---------------------------------------------------------------------------
def build(name: str, task: LogisticTask, args: argparse.Namespace, step0: float | None = None,
          steps: StepSizes | None = None):
    graph = ring(N)
    if name in ("chen-wang", "chen-wang-tuned"):
        if steps is None:  # the parameter-free rule allows any λ₀ > 0 (Sec. V)
            steps = StepSizes(1.0 if step0 is None else step0, 0.77, 1.0, 0.65)
        return ChenWang(graph, task, steps, W=laplacian_weights(graph, 0.3))
    cls = {"dsgd": DSGD, "dola": DOLA, "pdop": PDOP}[name]
    cfg = {} if step0 is None else {"step0": step0}
    return cls.from_config(graph, task, cfg)


def privacy_for(algo, equal_to: np.ndarray | None, args: argparse.Namespace,
                accountant: str = PER_STEP) -> dict:
    """The paper's noise, or (``equal_to``) the baseline's noise scaled to spend ``equal_to``
    per learner over T under ``accountant`` (both are ∝ 1/noise scale)."""
    nodes = np.arange(N)
    priv = algo.default_privacy(nodes)
    if equal_to is None or algo.name == "chen-wang":
        return priv
    state = algo.init(nodes, 0, priv)
    spent = algo.epsilon(state, args.steps)[accountant]
    return dict(priv, **{"noise-scale": priv["noise-scale"] * spent / equal_to})


def tune(name: str, shards: list, args: argparse.Namespace) -> float:
    """003's rule for the baselines, "near-optimal: doubling the step diverges": start at
    ``base × --tune-grid[0]`` and double while the final tracking error on a tuning seed
    (not used later) improves; return the best."""
    task = make_task(shards, args, seed=10_000)
    grid = np.array([args.steps - 1])
    star = optimum_path(task, grid)
    step = BASES[name] * args.tune_grid[0]
    best, best_err = step, math.inf
    for _ in range(args.tune_doublings):
        algo = build(name, task, args, step0=step)
        try:
            res = run(algo, args.steps, run_seed=10_000)
            err = metrics(task, res.decisions, grid, star)[0][-1]
        except FloatingPointError:
            err = math.inf
        log(f"  tune {name}: step0 = {step:g} → final error {err:.4g}")
        if not (np.isfinite(err) and err < best_err):
            break
        best, best_err = step, err
        step *= 2
    return best


# -- parts ----------------------------------------------------------------------------------
def fig1(args: argparse.Namespace, shards: list, source: str, out: Path) -> dict:
    grid = eval_grid(args.steps)
    algos = ["chen-wang", "chen-wang-tuned", "dsgd", "dola", "pdop"]
    step0 = {n: (None if n in ("chen-wang", "dsgd") or args.no_tune else tune(n, shards, args))
             for n in algos}
    variants = [(n, "paper noise") for n in algos]
    variants.append(("chen-wang", "noise off"))
    if args.equal_budget:
        variants += [(n, f"equal budget, {acc}") for acc in (PER_STEP, PER_DATUM)
                     for n in ("dsgd", "dola", "pdop")]
    curves: dict[tuple[str, str], list] = {v: [] for v in variants}
    tight_T = None
    start = time.perf_counter()
    for s in range(args.seeds):
        task = make_task(shards, args, seed=s)
        stars = optimum_path(task, grid)
        for name, noise in variants:
            algo = build(name, task, args, step0=step0[name])
            if name == "chen-wang" and tight_T is None:  # Algorithm 1's best bound per learner
                st = algo.init(np.arange(N), 0, algo.default_privacy(np.arange(N)))
                tight_T = np.min(np.stack(list(algo.epsilon(st, args.steps).values())), axis=0)
            acc = PER_DATUM if PER_DATUM in noise else PER_STEP
            priv = privacy_for(algo, tight_T if noise.startswith("equal") else None, args, acc)
            if noise == "noise off":
                priv = dict(priv, **{"noise-scale": np.zeros(N)})
            try:
                res = run(algo, args.steps, run_seed=s, privacy=priv, progress=True,
                          label=f"{name} seed {s}")
                curves[(name, noise)].append(metrics(task, res.decisions, grid, stars))
            except FloatingPointError as err:
                log(f"  {name} ({noise}) seed {s} diverged: {err}")
            log(f"seed {s + 1}/{args.seeds} {name} ({noise}) done "
                f"({time.perf_counter() - start:.0f} s)")
    rows = []
    with open(out / "fig1.csv", "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["algorithm", "noise", "data", "step0", "t", "seeds", "tracking_error_mean",
                     "tracking_error_std", "regret_mean", "regret_std"])
        for (name, noise), runs in curves.items():
            if not runs:
                continue
            e = np.stack([r[0] for r in runs])
            g = np.stack([r[1] for r in runs])
            for j, t in enumerate(grid):
                wr.writerow([name, noise, source, step0[name] or "", int(t) + 1, len(runs),
                             e[:, j].mean(), e[:, j].std(), g[:, j].mean(), g[:, j].std()])
            rows.append((name, noise, step0[name], len(runs), e[:, -1].mean(), e[:, -1].std(),
                         g[:, -1].mean(), g[:, -1].std()))
    eps = epsilon_table(args, shards, out, source, step0)
    plot_fig1(out, curves, grid, eps, source, args)
    return {"rows": rows, "eps": eps, "step0": step0}


def epsilon_table(args: argparse.Namespace, shards: list, out: Path, source: str,
                  step0: dict) -> dict:
    """Cumulative ε per learner and accountant (analytic: no run needed) at T and the curves."""
    task = make_task(shards, args, seed=0)
    T = args.steps
    ts = np.unique(np.round(np.logspace(0, math.log10(T), 60)).astype(int))
    result: dict[tuple[str, str], np.ndarray] = {}
    cw = build("chen-wang", task, args)
    C, L = gradient_constants(cw)
    priv = cw.default_privacy(np.arange(N))
    for name in ("chen-wang", "chen-wang-tuned"):
        algo = build(name, task, args, step0=step0.get(name))
        for acc in (TIGHT, THM5, CONTRACTIVE):
            result[(name, acc)] = np.stack([
                chen_wang_epsilon(T, algo.steps, w_self=0.6, L=L, C=C, dim=task.dim,
                                  noise_scale=1.0, exponent=float(priv["noise-exponent"][i]),
                                  accountant=acc, w_bar=0.6, mu=args.reg)[ts - 1]
                for i in range(N)])
    for name in ("dsgd", "dola", "pdop"):
        algo = build(name, task, args, step0=step0.get(name))
        p = algo.default_privacy(np.arange(N))
        lam = np.asarray(algo.step_size(np.arange(T)), dtype=float)
        per_step, per_datum = [], []
        for i in range(N):
            sc = np.asarray(algo.schedule(float(p["noise-scale"][i]),
                                          float(p["noise-rate"][i])).scale(np.arange(T)))
            per_step.append(baseline_epsilon_per_step(lam, sc, C, task.dim)[ts - 1])
            per_datum.append([baseline_epsilon_per_datum(lam[:t], algo.contraction(i, t),
                                                         sc[:t], C, task.dim) for t in ts])
        result[(name, PER_STEP)] = np.array(per_step)
        result[(name, PER_DATUM)] = np.array(per_datum)
    with open(out / "epsilon.csv", "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["algorithm", "accountant", "data", "T", *[f"learner{i + 1}"
                                                              for i in range(N)]])
        for (name, acc), arr in result.items():
            for j, t in enumerate(ts):
                wr.writerow([name, acc, source, int(t), *[f"{v:.6g}" for v in arr[:, j]]])
    return {"ts": ts, "values": result}


def table1(args: argparse.Namespace, shards: list, source: str, out: Path) -> list:
    """Base Lap(0.1 (t+1)^{0.1+0.01i}) × multiplier: budgets and iterations to
    ‖mean θ − θ*‖ ≤ threshold."""
    T = args.steps
    # every step early (the paper's counts start at 8), every 5th later
    grid = np.unique(np.concatenate([np.arange(min(T, 300)), np.arange(300, T, 5)]))
    rows = []
    stars_by_seed: dict[int, np.ndarray] = {}
    for mult in args.table_multipliers:
        iters, finals, budgets = [], [], None
        for s in range(args.table_seeds):
            task = make_task(shards, args, seed=s)
            if s not in stars_by_seed:  # θ*_t does not depend on the noise: solve once
                stars_by_seed[s] = optimum_path(task, grid)
            stars = stars_by_seed[s]
            algo = build("chen-wang", task, args)
            priv = algo.default_privacy(np.arange(N))
            priv["noise-scale"] = np.full(N, 0.1 * mult)
            res = run(algo, T, run_seed=s, privacy=priv)
            _, _, mean_err = metrics(task, res.decisions, grid, stars)
            hit = np.flatnonzero(mean_err <= args.threshold)
            iters.append(int(grid[hit[0]]) + 1 if hit.size else T)
            finals.append(float(mean_err[-1]))
            if budgets is None:
                st = algo.init(np.arange(N), 0, priv)
                budgets = algo.epsilon(st, T)
        best = np.min(np.stack(list(budgets.values())), axis=0)
        rows.append((mult, float(np.mean(budgets[TIGHT])), float(np.mean(budgets[THM5])),
                     float(np.mean(iters)), iters, float(np.mean(best)), float(np.mean(finals))))
        log(f"table I: ×{mult:g}: tight ε {rows[-1][1]:.3g}, iterations {iters}")
    with open(out / "table1.csv", "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["multiplier", "data", "epsilon_tight_mean", "epsilon_thm5_mean",
                     "epsilon_best_mean", "iterations_mean", "iterations_per_seed",
                     "final_distance_mean", "threshold", "T"])
        for m, et, e5, it, its, eb, fd in rows:
            wr.writerow([m, source, f"{et:.6g}", f"{e5:.6g}", f"{eb:.6g}", it,
                         " ".join(map(str, its)), f"{fd:.6g}", args.threshold, T])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
        ms = [r[0] for r in rows]
        ax[0].semilogy(ms, [r[1] for r in rows], "o-", label=TIGHT)
        ax[0].semilogy(ms, [r[5] for r in rows], "s--", label="best accountant")
        ax[0].set_xlabel("noise multiplier")
        ax[0].set_ylabel("mean ε over learners")
        ax[0].legend(fontsize=7)
        ax[1].plot(ms, [r[3] for r in rows], "o-", label=f"iterations to ≤ {args.threshold:g}")
        ax[1].plot(ms, [r[6] for r in rows], "s--", label="‖mean θ − θ*‖ at T")
        ax[1].set_xlabel("noise multiplier")
        ax[1].legend(fontsize=7)
        fig.suptitle(f"003 Table I trends — {source}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "table1.png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        log("matplotlib missing: no table1.png")
    return rows


def rate(args: argparse.Namespace, shards: list, source: str, out: Path) -> dict:
    """Slope of log E‖θ_t − θ*_t‖² and log regret vs log t with ς = 0.05, u = 0.6, v = 0.7
    (β = min{1 − v, 2u − 2ς − 1} = 0.1 > 0; the paper's own parameters give β ≤ 0)."""
    steps = StepSizes.parameter_free(1.0, 1.0, u=args.rate_u, v=args.rate_v)
    grid = eval_grid(args.steps)
    errs, regs = [], []
    for s in range(args.seeds):
        task = make_task(shards, args, seed=100 + s)
        stars = optimum_path(task, grid)
        algo = build("chen-wang", task, args, steps=steps)
        priv = {"noise-scale": np.full(N, args.rate_noise_scale),
                "noise-exponent": np.full(N, args.rate_varsigma)}
        res = run(algo, args.steps, run_seed=100 + s, privacy=priv)
        e, g, _ = metrics(task, res.decisions, grid, stars)
        errs.append(e)
        regs.append(g)
    e, g = np.mean(errs, axis=0), np.mean(regs, axis=0)
    half = grid + 1 >= min(args.rate_fit_from, args.steps // 2)
    te = np.log(grid[half] + 1.0)
    slope_e = float(np.polyfit(te, np.log(e[half]), 1)[0])
    slope_g = float(np.polyfit(te, np.log(np.maximum(g[half], 1e-300)), 1)[0])
    beta = steps.rate_beta(args.rate_varsigma)
    with open(out / "rate.csv", "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["data", "t", "tracking_error", "regret", "u", "v", "varsigma", "beta"])
        for j, t in enumerate(grid):
            wr.writerow([source, int(t) + 1, e[j], g[j], args.rate_u, args.rate_v,
                         args.rate_varsigma, beta])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.loglog(grid + 1, e, label=f"E‖θ−θ*‖² (slope {slope_e:.2f})")
        ax.loglog(grid + 1, np.maximum(g, 1e-12), label=f"regret (slope {slope_g:.2f})")
        ref = e[half][0] * ((grid[half] + 1.0) / (grid[half][0] + 1.0)) ** (-beta)
        ax.loglog(grid[half] + 1, ref, "k--", label=f"t^(−β), β = {beta:.2f} (Thm 1/3)")
        ax.set_xlabel("t")
        ax.legend(fontsize=7)
        ax.set_title(f"rate check — {source}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "rate.png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        log("matplotlib missing: no rate.png")
    return {"slope_error": slope_e, "slope_regret": slope_g, "beta": beta,
            "fit_from": int(grid[half][0]) + 1}


def plot_fig1(out: Path, curves: dict, grid: np.ndarray, eps: dict, source: str,
              args: argparse.Namespace) -> None:
    """Fig. 1's three panels. ``curves[(name, noise)]`` is a list of per-seed
    ``(error, regret, ...)`` arrays over ``grid``; ε curves that exceed 10⁸ are left out of
    panel (c) (they are in ``epsilon.csv``) so that the finite ones stay readable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        log("matplotlib missing: no fig1.png")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {"chen-wang": "C0", "chen-wang-tuned": "C1", "dsgd": "C2", "dola": "C3",
              "pdop": "C4"}
    for (name, noise), runs in curves.items():
        if not runs:
            continue
        style = {"paper noise": "-", "noise off": "--"}.get(noise, ":" if PER_STEP in noise
                                                             else "-.")
        lab = f"{NAMES[name]} ({noise})"
        kw = {"color": colors[name], "lw": 1.2}
        ax[0].loglog(grid + 1, np.mean([r[0] for r in runs], axis=0), style, label=lab, **kw)
        ax[1].loglog(grid + 1, np.maximum(np.mean([r[1] for r in runs], axis=0), 1e-12), style,
                     label=lab, **kw)
    ax[0].set_title("(a) mean tracking error ‖θ_t^i − θ_t^*‖²", fontsize=9)
    ax[1].set_title("(b) mean instantaneous regret F_t(θ_t^i) − F_t(θ_t^*)", fontsize=9)
    left_out = []
    for (name, acc), arr in eps["values"].items():
        mean = arr.mean(axis=0)
        if mean[-1] > 1e8:
            left_out.append(f"{NAMES[name]}: {acc}")
            continue
        style = {TIGHT: "-", THM5: "--", CONTRACTIVE: "-.", PER_STEP: ":",
                 PER_DATUM: "-"}[acc]
        ax[2].loglog(eps["ts"], mean, style, color=colors[name], label=f"{NAMES[name]}: {acc}")
    ax[2].set_title("(c) cumulative ε (mean over learners)" +
                    (f"\nleft out (> 1e8): {'; '.join(left_out)}" if left_out else ""),
                    fontsize=7 if left_out else 9)
    for a in ax:
        a.set_xlabel("t")
        a.legend(fontsize=5.5)
    fig.suptitle(f"Paper 003 Fig. 1 — {source}, 5 learners on a ring, {args.seeds} seeds",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "fig1.png", dpi=120)
    plt.close(fig)


def replot(args: argparse.Namespace, out: Path) -> None:
    """Redraw fig1.png from fig1.csv and epsilon.csv (means only) without rerunning."""
    curves: dict[tuple[str, str], list] = {}
    grids: dict[tuple[str, str], list[int]] = {}
    source = ""
    with open(out / "fig1.csv") as fh:
        for r in csv.DictReader(fh):
            key = (r["algorithm"], r["noise"])
            source = r["data"]
            curves.setdefault(key, [[[], []]])
            curves[key][0][0].append(float(r["tracking_error_mean"]))
            curves[key][0][1].append(float(r["regret_mean"]))
            grids.setdefault(key, []).append(int(r["t"]) - 1)
            args.seeds = int(r["seeds"])
    grid = np.array(next(iter(grids.values())))
    curves = {k: [(np.array(v[0][0]), np.array(v[0][1]))] for k, v in curves.items()}
    values: dict[tuple[str, str], list] = {}
    ts: list[int] = []
    with open(out / "epsilon.csv") as fh:
        for r in csv.DictReader(fh):
            key = (r["algorithm"], r["accountant"])
            values.setdefault(key, []).append([float(r[f"learner{i + 1}"]) for i in range(N)])
            if key == next(iter(values)):
                ts.append(int(r["T"]))
    eps = {"ts": np.array(ts), "values": {k: np.array(v).T for k, v in values.items()}}
    plot_fig1(out, curves, grid, eps, source, args)


# -- docs -----------------------------------------------------------------------------------
def write_docs(args: argparse.Namespace, out: Path, source: str, res: dict) -> None:
    docs = ROOT / "docs"
    (docs / "figures").mkdir(parents=True, exist_ok=True)
    tag = f"-{args.docs_tag}" if args.docs_tag else ""
    for name in ("fig1", "table1", "rate"):
        if (out / f"{name}.png").exists():
            shutil.copy(out / f"{name}.png", docs / "figures" / f"chen-wang{tag}-{name}.png")
    for name in ("fig1", "epsilon", "table1", "rate"):
        if (out / f"{name}.csv").exists():
            shutil.copy(out / f"{name}.csv", docs / f"results-chen-wang{tag}-{name}.csv")
    cmd = "nice -n 10 python -m simulations.chen_wang " + " ".join(args.argv)
    lines = [
        f"# Paper 003 (Chen & Wang): results{' (' + args.docs_tag + ')' if tag else ''}",
        "",
        f"Data: **{source}**. 5 learners on a ring (w_ij = 0.3), T = {args.steps}, "
        f"r = {args.reg:g}, {args.seeds} seeds. Produced by:",
        "",
        f"    {cmd}",
        "",
        f"(CSV files `docs/results-chen-wang{tag}-*.csv`, figures "
        f"`docs/figures/chen-wang{tag}-*.png`.)",
        "",
    ]
    if "fig1" in res:
        f = res["fig1"]
        lines += ["## Fig. 1: tracking error, regret, cumulative ε", "",
                  f"![fig1](figures/chen-wang{tag}-fig1.png)", "",
                  f"At t = T = {args.steps} (mean ± std over seeds):", "",
                  "| algorithm | noise | step₀ | seeds | ‖θ−θ*‖² | regret |",
                  "|---|---|---|---|---|---|"]
        for name, noise, s0, k, em, es, gm, gs in f["rows"]:
            lines.append(f"| {NAMES[name]} | {noise} | {s0 if s0 else 'paper'} | {k} | "
                         f"{em:.4g} ± {es:.2g} | {gm:.4g} ± {gs:.2g} |")
        lines += ["", "Cumulative ε at T, mean over the 5 learners (range), per accountant:",
                  "", "| algorithm | accountant | ε(T) mean | min–max |", "|---|---|---|---|"]
        for (name, acc), arr in f["eps"]["values"].items():
            lines.append(f"| {NAMES[name]} | {acc} | {arr[:, -1].mean():.4g} | "
                         f"{arr[:, -1].min():.4g}–{arr[:, -1].max():.4g} |")
        lines.append("")
    if "table1" in res:
        lines += ["## Table I: budget vs iterations", "",
                  f"![table1](figures/chen-wang{tag}-table1.png)", "",
                  f"Noise Lap(0.1·m·(t+1)^(0.1+0.01i)); iterations until ‖mean θ − θ*‖ ≤ "
                  f"{args.threshold:g} (T if never), mean over {args.table_seeds} seed(s).", "",
                  "| multiplier m | ε tight (mean) | ε Thm 5(i) (mean) | ε best (mean) | "
                  "iterations | ‖mean θ − θ*‖ at T |",
                  "|---|---|---|---|---|---|"]
        for m, et, e5, it, _, eb, fd in res["table1"]:
            lines.append(f"| {m:g} | {et:.4g} | {e5:.4g} | {eb:.4g} | {it:.0f} | {fd:.3g} |")
        lines.append("")
    if "rate" in res:
        r = res["rate"]
        lines += ["## Rate check", "", f"![rate](figures/chen-wang{tag}-rate.png)", "",
                  f"ϱ₀ = {args.rate_noise_scale}, ς = {args.rate_varsigma}, u = {args.rate_u}, "
                  f"v = {args.rate_v}, {args.seeds} seeds → "
                  f"β = {r['beta']:.3f}. Least-squares slope of log(mean over seeds) vs log t "
                  f"from t = {r['fit_from']}: tracking error {r['slope_error']:.3f} "
                  f"(theorem: ≤ −β = {-r['beta']:.3f}), regret {r['slope_regret']:.3f}.", ""]
    marker = "<!-- generated above; analysis below is written by hand -->"
    path = docs / f"results-chen-wang{tag}.md"
    tail = ""
    if path.exists() and marker in path.read_text():
        tail = path.read_text().split(marker, 1)[1]
    path.write_text("\n".join(lines) + "\n" + marker + tail)
    log(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--reg", type=float, default=0.01)
    p.add_argument("--data-path", default=None, help="mushrooms LIBSVM file (or .rda)")
    p.add_argument("--synthetic", action="store_true", help="use the generated stand-in")
    p.add_argument("--raw-rows", action="store_true",
                   help="keep mushrooms' raw one-hot rows (as the LIBSVM file; eq. (22) explodes, "
                        "the contractive accountant does not) instead of unit-norm rows")
    p.add_argument("--docs-tag", default="", help="suffix of the docs files (e.g. raw)")
    p.add_argument("--small-standin", action="store_true", help="a 600×20 stand-in (tests)")
    p.add_argument("--parts", nargs="+", default=["fig1", "table1", "rate"],
                   choices=["fig1", "table1", "rate"])
    p.add_argument("--tune-grid", nargs="+", type=float, default=[0.25],
                   help="first value: the starting multiple of each method's base step")
    p.add_argument("--tune-doublings", type=int, default=10)
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--equal-budget", action="store_true")
    p.add_argument("--table-multipliers", nargs="+", type=float,
                   default=[1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6])
    p.add_argument("--table-seeds", type=int, default=1)
    p.add_argument("--threshold", type=float, default=1.0)
    p.add_argument("--rate-varsigma", type=float, default=0.05)
    p.add_argument("--rate-u", type=float, default=0.6)
    p.add_argument("--rate-noise-scale", type=float, default=0.1,
                   help="ϱ₀ of the rate check (the rate does not depend on it; a smaller one "
                        "reaches the asymptotic regime within T)")
    p.add_argument("--rate-fit-from", type=int, default=200)
    p.add_argument("--rate-v", type=float, default=0.7)
    p.add_argument("--out", default="results/chen-wang")
    p.add_argument("--docs", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only redraw fig1.png from --out's CSV files")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        replot(args, out)
        return 0
    shards, source = load_data(args)
    log(f"data: {source}, dim {shards[0][0].shape[1]}, shard sizes "
        f"{[s[0].shape[0] for s in shards]}")
    res: dict = {}
    if "fig1" in args.parts:
        res["fig1"] = fig1(args, shards, source, out)
    if "table1" in args.parts:
        res["table1"] = table1(args, shards, source, out)
    if "rate" in args.parts:
        res["rate"] = rate(args, shards, source, out)
        log(f"rate: {res['rate']}")
    if args.docs:
        write_docs(args, out, source, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
