"""Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated Learning With
Correlated Noise", Sec. V-A: online logistic regression with correlated-noise local DP.

Full size (n = 20, d = 100, τ = 4, R = 1000, α = β = 0.1, 10 seeds, both budgets):

    python -m simulations.logreg --out results/logreg --docs

Toy size (what the tests run):

    python -m simulations.logreg --rounds 20 --seeds 2 --eta-grid 0.05 0.1 --out /tmp/lr

Step sizes are tuned per method and budget on ``--eta-grid`` by the average online loss
(paper eq. (1) is a sum of online losses) over ``--tune-seeds`` seeds that are *not* the
evaluation seeds, then every method runs ``--seeds`` seeds at its tuned step size. Every
run uses the vectorized in-process engine (``flwr_corrnoise.engine.run_vectorized``: all
learners of a round as one array, each learner's step still the library's one private step,
the same learner and server code as the Flower app); ``--engine reference`` runs the
one-learner-at-a-time ``run_inprocess`` instead (the same results to 1e-12, slower; timings
in docs/benchmarks-history.md, issue 22). A run's metrics are computed for all its rounds at
once when read (``SweepEvaluator``), and the dynamic regret's per-round optima once per data
seed and process. Outputs in ``--out``: ``runs.csv`` (per seed), ``tuning.csv``,
``curves.csv`` (mean/std per round), ``accuracy.png``, ``loss.png``, ``regret.png``;
``--docs`` also writes ``docs/results-logreg.csv`` (``-fedprox.csv`` for ``--labels
fedprox``, ``-TAG.csv`` with ``--docs-tag TAG``) and the tuning scores beside it
(``docs/results-logreg-tuning.csv``, ``-fedprox-tuning.csv``, …), copies the plots to
``docs/figures/`` and puts the table into ``docs/results-logreg.md`` between its markers.
"""

from __future__ import annotations

import os

# One BLAS thread per process: the sweep's parallelism is its worker processes, and on 2
# shared cores a multi-threaded product or eigendecomposition is 3–4× slower in wall time
# (docs/benchmarks-history.md, issue 22). Set before NumPy loads when run as a script.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402
from concurrent.futures import ProcessPoolExecutor, as_completed  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from scipy.special import expit  # noqa: E402

from experiments.logreg import run_logreg_inprocess  # noqa: E402
from flwr_corrnoise.apps.logreg_task import (  # noqa: E402
    LABEL_RULES,
    LogRegEvaluator,
    LogRegSetup,
    federation,
    initial_parameters,
    logistic_gradient,
)
from flwr_corrnoise.engine import InProcessResult, run_vectorized  # noqa: E402
from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.mechanisms import check_mechanism  # noqa: E402
from flwr_corrnoise.metrics import round_optimum  # noqa: E402
from flwr_corrnoise.settings import NOISELESS  # noqa: E402
from simulations.marked import update_marked_section  # noqa: E402

#: the paper's methods (a deliberate subset of the registry, checked against it)
METHODS = [NOISELESS, *(check_mechanism(m)
                        for m in ("independent", "tree", "optimized", "toeplitz", "blt"))]
NAMES = {
    "none": "noiseless (Mitra et al.)",
    "independent": "independent (Liu et al.)",
    "tree": "binary tree (MF i)",
    "optimized": "optimized (MF ii)",
    "toeplitz": "Toeplitz (MF iii)",
    "efficient-tree": "efficient tree",
    "blt": "BLT, 4 buffers (ours)",
}
RESULT_HEADER = [
    "method", "epsilon", "delta", "seed", "eta", "final_accuracy", "avg_online_loss",
    "dynamic_regret",
]


@dataclass(frozen=True)
class Job:
    setup: LogRegSetup
    phase: str  # "tune" or "eval"
    engine: str = "vectorized"  # or "reference" (flwr_corrnoise.engine.run_inprocess)


#: every learner's data at positions ``0 … R·τ − 1``, per federation and length: the runs
#: of a sweep that share a data seed (every method, budget and step size of the tuning,
#: every method of an evaluation seed) read the same data, so a process draws it once.
#: The last two are kept (64 MB each at the paper's size).
_DATA: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()


