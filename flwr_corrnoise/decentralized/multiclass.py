"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") online multiclass logistic regression as a decentralized :class:`~.tasks.Task`.

Decision ``X ∈ R^{q×p}`` (flattened C-order to ``dim = q·p``); at round ``t`` learner ``i`` sees
one example ``(e, y)`` and suffers ``f(X) = log(1 + Σ_{ℓ≠y} exp(x_ℓᵀe − x_yᵀe))
= logsumexp(Xe) − x_yᵀe``. Gradient ``(softmax(Xe) − 1_y) eᵀ``, Frobenius norm
``‖softmax − 1_y‖·‖e‖ ≤ √2 ‖e‖``.

Streams follow the paper's construction: ``copies`` copies of the data set are shuffled
together and split evenly over the ``n`` learners (letter: ``10n`` copies, so each learner has
``T = 10 × 15000`` rounds; poker: ``n`` copies, ``T = 10⁶``). Only indices are stored
(``[n, T]``), never the copies. :meth:`network_loss` evaluates every learner's decision on all
learners' examples of a round — the ``Σ_j f_{t,j}(X_i(t))`` inside Wang et al.'s average loss
``AL(t, i)``.

A malformed example — a row of the wrong length, a non-finite value, a label that is not an
integer in ``0..q−1`` — is kept in the stream and its gradient counts as zero
(:mod:`.tasks`' datum rule): refusing the data set, or an ``IndexError`` on a label, would be a
reply that depends on one datum. ``q`` and ``p`` should therefore be declared
(``num_classes``, ``features``; config ``classes``): read off the data, one label or row could
change the model's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from flwr_corrnoise.decentralized.tasks import (
    Task,
    clean_rows,
    register_task,
    row_norms,
    usable_samples,
    zero_unusable,
)
from flwr_corrnoise.learner import clip_target

__all__ = ["MulticlassTask", "synthetic_multiclass"]


