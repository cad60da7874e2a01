"""Independent noise: ``C = I``, ``B = A`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially
Private Online Federated Learning With Correlated Noise", Remark III.1; Liu et al.).

Every step gets fresh noise; prefix sum ``k`` accumulates ``k+1`` noise draws, so its
error grows linearly in ``k``. This is the baseline correlated noise is measured against.
"""

from __future__ import annotations

import math

import numpy as np

from .base import Factorization, prefix_sum_matrix
from .participation import Participation, Sensitivity
from .registry import register
from .streaming import Array, ArrayOps, Draw, Saved, StreamKernel


class Independent(Factorization):
    """The trivial factorization: sensitivity 1, ``‖b_k‖² = k + 1``."""

    name = "independent"
    stream_kind = "independent"

    def column_norms(self) -> np.ndarray:
        return np.ones(self.n)

    def prefix_sensitivity(self, k: int) -> float:
        self._check_prefix(k)
        return 1.0

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        # X = I: k uses add k orthogonal unit columns, sens = √k whatever the pattern
        value = math.sqrt(participation.participations(steps or self.n))
        return Sensitivity(value, value, True, "C = I: √k")

    def row_errors(self) -> np.ndarray:
        return np.arange(1, self.n + 1, dtype=float)

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        return prefix_sum_matrix(self.n), np.eye(self.n)

    def _make_stream_kernel(self) -> StreamKernel:
        return IndependentKernel()


class IndependentKernel(StreamKernel):
    """``e[k] = ξ_k``: no memory at all. The state is the number of rows a restored
    state brought along (zero, or :meth:`check` rejects it)."""

    kind = "independent"

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> int:
        return len(rows)

    def next(self, state: int, step: int, draw: Draw, ops: ArrayOps) -> tuple[Array, int]:
        return draw(), state

    def save(self, state: int) -> Saved:
        return [], []

    def check(self, state: int, step: int, dim: int) -> None:
        if state:
            raise ValueError("independent noise state must not hold buffers")

    def peak_rows(self, horizon: int) -> int:
        return 0


register("independent", "independent noise, C = I, B = A (Liu et al.; the baseline)",
         build=Independent)