def stream_data(setup: LogRegSetup) -> tuple[np.ndarray, np.ndarray]:
    """``(features, labels)`` of shapes ``(n, R·τ, d)`` and ``(n, R·τ)``: learner ``i``'s
    datum at position ``p`` is ``features[i, p]``, the one
    :meth:`~flwr_corrnoise.data.synthetic.SyntheticFederation.learner_batch` gives
    (memoized per process, :data:`_DATA`)."""
    s = setup
    length = s.rounds * s.tau
    key = (s.num_learners, s.dim, s.alpha, s.beta, s.drift, s.data_seed, s.labels, length)
    if key in _DATA:
        _DATA.move_to_end(key)
        return _DATA[key]
    fed = federation(setup)
    feats = np.empty((s.num_learners, length, s.dim))
    labels = np.empty((s.num_learners, length))
    for i in range(s.num_learners):
        feats[i], labels[i] = fed.learner_batch(i, 0, length)
    _DATA[key] = (feats, labels)
    while len(_DATA) > 2:
        _DATA.popitem(last=False)
    return feats, labels


class BatchGradient:
    """Every learner's logistic gradient at its datum in one call: the ``batch_gradient``
    of :func:`flwr_corrnoise.engine.run_vectorized` for this task.

    Row ``k`` is :func:`~flwr_corrnoise.metrics.logistic_grad` of model ``Z[k]`` on
    learner ``learners[k]``'s datum at ``positions[k]`` (the datum
    :func:`~flwr_corrnoise.apps.logreg_task.logistic_gradient` reads), as ``−y·σ(−y⟨z, a⟩)·a``
    for all rows at once. The data come from :func:`stream_data` (positions past the
    run's ``R·τ`` from the federation directly).
    """

    def __init__(self, setup: LogRegSetup) -> None:
        self.fed = federation(setup)
        self.feats, self.labels = stream_data(setup)
        # learner i's datum at position p is row i·length + p (a take, not a 2-D gather)
        self.length = self.labels.shape[1]
        self.flat_feats = self.feats.reshape(-1, self.feats.shape[2])
        self.flat_labels = self.labels.reshape(-1)

    def __call__(self, z: np.ndarray, learners: list[int], positions: list[int]) -> np.ndarray:
        if positions and min(positions) >= 0 and max(positions) < self.length:
            rows = np.array(learners, dtype=np.intp)
            rows *= self.length
            rows += positions
            feats = self.flat_feats.take(rows, axis=0)
            labels = self.flat_labels.take(rows)
        else:
            feats, labels = np.empty_like(z), np.empty(len(learners))
            for k, (i, p) in enumerate(zip(learners, positions, strict=True)):
                a, y = self.fed.learner_batch(i, p, 1)
                feats[k], labels[k] = a[0], y[0]
        weights = -labels * expit(-labels * np.einsum("ij,ij->i", feats, z))
        return feats * weights[:, None]


def run_vectorized_logreg(setup: LogRegSetup, evaluate=None) -> InProcessResult:
    """The experiment on the vectorized engine (the per-step methods; Zhang, Zhu, Fay & Johansson,
    "Locally Differentially Private Online Federated Learning With Correlated Noise" (arXiv version)
    and Zhang, Zhu & Johansson's ("Differentially Private Online Federated Learning with Correlated
    Noise") variants, ``noise_at`` ≠ ``"step"``, run on :func:`run_logreg_inprocess`). Equals
    :func:`run_logreg_inprocess` to 1e-12 on the same seeds
    (``tests/learner/test_vectorized_engine.py``)."""
    if setup.noise_at != "step" and setup.mechanism != NOISELESS:
        return run_logreg_inprocess(setup, evaluate=evaluate)
    return run_vectorized(
        initial=initial_parameters(setup),
        gradients=[logistic_gradient(setup, i) for i in range(setup.num_learners)],
        batch_gradient=BatchGradient(setup),
        settings=setup.settings(), rounds=setup.rounds, tau=setup.tau, eta=setup.eta,
        eta_g=setup.eta_g, seed=setup.seed, fraction_train=setup.fraction_train,
        evaluate=evaluate,
    )


