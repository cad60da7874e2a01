"""Constraint sets ``K`` for paper 004: Euclidean projection and linear minimization oracle.

PD-FTGL and PD-OGD need ``Proj_K``; PD-OCG (projection-free) only needs the LMO
``argmin_{v∈K} ⟨g, v⟩``. On the nuclear-norm ball the difference is the point of the paper's
Sec. 3.3: the projection needs a full SVD, the LMO only the top singular pair.

Every method works on a batch of flattened decisions ``x [k, dim]`` (the node axis of the
engines); :class:`NuclearBall` reshapes rows to its ``(q, p)`` matrix shape.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

__all__ = ["ConstraintSet", "L2Ball", "NuclearBall", "make_set", "project_simplex_capped"]


def _check_batch(x: np.ndarray, dim: int) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"expected a batch [k, {dim}], got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("non-finite values")
    return x


class ConstraintSet(ABC):
    """A compact convex set containing 0 with ``‖x‖ ≤ radius`` (Assumption 3.1)."""

    dim: int
    #: ``R``: the largest Euclidean norm of a point in the set
    radius: float

    @abstractmethod
    def project(self, x: np.ndarray) -> np.ndarray:
        """Euclidean projection of each row."""

    @abstractmethod
    def lmo(self, g: np.ndarray) -> np.ndarray:
        """``argmin_{v∈K} ⟨g_k, v⟩`` for each row ``g_k``."""

    @abstractmethod
    def norm(self, x: np.ndarray) -> np.ndarray:
        """The gauge of the set per row (``≤`` its size parameter iff inside)."""

    @property
    @abstractmethod
    def size(self) -> float:
        """The ball's radius in its own norm."""

    def contains(self, x: np.ndarray, tol: float = 1e-9) -> np.ndarray:
        return self.norm(x) <= self.size * (1 + tol) + tol


class L2Ball(ConstraintSet):
    """``{x : ‖x‖₂ ≤ r}``; projection rescales, LMO is ``−r g/‖g‖``."""

    def __init__(self, dim: int, r: float) -> None:
        if not (math.isfinite(r) and r > 0):
            raise ValueError(f"ball radius must be finite and > 0, got {r!r}")
        self.dim, self.r, self.radius = int(dim), float(r), float(r)

    @property
    def size(self) -> float:
        return self.r

    def norm(self, x: np.ndarray) -> np.ndarray:
        return np.linalg.norm(_check_batch(x, self.dim), axis=1)

    def project(self, x: np.ndarray) -> np.ndarray:
        x = _check_batch(x, self.dim)
        n = np.linalg.norm(x, axis=1, keepdims=True)
        return x * np.minimum(1.0, self.r / np.maximum(n, 1e-300))

    def lmo(self, g: np.ndarray) -> np.ndarray:
        g = _check_batch(g, self.dim)
        n = np.linalg.norm(g, axis=1, keepdims=True)
        return np.where(n > 0, -self.r * g / np.maximum(n, 1e-300), 0.0)


def project_simplex_capped(s: np.ndarray, tau: float) -> np.ndarray:
    """Project each row of non-negative ``s`` onto ``{s ≥ 0, Σ s ≤ τ}`` (Duchi et al. 2008).

    Rows already inside are returned unchanged; the others go to the simplex ``Σ s = τ`` by
    soft-thresholding ``max(s − μ, 0)`` with the threshold ``μ`` from the sorted values.
    """
    s = np.maximum(np.asarray(s, dtype=float), 0.0)
    out = s.copy()
    over = s.sum(axis=1) > tau
    if np.any(over):
        v = s[over]
        u = -np.sort(-v, axis=1)
        css = np.cumsum(u, axis=1) - tau
        idx = np.arange(1, v.shape[1] + 1)
        cond = u - css / idx > 0
        r = v.shape[1] - 1 - np.argmax(cond[:, ::-1], axis=1)  # last index where cond holds
        mu = css[np.arange(v.shape[0]), r] / (r + 1)
        out[over] = np.maximum(v - mu[:, None], 0.0)
    return out


class NuclearBall(ConstraintSet):
    """``{X ∈ R^{q×p} : ‖X‖_* ≤ τ}`` (004's experiments: ``τ = 10``), rows flattened C-order.

    Projection: SVD, then project the singular values onto ``{s ≥ 0, Σ s ≤ τ}``. LMO:
    ``−τ u₁ v₁ᵀ`` with ``(u₁, v₁)`` the top singular pair of the gradient. ``R = τ`` (a
    rank-one matrix has ‖X‖_F = ‖X‖_*).
    """

    def __init__(self, shape: tuple[int, int], tau: float) -> None:
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"nuclear-norm radius must be finite and > 0, got {tau!r}")
        q, p = (int(shape[0]), int(shape[1]))
        if q < 1 or p < 1:
            raise ValueError(f"bad matrix shape {shape!r}")
        self.shape, self.tau = (q, p), float(tau)
        self.dim, self.radius = q * p, float(tau)

    @property
    def size(self) -> float:
        return self.tau

    def _mats(self, x: np.ndarray) -> np.ndarray:
        return _check_batch(x, self.dim).reshape(-1, *self.shape)

    def norm(self, x: np.ndarray) -> np.ndarray:
        return np.linalg.svd(self._mats(x), compute_uv=False).sum(axis=1)

    def project(self, x: np.ndarray) -> np.ndarray:
        X = self._mats(x)
        U, s, Vt = np.linalg.svd(X, full_matrices=False)
        inside = s.sum(axis=1) <= self.tau
        s2 = project_simplex_capped(s, self.tau)
        Y = np.einsum("kqr,kr,krp->kqp", U, s2, Vt)
        Y[inside] = X[inside]  # exact identity inside (idempotence without rounding)
        return Y.reshape(-1, self.dim)

    def lmo(self, g: np.ndarray) -> np.ndarray:
        G = self._mats(g)
        U, _s, Vt = np.linalg.svd(G, full_matrices=False)
        V = -self.tau * np.einsum("kq,kp->kqp", U[:, :, 0], Vt[:, 0, :])
        return V.reshape(-1, self.dim)


def make_set(kind: str, dim: int, size: float, shape: tuple[int, int] | None = None
             ) -> ConstraintSet:
    """``l2`` ball of radius ``size`` or ``nuclear`` ball of radius ``size`` (needs ``shape``)."""
    if kind in ("l2", "ball", "l2-ball"):
        return L2Ball(dim, size)
    if kind in ("nuclear", "trace", "nuclear-ball"):
        if shape is None or shape[0] * shape[1] != dim:
            raise ValueError(f"a nuclear ball needs a (q, p) shape with q·p = {dim}")
        return NuclearBall(shape, size)
    raise ValueError(f"unknown constraint set {kind!r}; use l2 or nuclear")
