"""Learning tasks for the decentralized algorithms: a loss, its gradient, and each node's
data stream, as functions of ``(nodes, step)`` so that every engine sees the same data.

Why data is indexed rather than stored in node state: Chen & Wang's ("Locally Differentially Private
Distributed Online Learning with Guaranteed Optimality") Algorithm 1 uses *all* data seen so far at
the current parameter; keeping that history in Flower's ``context.state`` would grow it every round.
Instead node ``i``'s stream is a fixed i.i.d. draw (with replacement, as Chen & Wang's experiments
do) from its shard, seeded by ``(seed, i)``; a node's history up to step ``t`` is recomputed from
the indices ``0..t``. On a deployed node the same interface reads the node's own local data.

Tasks are rebuilt from a kebab-case config by :func:`build_task` (the Flower ClientApps do
this), so a task must be a deterministic function of its config.

**Declared bounds, not data maxima.** The privacy accountants need a bound ``C`` on how much
one replaced datum can move a per-sample gradient and the per-sample smoothness ``L``. Both
must hold for *every* neighbouring data set — including one whose replaced row is larger than
anything in the data at hand — so they cannot be read off the data (a maximum over the shards
under-bounds a neighbour with a larger row, and the reported ε itself would then depend on the
data). A task therefore *declares* them from its settings (:class:`LogisticTask`: the
``feature_bound`` ``B``, config key ``feature-bound``) and *enforces* them: every row is
projected onto ``{‖a‖ ≤ B}`` before any gradient sees it.

**A datum whose gradient cannot be computed is a zero gradient** — the rule every learner
front end follows (:func:`flwr_corrnoise.learner.attempt_datum`), here vectorized over nodes
and samples. A row of the wrong length, a non-finite value, a label out of range, or a
per-sample term that comes out non-finite: that sample's *data term* counts as zero (the
regularizer, the same on both sides of a neighbouring pair, stays). Whether a datum is
malformed is a property of the data, so it must change nothing that leaves a node — not the
reply's kind, not an error's text — and a zero data term is within the declared bound of any
other (``‖0 − g'‖ ≤ G``), so the accounting is unchanged. Tasks accept such data instead of
refusing the data set (:func:`clean_rows`); their ``grad`` applies the rule per sample
(:func:`usable_samples`, :func:`zero_unusable`); and the algorithms call every task through
:func:`data_gradient`, which applies it per node to a task that raises or returns a
non-finite gradient itself. How many data were zeroed is counted in the node's state
(``zeroed-data``) and its local diagnostics only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flwr_corrnoise.learner import attempt_datum, clip_target

__all__ = ["TASKS", "LogisticTask", "Task", "build_task", "clean_rows", "data_gradient",
           "project_rows", "register_task", "row_norms", "synthetic_shards", "usable_samples",
           "zero_unusable"]


def row_norms(X: np.ndarray) -> np.ndarray:
    """ℓ2 norms along the last axis (kept), without overflow for huge finite rows: a row
    whose plain norm overflows is rescaled by its largest entry first. A huge datum must be
    *projected* (its direction kept), not turned into ``inf``."""
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.linalg.norm(X, axis=-1, keepdims=True)
    if not np.any(np.isinf(norms)):  # the usual case: one pass
        return norms
    over = np.isinf(norms) & np.all(np.isfinite(X), axis=-1, keepdims=True)
    if np.any(over):
        top = np.max(np.abs(X), axis=-1, keepdims=True)
        safe = np.where(over, top, 1.0)
        with np.errstate(over="ignore"):
            norms = np.where(over, safe * np.linalg.norm(X / safe, axis=-1, keepdims=True),
                             norms)
    return norms


def project_rows(X: np.ndarray, bound: float, norms: np.ndarray | None = None) -> np.ndarray:
    """Each row (last axis) projected onto the ℓ2 ball of radius ``bound``: rows inside are
    returned unchanged (bit for bit), rows outside are scaled onto the sphere. This is what
    makes a declared feature bound true for any datum, whatever a data file holds. (A row
    with a non-finite value stays non-finite: :func:`usable_samples` zeroes it.) ``norms``:
    the rows' :func:`row_norms`, if already known.

    "Inside" means a computed norm within :func:`~flwr_corrnoise.learner.clip_target` of
    ``bound`` (``bound`` less a float64 margin), and a row outside is scaled to that radius:
    every row returned then has an **exact** norm of at most ``bound`` (a computed norm,
    and the scaled coordinates, are off by rounding; the accountants take ``bound`` as
    exact)."""
    X = np.asarray(X, dtype=float)
    norms = row_norms(X) if norms is None else norms
    radius = clip_target(bound, X.shape[-1])
    outside = norms > radius
    if not np.any(outside):
        return X
    return X * np.where(outside, radius / np.where(outside, norms, 1.0), 1.0)


# -- a datum whose gradient cannot be computed: zero, vectorized -------------------------
LabelCheck = Callable[[np.ndarray], np.ndarray]


def clean_rows(X: Any, y: Any, label_ok: LabelCheck, dim: int | None = None,
               mark: float = math.nan) -> tuple[np.ndarray, np.ndarray, int]:
    """One shard's rows as ``X [m, dim]`` floats and labels ``y [m]``, with every malformed
    datum kept in place (the stream's indices do not move) but marked: its row zeros, its
    label ``mark`` (which ``label_ok`` rejects). Returns ``(X, y, how many were marked)``.

    Malformed: a row that is not ``dim`` numbers (``X`` may be a sequence of rows of any
    lengths; ``dim`` is then required — the feature count is a setting, never read off
    the data), a non-finite value, a label ``label_ok`` rejects. Why not refuse the data set:
    that refusal is a reply that depends on one datum. Only structure that no single datum
    decides is refused: no rows, or labels of another count than the rows."""
    try:
        dense = np.asarray(X, dtype=float)
    except (TypeError, ValueError):
        dense = None
    if dense is not None and dense.ndim == 2:
        if dim is not None and dense.shape[1] != dim:  # every row: the data set, not a datum
            raise ValueError(f"a shard has {dense.shape[1]} features, the task {dim}")
        rows = dense.copy()
        ok = np.ones(rows.shape[0], dtype=bool)
    else:
        if dim is None:
            raise ValueError("rows of different lengths: declare the feature count (dim)")
        seq = list(X)
        rows = np.zeros((len(seq), int(dim)))
        ok = np.zeros(len(seq), dtype=bool)
        for i, row in enumerate(seq):
            try:
                r = np.asarray(row, dtype=float).ravel()
            except (TypeError, ValueError):
                continue
            if r.size == dim:
                rows[i], ok[i] = r, True
    labels = np.full(rows.shape[0], mark, dtype=float)
    try:
        raw = np.asarray(y, dtype=float).ravel()
    except (TypeError, ValueError):  # a label that is not a number: that datum only
        raw = np.array([_number(v) for v in np.asarray(y, dtype=object).ravel()])
    if raw.shape != (rows.shape[0],) or rows.shape[0] == 0:
        raise ValueError("each shard must be a non-empty set of rows with one label each")
    ok &= np.all(np.isfinite(rows), axis=1)
    with np.errstate(invalid="ignore"):
        ok &= np.asarray(label_ok(raw), dtype=bool)
    rows[~ok] = 0.0
    labels[ok] = raw[ok]
    return rows, labels, int(np.count_nonzero(~ok))


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def usable_samples(X: np.ndarray, y: np.ndarray, label_ok: LabelCheck, fill: float = 0.0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The first half of the rule inside a task's ``grad``: which samples of ``X [k, m, …]``,
    ``y [k, m]`` can enter a gradient (every value finite, the label accepted), and the
    inputs with the others neutralized (row zeros, label ``fill``) so that the vectorized
    code can run on them without raising or overflowing. Returns ``(X, y, ok [k, m],
    norms)``, ``norms`` the :func:`row_norms` of the returned ``X`` (the finiteness check
    costs the one pass a projection or a clip needs anyway)."""
    X = np.asarray(X, dtype=float)
    yy = np.asarray(y, dtype=float)
    norms = row_norms(X)  # non-finite exactly for a row with a non-finite value
    with np.errstate(invalid="ignore"):
        ok = np.all(np.isfinite(norms.reshape(*X.shape[:2], -1)), axis=2) & np.isfinite(yy)
        ok &= np.asarray(label_ok(yy), dtype=bool)
    if not np.all(ok):
        keep = ok.reshape(*ok.shape, *(1,) * (X.ndim - 2))
        X, norms = np.where(keep, X, 0.0), np.where(keep, norms, 0.0)
        yy = np.where(ok, yy, fill)
    return X, yy, ok, norms


def zero_unusable(terms: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The second half: per-sample terms ``[k, m, …]`` with every sample that was not
    usable, or whose term is not finite, set to zero; and how many per node ``[k]``."""
    terms = np.asarray(terms, dtype=float)
    ok = ok & np.all(np.isfinite(terms.reshape(*terms.shape[:2], -1)), axis=2)
    out = np.where(ok.reshape(*ok.shape, *(1,) * (terms.ndim - 2)), terms, 0.0)
    return out, np.count_nonzero(~ok, axis=1).astype(np.int64)


class Task(ABC):
    """A learning problem: ``dim`` parameters, per-node streams, loss and gradient.

    A task that Chen & Wang's accountants (and its baselines') can use also declares
    ``gradient_bound`` (a bound on one sample's data-term gradient norm) and ``smoothness``
    (``L`` of one sample's gradient), as functions of its settings — never of its data — and
    enforces them inside :meth:`grad` (see the module docstring).
    """

    dim: int
    num_nodes: int

    @abstractmethod
    def batch(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The data node ``nodes[k]`` receives at step ``t``: ``X [k, b, ...]``, ``y [k, b]``."""

    @abstractmethod
    def history(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """All data of steps ``0..t``: ``X [k, (t+1)·b, ...]``, ``y [k, (t+1)·b]``."""

    @abstractmethod
    def loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean loss per node ``[k]`` of ``theta [k, dim]`` on ``X, y`` (leading node axis)."""

    @abstractmethod
    def grad(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
             clip: float | None = None) -> np.ndarray:
        """Mean gradient per node ``[k, dim]``; with ``clip`` each sample's data term is
        clipped to ℓ2 norm ``clip`` (so two samples' gradients differ by ≤ 2·clip). A
        sample whose data term cannot be computed should count as zero (the module
        docstring; :func:`usable_samples`, :func:`zero_unusable`)."""

    def grad_counted(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                     clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`grad` and how many samples per node ``[k]`` counted as zero (local
        diagnostics). A task that applies the per-sample rule overrides this."""
        return self.grad(theta, X, y, clip), np.zeros(np.shape(theta)[0], dtype=np.int64)

    def regularizer_grad(self, theta: np.ndarray) -> np.ndarray:
        """The gradient of the data-independent part of the per-sample loss (what stays of
        a zeroed sample's gradient): zero unless the task has a regularizer."""
        return np.zeros_like(np.asarray(theta, dtype=float))


def data_gradient(task: Task, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                  clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The mean gradient per node ``[k, dim]`` that every decentralized algorithm uses, and
    how many samples per node counted as zero ``[k]`` — the one place the datum rule is
    applied for all of them (module docstring).

    The task's own ``grad`` applies it per sample (:meth:`Task.grad_counted`; the built-in
    tasks do). For any task, a node whose gradient still cannot be computed — the call
    raises, returns another shape, or a non-finite row — is retried alone (the other nodes
    keep their vectorized rows, so the in-process engine and a relay node compute the same
    numbers), and if it fails alone its data term counts as zero: the gradient is the
    task's :meth:`~Task.regularizer_grad` and all its samples are counted. The details go
    to the node's log (:func:`flwr_corrnoise.learner.attempt_datum`), never into a reply.
    For an all-history gradient (Chen & Wang) that zeroes the whole step's data term, more
    than one datum: a task should apply the per-sample rule itself.
    """
    theta = np.asarray(theta, dtype=float)
    counted = getattr(task, "grad_counted", None)

    def call(nodes: slice) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(all="ignore"):
            if counted is not None:
                g, zeroed = counted(theta[nodes], X[nodes], y[nodes], clip)
            else:
                g = task.grad(theta[nodes], X[nodes], y[nodes], clip)
                zeroed = np.zeros(theta[nodes].shape[0], dtype=np.int64)
        g = np.asarray(g, dtype=float)
        if g.shape != theta[nodes].shape:
            raise ValueError(f"a gradient of shape {g.shape} for parameters "
                             f"{theta[nodes].shape}")
        return g, np.asarray(zeroed, dtype=np.int64).reshape(g.shape[0])

    where = "a decentralized task's gradient"
    got, _ = attempt_datum(lambda: call(slice(None)), where)
    if got is not None and np.all(np.isfinite(got[0])):
        return got
    g = np.zeros_like(theta)
    zeroed = np.zeros(theta.shape[0], dtype=np.int64)
    bad = np.ones(theta.shape[0], dtype=bool)
    if got is not None:
        g, zeroed = got[0].copy(), got[1].copy()
        bad = ~np.all(np.isfinite(g), axis=1)
    samples = int(np.shape(X)[1]) if np.ndim(X) >= 2 else 1
    for k in np.flatnonzero(bad):
        one, _ = attempt_datum(lambda k=k: call(slice(k, k + 1)), where)
        if one is not None and np.all(np.isfinite(one[0])):
            g[k], zeroed[k] = one[0][0], one[1][0]
        else:  # this node's data term counts as zero
            g[k] = np.asarray(task.regularizer_grad(theta[k : k + 1]), dtype=float)[0] \
                if hasattr(task, "regularizer_grad") else 0.0
            zeroed[k] = samples
    return g, zeroed


class LogisticTask(Task):
    """ℓ2-regularized binary logistic regression (Chen & Wang, Sec. VII-A).

    Per sample ``(a, b)``, ``b ∈ {0, 1}``: ``l = (1 − b) aᵀθ − log s(aᵀθ) + (r/2)‖θ‖²
    = log(1 + e^{aᵀθ}) − b aᵀθ + (r/2)‖θ‖²``; gradient ``(s(aᵀθ) − b) a + rθ``.

    ``feature_bound`` ``B`` is *declared*, not measured: every row is projected onto
    ``{‖a‖ ≤ B}`` (at construction, and again inside :meth:`grad` and :meth:`loss`, so rows
    that reach them by any other way are bounded too). Then the data term has norm
    ``|s − b|·‖a‖ ≤ B`` (:attr:`gradient_bound`; two samples differ by ``≤ 2B``) and is
    ``B²/4``-smooth (:attr:`smoothness` ``= B²/4 + r``) — for every datum, so the ε the
    accountants report is a function of the settings only. The default ``B = 1`` is what the
    bundled loaders guarantee by construction (unit-norm rows); a larger ``B`` keeps larger
    rows intact at the price of larger ``C`` and ``L``.
    """

    def __init__(self, shards: Sequence[tuple[Any, Any]], *, reg: float = 1e-3,
                 horizon: int = 2000, seed: int = 0, batch_size: int = 1,
                 feature_bound: float = 1.0, dim: int | None = None,
                 name: str = "logistic") -> None:
        if not shards:
            raise ValueError("need at least one node shard")
        if not (math.isfinite(reg) and reg >= 0):
            raise ValueError(f"regularization must be ≥ 0, got {reg!r}")
        bound = float(feature_bound)
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"feature bound must be finite and > 0, got {feature_bound!r}")
        self.feature_bound = bound
        # a malformed datum (wrong length, non-finite, label not 0/1) is kept, marked, and
        # counts as a zero gradient (module docstring); only the data set's shape is refused
        cleaned = [clean_rows(X, y, self.label_ok, dim) for X, y in shards]
        dims = {X.shape[1] for X, _, _ in cleaned}
        if len(dims) != 1:
            raise ValueError(f"shards have different feature counts {dims}")
        #: how many rows of each shard are malformed (local diagnostics, never sent)
        self.malformed = [count for _, _, count in cleaned]
        self.shards = [(project_rows(X, self.feature_bound), y) for X, y, _ in cleaned]
        self.dim = dims.pop()
        self.num_nodes = len(self.shards)
        self.reg = float(reg)
        self.horizon = int(horizon)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.name = name
        self.indices = np.stack([
            np.random.default_rng([self.seed, i, 0xDA7A]).integers(
                0, X.shape[0], size=(self.horizon, self.batch_size))
            for i, (X, _) in enumerate(self.shards)
        ])  # [n, horizon, b]

    @staticmethod
    def label_ok(y: np.ndarray) -> np.ndarray:
        """Labels a sample may have: 0 or 1."""
        return (y == 0.0) | (y == 1.0)

    #: the regularized logistic loss is convex in θ (what the contractive accountant needs)
    convex = True

    @property
    def strong_convexity(self) -> float:
        """μ = r (the data term is only convex)."""
        return self.reg

    @property
    def gradient_bound(self) -> float:
        """Declared bound on one sample's data-term gradient norm, ``|s − b|·‖a‖ ≤ B``."""
        return self.declared_constants()[0]

    @property
    def smoothness(self) -> float:
        """Declared ``L`` of one sample's gradient: ``B²/4 + r`` (``B`` the feature bound)."""
        return self.declared_constants()[1]

    def declared_constants(self, feature_bound: float | None = None) -> tuple[float, float]:
        """``(G, L) = (B, B²/4 + r)`` for feature bound ``B`` (this task's by default). The
        accountant asks for another ``B`` — the one a node's state records, which may be
        larger than the one enforced now — so that it never charges less than was spent."""
        B = self.feature_bound if feature_bound is None else float(feature_bound)
        return B, B**2 / 4 + self.reg

    def _take(self, nodes: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        X = np.stack([self.shards[int(i)][0][idx[k]] for k, i in enumerate(nodes)])
        y = np.stack([self.shards[int(i)][1][idx[k]] for k, i in enumerate(nodes)])
        return X, y

    def _check_t(self, t: int) -> None:
        if not 0 <= t < self.horizon:
            raise ValueError(f"step {t} outside the task's horizon {self.horizon}")

    def batch(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_t(t)
        nodes = np.asarray(nodes, dtype=int)
        return self._take(nodes, self.indices[nodes, t])

    def history(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_t(t)
        nodes = np.asarray(nodes, dtype=int)
        return self._take(nodes, self.indices[nodes, : t + 1].reshape(nodes.size, -1))

    def loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean loss per node; a malformed sample's data term counts as zero (as in
        :meth:`grad`)."""
        X, y, ok, norms = usable_samples(X, y, self.label_ok)
        X = project_rows(X, self.feature_bound, norms)
        z = np.einsum("kmd,kd->km", X, theta)
        data, _ = zero_unusable(np.logaddexp(0.0, z) - y * z, ok)
        return data.mean(axis=1) + 0.5 * self.reg * np.sum(theta * theta, axis=1)

    def grad(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
             clip: float | None = None) -> np.ndarray:
        return self.grad_counted(theta, X, y, clip)[0]

    def grad_counted(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                     clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        X, y, ok, norms = usable_samples(X, y, self.label_ok)  # malformed: zero data term
        projected = project_rows(X, self.feature_bound, norms)  # the declared bound holds
        if clip is not None and projected is not X:
            norms = row_norms(projected)
        X = projected
        with np.errstate(all="ignore"):
            z = np.einsum("kmd,kd->km", X, theta)
            coef = 0.5 * (1.0 + np.tanh(0.5 * z)) - y  # sigmoid, overflow-free
            if clip is not None:  # to clip less the float64 margin (learner.clip_target):
                # each sample's term is then within ``clip`` exactly, not just to rounding
                size = np.abs(coef) * norms[..., 0]
                target = clip_target(clip, X.shape[-1])
                coef = coef * np.minimum(1.0, target / np.maximum(size, 1e-300))
        coef, zeroed = zero_unusable(coef, ok)
        return np.einsum("km,kmd->kd", coef, X) / X.shape[1] + self.reg * theta, zeroed

    def regularizer_grad(self, theta: np.ndarray) -> np.ndarray:
        return self.reg * np.asarray(theta, dtype=float)

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """All shards pooled (``X [N, dim], y [N]``), malformed rows left out."""
        X = np.concatenate([X for X, _ in self.shards])
        y = np.concatenate([y for _, y in self.shards])
        keep = self.label_ok(y)
        return X[keep], y[keep]

    def accuracy(self, theta: np.ndarray) -> np.ndarray:
        """Accuracy of each row of ``theta [k, dim]`` on all shards pooled."""
        X, y = self.pooled()
        return ((X @ theta.T > 0) == (y[:, None] > 0.5)).mean(axis=0)


def synthetic_shards(num_nodes: int, dim: int, samples: int = 200, seed: int = 0,
                     split_by_class: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """A small logistic data set (rows normalized to ``‖a‖ ≤ 1``), split by class across
    nodes like Chen & Wang's mushrooms setting (first ⌈n/2⌉+ nodes class 0, the rest class 1) or
    i.i.d. — for tests, the CLI and the relay demo."""
    rng = np.random.default_rng([seed, 0x5A17])
    w = rng.normal(size=dim)
    X = rng.normal(size=(samples * num_nodes, dim))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    y = (rng.random(X.shape[0]) < 1 / (1 + np.exp(-3 * X @ w))).astype(float)
    if not split_by_class or num_nodes < 2:
        return [(X[i::num_nodes], y[i::num_nodes]) for i in range(num_nodes)]
    n0 = max(1, min(num_nodes - 1, round(num_nodes * 0.6)))
    out = []
    for cls, members in ((0.0, range(n0)), (1.0, range(n0, num_nodes))):
        Xc = X[y == cls]
        for k, _ in enumerate(members):
            part = Xc[k :: len(members)]
            out.append((part, np.full(part.shape[0], cls)))
    return out


TASKS: dict[str, Callable[[Mapping[str, Any]], Task]] = {}


def register_task(name: str) -> Callable[[Callable[[Mapping[str, Any]], Task]],
                                         Callable[[Mapping[str, Any]], Task]]:
    def deco(fn: Callable[[Mapping[str, Any]], Task]) -> Callable[[Mapping[str, Any]], Task]:
        TASKS[name] = fn
        return fn

    return deco


@register_task("synthetic-logreg")
def _synthetic_logreg(cfg: Mapping[str, Any]) -> Task:
    n = int(cfg.get("num-nodes", 5))
    return LogisticTask(
        synthetic_shards(n, int(cfg.get("dim", 10)), int(cfg.get("samples-per-node", 200)),
                         int(cfg.get("data-seed", 0)),
                         bool(cfg.get("split-by-class", True))),
        reg=float(cfg.get("reg", 1e-3)), horizon=int(cfg.get("horizon", 2000)),
        seed=int(cfg.get("data-seed", 0)), feature_bound=float(cfg.get("feature-bound", 1.0)),
        name="synthetic-logreg",
    )


# The papers' named data sets (mushrooms, letter, poker) are registered by the repository's
# experiments/tasks.py: their loaders are experiment code, not installed.


def build_task(name: str, cfg: Mapping[str, Any]) -> Task:
    """A task by name from a kebab-case config (``num-nodes``, ``horizon``, ``data-seed``,
    ``feature-bound``…)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(TASKS)}")
    return TASKS[name](cfg)
