"""Learning tasks for the decentralized algorithms: a loss, its gradient, and each node's
data stream, as functions of ``(nodes, step)`` so that every engine sees the same data.

Why data is indexed rather than stored in node state: paper 003's Algorithm 1 uses *all* data
seen so far at the current parameter; keeping that history in Flower's ``context.state``
would grow it every round. Instead node ``i``'s stream is a fixed i.i.d. draw (with
replacement, as 003's experiments do) from its shard, seeded by ``(seed, i)``; a node's
history up to step ``t`` is recomputed from the indices ``0..t``. On a deployed node the same
interface reads the node's own local data.

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
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["TASKS", "LogisticTask", "Task", "build_task", "project_rows", "register_task",
           "synthetic_shards"]


def project_rows(X: np.ndarray, bound: float) -> np.ndarray:
    """Each row (last axis) projected onto the ℓ2 ball of radius ``bound``: rows inside are
    returned unchanged (bit for bit), rows outside are scaled onto the sphere. This is what
    makes a declared feature bound true for any datum, whatever a data file holds."""
    X = np.asarray(X, dtype=float)
    norms = np.linalg.norm(X, axis=-1, keepdims=True)
    scale = np.where(norms > bound, bound / np.where(norms > bound, norms, 1.0), 1.0)
    return X * scale


class Task(ABC):
    """A learning problem: ``dim`` parameters, per-node streams, loss and gradient.

    A task that paper 003's accountants (and its baselines') can use also declares
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
        clipped to ℓ2 norm ``clip`` (so two samples' gradients differ by ≤ 2·clip)."""


class LogisticTask(Task):
    """ℓ2-regularized binary logistic regression (paper 003, Sec. VII-A).

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

    def __init__(self, shards: Sequence[tuple[np.ndarray, np.ndarray]], *, reg: float = 1e-3,
                 horizon: int = 2000, seed: int = 0, batch_size: int = 1,
                 feature_bound: float = 1.0, name: str = "logistic") -> None:
        if not shards:
            raise ValueError("need at least one node shard")
        self.shards = [(np.asarray(X, dtype=float), np.asarray(y, dtype=float))
                       for X, y in shards]
        dims = {X.shape[1] for X, _ in self.shards}
        if len(dims) != 1:
            raise ValueError(f"shards have different feature counts {dims}")
        for X, y in self.shards:
            if X.ndim != 2 or y.shape != (X.shape[0],) or X.shape[0] == 0:
                raise ValueError("each shard must be a non-empty X [m, dim] with labels y [m]")
            if not (np.all(np.isfinite(X)) and np.all(np.isin(y, (0.0, 1.0)))):
                raise ValueError("features must be finite and labels in {0, 1}")
        if not (math.isfinite(reg) and reg >= 0):
            raise ValueError(f"regularization must be ≥ 0, got {reg!r}")
        bound = float(feature_bound)
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"feature bound must be finite and > 0, got {feature_bound!r}")
        self.feature_bound = bound
        self.shards = [(project_rows(X, self.feature_bound), y) for X, y in self.shards]
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

    #: the regularized logistic loss is convex in θ (what the contractive accountant needs)
    convex = True

    @property
    def strong_convexity(self) -> float:
        """μ = r (the data term is only convex)."""
        return self.reg

    @property
    def gradient_bound(self) -> float:
        """Declared bound on one sample's data-term gradient norm, ``|s − b|·‖a‖ ≤ B``."""
        return self.feature_bound

    @property
    def smoothness(self) -> float:
        """Declared ``L`` of one sample's gradient: ``B²/4 + r`` (``B`` the feature bound)."""
        return self.feature_bound**2 / 4 + self.reg

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
        X = project_rows(X, self.feature_bound)
        z = np.einsum("kmd,kd->km", X, theta)
        data = np.logaddexp(0.0, z) - y * z
        return data.mean(axis=1) + 0.5 * self.reg * np.sum(theta * theta, axis=1)

    def grad(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
             clip: float | None = None) -> np.ndarray:
        X = project_rows(X, self.feature_bound)  # the declared bound holds for any input
        z = np.einsum("kmd,kd->km", X, theta)
        coef = 0.5 * (1.0 + np.tanh(0.5 * z)) - y  # sigmoid, overflow-free
        # |s − b| ≤ 1 for labels in {0, 1} (a no-op then); holds the declared gradient bound
        # even for a label that reached this point without the constructor's check
        coef = np.clip(coef, -1.0, 1.0)
        if clip is not None:
            norms = np.abs(coef) * np.linalg.norm(X, axis=2)
            coef = coef * np.minimum(1.0, clip / np.maximum(norms, 1e-300))
        return np.einsum("km,kmd->kd", coef, X) / X.shape[1] + self.reg * theta

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """All shards pooled (``X [N, dim], y [N]``)."""
        return (np.concatenate([X for X, _ in self.shards]),
                np.concatenate([y for _, y in self.shards]))

    def accuracy(self, theta: np.ndarray) -> np.ndarray:
        """Accuracy of each row of ``theta [k, dim]`` on all shards pooled."""
        X, y = self.pooled()
        return ((X @ theta.T > 0) == (y[:, None] > 0.5)).mean(axis=0)


def synthetic_shards(num_nodes: int, dim: int, samples: int = 200, seed: int = 0,
                     split_by_class: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """A small logistic data set (rows normalized to ``‖a‖ ≤ 1``), split by class across
    nodes like 003's mushrooms setting (first ⌈n/2⌉+ nodes class 0, the rest class 1) or
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


@register_task("mushrooms")
def _mushrooms(cfg: Mapping[str, Any]) -> Task:
    from flwr_corrnoise.data.mushrooms import load_mushrooms, split_by_class

    X, y, _source = load_mushrooms(cfg.get("data-path") or None)
    n = int(cfg.get("num-nodes", 5))
    return LogisticTask(split_by_class(X, y, n), reg=float(cfg.get("reg", 1e-3)),
                        horizon=int(cfg.get("horizon", 2000)), seed=int(cfg.get("data-seed", 0)),
                        feature_bound=float(cfg.get("feature-bound", 1.0)), name="mushrooms")


def build_task(name: str, cfg: Mapping[str, Any]) -> Task:
    """A task by name from a kebab-case config (``num-nodes``, ``horizon``, ``data-seed``,
    ``feature-bound``…)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(TASKS)}")
    return TASKS[name](cfg)
