"""Release descriptions ("DP events"): what a mechanism releases, in terms an accountant
reads — sensitivities and noise, never data.

A mechanism or algorithm builds one of these from its *settings* (its factorization, clip,
noise std or Laplace schedule, declared data bounds); an accountant (:mod:`.gaussian`,
:mod:`.pure`) turns it into ``(ε, δ)``. Keeping the two apart is what lets the main library
(one Gaussian mechanism per learner) and the decentralized papers (Laplace releases step by
step) share the accounting code, and what lets a test hold each against an independent
computation.

Every event is for one neighbouring relation, fixed by whoever builds it (here: one datum of
one learner's stream replaced). Sensitivities are the largest change of the noiseless
release between two neighbouring inputs: ℓ2 for Gaussian noise, ℓ1 for Laplace noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from .base import PrivacyBudgetError, Release, check_positive

__all__ = [
    "Composed",
    "GaussianRelease",
    "LaplaceRelease",
    "LaplaceSeries",
    "NoRelease",
    "PerDatumLaplace",
    "Release",
    "SelfComposed",
    "WorstCase",
    "replace_one_l2",
]


def _nonneg(name: str, value: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as err:
        raise PrivacyBudgetError(f"{name} must be a number, got {value!r}") from err
    if math.isnan(x) or x < 0:
        raise PrivacyBudgetError(f"{name} must be ≥ 0, got {value!r}")
    return x


def _vector(name: str, values: Iterable[float] | np.ndarray, *, allow_inf: bool) -> np.ndarray:
    arr = np.array(values, dtype=float).reshape(-1)
    if np.any(np.isnan(arr)) or np.any(arr < 0) or (not allow_inf and np.any(np.isinf(arr))):
        raise PrivacyBudgetError(f"{name} must be {'' if allow_inf else 'finite and '}≥ 0")
    arr.flags.writeable = False
    return arr


def replace_one_l2(clip: float, column_norm: float) -> float:
    """``Δ = 2·clip·column_norm``: the ℓ2 sensitivity of a linear map with largest column
    norm ``column_norm`` applied to rows clipped to ``clip``, when one row is replaced (the
    replaced row moves by at most ``2·clip``; Zhang, Zhu, Fay & Johansson, "Locally Differentially
    Private Online Federated Learning With Correlated Noise", eq. (15) for ``C·G``)."""
    return 2.0 * check_positive("clip norm", clip) * check_positive("sensitivity", column_norm)


@dataclass(frozen=True)
class NoRelease(Release):
    """Nothing that depends on the data is released: ε = 0, δ = 0 for every accountant."""


@dataclass(frozen=True)
class GaussianRelease(Release):
    """``f(x) + N(0, std²·I)`` with ``‖f(x) − f(x')‖₂ ≤ l2_sensitivity``.

    A learner's whole matrix-factorization release ``B(C·G + std·ξ)`` is post-processing of
    one of these, with ``l2_sensitivity = 2·B_g·max_j ‖c_j‖`` over the rows of ``C``
    released so far (:meth:`~flwr_corrnoise.mechanisms.Factorization.release`).
    """

    l2_sensitivity: float
    std: float

    def __post_init__(self) -> None:
        l2 = _nonneg("ℓ2 sensitivity", self.l2_sensitivity)
        if math.isinf(l2):
            raise PrivacyBudgetError(f"ℓ2 sensitivity must be finite, got {self.l2_sensitivity!r}")
        object.__setattr__(self, "l2_sensitivity", l2)
        object.__setattr__(self, "std", check_positive("noise std", self.std))

    @property
    def mu(self) -> float:
        """``μ = Δ/std``: the mechanism is exactly ``μ``-GDP (Dong, Roth & Su 2019)."""
        return self.l2_sensitivity / self.std


@dataclass(frozen=True)
class LaplaceRelease(Release):
    """``f(x) + Lap(scale)^d`` with ``‖f(x) − f(x')‖₁ ≤ l1_sensitivity`` (``scale = 0``: no
    noise, ε = ∞ unless the sensitivity is 0)."""

    l1_sensitivity: float
    scale: float

    def __post_init__(self) -> None:
        l1 = _nonneg("ℓ1 sensitivity", self.l1_sensitivity)
        if math.isinf(l1):
            raise PrivacyBudgetError(f"ℓ1 sensitivity must be finite, got {self.l1_sensitivity!r}")
        object.__setattr__(self, "l1_sensitivity", l1)
        object.__setattr__(self, "scale", _nonneg("Laplace scale", self.scale))


@dataclass(frozen=True, eq=False)
class LaplaceSeries(Release):
    """Releases ``t = 0..T−1``, release ``t`` a :class:`LaplaceRelease` of
    ``l1_sensitivities[t]`` and ``scales[t]``, all shown to the adversary (composed).

    One array per field rather than ``T`` objects: a decentralized node releases at every
    step, and its accountant asks for the cumulative ε after each one.
    """

    l1_sensitivities: np.ndarray
    scales: np.ndarray

    def __post_init__(self) -> None:
        sens = np.asarray(self.l1_sensitivities, dtype=float)
        sc = np.asarray(self.scales, dtype=float)
        if sens.shape != sc.shape or sens.ndim != 1:
            raise PrivacyBudgetError("sensitivity and scales must have the same length")
        object.__setattr__(self, "l1_sensitivities",
                           _vector("ℓ1 sensitivities", sens, allow_inf=False))
        object.__setattr__(self, "scales", _vector("Laplace scales", sc, allow_inf=True))

    def __len__(self) -> int:
        return int(self.scales.size)

    def releases(self) -> Composed:
        """The same series as ``T`` single releases (for checks: O(T) objects)."""
        return Composed(tuple(LaplaceRelease(float(s), float(b))
                              for s, b in zip(self.l1_sensitivities, self.scales, strict=True)))


@dataclass(frozen=True, eq=False)
class PerDatumLaplace(Release):
    """Releases ``t = 0..T−1`` with Laplace scales ``scales[t]`` of a learner whose datum
    ``k`` (used at step ``k``) first shows in release ``k+1``, moving it by ``entry[k]`` in
    ℓ1, and then only through the learner's own state: release ``t > k+1`` moves by
    ``entry[k]·Π_{j=k+1}^{t−1} contraction[j]``.

    Neighbouring streams differ in one datum, so the guarantee is that of the worst datum —
    :meth:`cases` spells it out as a :class:`WorstCase` of one :class:`LaplaceSeries` per
    datum (O(T²)); the accountant computes the same in O(T). ``entry[T−1]`` (a datum used at
    the last step, shown in no release of this window) is not read.
    """

    entry: np.ndarray
    contraction: np.ndarray
    scales: np.ndarray

    def __post_init__(self) -> None:
        arrays = [np.asarray(a, dtype=float) for a in (self.entry, self.contraction,
                                                       self.scales)]
        if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
            raise PrivacyBudgetError("entry, contraction and scales must have the same length")
        object.__setattr__(self, "entry", _vector("ℓ1 entries", arrays[0], allow_inf=False))
        object.__setattr__(self, "contraction",
                           _vector("contraction factors", arrays[1], allow_inf=False))
        object.__setattr__(self, "scales", _vector("Laplace scales", arrays[2], allow_inf=True))

    def __len__(self) -> int:
        return int(self.scales.size)

    def cases(self) -> WorstCase:
        """One :class:`LaplaceSeries` per datum ``k = 0..T−2`` (for checks)."""
        T = len(self)
        out = []
        for k in range(T - 1):
            sens = np.zeros(T)
            sens[k + 1] = self.entry[k]
            for t in range(k + 2, T):
                sens[t] = sens[t - 1] * self.contraction[t - 1]
            out.append(LaplaceSeries(sens, self.scales))
        return WorstCase(tuple(out))


@dataclass(frozen=True)
class Composed(Release):
    """Every one of ``events`` is released (adaptively: each may depend on the earlier
    outputs), all on the same data."""

    events: tuple[Release, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        events = tuple(self.events)
        for e in events:
            if not isinstance(e, Release):
                raise TypeError(f"Composed takes releases, got {type(e).__name__}")
        object.__setattr__(self, "events", events)


@dataclass(frozen=True)
class SelfComposed(Release):
    """``event`` released ``count`` times on the same data (e.g. a leaf inside ``count``
    noisy nodes of a tree)."""

    event: Release
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.event, Release):
            raise TypeError(f"SelfComposed takes a release, got {type(self.event).__name__}")
        if isinstance(self.count, bool) or int(self.count) != self.count or self.count < 0:
            raise PrivacyBudgetError(f"count must be an integer ≥ 0, got {self.count!r}")
        object.__setattr__(self, "count", int(self.count))


@dataclass(frozen=True)
class WorstCase(Release):
    """The release's guarantee is the worst over ``cases``: the neighbouring relation is a
    union of sub-relations (which datum was replaced, whose data), each with its own
    description. An empty tuple is no release."""

    cases: tuple[Release, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        cases = tuple(self.cases)
        for e in cases:
            if not isinstance(e, Release):
                raise TypeError(f"WorstCase takes releases, got {type(e).__name__}")
        object.__setattr__(self, "cases", cases)