#: ``(f^r)*`` of every round, per (federation, R, τ): the dynamic regret's optimum depends
#: on the round's data only, so the runs of a sweep that share a data seed (every method,
#: budget and step size of the tuning, every method of an evaluation seed) solve them once
#: per process (:func:`round_optima`)
_OPTIMA: dict[tuple, np.ndarray] = {}


def certified_separable(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """For each of ``R`` rounds (``features``: ``R×m×d``, ``labels``: ``R×m``), whether the
    minimum-norm solution of ``⟨x, a_j⟩ = y_j`` separates the round's points strictly, by
    :func:`~flwr_corrnoise.metrics.is_separable`'s acceptance rule (every margin above
    ``1e-8·‖x‖·‖a_j‖``). ``True`` is a proof that the round is separable, whose optimum
    :func:`~flwr_corrnoise.metrics.round_optimum` then decides is ``0.0``; ``False``
    proves nothing (the caller asks ``round_optimum``). Why: the same certificate for all
    rounds in a few batched products (``x = Aᵀ(AAᵀ)⁻¹y``) instead of one least-squares
    solve per round — 1000 per data seed."""
    rounds, m, d = features.shape
    if m > d:  # more points than dimensions: AAᵀ is singular, no batched certificate
        return np.zeros(rounds, dtype=bool)
    gram = features @ features.transpose(0, 2, 1)
    try:
        coef = np.linalg.solve(gram, labels[:, :, None])[:, :, 0]
    except np.linalg.LinAlgError:  # some round's AAᵀ is singular: round by round
        coef = np.full(labels.shape, np.nan)  # NaN margins: no certificate
        for r in range(rounds):
            with contextlib.suppress(np.linalg.LinAlgError):
                coef[r] = np.linalg.solve(gram[r], labels[r])
    x = np.einsum("rmd,rm->rd", features, coef)
    margins = labels * np.einsum("rmd,rd->rm", features, x)
    scale = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(features, axis=2)
    ok = np.all(np.isfinite(margins), axis=1) & np.all(scale > 0, axis=1)
    return ok & np.all(margins > 1e-8 * scale, axis=1)


def round_features(setup: LogRegSetup) -> tuple[np.ndarray, np.ndarray]:
    """Every round's ``n·τ`` points from :func:`stream_data`, as ``R×nτ×d`` and ``R×nτ``:
    round ``r`` holds learner after learner, ``τ`` points each (the order
    :meth:`~flwr_corrnoise.apps.logreg_task.LogRegEvaluator.round_data` concatenates)."""
    s = setup
    feats, labels = stream_data(s)
    per = feats.reshape(s.num_learners, s.rounds, s.tau, s.dim).transpose(1, 0, 2, 3)
    return (per.reshape(s.rounds, s.num_learners * s.tau, s.dim),
            labels.reshape(s.num_learners, s.rounds, s.tau).transpose(1, 0, 2).reshape(
                s.rounds, s.num_learners * s.tau))


def round_optima(setup: LogRegSetup) -> np.ndarray:
    """``(f^r)*`` for ``r = 0 … R − 1`` (memoized per data seed, :data:`_OPTIMA`):
    ``0.0`` where :func:`certified_separable` proves the round separable, else
    :func:`~flwr_corrnoise.metrics.round_optimum` of the round's data — the value
    ``round_optimum`` gives for every round."""
    s = setup
    key = (s.num_learners, s.dim, s.alpha, s.beta, s.drift, s.data_seed, s.labels, s.tau,
           s.rounds)
    if key not in _OPTIMA:
        feats, labels = round_features(s)
        out = np.zeros(s.rounds)
        for r in np.flatnonzero(~certified_separable(feats, labels)):
            out[r] = round_optimum(feats[r], labels[r])
        _OPTIMA[key] = out
    return _OPTIMA[key]


#: models per block of the evaluation's ``models × test points`` products (2 MB at 2000)
_EVAL_BLOCK = 128


def softplus(z: np.ndarray) -> np.ndarray:
    """``log(1 + e^z)`` as ``max(z, 0) + log1p(e^{−|z|})``: the logistic loss
    :func:`~flwr_corrnoise.metrics.logistic_loss` takes as ``logaddexp(0, z)``, equal to
    rounding (stable at any ``z``), with one exponential instead of two (half the time
    over the ``(R+1)×m`` margins of a run)."""
    return np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z)))


