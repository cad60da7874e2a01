"""The Toeplitz square-root factorization ``B = C = A^{1/2}`` (Zhang, Zhu, Fay & Johansson, "Locally
Differentially Private Online Federated Learning With Correlated Noise", Example iii).

Henzinger et al. (2023): ``h(0) = 1, h(j) = (1 − 1/(2j))·h(j−1)`` are the Taylor
coefficients of ``(1 − x)^{−1/2}``, so the lower-triangular Toeplitz matrix ``C`` with first
column ``h`` squares to ``A`` (whose symbol is ``(1 − x)^{−1}``). Its inverse is Toeplitz
with the coefficients ``g`` of ``(1 − x)^{1/2}``, which is what a stream needs: the noise
increment is ``e[k] = (C⁻¹ξ)[k] = Σ_{j≤k} g(k−j)·ξ_j``.

Everything here is O(N) except :meth:`ToeplitzSqrt.matrices`.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import toeplitz

from .base import Factorization
from .participation import Participation, Sensitivity, toeplitz_sensitivity
from .registry import register
from .streaming import HistoryKernel, StreamKernel


def sqrt_coefficients(n: int) -> np.ndarray:
    """``h(0..n−1)``: coefficients of ``(1 − x)^{−1/2}`` (Zhang et al., Example iii)."""
    j = np.arange(1, n, dtype=float)
    return np.concatenate(([1.0], np.cumprod(1.0 - 1.0 / (2.0 * j))))


def inverse_sqrt_coefficients(n: int) -> np.ndarray:
    """``g(0..n−1)``: coefficients of ``(1 − x)^{1/2}``, the inverse Toeplitz of ``h``.

    ``g(0) = 1, g(j) = g(j−1)·(j − 3/2)/j``; ``g(j) < 0`` for ``j ≥ 1``.
    """
    j = np.arange(1, n, dtype=float)
    return np.concatenate(([1.0], np.cumprod((j - 1.5) / j)))


class ToeplitzSqrt(Factorization):
    """``B = C`` lower-triangular Toeplitz with first column ``h``.

    Column ``j`` of ``C`` holds ``h(0..N−1−j)``, so the largest column norm is column 0:
    ``sensitivity² = Σ_{j<N} h(j)²`` (≤ ``1 + ln(4N/5)/π``, paper eq. (8)). Row ``k`` of
    ``B`` holds ``h(k..0)``, so ``‖b_k‖² = Σ_{j≤k} h(j)²`` (the same bound).
    """

    name = "toeplitz"
    stream_kind = "toeplitz"

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.h = sqrt_coefficients(self.n)
        self.g = inverse_sqrt_coefficients(self.n)
        self.g_reversed = np.ascontiguousarray(self.g[::-1])  # for the stream's dot products
        self._cum = np.cumsum(self.h**2)

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"g": self.g}

    def column_norms(self) -> np.ndarray:
        # column j has the first N − j coefficients
        return np.sqrt(self._cum[::-1])

    def prefix_sensitivity(self, k: int) -> float:
        # rows 0..k−1 of column 0 hold h(0..k−1), the largest prefix column
        return float(np.sqrt(self._cum[self._check_prefix(k) - 1]))

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        # h is positive and decreasing: the closed form is exact at any N
        return toeplitz_sensitivity(self.h, steps or self.n, participation)

    def row_errors(self) -> np.ndarray:
        return self._cum.copy()

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        C = np.tril(toeplitz(self.h))
        return C.copy(), C

    def noising_matrix(self) -> np.ndarray:
        return np.tril(toeplitz(self.g))

    def _make_stream_kernel(self) -> StreamKernel:
        # e[k] = Σ_j g(k−j)·ξ_j: C⁻¹ is dense, so every past ξ row is kept
        return HistoryKernel("toeplitz", self.n, toeplitz_g=self.g)


register("toeplitz", "Toeplitz square root B = C = A^(1/2) (Zhang et al., Example iii)",
         build=ToeplitzSqrt)


# -- the best Toeplitz encoder for a participation (a dense reference at small N) ---------

def toeplitz_rmse_squared(c: np.ndarray, n: int, participation: Participation) -> float:
    """Squared RMSE at unit sensitivity of the lower-triangular Toeplitz encoder with
    column 0 ``c`` (non-increasing, ≥ 0: the min-sep sensitivity is then exact):
    ``sens²·‖A·C⁻¹‖_F²/N``."""
    sens = toeplitz_sensitivity(c, n, participation).value
    g = toeplitz_inverse_coefficients(c, n)
    b = np.cumsum(g)
    return float(sens**2 * ((n - np.arange(n)) @ (b * b)) / n)


def toeplitz_inverse_coefficients(c: np.ndarray, n: int) -> np.ndarray:
    """Column 0 of ``C⁻¹`` for the lower-triangular Toeplitz ``C`` with column 0 ``c``
    (forward substitution, O(N²))."""
    g = np.zeros(n)
    g[0] = 1.0 / c[0]
    for t in range(1, n):
        g[t] = -(c[1:t + 1][::-1] @ g[:t]) / c[0] if t < len(c) else \
            -(c[1:][::-1] @ g[t - len(c) + 1:t]) / c[0]
    return g


def _objective_and_gradient(z: np.ndarray, n: int, participation: Participation
                            ) -> tuple[float, np.ndarray]:
    """``log`` of the squared RMSE and its gradient in ``z`` (``c = revcumsum(exp z)``).

    ``S = ‖Mc‖²`` with ``M`` the sum of ``k`` shifts by ``b`` (exact: ``c`` is
    non-increasing and positive by construction), ``∇S = 2Mᵀ(Mc)``; ``E = Σ_t (N−t) b_t²``
    with ``b = cumsum(g)``, ``g`` the inverse's coefficients: ``dg = −g∗dc∗g``, so
    ``∇E_j = −2 Σ_{s≥j} r_s (g∗g)_{s−j}`` with ``r = revcumsum((N−t)·b)``.
    """
    d = np.exp(np.clip(z, -700, 700))
    c = np.cumsum(d[::-1])[::-1]
    k, sep = participation.participations(n), participation.min_sep
    shifts = [e * sep for e in range(k) if e * sep < n]
    v = np.zeros(n)
    for s in shifts:
        v[s:] += c[:n - s]
    S = float(v @ v)
    grad_S = np.zeros(n)
    for s in shifts:
        grad_S[:n - s] += 2 * v[s:]
    g = toeplitz_inverse_coefficients(c, n)
    b = np.cumsum(g)
    w = n - np.arange(n, dtype=float)
    E = float(w @ (b * b))
    r = np.cumsum((w * b)[::-1])[::-1]
    h = np.convolve(g, g)[:n]
    grad_E = -2.0 * np.correlate(r, h, mode="full")[n - 1:]
    value = S * E / n
    grad_c = (grad_S * E + S * grad_E) / n
    grad_z = np.cumsum(grad_c) * d
    return math.log(value), grad_z / value


def optimize_toeplitz(n: int, participation: Participation,
                      init: np.ndarray | None = None, maxiter: int = 3000) -> np.ndarray:
    """Column 0 of the lower-triangular Toeplitz ``C`` (all ``n`` coefficients free,
    non-increasing and positive, so its sensitivity is exact) minimizing the RMSE at unit
    sensitivity under ``participation``: the dense reference that the BLT (a Toeplitz
    encoder with ``O(buffers)`` parameters) is measured against. O(N²) per iteration:
    for ``N`` up to a few thousand. ``init``: starting coefficients (default: the square
    root's); L-BFGS only moves downhill from them."""
    from scipy.optimize import minimize

    c0 = sqrt_coefficients(n) if init is None else np.asarray(init, dtype=float)[:n]
    d0 = np.maximum(-np.diff(np.append(c0, 0.0)), 1e-300)
    res = minimize(_objective_and_gradient, np.log(d0), args=(n, participation), jac=True,
                   method="L-BFGS-B", options={"maxiter": maxiter})
    d = np.exp(np.clip(res.x, -700, 700))
    c = np.cumsum(d[::-1])[::-1]
    return c / c[0]