class MulticlassTask(Task):
    """Multiclass logistic loss on per-learner streams of single examples."""

    def __init__(self, X: Any, y: Any, num_nodes: int, *, copies: int = 1,
                 horizon: int | None = None, seed: int = 0, num_classes: int | None = None,
                 features: int | None = None, name: str = "multiclass") -> None:
        if num_classes is None:  # inferred from the integer labels (better: declare it)
            try:
                raw = np.asarray(y, dtype=float).ravel()
            except (TypeError, ValueError):
                raw = np.asarray([_label(v) for v in np.asarray(y, dtype=object).ravel()])
            whole = raw[np.isfinite(raw) & (raw == np.round(raw)) & (raw >= 0)]
            if whole.size == 0:
                raise ValueError("labels must be integers 0..q−1")
            num_classes = int(whole.max()) + 1
        self.q = int(num_classes)
        if self.q < 1:
            raise ValueError(f"need ≥ 1 class, got {self.q}")
        X, yf, malformed = clean_rows(X, y, self.label_ok, features, mark=-1.0)
        #: how many examples are malformed (local diagnostics, never sent)
        self.malformed = malformed
        self.X, self.y = X, yf.astype(np.int64)
        self.p = X.shape[1]
        self.shape = (self.q, self.p)
        self.dim = self.q * self.p
        if num_nodes < 1 or copies < 1:
            raise ValueError("need ≥ 1 learner and ≥ 1 copy")
        self.num_nodes = int(num_nodes)
        per_node = copies * X.shape[0] // num_nodes
        T = per_node if horizon is None else int(horizon)
        if not 1 <= T <= per_node:
            raise ValueError(f"horizon {T} exceeds the {per_node} examples per learner of "
                             f"{copies} copies of {X.shape[0]} rows over {num_nodes} learners")
        self.horizon = T
        self.name = name
        rng = np.random.default_rng([int(seed), 0x1E77E2])
        order = rng.permutation(np.tile(np.arange(X.shape[0], dtype=np.int32), copies))
        self.indices = order[: per_node * num_nodes].reshape(num_nodes, per_node)[:, :T]

    def label_ok(self, y: np.ndarray) -> np.ndarray:
        """Labels an example may have: integers ``0..q−1``."""
        return (y == np.round(y)) & (y >= 0) & (y < self.q)

    def _check_t(self, t: int) -> None:
        if not 0 <= t < self.horizon:
            raise ValueError(f"step {t} outside the task's horizon {self.horizon}")

    def batch(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_t(t)
        idx = self.indices[np.asarray(nodes, dtype=int), t]
        return self.X[idx][:, None, :], self.y[idx][:, None]

    def history(self, nodes: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        self._check_t(t)
        idx = self.indices[np.asarray(nodes, dtype=int), : t + 1]
        return self.X[idx], self.y[idx]

    def _scores(self, theta: np.ndarray, X: np.ndarray) -> np.ndarray:
        W = np.asarray(theta, dtype=float).reshape(-1, self.q, self.p)
        return np.einsum("kqp,kmp->kmq", W, X)

    def loss(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Mean loss per learner; a malformed example's loss counts as zero."""
        X, yy, ok, _ = usable_samples(X, y, self.label_ok)
        with np.errstate(all="ignore"):
            s = self._scores(theta, X)
            top = s.max(axis=2, keepdims=True)
            lse = top[..., 0] + np.log(np.exp(s - top).sum(axis=2))
            own = np.take_along_axis(s, yy.astype(np.int64)[..., None], axis=2)[..., 0]
        data, _ = zero_unusable(lse - own, ok)
        return data.mean(axis=1)

    def grad(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
             clip: float | None = None) -> np.ndarray:
        """Mean over the batch of per-example gradients, each clipped to Frobenius ``clip``."""
        return self.grad_counted(theta, X, y, clip)[0]

    def grad_counted(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                     clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        X, yy, ok, xnorms = usable_samples(X, y, self.label_ok)  # malformed: zero gradient
        with np.errstate(all="ignore"):
            s = self._scores(theta, X)
            s = s - s.max(axis=2, keepdims=True)
            prob = np.exp(s)
            prob /= prob.sum(axis=2, keepdims=True)
            k, m = prob.shape[:2]
            prob[np.arange(k)[:, None], np.arange(m)[None, :], yy.astype(np.int64)] -= 1.0
            if clip is not None:
                norms = row_norms(prob)[..., 0] * xnorms[..., 0]
                target = clip_target(clip, prob.shape[-1] * X.shape[-1])
                prob = prob * np.minimum(1.0, target / np.maximum(norms, 1e-300))[..., None]
        # a huge example can overflow its scores: that example's gradient is not computable
        prob, zeroed = zero_unusable(prob, ok)
        with np.errstate(all="ignore"):
            g = np.einsum("kmq,kmp->kqp", prob, X).reshape(k, self.dim) / m
        return g, zeroed

    def network_loss(self, theta: np.ndarray, t: int) -> np.ndarray:
        """``Σ_j f_{t,j}(X_k)/n`` for each row ``X_k`` of ``theta``: a decision's mean loss on
        all learners' examples of round ``t``."""
        self._check_t(t)
        idx = self.indices[:, t]
        E, lab = self.X[idx], self.y[idx]
        W = np.asarray(theta, dtype=float).reshape(-1, self.q, self.p)
        s = np.einsum("kqp,jp->kjq", W, E)
        top = s.max(axis=2, keepdims=True)
        lse = top[..., 0] + np.log(np.exp(s - top).sum(axis=2))
        own = s[:, np.arange(len(lab)), lab]
        return np.where(lab[None, :] >= 0, lse - own, 0.0).mean(axis=1)  # malformed: 0

    def accuracy(self, theta: np.ndarray) -> np.ndarray:
        """Accuracy of each decision on the whole (un-copied) data set."""
        W = np.asarray(theta, dtype=float).reshape(-1, self.q, self.p)
        keep = self.y >= 0  # malformed examples left out
        pred = np.einsum("kqp,mp->kmq", W, self.X[keep]).argmax(axis=2)
        return (pred == self.y[None, keep]).mean(axis=1)


def _label(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def synthetic_multiclass(rows: int = 600, features: int = 4, classes: int = 3, seed: int = 0
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian class clusters in ``[−1, 1]^p``: a small learnable problem for tests/the CLI."""
    rng = np.random.default_rng([seed, 0xC1A55])
    centers = rng.uniform(-0.6, 0.6, size=(classes, features))
    y = rng.integers(0, classes, size=rows)
    X = np.clip(centers[y] + rng.normal(scale=0.25, size=(rows, features)), -1, 1)
    return X, y


def _task_from(X: np.ndarray, y: np.ndarray, cfg: Mapping[str, Any], name: str,
               default_copies: int) -> MulticlassTask:
    n = int(cfg.get("num-nodes", 9))
    copies = int(cfg.get("copies", default_copies))
    horizon = cfg.get("horizon")
    classes = cfg.get("classes")
    return MulticlassTask(X, y, n, copies=copies,
                          horizon=None if horizon in (None, "") else int(horizon),
                          seed=int(cfg.get("data-seed", 0)),
                          num_classes=None if classes in (None, "") else int(classes),
                          name=name)


@register_task("synthetic-multiclass")
def _synthetic(cfg: Mapping[str, Any]) -> Task:
    X, y = synthetic_multiclass(int(cfg.get("samples", 600)), int(cfg.get("dim", 4)),
                                int(cfg.get("classes", 3)), int(cfg.get("data-seed", 0)))
    n = int(cfg.get("num-nodes", 9))
    T = int(cfg.get("horizon", 100))
    copies = max(1, -(-T * n // X.shape[0]))
    return _task_from(X, y, dict(cfg, copies=copies, classes=int(cfg.get("classes", 3))),
                      "synthetic-multiclass", copies)
