"""Factorizations ``A = B·C`` of the prefix-sum matrix, by name.

Pure NumPy/SciPy: nothing here imports Flower. ``build_factorization(name, n, **params)``
is the one entry point the streams, the calibration, the CLI and the Flower layer use;
built factorizations are memoized per process (the solved ones are also cached on disk),
because every virtual learner of a simulation needs the same matrices. Which names exist,
what they take and how each is built is the registry's (:mod:`.registry`); each mechanism
module registers itself when it is imported below.
"""

from __future__ import annotations

# isort: off
# each mechanism module registers itself on import; this order is MECHANISMS' order
from . import independent, tree, toeplitz, optimized, blt, banded, bandmf  # noqa: F401
# isort: on
from . import cache  # noqa: F401  (callers use mechanisms.cache)
from .base import Factorization, rmse_lower_bound
from .blt import BLTParams
from .registry import (
    MECHANISMS,
    FactorizationChangedError,
    Mechanism,
    Param,
    build_factorization,
    check_mechanism,
    get_mechanism,
    mechanism_names,
    register,
)

__all__ = [
    "MECHANISMS",
    "BLTParams",
    "Factorization",
    "FactorizationChangedError",
    "Mechanism",
    "Param",
    "build_factorization",
    "check_mechanism",
    "get_mechanism",
    "mechanism_names",
    "register",
    "rmse_lower_bound",
]
