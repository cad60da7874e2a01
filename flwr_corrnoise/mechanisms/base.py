"""The common interface of every factorization ``A = B·C`` of the prefix-sum matrix.

Notation (fixed once, as in Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online
Federated Learning With Correlated Noise" and ``docs/notation.md``): ``A`` is the ``N×N``
lower-triangular all-ones matrix, ``N = R·τ`` the horizon (number of local steps), ``C`` (``W×N``)
the *encoder* whose output receives i.i.d. Gaussian noise, ``B`` (``N×W``) the *decoder* that turns
the noisy encoding into noisy prefix sums. A learner releases ``A·G + B·ξ = B(C·G + ξ)``; the
privacy cost depends only on the column norms of ``C`` (the sensitivity) and the utility cost on the
row norms of ``B``.

Single-letter matrix names are used on purpose: they are the papers' names.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import numpy as np

from ..accounting import GaussianRelease
from ..accounting.events import replace_one_l2
from .participation import (
    DENSE_LIMIT,
    ONCE,
    Participation,
    Sensitivity,
    gram_sensitivity,
    triangle_sensitivity,
)
from .streaming import HistoryKernel, StreamKernel

#: dense prefix sensitivities (ε spent before the horizon) are recomputed up to this N;
#: beyond it a prefix takes min(full, triangle bound), both certified
DENSE_PREFIX_LIMIT = 512


def prefix_sum_matrix(n: int) -> np.ndarray:
    """Return ``A``, the ``n×n`` lower-triangular matrix of ones (the prefix-sum workload)."""
    check_horizon(n)
    return np.tril(np.ones((n, n)))


def prefix_sum_singular_values(n: int) -> np.ndarray:
    """Singular values of ``A`` in closed form: ``σ_j = 1 / (2 sin((2j−1)π / (4N+2)))``.

    ``A⁻¹`` is the bidiagonal difference matrix, whose ``(A⁻¹)ᵀA⁻¹`` is the tridiagonal
    ``[2, −1]`` matrix with a 1 in its corner; its eigenvalues are ``4 sin²((2j−1)π/(4N+2))``.
    """
    n = check_horizon(n)
    j = np.arange(1, n + 1, dtype=float)
    return 1.0 / (2.0 * np.sin((2.0 * j - 1.0) * np.pi / (4.0 * n + 2.0)))


def rmse_lower_bound(n: int) -> float:
    """A certified lower bound on the RMSE at unit sensitivity of *every* factorization.

    For ``A = B·C``: ``‖A‖_* ≤ ‖B‖_F·‖C‖_F ≤ ‖B‖_F·√N·max_j ‖c_j‖`` (Hölder), so
    ``RMSE = max_j ‖c_j‖·‖B‖_F/√N ≥ ‖A‖_*/N``, with the nuclear norm ``‖A‖_*`` in closed
    form. It is the optimized solver's dual bound at ``v = 1`` and, at N = 4000, 1.2 %
    below the optimum; it is what "ratio to the best" means where no optimum is computable.
    """
    n = check_horizon(n)
    return float(np.sum(prefix_sum_singular_values(n)) / n)


def check_horizon(n: int) -> int:
    """Validate a horizon: a positive integer number of steps.

    Why: every mechanism is defined for a fixed horizon; a zero or negative horizon is a
    configuration error that would otherwise surface later as an empty matrix.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or int(n) < 1:
        raise ValueError(f"the horizon N must be a positive integer, got {n!r}")
    return int(n)