class SweepEvaluator(LogRegEvaluator):
    """:class:`LogRegEvaluator`'s rows, computed for all rounds at once.

    A call records ``x^r`` and returns nothing; the rows are computed when :attr:`rows`
    (or :meth:`summary`) is read: the test accuracy and loss of every recorded model in
    one ``(R+1)×d`` by ``d×m`` product, the online losses from the rounds' data
    (:func:`round_features`), and the round optima from :func:`round_optima` (solved once
    per data seed and process). The same formulas as
    :func:`~flwr_corrnoise.metrics.accuracy` and :func:`~flwr_corrnoise.metrics.logistic_loss`
    over a matrix product instead of ``R + 1`` vector products: equal to the plain
    evaluator's rows to rounding (``tests/learner/test_vectorized_engine.py``). Why: evaluating
    round by round was ≈ 0.25 s of a 1000-round run's ≈ 0.6–2.4 s."""

    def __init__(self, setup: LogRegSetup) -> None:
        self._rows: list[dict[str, float]] = []
        self._pending: list[tuple[int, np.ndarray]] = []
        super().__init__(setup, regret=False)

    @property
    def rows(self) -> list[dict[str, float]]:  # type: ignore[override]
        self._flush()
        return self._rows

    @rows.setter
    def rows(self, value: list[dict[str, float]]) -> None:
        self._rows = list(value)

    def round_data(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        tau = self.setup.tau
        feats, labels = stream_data(self.setup)
        if (r + 1) * tau > labels.shape[1]:
            return super().round_data(r)
        # learner after learner, τ points each: the order LogRegEvaluator concatenates
        return (feats[:, r * tau:(r + 1) * tau].reshape(-1, self.setup.dim),
                labels[:, r * tau:(r + 1) * tau].reshape(-1))

    def __call__(self, r: int, params: list[np.ndarray]) -> None:  # type: ignore[override]
        self._pending.append((r, np.array(params[0], dtype=np.float64, copy=True)))

    def _flush(self) -> None:
        """The rows of the recorded models, appended in order."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        s = self.setup
        if s.drift:  # a test set per round: round by round
            for r, x in pending:  # (appends the row, which gets its optimum here)
                self._with_optimum(r, LogRegEvaluator.__call__(self, r, [x]))
            return
        models = np.stack([x for _, x in pending])
        finite = np.all(np.isfinite(models), axis=1)
        a, b = self._test
        accuracy, loss = np.empty(len(pending)), np.empty(len(pending))
        for k in range(0, len(pending), _EVAL_BLOCK):  # blocks of models: arrays of ≤ 2 MB
            margins = models[k:k + _EVAL_BLOCK] @ a.T
            # sign(0) = +1, as metrics.accuracy; a count of the correct, exactly its mean
            accuracy[k:k + _EVAL_BLOCK] = np.count_nonzero(
                (margins >= 0.0) == (b > 0), axis=1) / b.size
            loss[k:k + _EVAL_BLOCK] = np.mean(softplus(-b * margins), axis=1)
        rounds = np.array([r for r, _ in pending])
        train = rounds < s.rounds
        online = np.full(len(pending), np.nan)
        # round r's points are feats[i, r·τ:(r+1)·τ] of every learner i: margins as
        # learners × rounds × τ (views of the data, no copy), then in the round's order
        # (learner after learner, τ each: LogRegEvaluator.round_data's)
        at = rounds[train]
        if at.size:
            feats, labels = stream_data(s)
            shape = (s.num_learners, s.rounds, s.tau)
            # consecutive rounds (a run's): a slice, a view; else a gather
            which = (slice(at[0], at[-1] + 1)
                     if np.array_equal(at, np.arange(at[0], at[0] + at.size)) else at)
            margins = np.einsum("nrtd,rd->rnt", feats.reshape(*shape, s.dim)[:, which],
                                models[train])
            y = labels.reshape(shape)[:, which].transpose(1, 0, 2)
            online[train] = np.mean(softplus(-(y * margins).reshape(at.size, -1)), axis=1)
        for k, (r, _) in enumerate(pending):
            row = {"round": float(r),
                   "test-accuracy": float(accuracy[k]) if finite[k] else math.nan,
                   "test-loss": float(loss[k]) if finite[k] else math.nan}
            if r < s.rounds:
                row["online-loss"] = float(online[k]) if finite[k] else math.nan
            self._rows.append(self._with_optimum(r, row))

    def _with_optimum(self, r: int, row: dict[str, float]) -> dict[str, float]:
        if r < self.setup.rounds:
            row["round-optimum"] = float(round_optima(self.setup)[r])
        return row


def run_job(job: Job) -> dict:
    """One run of Algorithm 1 (vectorized engine, or the reference in-process engine with
    ``--engine reference``); returns summary and per-round curves."""
    s = job.setup
    ev = SweepEvaluator(s)
    start = time.perf_counter()
    if job.engine == "reference":
        run_logreg_inprocess(s, evaluate=ev)
    else:
        run_vectorized_logreg(s, evaluate=ev)
    return {
        "job": job,
        "summary": ev.summary(),
        "seconds": time.perf_counter() - start,
        "accuracy": np.array([r["test-accuracy"] for r in ev.rows]),
        "test_loss": np.array([r["test-loss"] for r in ev.rows]),
        "online_loss": np.array([r["online-loss"] for r in ev.rows if "online-loss" in r]),
        "regret": s.tau * np.cumsum(
            [r["online-loss"] - r["round-optimum"] for r in ev.rows if "online-loss" in r]
        ),
    }


def run_chunk(jobs: list[Job]) -> list[dict]:
    """Several runs in one worker, one after the other (see :func:`chunks`)."""
    return [run_job(j) for j in jobs]


def chunks(jobs: list[Job], workers: int) -> list[list[Job]]:
    """The jobs cut so that each data seed's runs go to as few workers as can keep all
    busy: a process then draws a seed's data (:func:`stream_data`) and solves its round
    optima (:data:`_OPTIMA`) once. A seed with fewer chunks than workers (the tuning's)
    is dealt out round-robin, so that the chunks cost about the same."""
    by_seed: dict[int, list[Job]] = {}
    for j in jobs:
        by_seed.setdefault(j.setup.data_seed, []).append(j)
    parts = max(1, workers // len(by_seed)) if by_seed else 1
    return [group[k::parts] for group in by_seed.values() for k in range(parts)
            if group[k::parts]]


def prepare(setups: list[LogRegSetup]) -> None:
    """Build every setup's factorization, calibration and kernel in this process before
    the workers start: forked workers inherit them, so a factorization that is slow to
    load is loaded once, not once per worker (``optimized`` at N = 4000: ≈ 0.4 s from
    its cached ``C`` and ``C⁻¹``, ≈ 16 s the first time, one N×N eigendecomposition)."""
    for s in setups:
        if s.mechanism != NOISELESS and s.noise_at == "step":
            LearnerState.create(s.settings(), [(1,)], seed=0)


def run_all(jobs: list[Job], workers: int, what: str) -> list[dict]:
    """Run jobs in parallel processes (by data seed, :func:`chunks`) and show progress
    with an ETA."""
    results, start = [], time.perf_counter()
    print(f"{what}: {len(jobs)} runs on {workers} worker(s)", file=sys.stderr, flush=True)
    if workers <= 1:
        for i, res in enumerate((run_job(j) for j in jobs), 1):
            results.append(res)
            _progress(i, len(jobs), start, res)
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_chunk, c) for c in chunks(jobs, workers)]
        for fut in as_completed(futures):
            chunk = fut.result()
            done = len(results) + len(chunk)  # the ETA counts whole chunks
            for res in chunk:
                results.append(res)
                _progress(len(results), len(jobs), start, res, done)
    return results


def _progress(i: int, total: int, start: float, res: dict, done: int | None = None) -> None:
    elapsed = time.perf_counter() - start
    done = i if done is None else done
    eta = elapsed / done * (total - done)
    s = res["job"].setup
    print(
        f"  [{i:>3}/{total}] {s.label:<34} η={s.eta:<6g} seed={s.seed:<3} "
        f"acc={res['summary']['final_accuracy']:.3f} "
        f"online={res['summary']['avg_online_loss']:.3f}  "
        f"({elapsed:.0f} s elapsed, ~{eta:.0f} s left)",
        file=sys.stderr,
        flush=True,
    )


def configs(args: argparse.Namespace) -> list[LogRegSetup]:
    """One setup per (method, budget); the noiseless method once (no budget)."""
    base = LogRegSetup(
        num_learners=args.learners, dim=args.dim, alpha=args.alpha, beta=args.beta,
        drift=args.drift, rounds=args.rounds, tau=args.tau, eta_g=args.eta_g,
        clip=args.clip, method=args.calibration, test_size=args.test_size,
        labels=args.labels,
    )
    out = []
    for method in args.methods:
        if method == "none":
            out.append(base.with_(mechanism="none"))
            continue
        mechanism, _, where = method.partition("@")
        for eps, delta in args.budgets:
            out.append(base.with_(mechanism=mechanism, noise_at=where or "step",
                                  epsilon=eps, delta=delta))
    return out


def method_name(s: LogRegSetup) -> str:
    """``toeplitz`` (per-step, Zhang et al.), ``toeplitz@round`` (Zhang et al., arXiv) or
    ``toeplitz@server`` (Zhang, Zhu & Johansson): the method column of the CSVs and tables."""
    if s.mechanism == "none":
        return "none"
    return s.mechanism if s.noise_at == "step" else f"{s.mechanism}@{s.noise_at}"


def display_name(method: str) -> str:
    mechanism, _, where = method.partition("@")
    suffix = {"": "", "round": ", per round (Zhang et al., arXiv)",
              "server": ", central (Zhang, Zhu & Johansson)"}[where]
    return NAMES.get(mechanism, mechanism) + suffix


def order(method: str) -> tuple[int, str]:
    mechanism = method.partition("@")[0]
    return (METHODS.index(mechanism) if mechanism in METHODS else len(METHODS), method)


def key(s: LogRegSetup) -> tuple:
    return (method_name(s), None if s.mechanism == "none" else s.epsilon,
            None if s.mechanism == "none" else s.delta)


def tune(args: argparse.Namespace, setups: list[LogRegSetup]) -> dict[tuple, float]:
    """Pick η per (method, budget) by mean average online loss on the tuning seeds."""
    jobs = [
        Job(s.with_(eta=eta, seed=1000 + j, data_seed=1000 + j), "tune", args.engine)
        for s in setups for eta in args.eta_grid for j in range(args.tune_seeds)
    ]
    results = run_all(jobs, args.workers, "tuning step sizes")
    scores: dict[tuple, dict[float, list[float]]] = {}
    for res in results:
        s = res["job"].setup
        loss = res["summary"]["avg_online_loss"]
        scores.setdefault(key(s), {}).setdefault(s.eta, []).append(
            loss if math.isfinite(loss) else math.inf
        )
    best = {k: min(v, key=lambda eta: float(np.mean(v[eta]))) for k, v in scores.items()}
    with open(args.out / "tuning.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "epsilon", "delta", "eta", "mean_avg_online_loss", "chosen"])
        for k, per_eta in sorted(scores.items(), key=lambda kv: str(kv[0])):
            for eta, losses in sorted(per_eta.items()):
                w.writerow([k[0], k[1] or "", k[2] or "", eta, float(np.mean(losses)),
                            int(eta == best[k])])
    return best


def evaluate(args: argparse.Namespace, setups: list[LogRegSetup], etas: dict) -> list[dict]:
    jobs = [
        Job(s.with_(eta=etas[key(s)], seed=seed, data_seed=seed), "eval", args.engine)
        for s in setups for seed in range(args.seeds)
    ]
    return run_all(jobs, args.workers, "evaluation runs")


def write_runs(path: Path, results: list[dict]) -> list[list]:
    rows = []
    for res in sorted(results, key=lambda r: (key(r["job"].setup).__str__(), r["job"].setup.seed)):
        s, m = res["job"].setup, res["summary"]
        noiseless = s.mechanism == "none"
        rows.append([
            "noiseless" if noiseless else method_name(s),
            "" if noiseless else s.epsilon,
            "" if noiseless else s.delta,
            s.seed, s.eta, m["final_accuracy"], m["avg_online_loss"], m["dynamic_regret"],
        ])
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(RESULT_HEADER)
        w.writerows(rows)
    return rows


def aggregate_curves(results: list[dict]) -> dict[tuple, dict[str, tuple[np.ndarray, np.ndarray]]]:
    groups: dict[tuple, list[dict]] = {}
    for res in results:
        groups.setdefault(key(res["job"].setup), []).append(res)
    out = {}
    for k, runs in groups.items():
        out[k] = {}
        for name in ("accuracy", "test_loss", "online_loss", "regret"):
            stack = np.vstack([r[name] for r in runs])
            out[k][name] = (stack.mean(axis=0), stack.std(axis=0))
    return out


def plot(args: argparse.Namespace, curves: dict, budgets: list[tuple[float, float]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, ylabel, fname in (
        ("accuracy", "test accuracy", "accuracy.png"),
        ("online_loss", "online loss $f^r(x^r)$", "loss.png"),
        ("regret", "cumulative dynamic regret (eq. 1)", "regret.png"),
    ):
        fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.2), squeeze=False)
        for ax, (eps, delta) in zip(axes[0], budgets, strict=True):
            for k, per in sorted(curves.items(), key=lambda kv: order(kv[0][0])):
                if k[0] != "none" and (k[1], k[2]) != (eps, delta):
                    continue
                mean, std = per[name]
                x = np.arange(len(mean))
                if name == "online_loss" and len(mean) > 50:  # smooth the noisy online loss
                    mean, std = moving_average(mean, len(mean) // 50), moving_average(
                        std, len(mean) // 50)
                ax.plot(x, mean, label=display_name(k[0]))
                ax.fill_between(x, mean - std, mean + std, alpha=0.2)
            ax.set_title(f"(ε, δ) = ({eps:g}, {delta:g}), mean ± std over {args.seeds} seeds")
            ax.set_xlabel("round r")
            ax.set_ylabel(ylabel)
            if name != "accuracy":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = args.out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def moving_average(values: np.ndarray, width: int) -> np.ndarray:
    """Centred moving average that averages only the points that exist at the edges (a
    plain ``np.convolve(..., "same")`` pads with zeros and bends the curve's ends down)."""
    if width <= 1:
        return values
    kernel = np.ones(width)
    return np.convolve(values, kernel, mode="same") / np.convolve(
        np.ones_like(values), kernel, mode="same")


def write_curves(path: Path, curves: dict) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "epsilon", "delta", "metric", "round", "mean", "std"])
        for k, per in curves.items():
            for name, (mean, std) in per.items():
                for r, (m, s) in enumerate(zip(mean, std, strict=True)):
                    w.writerow([k[0], k[1] or "", k[2] or "", name, r, m, s])


def read_curves(path: Path) -> dict[tuple, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Inverse of :func:`write_curves` (for ``--replot``)."""
    cols: dict[tuple, dict[str, dict[int, tuple[float, float]]]] = {}
    with open(path) as fh:
        for row in csv.DictReader(fh):
            k = (row["method"], float(row["epsilon"]) if row["epsilon"] else None,
                 float(row["delta"]) if row["delta"] else None)
            cols.setdefault(k, {}).setdefault(row["metric"], {})[int(row["round"])] = (
                float(row["mean"]), float(row["std"]))
    out = {}
    for k, metrics in cols.items():
        out[k] = {}
        for name, points in metrics.items():
            ordered = [points[r] for r in sorted(points)]
            out[k][name] = (np.array([m for m, _ in ordered]), np.array([s for _, s in ordered]))
    return out


def table(rows: list[list], etas: dict, budgets: list[tuple[float, float]]) -> str:
    """Markdown table: mean ± std of the per-seed summaries per method and budget."""
    lines = [
        "| budget (ε, δ) | method | η (tuned) | final accuracy | avg online loss "
        "| dynamic regret |",
        "|---|---|---|---|---|---|",
    ]
    methods = sorted({"none" if r[0] == "noiseless" else r[0] for r in rows}, key=order)
    for eps, delta in budgets:
        for method in methods:
            sel = [r for r in rows if r[0] == ("noiseless" if method == "none" else method)
                   and (method == "none" or (r[1], r[2]) == (eps, delta))]
            if not sel:
                continue
            arr = np.array([[r[5], r[6], r[7]] for r in sel], dtype=float)
            mean, std = arr.mean(axis=0), arr.std(axis=0)
            eta = sel[0][4]
            lines.append(
                f"| ({eps:g}, {delta:g}) | {display_name(method)} | {eta:g} | "
                f"{mean[0]:.3f} ± {std[0]:.3f} | {mean[1]:.3f} ± {std[1]:.3f} | "
                f"{mean[2]:.0f} ± {std[2]:.0f} |"
            )
    return "\n".join(lines)


def parse_budget(text: str) -> tuple[float, float]:
    eps, delta = text.split(":")
    return float(eps), float(delta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--learners", type=int, default=20)
    p.add_argument("--dim", type=int, default=100)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--drift", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--eta-g", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--calibration", default="exact", choices=["exact", "zcdp"])
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--labels", default="centred", choices=sorted(LABEL_RULES),
                   help="label rule of the synthetic data (docs/data.md): our balanced "
                        "'centred' adaptation or the paper's naive 'fedprox' rule")
    p.add_argument("--methods", nargs="+", default=METHODS,
                   help="mechanisms (noise at every local step, Zhang et al.); NAME@round "
                        "adds the noise once per round on the learner (Zhang et al., arXiv), "
                        "NAME@server on a trusted server (Zhang, Zhu & Johansson)")
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=[(2.0, 1e-3), (0.5, 1e-3)])
    p.add_argument("--eta-grid", nargs="+", type=float, default=[0.01, 0.02, 0.05, 0.1, 0.2])
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--engine", default="vectorized", choices=["vectorized", "reference"],
                   help="vectorized: all learners of a round as one array (the default); "
                        "reference: flwr_corrnoise.engine.run_inprocess, one learner at a "
                        "time (the same results to 1e-12, slower)")
    p.add_argument("--out", type=Path, default=Path("results/logreg"))
    p.add_argument("--docs", action="store_true", help="also write docs/results-logreg.*")
    p.add_argument("--docs-tag", default=None,
                   help="with --docs: write docs/results-logreg-TAG.csv and the table section "
                        "'table:TAG' (default: none for centred labels, else the label rule)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the plots of --out from its curves.csv (no runs)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        curves = read_curves(args.out / "curves.csv")
        budgets = sorted({(k[1], k[2]) for k in curves if k[0] != "none"}, reverse=True)
        with open(args.out / "runs.csv") as fh:
            seeds = {row["seed"] for row in csv.DictReader(fh)}
        args.seeds = len(seeds)
        print("\n".join(str(path) for path in plot(args, curves, budgets)))
        return 0
    start = time.perf_counter()
    setups = configs(args)
    if args.workers > 1:
        prepare(setups)
    etas = tune(args, setups)
    results = evaluate(args, setups, etas)
    rows = write_runs(args.out / "runs.csv", results)
    curves = aggregate_curves(results)
    write_curves(args.out / "curves.csv", curves)
    pngs = plot(args, curves, args.budgets)
    md = table(rows, etas, args.budgets)
    (args.out / "table.md").write_text(md + "\n")
    if args.docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        tag = args.docs_tag if args.docs_tag is not None else (
            "" if args.labels == "centred" else args.labels)
        name = f"results-logreg{'-' + tag if tag else ''}"
        write_runs(docs / f"{name}.csv", results)
        # the tuning grid's scores, so that the docs' statements about η are backed by a file
        shutil.copyfile(args.out / "tuning.csv", docs / f"{name}-tuning.csv")
        figures = docs / "figures"
        figures.mkdir(exist_ok=True)
        for png in pngs:  # the plots the docs page shows
            shutil.copyfile(png, figures / f"{name}-{png.name}")
        update_marked_section(docs / "results-logreg.md", f"table:{tag or args.labels}", md)
    print(md)
    print(f"\nresults in {args.out.resolve()} ({', '.join(p.name for p in pngs)}, runs.csv, "
          f"tuning.csv, curves.csv); {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
