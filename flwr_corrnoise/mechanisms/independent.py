"""Independent noise: ``C = I``, ``B = A`` (paper 000, Remark III.1; Liu et al.).

Every step gets fresh noise; prefix sum ``k`` accumulates ``k+1`` noise draws, so its
error grows linearly in ``k``. This is the baseline correlated noise is measured against.
"""

from __future__ import annotations

import numpy as np

from .base import Factorization, prefix_sum_matrix
from .streaming import IndependentKernel, StreamKernel


class Independent(Factorization):
    """The trivial factorization: sensitivity 1, ``‖b_k‖² = k + 1``."""

    name = "independent"
    stream_kind = "independent"

    def column_norms(self) -> np.ndarray:
        return np.ones(self.n)

    def prefix_sensitivity(self, k: int) -> float:
        self._check_prefix(k)
        return 1.0

    def row_errors(self) -> np.ndarray:
        return np.arange(1, self.n + 1, dtype=float)

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        return prefix_sum_matrix(self.n), np.eye(self.n)

    def _make_stream_kernel(self) -> StreamKernel:
        return IndependentKernel()