class Factorization(ABC):
    """A factorization ``A = B·C`` of the ``N×N`` prefix-sum matrix.

    Subclasses compute the quantities a user needs to pick a mechanism *without*
    materializing ``B`` and ``C`` where a closed form exists (the trees at N = 10⁵ would
    need gigabytes otherwise); :meth:`matrices` materializes them for checks at small N.
    """

    #: registry name, e.g. ``"toeplitz"``
    name: str = ""
    #: which streaming generator produces this mechanism's increments
    stream_kind: str = ""

    def __init__(self, n: int) -> None:
        self.n = check_horizon(n)

    # -- identity -------------------------------------------------------------------------
    def defining_arrays(self) -> dict[str, np.ndarray]:
        """The numbers that generate this factorization's noise, besides its name and N
        (closed forms have none; solved ones return their parameters)."""
        return {}

    @property
    def digest(self) -> str:
        """SHA-256 of the name, ``N`` and :meth:`defining_arrays`: the identity of the
        exact factorization a noise stream uses.

        Why: two factorizations with the same name and horizon can differ (a tighter
        ``--gap`` solve, another BLT optimum); a stream restored under another one would
        silently change its noise and its privacy accounting. Streams record this digest
        and refuse to continue under any other.
        """
        cached = getattr(self, "_digest", None)
        if cached is None:
            h = hashlib.sha256(f"{self.name}|{self.n}".encode())
            for key, value in sorted(self.defining_arrays().items()):
                arr = np.ascontiguousarray(np.asarray(value, dtype=np.float64))
                h.update(f"|{key}:{arr.shape}".encode())
                h.update(arr.tobytes())
            cached = h.hexdigest()
            self._digest = cached
        return cached

    # -- privacy side -------------------------------------------------------------------
    @abstractmethod
    def column_norms(self) -> np.ndarray:
        """``‖c_j‖`` for every column ``j`` of ``C`` (length ``N``)."""

    @property
    def sensitivity(self) -> float:
        """``max_j ‖c_j‖``: the L2 sensitivity of ``C·G`` to a change of one row of ``G``
        of norm at most 1. The Gaussian mechanism's noise is calibrated to this."""
        return float(np.max(self.column_norms()))

    def prefix_sensitivity(self, k: int) -> float:
        """Sensitivity of what has been released after the first ``k`` steps.

        The encoder rows released by step ``k`` are those a causal stream has drawn by
        then; their column norms bound the privacy loss spent so far. The default reads
        the materialized ``C`` (rows of a square lower-triangular ``C``); subclasses
        override it with closed forms.
        """
        k = self._check_prefix(k)
        _, C = self.matrices()
        return float(np.max(np.linalg.norm(C[:k], axis=0)))

    def participation_sensitivity(
        self, participation: Participation = ONCE, steps: int | None = None
    ) -> Sensitivity:
        """Sensitivity when one datum enters the stream as ``participation`` says, of what
        is released after ``steps`` steps (all ``N`` by default); see :mod:`.participation`.

        The default materializes ``C`` up to :data:`~.participation.DENSE_LIMIT` steps and
        otherwise falls back to the triangle bound ``k·max_j‖c_j‖``; Toeplitz encoders and
        independent noise override it with closed forms. Memoized per object.
        """
        if steps is not None:
            steps = self._check_prefix(steps)
            if steps == self.n:
                steps = None
        if participation.single:
            value = self.sensitivity if steps is None else self.prefix_sensitivity(steps)
            return Sensitivity(value, value, True, "max column norm")
        memo = self.__dict__.setdefault("_participation_memo", {})
        key = (participation, steps)
        if key not in memo:
            memo[key] = self._participation_sensitivity(participation, steps)
        return memo[key]

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        n = self.n if steps is None else steps
        single = self.sensitivity if steps is None else self.prefix_sensitivity(steps)
        triangle = triangle_sensitivity(single, participation, n)
        limit = DENSE_LIMIT if steps is None else DENSE_PREFIX_LIMIT
        if self.n <= limit:
            return gram_sensitivity(self.encoder_gram(n), participation)
        if steps is not None:
            full = self.participation_sensitivity(participation)
            if full.value <= triangle.value:
                return Sensitivity(full.value, triangle.lower, False,
                                   "full-horizon value (a prefix releases less)")
        return triangle

    def encoder_gram(self, steps: int) -> np.ndarray:
        """``X = CᵀC`` over the rows of ``C`` a causal stream has drawn after ``steps``
        steps (the first ``steps`` rows of a square lower-triangular ``C``), restricted to
        the first ``steps`` columns (later ones are zero); the tree overrides it."""
        steps = self._check_prefix(steps)
        _, C = self.matrices()
        top = C[:steps, :steps]
        return top.T @ top

    def release(self, clip_norm: float, std: float, steps: int | None = None,
                participation: Participation = ONCE) -> GaussianRelease:
        """What a learner clipping each datum's gradient to ``clip_norm`` and adding noise
        of ``std`` has released after ``steps`` steps (all ``N`` by default), as an
        accountant reads it: one Gaussian mechanism of ℓ2 sensitivity ``2·clip_norm·`` the
        (prefix) sensitivity under ``participation`` (:mod:`flwr_corrnoise.accounting`)."""
        sens = self.participation_sensitivity(participation, steps).value
        return GaussianRelease(replace_one_l2(clip_norm, sens), std)

    def _check_prefix(self, k: int) -> int:
        if not 0 < int(k) <= self.n:
            raise ValueError(f"prefix length must be in [1, {self.n}], got {k}")
        return int(k)

    # -- utility side -------------------------------------------------------------------
    @abstractmethod
    def row_errors(self) -> np.ndarray:
        """``‖b_k‖²`` for every step ``k``: the variance of the noise in prefix sum ``k``
        per coordinate, for unit noise std (length ``N``)."""

    @property
    def total_error(self) -> float:
        """``‖B‖_F²``, the objective the optimized factorization minimizes."""
        return float(np.sum(self.row_errors()))

    @property
    def rmse(self) -> float:
        """Per-query RMSE of the prefix-sum noise at *unit sensitivity*.

        The noise std is proportional to the sensitivity, so the comparable figure of merit
        is ``sensitivity · sqrt(mean_k ‖b_k‖²)``.
        """
        return float(self.sensitivity * np.sqrt(np.mean(self.row_errors())))

    def participation_rmse(self, participation: Participation = ONCE) -> float:
        """:attr:`rmse` with the sensitivity under ``participation``: the figure of merit
        when one datum is used more than once (what ``blt`` optimizes for a given ``(k, b)``)."""
        sens = self.participation_sensitivity(participation).value
        return float(sens * np.sqrt(np.mean(self.row_errors())))

    @property
    def max_error(self) -> float:
        """Largest per-query noise std at unit sensitivity: ``sensitivity · max_k ‖b_k‖``."""
        return float(self.sensitivity * np.sqrt(np.max(self.row_errors())))

    @abstractmethod
    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """Materialize ``(B, C)`` as dense arrays (for checks; O(N·W) memory)."""

    def noising_matrix(self) -> np.ndarray:
        """Dense ``N×W`` matrix ``M`` with ``e = M·ξ`` the per-step noise increments.

        ``M = A⁻¹·B``: row ``k`` is ``b_k − b_{k−1}``. Used by tests and by dense streams.
        """
        B, _ = self.matrices()
        return np.diff(B, axis=0, prepend=np.zeros((1, B.shape[1])))

    def stream_kernel(self) -> StreamKernel:
        """This mechanism's streaming recurrence (:mod:`.streaming`), built once.

        Why here: the mechanism owns its math, so a noise stream (NumPy or torch) asks the
        factorization for its kernel instead of dispatching on names. The default streams
        any square factorization from its dense noising matrix (``k·d`` floats of history);
        mechanisms with a cheaper recurrence override :meth:`_make_stream_kernel`.
        """
        kernel = getattr(self, "_stream_kernel", None)
        if kernel is None:
            kernel = self._make_stream_kernel()
            self._stream_kernel = kernel
        return kernel

    def _make_stream_kernel(self) -> StreamKernel:
        return HistoryKernel(self.stream_kind or "dense", self.n, matrix=self.noising_matrix)

    def summary(self) -> dict[str, float | int | str]:
        """The figures the CLI prints and ``docs/mechanisms.md`` tabulates."""
        return {
            "name": self.name,
            "steps": self.n,
            "sensitivity": self.sensitivity,
            "rmse": self.rmse,
            "max_error": self.max_error,
            "total_error": self.total_error,
        }
