"""Constraint sets ``K`` for Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private
Algorithms for Decentralized Online Learning": Euclidean projection and linear minimization oracle.

PD-FTGL and PD-OGD need ``Proj_K``; PD-OCG (projection-free) only needs the LMO
``argmin_{v∈K} ⟨g, v⟩``. On the nuclear-norm ball the difference is the point of the paper's
Sec. 3.3: the projection needs a full SVD, the LMO only the top singular pair — which
:func:`top_singular_pair_lanczos` (Lanczos, the default) or :func:`top_singular_pair` (power
iteration) compute with ``O(qp)`` work per iteration, warm-started from the previous call's
right vector inside a Frank–Wolfe loop, never by a full SVD.

Every method works on a batch of flattened decisions ``x [k, dim]`` (the node axis of the
engines); :class:`NuclearBall` reshapes rows to its ``(q, p)`` matrix shape.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

__all__ = ["LMO_METHODS", "ConstraintSet", "L2Ball", "NuclearBall", "make_set",
           "project_simplex_capped", "top_singular_pair", "top_singular_pair_lanczos"]

#: how :class:`NuclearBall` finds the top singular pair: ``power`` (power iteration, the
#: paper's projection-free point), ``lanczos`` (ARPACK's implicitly restarted Lanczos through
#: ``scipy.sparse.linalg.svds(k=1)``, warm-started) or ``svd`` (a full SVD: the reference,
#: and what the code did before)
LMO_METHODS = ("power", "lanczos", "svd")


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

    def lmo_warm(self, g: np.ndarray, warm: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`lmo` with a warm start: ``(v, warm')``, ``warm'`` to pass to the next call
        on a nearby ``g`` (sets whose LMO is closed-form ignore it)."""
        return self.lmo(g), None

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


def top_singular_pair(G: np.ndarray, v0: np.ndarray | None = None, *, tol: float = 1e-13,
                      max_iter: int = 5000) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Top singular triple ``(u₁, σ₁, v₁)`` of each matrix of ``G [k, q, p]`` by power
    iteration on ``GᵀG``: two matrix–vector products (``O(qp)``) per iteration, no SVD.

    ``v0 [k, p]``: start vectors (a warm start: the previous call's ``v₁`` for a nearby
    ``G``); rows of ``v0`` that are zero or missing start from ``G``'s largest-norm row
    (``Gᵀe_i``, close to ``v₁`` when one direction dominates). The iteration keeps the sign
    (``⟨v, GᵀGv⟩ ≥ 0``), so it stops when ``‖v_{j+1} − v_j‖ ≤ tol``; the error left is
    ``≈ tol·ρ/(1−ρ)`` with ``ρ = (σ₂/σ₁)²``. A matrix still unconverged after ``max_iter``
    (``σ₁ ≈ σ₂``: the top pair is then nearly non-unique, and so is the LMO) finishes with
    a full SVD so that the result is always the top pair; the fallback is counted in the
    returned iteration count (``max_iter``). Zero matrices give ``u = v = 0, σ = 0``.
    Returns ``(u [k, q], σ [k], v [k, p], iterations)``."""
    G = np.asarray(G, dtype=float)
    if G.ndim != 3:
        raise ValueError(f"expected a batch [k, q, p], got shape {G.shape}")
    k, _q, p = G.shape
    rows = np.linalg.norm(G, axis=2)  # [k, q]
    start = G[np.arange(k), np.argmax(rows, axis=1)]  # largest-norm row, [k, p]
    v = start if v0 is None else np.asarray(v0, dtype=float).reshape(k, p).copy()
    if v0 is not None:
        bad = np.linalg.norm(v, axis=1) == 0
        v[bad] = start[bad]
    nv = np.linalg.norm(v, axis=1, keepdims=True)
    zero = nv[:, 0] == 0
    v = np.divide(v, nv, out=np.zeros_like(v), where=nv > 0)
    active = ~zero
    it = 0
    while np.any(active) and it < max_iter:
        it += 1
        Ga = G[active]
        w = np.einsum("kqp,kp->kq", Ga, v[active])
        new = np.einsum("kqp,kq->kp", Ga, w)
        nn = np.linalg.norm(new, axis=1, keepdims=True)
        new = np.divide(new, nn, out=np.zeros_like(new), where=nn > 0)
        done = np.linalg.norm(new - v[active], axis=1) <= tol
        v[active] = new
        idx = np.flatnonzero(active)
        active[idx[done]] = False
    if np.any(active):  # σ₁ ≈ σ₂: finish those exactly
        _U, _s, Vt = np.linalg.svd(G[active], full_matrices=False)
        v[active] = Vt[:, 0, :]
    u = np.einsum("kqp,kp->kq", G, v)
    sigma = np.linalg.norm(u, axis=1)
    u = np.divide(u, sigma[:, None], out=np.zeros_like(u), where=sigma[:, None] > 0)
    return u, sigma, v, it


def top_singular_pair_lanczos(G: np.ndarray, v0: np.ndarray | None = None, *,
                              tol: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top singular triple of each matrix of ``G [k, q, p]`` by
    ``scipy.sparse.linalg.svds(k=1)`` (Lanczos; ``tol = 0``: to machine precision),
    started from ``v0`` where given. Matrices with ``min(q, p) = 1`` (where ARPACK's
    ``k < min(q, p)`` fails) are one vector: its direction is the pair, no iteration. ARPACK
    can fail to converge when ``σ₁ ≈ σ₂`` (seen on noise-only 26 × 16 sums): that matrix then
    finishes with a full SVD, so the result is always the top pair."""
    from scipy.sparse.linalg import ArpackNoConvergence, svds

    G = np.asarray(G, dtype=float)
    k, q, p = G.shape
    u, s, v = np.zeros((k, q)), np.zeros(k), np.zeros((k, p))
    for j in range(k):
        A = G[j]
        n = float(np.linalg.norm(A))
        if n == 0:
            continue
        if min(q, p) == 1:
            u[j] = A[:, 0] / n if p == 1 else np.ones(1)
            v[j] = A[0] / n if q == 1 else np.ones(1)
            s[j] = n
            continue
        start = None if v0 is None or not np.any(v0[j]) else np.asarray(v0[j], dtype=float)
        # svds iterates on the smaller Gram matrix; v0 lives in that space
        if q < p:
            start = None if start is None else A @ start
            if start is not None and not np.any(start):
                start = None
        try:
            U, S, Vt = svds(A, k=1, v0=start, tol=tol)
            u[j], s[j], v[j] = U[:, 0], S[0], Vt[0]
        except ArpackNoConvergence:  # σ₁ ≈ σ₂ on a tiny matrix: finish exactly
            U, S, Vt = np.linalg.svd(A, full_matrices=False)
            u[j], s[j], v[j] = U[:, 0], S[0], Vt[0]
    return u, s, v


