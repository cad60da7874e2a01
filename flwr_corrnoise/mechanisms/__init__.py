"""Factorizations ``A = B·C`` of the prefix-sum matrix, by name.

Pure NumPy/SciPy: nothing here imports Flower. ``build_factorization(name, n)`` is the
one entry point the streams, the calibration, the CLI and the Flower layer use; built
factorizations are memoized per process (the optimized one is also cached on disk),
because every virtual learner of a simulation needs the same matrices.
"""

from __future__ import annotations

from functools import lru_cache

from . import cache
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


class FactorizationChangedError(ValueError):
    """A stream was made with a factorization that can no longer be rebuilt exactly."""


def factorization_by_digest(name: str, n: int, digest: str) -> Factorization:
    """The exact factorization ``(name, N)`` whose :attr:`~Factorization.digest` is
    ``digest``: the current one if it matches, else the write-once copy that was cached
    under that digest when it was built (solved kinds). Raises
    :class:`FactorizationChangedError`, naming old and new, if neither exists."""
    current = build_factorization(name, n)
    if current.digest == digest:
        return current
    found: Factorization | None = None
    if name == "optimized":
        stored = cache.load(cache.digest_key(name, n, digest), ("v", "report"))
        if stored is not None:
            import json

            found = Optimized.from_dual(n, stored["v"], json.loads(str(stored["report"])))
    elif name == "blt":
        stored = cache.load(cache.digest_key(name, n, digest), ("theta", "omega"))
        if stored is not None:
            found = BufferedToeplitz(n, params=BLTParams(stored["theta"], stored["omega"]),
                                     use_cache=False)
    if found is None or found.digest != digest:
        raise FactorizationChangedError(
            f"the noise stream was made with the {name} factorization for N = {n} with digest "
            f"{digest[:16]}…, but this process builds digest {current.digest[:16]}… and the "
            f"original is not in the cache ({cache.cache_dir()}); refusing to continue the "
            f"stream with other noise"
        )
    return found


__all__ = [
    "MECHANISMS",
    "BLTParams",
    "BinaryTree",
    "BufferedToeplitz",
    "Factorization",
    "FactorizationChangedError",
    "Independent",
    "Optimized",
    "ToeplitzSqrt",
    "build_factorization",
    "check_horizon",
    "check_mechanism",
    "factorization_by_digest",
    "prefix_sum_matrix",
    "prefix_sum_singular_values",
    "rmse_lower_bound",
]
