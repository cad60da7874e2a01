"""Pure ε-DP of Laplace releases by basic composition — the accountant of Chen & Wang, "Locally
Differentially Private Distributed Online Learning with Guaranteed Optimality" and Wang, Yang, Yao,
Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized Online Learning".

One Laplace release of ℓ1 sensitivity ``Δ₁`` and scale ``b`` is ``Δ₁/b``-DP (its privacy
loss never exceeds ``Δ₁/b``), and pure-DP releases on the same data compose by adding their
ε (Dwork & Roth 2014, Thm. 3.16) — tight at δ = 0: the losses reach their maxima together
with positive probability, so no smaller ε holds with δ = 0.

The decentralized accountants differ only in the *description* they hand over (which
sensitivity bound per release, which neighbouring relation); the composition is this one.
"""

from __future__ import annotations

import math

import numpy as np

from .base import Accountant, PrivacyBudgetError, UnsupportedEventError
from .events import (
    Composed,
    LaplaceRelease,
    LaplaceSeries,
    NoRelease,
    PerDatumLaplace,
    Release,
    SelfComposed,
    WorstCase,
)

__all__ = ["BasicComposition"]


def _terms(series: LaplaceSeries) -> np.ndarray:
    """ε of each release of ``series``: ``Δ₁/b``; 0 where ``Δ₁ = 0`` (even if ``b = 0``),
    ``inf`` where ``b = 0 < Δ₁``."""
    sens, sc = series.l1_sensitivities, series.scales
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sens == 0, 0.0, sens / sc)


def _per_datum(event: PerDatumLaplace) -> float:
    """``max_k Σ_{t>k} entry_k·Π_{j=k+1}^{t−1} a_j / b_t`` in O(T), by
    ``H_j = 1/b_j + a_j·H_{j+1}`` (``H_T = 0``): datum ``k``'s ε is
    ``entry_k/b_{k+1} + entry_k·a_{k+1}·H_{k+2}``."""
    entry, a, sc = event.entry, event.contraction, event.scales
    T = sc.size
    if T < 2:
        return 0.0
    with np.errstate(divide="ignore"):
        inv = np.where(sc > 0, 1.0 / np.where(sc > 0, sc, 1.0), math.inf)
    H = np.zeros(T + 1)
    for j in range(T - 1, 0, -1):
        H[j] = inv[j] + (a[j] * H[j + 1] if a[j] != 0 else 0.0)
    e = entry[: T - 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where(e == 0, 0.0, e / sc[1:T])
        later = np.where((e == 0) | (a[1:T] == 0), 0.0, e * a[1:T] * H[2 : T + 1])
    return float((first + later).max())


class BasicComposition(Accountant):
    """ε of a pure-DP release: ``Σ Δ₁/b`` over what it composes, the worst case over the
    cases of a :class:`~.events.WorstCase`. δ plays no part (the result holds at δ = 0)."""

    name = "basic composition"

    def supports(self, event: Release) -> bool:
        try:
            self._eps(event)
        except UnsupportedEventError:
            return False
        return True

    def _eps(self, event: Release) -> float:
        if isinstance(event, LaplaceRelease):
            if event.l1_sensitivity == 0:
                return 0.0
            return math.inf if event.scale == 0 else event.l1_sensitivity / event.scale
        if isinstance(event, LaplaceSeries):  # summed in release order: the curve's last
            return float(np.cumsum(_terms(event))[-1]) if len(event) else 0.0
        if isinstance(event, PerDatumLaplace):
            return _per_datum(event)
        if isinstance(event, NoRelease):
            return 0.0
        if isinstance(event, Composed):
            return float(sum(self._eps(e) for e in event.events))
        if isinstance(event, SelfComposed):
            if event.count == 0:
                return 0.0
            if isinstance(event.event, LaplaceRelease):  # k·Δ₁/b in one division
                inner = event.event
                return self._eps(LaplaceRelease(event.count * inner.l1_sensitivity,
                                                inner.scale))
            return event.count * self._eps(event.event)
        if isinstance(event, WorstCase):
            return max((self._eps(e) for e in event.cases), default=0.0)
        raise UnsupportedEventError(
            f"basic composition cannot account {type(event).__name__}: it has no pure ε "
            "(a Gaussian release needs δ > 0 — use a Gaussian accountant)")

    def epsilon(self, event: Release, delta: float = 0.0) -> float:
        """The pure ε of ``event`` (valid at every ``δ ≥ 0``)."""
        return self._eps(event)

    def delta(self, event: Release, epsilon: float) -> float:
        """0 at or above the pure ε; below it basic composition proves nothing (1)."""
        return 0.0 if epsilon >= self._eps(event) else 1.0

    def epsilon_curve(self, series: LaplaceSeries) -> np.ndarray:
        """Cumulative ε after releases ``0..t`` for every ``t`` (Lemma 2 of Chen & Wang when
        the series is a node's releases)."""
        if not isinstance(series, LaplaceSeries):
            raise UnsupportedEventError(f"a curve needs a LaplaceSeries, got "
                                        f"{type(series).__name__}")
        return np.cumsum(_terms(series))

    def scale_for(self, unit: Release, epsilon: float) -> float:
        """The factor ``s`` by which every Laplace scale of ``unit`` must be multiplied for
        the release to be exactly ``epsilon``-DP: pure ε is ``∝ 1/s``, so
        ``s = ε(unit)/epsilon``."""
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise PrivacyBudgetError(f"ε must be finite and > 0, got {epsilon!r}")
        return float(self._eps(unit) / epsilon)
