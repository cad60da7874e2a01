"""The numbers the docs quote outside the sweeps' own tables, each written to a CSV.

Issue 36 item 3: every number in README.md and docs/ comes from a committed CSV or from a
command whose output is committed. The sweeps (``simulations.logreg``, ``simulations.cnn``,
…) write their own tables; this script writes the rest, one subcommand per CSV:

    # noise std and noise multiplier, exact analytic Gaussian vs the paper's zCDP formula,
    # at the settings the results pages use
    python -m simulations.doc_numbers calibration --out docs/results-calibration.csv
    # the demo's step-size tuning (README command 1; experiments/demo.py's ETAS)
    python -m simulations.doc_numbers demo-tuning --out docs/results-demo-tuning.csv
    # feature and raw gradient norms of the logistic-regression data (balanced labels)
    python -m simulations.doc_numbers logreg-norms --out docs/results-logreg-norms.csv
    # the CNN's final noise-to-signal ratio per batch size at fixed images per learner
    python -m simulations.doc_numbers cnn-noise --out docs/results-cnn-noise.csv
    # the zero decision's and the class prior's loss on Wang et al.'s data sets
    python -m simulations.doc_numbers class-prior --out docs/results-wang-class-prior.csv
    # rewrite the tables of results pages from their committed CSVs (no run)
    python -m simulations.doc_numbers blocks results-wang.md results-chen-wang.md
    # docs/data.md's measured numbers: label balance and the best global model per
    # configuration, the default's label spread over many seeds, drift, gradient noise
    python -m simulations.doc_numbers data-balance --out docs/results-data-balance.csv
    python -m simulations.doc_numbers data-balance --no-fit --configs default \\
        --seeds $(seq 0 49) --out docs/results-data-label-spread.csv
    python -m simulations.doc_numbers data-drift --out docs/results-data-drift.csv
    python -m simulations.doc_numbers data-noise --out docs/results-data-noise.csv
    python -m simulations.doc_numbers blocks data.md
    # per-seed comparison of every pair of methods in a sweep's per-seed CSV
    python -m simulations.doc_numbers paired --runs docs/results-logreg.csv \\
        --out docs/results-logreg-paired.csv

Experiment code (not installed); it calls the library's public API and the experiment
modules only.
"""

from __future__ import annotations

import argparse
import csv
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: (page, mechanism, steps, epsilon, delta): the calibrations the results pages quote
CALIBRATIONS = (
    ("results-cnn.md", "blt", 5000, 2.0, 1e-3),
    ("results-cnn.md", "independent", 5000, 2.0, 1e-3),
    ("results-logreg.md", "toeplitz", 4000, 2.0, 1e-3),
    ("results-logreg.md", "toeplitz", 4000, 0.5, 1e-3),
)


