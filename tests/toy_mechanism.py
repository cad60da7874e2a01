"""A mechanism in one file: the worked example of ``docs/architecture.md``.

``banded-sqrt``: the encoder ``C`` is lower-triangular Toeplitz whose first column is the
Toeplitz square root's coefficients ``h(0..b−1)``, cut after ``bands = b`` entries (each
input enters ``b`` encoded rows), and ``B = A·C⁻¹``. It is not a good mechanism — only an
example with a parameter, closed-form sensitivity and its own streaming kernel and state.

Importing this module registers it (``tests/mechanisms/test_mechanism_registry.py`` imports it in a
fixture and unregisters it afterwards, so no other test sees it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.linalg import solve_triangular, toeplitz

from flwr_corrnoise.mechanisms import Factorization, Param, register
from flwr_corrnoise.mechanisms.base import prefix_sum_matrix
from flwr_corrnoise.mechanisms.streaming import Array, ArrayOps, Draw, Saved, StreamKernel
from flwr_corrnoise.mechanisms.toeplitz import sqrt_coefficients

NAME = "banded-sqrt"


class BandedSqrt(Factorization):
    """``C`` banded lower-triangular Toeplitz (``c = h(0..b−1)``), ``B = A·C⁻¹``."""

    name = NAME
    stream_kind = "banded"

    def __init__(self, n: int, bands: int = 3) -> None:
        super().__init__(n)
        self.c = sqrt_coefficients(min(bands, self.n))  # c(0) = 1: C is invertible
        self._cum = np.cumsum(self.c**2)

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"c": self.c}  # so that two band counts have two digests

    def column_norms(self) -> np.ndarray:
        # column j holds c(0..min(b, N − j) − 1)
        rows = np.minimum(self.c.size, self.n - np.arange(self.n))
        return np.sqrt(self._cum[rows - 1])

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        first = np.zeros(self.n)
        first[: self.c.size] = self.c
        C = np.tril(toeplitz(first))
        # B = A·C⁻¹, from Cᵀ·Bᵀ = Aᵀ
        B = solve_triangular(C, prefix_sum_matrix(self.n).T, trans="T", lower=True).T
        return B, C

    def row_errors(self) -> np.ndarray:
        B, _ = self.matrices()
        return np.sum(B * B, axis=1)

    def _make_stream_kernel(self) -> StreamKernel:
        return BandedKernel(self.c)


@dataclass
class BandedState:
    """The last ``b − 1`` unit-std increments, oldest first (saved as ``rows``)."""

    past: list[Array] = field(default_factory=list)


class BandedKernel(StreamKernel):
    """``C·e = ξ`` solved forward: ``e[k] = ξ_k − Σ_{1≤j<b} c(j)·e[k−j]`` (``c(0) = 1``)."""

    kind = "banded"

    def __init__(self, c: np.ndarray) -> None:
        self.c = [float(x) for x in c]

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> BandedState:
        return BandedState(past=list(rows))

    def next(self, state: BandedState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, BandedState]:
        e = draw()
        for j, earlier in enumerate(reversed(state.past), start=1):
            e -= self.c[j] * earlier
        # a new state (the kernel contract: ``state`` is never changed); a copy of ``e``,
        # which the caller scales in place
        past = [*state.past, ops.copy(e)][-(len(self.c) - 1):] if len(self.c) > 1 else []
        return e, BandedState(past=past)

    def save(self, state: BandedState) -> Saved:
        return [], list(state.past)

    def check(self, state: BandedState, step: int, dim: int) -> None:
        if len(state.past) != min(step, len(self.c) - 1):
            raise ValueError("banded noise state does not match its step")


register(
    NAME,
    "toy: the Toeplitz square root cut to `bands` diagonals (docs/architecture.md)",
    build=lambda n, bands: BandedSqrt(n, bands),
    params=[Param("bands", int, 3, "nonzero diagonals of C", valid=lambda b: b >= 1,
                  constraint="≥ 1")],
)
