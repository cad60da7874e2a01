"""Factorizations ``A = B·C`` of the prefix-sum matrix, by name.

Pure NumPy/SciPy: nothing here imports Flower. ``build_factorization(name, n)`` is the
one entry point the streams, the calibration, the CLI and the Flower layer use; built
factorizations are memoized per process (the optimized one is also cached on disk),
because every virtual learner of a simulation needs the same matrices.
"""

from __future__ import annotations

from functools import lru_cache

from .base import (
    Factorization,
    check_horizon,
    prefix_sum_matrix,
    prefix_sum_singular_values,
    rmse_lower_bound,
)
from .blt import BLTParams, BufferedToeplitz
from .independent import Independent
from .optimized import Optimized
from .toeplitz import ToeplitzSqrt
from .tree import BinaryTree

#: every mechanism a user can name, with a one-line description
MECHANISMS: dict[str, str] = {
    "independent": "independent noise, C = I, B = A (Liu et al.; the baseline)",
    "tree": "binary tree (paper 000 Example i, Fig. 2)",
    "efficient-tree": "binary tree with Honaker's efficient estimator",
    "toeplitz": "Toeplitz square root B = C = A^(1/2) (paper 000 Example iii)",
    "optimized": "min ||B||_F^2 s.t. max column norm of C = 1 (paper 000 Example ii)",
    "blt": "buffered linear Toeplitz, optimized per horizon (Dvijotham et al. 2024); "
    "near-optimal, O(buffers·d) stream state at any N",
}


def check_mechanism(name: str) -> str:
    """Validate a mechanism name; the error lists the valid ones."""
    if name not in MECHANISMS:
        raise ValueError(f"unknown mechanism {name!r}; choose one of {sorted(MECHANISMS)}")
    return name


@lru_cache(maxsize=16)
def build_factorization(name: str, n: int) -> Factorization:
    """The factorization called ``name`` for horizon ``n`` (memoized)."""
    check_mechanism(name)
    n = check_horizon(n)
    if name == "independent":
        return Independent(n)
    if name == "tree":
        return BinaryTree(n, efficient=False)
    if name == "efficient-tree":
        return BinaryTree(n, efficient=True)
    if name == "toeplitz":
        return ToeplitzSqrt(n)
    if name == "blt":
        return BufferedToeplitz(n)
    return Optimized(n)


__all__ = [
    "MECHANISMS",
    "BLTParams",
    "BinaryTree",
    "BufferedToeplitz",
    "Factorization",
    "Independent",
    "Optimized",
    "ToeplitzSqrt",
    "build_factorization",
    "check_horizon",
    "check_mechanism",
    "prefix_sum_matrix",
    "prefix_sum_singular_values",
    "rmse_lower_bound",
]