class NuclearBall(ConstraintSet):
    """``{X ∈ R^{q×p} : ‖X‖_* ≤ τ}`` (Wang et al.'s experiments: ``τ = 10``), rows flattened
    C-order.

    Projection: SVD, then project the singular values onto ``{s ≥ 0, Σ s ≤ τ}``. LMO:
    ``−τ u₁ v₁ᵀ`` with ``(u₁, v₁)`` the top singular pair of the gradient, by
    Lanczos (``lmo="lanczos"``, the default: :func:`top_singular_pair_lanczos`), power
    iteration (``lmo="power"``: :func:`top_singular_pair`; slow when ``σ₂/σ₁ → 1``, as on
    noise-dominated private sums) or, as a reference, a full SVD (``lmo="svd"``).
    ``R = τ`` (a rank-one matrix has ‖X‖_F = ‖X‖_*). A zero gradient gives
    the zero matrix (every point of the ball minimises ``⟨0, v⟩``).
    """

    def __init__(self, shape: tuple[int, int], tau: float, lmo: str = "lanczos") -> None:
        if lmo not in LMO_METHODS:
            raise ValueError(f"unknown LMO method {lmo!r}; use one of {LMO_METHODS}")
        self.lmo_method = lmo
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
        return self.lmo_warm(g, None)[0]

    def lmo_warm(self, g: np.ndarray, warm: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        G = self._mats(g)
        if self.lmo_method == "svd":
            U, s, Vt = np.linalg.svd(G, full_matrices=False)
            u, v = U[:, :, 0] * (s[:, :1] > 0), Vt[:, 0, :] * (s[:, :1] > 0)
        elif self.lmo_method == "lanczos":
            u, _sigma, v = top_singular_pair_lanczos(G, warm)
        else:
            u, _sigma, v, _it = top_singular_pair(G, warm)
        V = -self.tau * np.einsum("kq,kp->kqp", u, v)
        return V.reshape(-1, self.dim), v


def make_set(kind: str, dim: int, size: float, shape: tuple[int, int] | None = None,
             lmo: str = "lanczos") -> ConstraintSet:
    """``l2`` ball of radius ``size`` or ``nuclear`` ball of radius ``size`` (needs ``shape``;
    ``lmo``: how its LMO finds the top singular pair, see :data:`LMO_METHODS`)."""
    if kind in ("l2", "ball", "l2-ball"):
        return L2Ball(dim, size)
    if kind in ("nuclear", "trace", "nuclear-ball"):
        if shape is None or shape[0] * shape[1] != dim:
            raise ValueError(f"a nuclear ball needs a (q, p) shape with q·p = {dim}")
        return NuclearBall(shape, size, lmo)
    raise ValueError(f"unknown constraint set {kind!r}; use l2 or nuclear")