def _write(path: Path, header: Sequence[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    print(f"{len(rows)} rows -> {path}", flush=True)


def calibration_rows(cases: Sequence[tuple] = CALIBRATIONS) -> list[list]:
    """Each case under both calibrations: the noise std per coordinate for clip norm 1
    and the noise multiplier (std / L2 sensitivity), and zCDP's std over the exact one."""
    from flwr_corrnoise import calibrate_mechanism

    rows = []
    for page, mechanism, steps, eps, delta in cases:
        cal = {m: calibrate_mechanism(epsilon=eps, delta=delta, clip_norm=1.0,
                                      mechanism=mechanism, steps=steps, method=m)
               for m in ("exact", "zcdp")}
        for m, c in cal.items():
            rows.append([page, mechanism, steps, eps, delta, m, f"{c.std:.4f}",
                         f"{c.noise_multiplier:.4f}", f"{c.std / cal['exact'].std:.4f}"])
    return rows


def demo_tuning_rows(methods: Sequence[str], grid: Sequence[float], seeds: Sequence[int],
                     rounds: int | None = None) -> list[list]:
    """experiments.demo's tuning (final test accuracy per method, η and tuning seed), with
    the mean over the seeds and the η each method's best mean picks."""
    from experiments.demo import DEMO, run_inprocess

    base = DEMO if rounds is None else DEMO.with_(rounds=rounds)
    rows = []
    for method in methods:
        per_eta = {}
        for eta in grid:
            per_eta[eta] = [
                run_inprocess(base.with_(mechanism=method, eta=eta, seed=s, data_seed=s))[0][-1][
                    "test-accuracy"] for s in seeds]
            print(f"{method:<12} η = {eta:<5g} mean final accuracy "
                  f"{np.mean(per_eta[eta]):.3f}", flush=True)
        best = max(per_eta, key=lambda e: float(np.mean(per_eta[e])))
        for eta, accs in per_eta.items():
            for s, acc in zip(seeds, accs, strict=True):
                rows.append([method, eta, s, f"{acc:.4f}", f"{np.mean(accs):.4f}",
                             int(eta == best)])
    return rows


def _grad_norms(A: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """‖∇ log(1 + exp(−y⟨x, a⟩))‖ = σ(−y⟨x, a⟩)·‖a‖ for every datum."""
    from scipy.special import expit

    return expit(-y * (A @ x)) * np.linalg.norm(A, axis=1)


def _quantiles(v: np.ndarray) -> list[str]:
    return [f"{np.quantile(v, p):.3f}" for p in (0.1, 0.5, 0.9)]


def logreg_norms_rows(seeds: Sequence[int], points: int, learners: int = 20,
                      dim: int = 100) -> list[list]:
    """Per data seed of the logistic-regression setting (balanced labels, α = β = 0.1):
    the features' norm, the share of ‖a‖² in the learner's mean ``v_i``, and the raw
    per-datum gradient norms at ``x = 0`` (where every run starts) and at the best single
    global model (L2-regularised logistic fit on the same points), over each learner's
    first ``points`` stream positions. Quantiles: 10 %, 50 %, 90 %."""
    from flwr_corrnoise.apps.logreg_task import LogRegSetup, federation
    from flwr_corrnoise.metrics import fit_logistic

    rows = []
    for seed in seeds:
        setup = LogRegSetup(num_learners=learners, dim=dim, labels="centred", data_seed=seed)
        fed = federation(setup)
        means = fed.feature_means
        batches = [fed.learner_batch(i, 0, points) for i in range(learners)]
        A = np.concatenate([a for a, _ in batches])
        y = np.concatenate([b for _, b in batches])
        mean_of = np.repeat(means, points, axis=0)
        norms = np.linalg.norm(A, axis=1)
        share = float(np.sum(mean_of**2) / np.sum(A**2))
        x_best = fit_logistic(A, y, l2=1e-4)

        g0, gb = _grad_norms(A, y, np.zeros(dim)), _grad_norms(A, y, x_best)
        q = _quantiles
        rows.append([seed, learners, dim, points, f"{norms.mean():.3f}", *q(norms),
                     f"{share:.3f}", *q(g0), *q(gb), f"{np.mean(gb > 1.0):.3f}"])
    return rows


NORMS_HEADER = ["data_seed", "learners", "dim", "points_per_learner", "feature_norm_mean",
                "feature_norm_q10", "feature_norm_q50", "feature_norm_q90",
                "share_of_squared_norm_in_learner_mean", "grad_norm_at_zero_q10",
                "grad_norm_at_zero_q50", "grad_norm_at_zero_q90", "grad_norm_at_best_q10",
                "grad_norm_at_best_q50", "grad_norm_at_best_q90",
                "fraction_clipped_at_best_bg1"]


def paired_rows(runs: Path, metrics: Sequence[str]) -> list[list]:
    """Every pair of methods at every budget of a per-seed CSV (``simulations.logreg``'s
    ``runs.csv``/``docs/results-logreg*.csv``): on how many seeds the first is above, equal
    to, below the second, and the mean and std over the seeds of the difference."""
    with open(runs) as fh:
        data = list(csv.DictReader(fh))
    budgets = sorted({(r["epsilon"], r["delta"]) for r in data if r["epsilon"]})
    rows = []
    for eps, delta in budgets:
        here = [r for r in data if (r["epsilon"], r["delta"]) == (eps, delta) or not r["epsilon"]]
        methods = list(dict.fromkeys(r["method"] for r in here))
        for metric in metrics:
            by = {m: {r["seed"]: float(r[metric]) for r in here if r["method"] == m}
                  for m in methods}
            for a, b in itertools.combinations(methods, 2):
                seeds = sorted(set(by[a]) & set(by[b]), key=int)
                d = np.array([by[a][s] - by[b][s] for s in seeds])
                rows.append([eps, delta, metric, a, b, len(seeds), int(np.sum(d > 0)),
                             int(np.sum(d == 0)), int(np.sum(d < 0)), f"{d.mean():.5f}",
                             f"{d.std(ddof=1) if len(d) > 1 else 0.0:.5f}"])
    return rows


def cnn_noise_rows(images: Sequence[int], batches: Sequence[int],
                   mechanisms: Sequence[str] = ("independent", "blt"),
                   learners: int = 10) -> list[list]:
    """The CNN's final noise-to-signal ratio (``experiments.cnn.final_noise_to_signal``)
    at ``images`` per learner, each used once, in steps of ``B`` images (``N = images/B``
    steps; the step's noise is added to the sum of ``B`` clipped gradients, so the ratio
    at ``N`` steps is divided by ``B``), under both calibrations. Why: whether a batch
    size exists at which independent noise's ratio falls below 1 (Zhang, Zhu, Fay &
    Johansson report ≈ 0.8 accuracy for it) without using an image twice."""
    from experiments.cnn import CNNSetup, PaperCNN, final_noise_to_signal

    d = sum(p.numel() for p in PaperCNN().parameters())
    rows = []
    for m_images, b, cal, mech in itertools.product(images, batches, ("exact", "zcdp"),
                                                    mechanisms):
        if m_images % b:
            continue
        steps = m_images // b
        ratio = final_noise_to_signal(CNNSetup(mechanism=mech, steps=steps,
                                               num_learners=learners, calibration=cal), d)
        rows.append([m_images, b, steps, cal, mech, learners, d, f"{ratio / b:.4f}"])
    return rows


def class_prior_rows() -> list[list]:
    """Wang et al.'s data sets: the multiclass logistic loss of the zero decision (``ln k``)
    and of always predicting the class prior (its entropy), the two levels a learned model
    must beat. Poker from its exact class law (what the stand-in draws; the real set's
    law), letter from its rows where the data is on the machine (skipped, and said so,
    where it is not)."""
    from experiments.data.poker import CLASS_COUNTS

    def entropy(counts: np.ndarray) -> float:
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    rows = [["poker", len(CLASS_COUNTS), f"{np.log(len(CLASS_COUNTS)):.4f}",
             f"{entropy(CLASS_COUNTS):.4f}", "exact class law (experiments/data/poker.py)"]]
    try:
        from experiments.data.letter import load_letter

        _, y, source = load_letter(None)
    except FileNotFoundError as err:
        print(f"letter skipped: {err}", flush=True)
    else:
        counts = np.bincount(y, minlength=26)
        rows.append(["letter", 26, f"{np.log(26):.4f}", f"{entropy(counts):.4f}", source])
    return rows


#: docs/data.md § 3's configurations of the synthetic generator: key → (label, changes to
#: the default ``SyntheticConfig``)
DATA_CONFIGS: dict[str, tuple[str, dict]] = {
    "naive": ("naive FedProx (`shared_scale=0, centered=False`)",
              {"shared_scale": 0.0, "centered": False}),
    "centred-independent": ("centred, independent models (`shared_scale=0`)",
                            {"shared_scale": 0.0}),
    "shared-1": ("`shared_scale=1`", {"shared_scale": 1.0}),
    "default": ("**default** (`shared_scale=2`, α = β = 0.1)", {}),
    "label-noise": ("default, `label_noise=0.05`", {"label_noise": 0.05}),
    "shared-3": ("`shared_scale=3`", {"shared_scale": 3.0}),
    "alpha-beta-0": ("default with α = β = 0", {"alpha": 0.0, "beta": 0.0}),
    "alpha-beta-1": ("default with α = β = 1", {"alpha": 1.0, "beta": 1.0}),
}
BALANCE_HEADER = ["config", "seed", "points_per_learner", "test_size", "best_global_accuracy",
                  "majority_accuracy", "learner_majority_accuracy", "plus_fraction_per_learner"]


def _best_global(fed, points: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every learner's first ``points`` positions and the L2-regularised (λ = 10⁻⁴)
    logistic fit on all of them: the best single global model (``metrics.fit_logistic``)."""
    from flwr_corrnoise.metrics import fit_logistic

    batches = [fed.learner_batch(i, 0, points) for i in range(fed.num_learners)]
    A = np.concatenate([a for a, _ in batches])
    y = np.concatenate([b for _, b in batches])
    return fit_logistic(A, y, l2=1e-4, gtol=1e-7), A, y


def data_balance_rows(configs: Sequence[str], seeds: Sequence[int], points: int = 4000,
                      test_size: int = 20_000, fit: bool = True, learners: int = 20,
                      dim: int = 100) -> list[list]:
    """Per configuration of :data:`DATA_CONFIGS` and data seed: each learner's +1 fraction
    over its first ``points`` positions and, with ``fit``, the test accuracy of the best
    global model, of the test set's majority label and of each learner's training majority
    label (``test_set`` point ``j`` is learner ``j mod n``'s). Why: docs/data.md's case
    that the default leaves room between the trivial predictor and the achievable one.
    ``learners``, ``dim``: Zhang et al.'s 20 and 100 (smaller for a toy-size test)."""
    from flwr_corrnoise.data import SyntheticConfig, SyntheticFederation
    from flwr_corrnoise.metrics import accuracy

    rows = []
    for key, seed in itertools.product(configs, seeds):
        fed = SyntheticFederation(SyntheticConfig(seed=seed, num_learners=learners, dim=dim,
                                                  **DATA_CONFIGS[key][1]))
        n = fed.num_learners
        if fit:
            x, _, y = _best_global(fed, points)
            plus = (y.reshape(n, points) > 0).mean(axis=1)
            ta, ty = fed.test_set(test_size)
            p = float(np.mean(ty > 0))
            learner_label = np.where(plus >= 0.5, 1.0, -1.0)[np.arange(test_size) % n]
            accs = [f"{accuracy(x, ta, ty):.4f}", f"{max(p, 1 - p):.4f}",
                    f"{np.mean(learner_label == ty):.4f}"]
        else:
            plus = np.array([np.mean(fed.learner_batch(i, 0, points)[1] > 0)
                             for i in range(n)])
            accs = ["", "", ""]
        rows.append([key, seed, points, test_size if fit else "", *accs,
                     ";".join(f"{f:.4f}" for f in plus)])
        print(f"{key:<20} seed {seed}: {accs}", flush=True)
    return rows


def _fractions(rows: Sequence[dict]) -> np.ndarray:
    return np.array([float(f) for r in rows for f in r["plus_fraction_per_learner"].split(";")])


def balance_table(rows: Sequence[dict]) -> str:
    """docs/data.md's table: per configuration, the +1 fraction per learner (min / median /
    max over seeds × learners), the share of learners whose labels are almost constant,
    and the mean ± sample std over seeds of the best global model's accuracy beside the
    two trivial predictors' means."""
    lines = ["| configuration | +1 fraction per learner (min / median / max) | learners "
             "outside [0.1, 0.9] / [0.02, 0.98] | best global model | majority | "
             "learner-majority |", "|---|---|---|---|---|---|"]
    for key, (label, _) in DATA_CONFIGS.items():
        mine = [r for r in rows if r["config"] == key]
        if not mine:
            continue
        f = _fractions(mine)
        best = np.array([float(r["best_global_accuracy"]) for r in mine])
        mean = {c: np.mean([float(r[c]) for r in mine])
                for c in ("majority_accuracy", "learner_majority_accuracy")}
        bold = "**" if key == "default" else ""
        lines.append(
            f"| {label} | {f.min():.2f} / {np.median(f):.2f} / {f.max():.2f} | "
            f"{100 * np.mean((f < 0.1) | (f > 0.9)):.0f} % / "
            f"{100 * np.mean((f < 0.02) | (f > 0.98)):.0f} % | "
            f"{bold}{best.mean():.3f} ± {best.std(ddof=1):.3f}{bold} | "
            f"{bold}{mean['majority_accuracy']:.3f}{bold} | "
            f"{mean['learner_majority_accuracy']:.3f} |")
    return "\n".join(lines)


def label_spread_text(rows: Sequence[dict]) -> str:
    """The default's label balance over many seeds, as a sentence."""
    f = _fractions(rows)
    per_seed = [_fractions([r]).mean() for r in rows]
    seeds = sorted({int(r["seed"]) for r in rows})
    n = len(f) // len(rows)
    return (f"Label balance of the default over {len(seeds)} seeds × {n} learners: all "
            f"per-learner +1 fractions lie in [{f.min():.2f}, {f.max():.2f}], 90 % in "
            f"[{np.quantile(f, 0.05):.2f}, {np.quantile(f, 0.95):.2f}]; the per-seed mean "
            f"over learners lies in [{min(per_seed):.2f}, {max(per_seed):.2f}].")


def data_drift_rows(drifts: Sequence[float], seed: int = 0, points: int = 1000,
                    late: int = 3000, test_at: int = 3500, test_size: int = 20_000,
                    learners: int = 20, dim: int = 100) -> list[list]:
    """Drift (docs/data.md § 4): the best global models of the default configuration on
    every learner's positions ``0 … points−1`` and ``late … late+points−1``, the cosine
    between them, and each one's accuracy on ``test_set(test_size, position=test_at)``."""
    from flwr_corrnoise.data import SyntheticConfig, SyntheticFederation
    from flwr_corrnoise.metrics import accuracy, fit_logistic

    rows = []
    for drift in drifts:
        fed = SyntheticFederation(SyntheticConfig(seed=seed, drift=drift,
                                                  num_learners=learners, dim=dim))
        models = []
        for start in (0, late):
            batches = [fed.learner_batch(i, start, points) for i in range(fed.num_learners)]
            models.append(fit_logistic(np.concatenate([a for a, _ in batches]),
                                       np.concatenate([b for _, b in batches]),
                                       l2=1e-4, gtol=1e-7))
        early, later = models
        cos = float(early @ later / (np.linalg.norm(early) * np.linalg.norm(later)))
        ta, ty = fed.test_set(test_size, position=test_at)
        rows.append([drift, seed, points, late, test_at, test_size, f"{cos:.4f}",
                     f"{accuracy(early, ta, ty):.4f}", f"{accuracy(later, ta, ty):.4f}"])
    return rows


DRIFT_HEADER = ["drift", "seed", "points_per_learner", "late_start", "test_position",
                "test_size", "cosine_early_late", "early_model_accuracy",
                "late_model_accuracy"]


def _exp(v: float) -> str:
    """``1e-4`` rather than Python's ``1e-04``."""
    return f"{v:.0e}".replace("e-0", "e-")


def drift_table(rows: Sequence[dict]) -> str:
    r0 = rows[0]
    lines = [f"| drift | cosine of the two optima | early model on test@{r0['test_position']} "
             f"| late model on test@{r0['test_position']} |", "|---|---|---|---|"]
    lines += [f"| {_exp(float(r['drift']))} | {float(r['cosine_early_late']):.2f} | "
              f"{float(r['early_model_accuracy']):.3f} | {float(r['late_model_accuracy']):.3f} |"
              for r in rows]
    return "\n".join(lines)


def _noisy(grad, std: float, rng: np.random.Generator):
    """A gradient oracle with ``N(0, std²)`` added to every coordinate of its gradient."""
    def g(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        (v,) = grad(params, position)
        return [v + std * rng.standard_normal(v.shape)] if std else [v]
    return g


def data_noise_rows(stds: Sequence[float], seeds: Sequence[int], rounds: int = 1000,
                    eta: float = 0.03, test_size: int = 20_000) -> list[list]:
    """Online FedAvg on the default data (the library's in-process engine, no clipping, no
    privacy) with i.i.d. ``N(0, std²)`` added to every per-step gradient by the gradient
    oracle: final test accuracy. Why: that added noise shows up as lower accuracy on this
    data, which the mechanism comparison needs. The noise here is a plain NumPy draw — a
    property of the task, not a private release."""
    from flwr_corrnoise.apps.logreg_task import (
        LogRegSetup,
        federation,
        initial_parameters,
        logistic_gradient,
    )
    from flwr_corrnoise.engine import run_inprocess
    from flwr_corrnoise.metrics import accuracy

    rows = []
    for std, seed in itertools.product(stds, seeds):
        setup = LogRegSetup(mechanism="none", eta=eta, rounds=rounds, data_seed=seed,
                            seed=seed)

        res = run_inprocess(initial=initial_parameters(setup),
                            gradients=[_noisy(logistic_gradient(setup, i), std,
                                              np.random.default_rng([seed, i]))
                                       for i in range(setup.num_learners)],
                            settings=setup.settings(), rounds=rounds, tau=setup.tau,
                            eta=eta, seed=seed)
        ta, ty = federation(setup).test_set(test_size)
        acc = accuracy(res.params[0], ta, ty)
        rows.append([std, seed, setup.num_learners, setup.tau, rounds, eta, test_size,
                     f"{acc:.4f}"])
        print(f"std {std:g} seed {seed}: {acc:.4f}", flush=True)
    return rows


NOISE_HEADER = ["noise_std", "seed", "learners", "tau", "rounds", "eta", "test_size",
                "test_accuracy"]


def noise_table(rows: Sequence[dict]) -> str:
    seeds = sorted({int(r["seed"]) for r in rows})
    lines = [f"| per-step gradient noise | test accuracy, seeds {' / '.join(map(str, seeds))} |",
             "|---|---|"]
    for std in dict.fromkeys(float(r["noise_std"]) for r in rows):
        accs = {int(r["seed"]): float(r["test_accuracy"]) for r in rows
                if float(r["noise_std"]) == std}
        label = f"i.i.d. N(0, {std:g}²) per coordinate" if std else "none"
        lines.append(f"| {label} | {' / '.join(f'{accs[s]:.3f}' for s in seeds)} |")
    return "\n".join(lines)


def data_blocks(docs: Path) -> dict[str, str]:
    """docs/data.md's generated blocks, from the CSVs that exist (each written by its
    subcommand)."""
    def read(name: str) -> list[dict]:
        with open(docs / name) as fh:
            return list(csv.DictReader(fh))

    out = {}
    for block, name, render in (("table:data-balance", "results-data-balance.csv",
                                 balance_table),
                                ("text:data-label-spread", "results-data-label-spread.csv",
                                 label_spread_text),
                                ("table:data-drift", "results-data-drift.csv", drift_table),
                                ("table:data-noise", "results-data-noise.csv", noise_table)):
        if (docs / name).exists():
            out[block] = render(read(name))
    return out


def _logreg_rows(path: Path) -> list[list]:
    """A ``simulations.logreg`` per-seed CSV read back into the rows its ``table`` takes."""
    with open(path) as fh:
        raw = list(csv.reader(fh))[1:]
    return [[r[0], float(r[1]) if r[1] else "", float(r[2]) if r[2] else "", int(r[3]),
             float(r[4]), float(r[5]), float(r[6]), float(r[7])] for r in raw]


#: results-logreg.md's blocks: (CSV, budgets in the order the sweep's ``--budgets`` ran)
LOGREG_BLOCKS = {
    "table:centred": ("results-logreg.csv", "descending"),
    "table:fedprox": ("results-logreg-fedprox.csv", "descending"),
    "table:eps-sweep": ("results-logreg-eps-sweep.csv", "ascending"),
    "table:variants": ("results-logreg-variants.csv", "descending"),
}


def doc_blocks(page: str, docs: Path | None = None) -> dict[str, str]:
    """Every generated block (``<!-- BEGIN name -->`` … ``<!-- END name -->``) of a
    results page, rendered by its sweep's own table code from the committed CSVs alone.
    Issue 36: a table in the docs is the output of a command on a committed file, so the
    page must equal this (tests/experiments/test_doc_numbers.py); a page not listed here raises."""
    docs = docs or Path(__file__).resolve().parents[1] / "docs"
    if page == "results-cnn.md":
        from simulations.cnn import render_blocks

        return {f"table:{k}": v for k, v in render_blocks(docs).items()}
    if page == "results-logreg.md":
        from simulations.logreg import table

        out = {}
        for name, (path, order) in LOGREG_BLOCKS.items():
            rows = _logreg_rows(docs / path)
            budgets = sorted({(r[1], r[2]) for r in rows if r[1] != ""},
                             reverse=order == "descending")
            out[name] = table(rows, {}, budgets)
        return out
    if page == "results-multi-epoch.md":
        from simulations import multi_epoch

        runs = multi_epoch.read_csv(docs / "results-multi-epoch.csv")
        tuning = (multi_epoch.read_csv(docs / "results-multi-epoch-tuning.csv")
                  if (docs / "results-multi-epoch-tuning.csv").exists() else [])
        tabs = multi_epoch.tables(runs, tuning)
        if (docs / "results-multi-epoch-noise.csv").exists():
            tabs["rmse"] = multi_epoch.noise_table(
                multi_epoch.read_csv(docs / "results-multi-epoch-noise.csv"))
        if (docs / "results-multi-epoch-bands.csv").exists():
            tabs["bands"] = multi_epoch.bands_table(
                multi_epoch.read_csv(docs / "results-multi-epoch-bands.csv"))
        return {f"table:{k}": v for k, v in tabs.items()}
    if page == "results-wang.md":
        from simulations.wang_tables import render_blocks

        return render_blocks(docs)
    if page.startswith("results-chen-wang"):
        from simulations.chen_wang_tables import render_blocks

        return render_blocks(page, docs)
    if page == "data.md":
        return data_blocks(docs)
    if page == "results-plan-check.md":  # issue 32's
        from simulations.plan_check import render_blocks as plan_check_blocks

        return plan_check_blocks(docs)
    raise KeyError(f"no renderer for the generated blocks of {page}")


def write_blocks(pages: Sequence[str], docs: Path | None = None) -> None:
    """Rewrite every generated block of each page from the committed CSVs (a page must
    already hold each block's markers: the prose around a table places it)."""
    from simulations.marked import update_marked_section

    docs = docs or Path(__file__).resolve().parents[1] / "docs"
    for page in pages:
        for name, text in doc_blocks(page, docs).items():
            update_marked_section(docs / page, name, text, append=False)
        print(f"{page}: blocks rewritten from the committed CSVs", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("calibration", help="noise std, exact vs zCDP, at the docs' settings")
    c.add_argument("--out", type=Path, default=Path("docs/results-calibration.csv"))
    d = sub.add_parser("demo-tuning", help="the demo's η grid on its tuning seeds")
    d.add_argument("--out", type=Path, default=Path("docs/results-demo-tuning.csv"))
    d.add_argument("--methods", nargs="+", default=["none", "independent", "blt"])
    d.add_argument("--grid", nargs="+", type=float, default=[0.01, 0.03, 0.1, 0.3, 1.0])
    d.add_argument("--seeds", nargs="+", type=int, default=[100, 101, 102])
    d.add_argument("--rounds", type=int, default=None, help="default: the demo's (20)")
    n = sub.add_parser("logreg-norms", help="feature and gradient norms, balanced labels")
    n.add_argument("--out", type=Path, default=Path("docs/results-logreg-norms.csv"))
    n.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    n.add_argument("--points", type=int, default=1000, help="stream positions per learner")
    n.add_argument("--learners", type=int, default=20)
    n.add_argument("--dim", type=int, default=100)
    q = sub.add_parser("paired", help="per-seed pairwise comparison of a sweep's methods")
    q.add_argument("--runs", type=Path, default=Path("docs/results-logreg.csv"))
    q.add_argument("--metrics", nargs="+", default=["final_accuracy", "avg_online_loss"])
    q.add_argument("--out", type=Path, default=Path("docs/results-logreg-paired.csv"))
    w = sub.add_parser("class-prior", help="Wang et al.'s data: zero-decision and prior loss")
    w.add_argument("--out", type=Path, default=Path("docs/results-wang-class-prior.csv"))
    b = sub.add_parser("blocks", help="rewrite a results page's tables from its CSVs")
    b.add_argument("pages", nargs="+", help="e.g. results-wang.md results-chen-wang.md")
    k = sub.add_parser("cnn-noise", help="the CNN's noise-to-signal ratio per batch size")
    k.add_argument("--out", type=Path, default=Path("docs/results-cnn-noise.csv"))
    k.add_argument("--images", nargs="+", type=int, default=[1000, 5000, 6000])
    k.add_argument("--batches", nargs="+", type=int, default=[1, 10, 50, 100, 200])
    db = sub.add_parser("data-balance", help="data.md: label balance, best global model")
    db.add_argument("--out", type=Path, default=Path("docs/results-data-balance.csv"))
    db.add_argument("--configs", nargs="+", default=list(DATA_CONFIGS), choices=DATA_CONFIGS)
    db.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    db.add_argument("--points", type=int, default=4000, help="stream positions per learner")
    db.add_argument("--no-fit", action="store_true", help="label fractions only")
    dd = sub.add_parser("data-drift", help="data.md: the optimum's drift")
    dd.add_argument("--out", type=Path, default=Path("docs/results-data-drift.csv"))
    dd.add_argument("--drifts", nargs="+", type=float, default=[1e-4, 3e-4])
    dn = sub.add_parser("data-noise", help="data.md: online FedAvg with gradient noise")
    dn.add_argument("--out", type=Path, default=Path("docs/results-data-noise.csv"))
    dn.add_argument("--stds", nargs="+", type=float, default=[0.0, 1.0, 3.0])
    dn.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    dn.add_argument("--rounds", type=int, default=1000)
    args = p.parse_args(argv)
    if args.what == "data-balance":
        _write(args.out, BALANCE_HEADER, data_balance_rows(args.configs, args.seeds,
                                                           args.points, fit=not args.no_fit))
    elif args.what == "data-drift":
        _write(args.out, DRIFT_HEADER, data_drift_rows(args.drifts))
    elif args.what == "data-noise":
        _write(args.out, NOISE_HEADER, data_noise_rows(args.stds, args.seeds, args.rounds))
    elif args.what == "blocks":
        write_blocks(args.pages)
    elif args.what == "class-prior":
        _write(args.out, ["dataset", "classes", "zero_decision_loss", "class_prior_loss",
                          "source"], class_prior_rows())
    elif args.what == "cnn-noise":
        _write(args.out, ["images_per_learner", "batch_size", "steps", "calibration",
                          "mechanism", "learners", "dim", "noise_to_signal"],
               cnn_noise_rows(args.images, args.batches))
    elif args.what == "calibration":
        _write(args.out, ["page", "mechanism", "steps", "epsilon", "delta", "calibration",
                          "std_per_coordinate_clip1", "noise_multiplier",
                          "std_over_exact"], calibration_rows())
    elif args.what == "demo-tuning":
        _write(args.out, ["method", "eta", "tuning_seed", "final_accuracy",
                          "mean_final_accuracy", "chosen"],
               demo_tuning_rows(args.methods, args.grid, args.seeds, args.rounds))
    elif args.what == "logreg-norms":
        _write(args.out, NORMS_HEADER,
               logreg_norms_rows(args.seeds, args.points, args.learners, args.dim))
    else:
        _write(args.out, ["epsilon", "delta", "metric", "method_a", "method_b", "seeds",
                          "a_above_b", "equal", "a_below_b", "mean_a_minus_b",
                          "std_a_minus_b"], paired_rows(args.runs, args.metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
