"""The Toeplitz square-root factorization ``B = C = A^{1/2}`` (paper 000, Example iii).

Henzinger et al. (2023): ``h(0) = 1, h(j) = (1 − 1/(2j))·h(j−1)`` are the Taylor
coefficients of ``(1 − x)^{−1/2}``, so the lower-triangular Toeplitz matrix ``C`` with first
column ``h`` squares to ``A`` (whose symbol is ``(1 − x)^{−1}``). Its inverse is Toeplitz
with the coefficients ``g`` of ``(1 − x)^{1/2}``, which is what a stream needs: the noise
increment is ``e[k] = (C⁻¹ξ)[k] = Σ_{j≤k} g(k−j)·ξ_j``.

Everything here is O(N) except :meth:`ToeplitzSqrt.matrices`.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import toeplitz

from .base import Factorization
from .participation import Participation, Sensitivity, toeplitz_sensitivity
from .registry import register
from .streaming import HistoryKernel, StreamKernel


def sqrt_coefficients(n: int) -> np.ndarray:
    """``h(0..n−1)``: coefficients of ``(1 − x)^{−1/2}`` (paper 000, Example iii)."""
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


register("toeplitz", "Toeplitz square root B = C = A^(1/2) (paper 000 Example iii)",
         build=ToeplitzSqrt)
