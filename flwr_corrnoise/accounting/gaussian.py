"""Accountants for Gaussian releases: the exact analytic Gaussian one and the paper's zCDP.

Both read a release as ``μ``, the ratio of ℓ2 sensitivity to noise std. A composition of
Gaussian releases (adaptive or not) is exactly one Gaussian release with
``μ = √(Σ μ_i²)`` (Dong, Roth & Su 2019, Cor. 3.3), and its zCDP level is
``ρ = Σ μ_i²/2`` (Bun & Steinke 2016, Prop. 1.6 and Lemma 2.3) — so one number describes
any event these accountants support.

* ``"exact"`` — the analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8):
  ``δ(ε) = Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ)``. Tight, so never looser than ``"zcdp"``.
* ``"zcdp"`` — Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated
  Learning With Correlated Noise") Lemma IV.8: ``ρ = μ²/2`` and ``ε = ρ + 2√(ρ ln 1/δ)`` (Bun &
  Steinke 2016, Prop. 1.3).

**Safe side.** A root finder in float64 lands within ~1e−13 of the exact std, on either
side. :meth:`GaussianAccountant.noise_std` checks the float it returns in 60-digit
arithmetic (``mpmath``) and rounds it *up*, one float at a time, until the budget provably
holds; :meth:`AnalyticGaussianAccountant.epsilon` returns the side of its bracket on which
``δ(ε) ≤ δ`` holds exactly.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import mpmath
from scipy.special import log_ndtr

from .base import Accountant, PrivacyBudgetError, UnsupportedEventError
from .events import Composed, GaussianRelease, NoRelease, Release, SelfComposed, WorstCase

__all__ = [
    "AnalyticGaussianAccountant",
    "GaussianAccountant",
    "ZCdpAccountant",
    "gaussian_delta",
    "gaussian_delta_exact",
    "solve_mu",
    "zcdp_epsilon",
    "zcdp_rho",
]

#: working precision (decimal digits) of the exact checks
DPS = 60


# -- zCDP (Zhang et al., Lemma IV.8) ------------------------------------------------------------
def zcdp_rho(eps: float, dlt: float) -> float:
    """``ρ = (√(ε + ln 1/δ) − √(ln 1/δ))²``: the zCDP level that implies ``(ε, δ)``-DP
    (inputs already checked)."""
    log_term = math.log(1.0 / dlt)
    return (math.sqrt(eps + log_term) - math.sqrt(log_term)) ** 2


def zcdp_epsilon(rho: float, dlt: float) -> float:
    """Inverse of :func:`zcdp_rho`: ``ε = ρ + 2·√(ρ·ln 1/δ)`` (inputs already checked)."""
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / dlt))


# -- the analytic Gaussian mechanism (Balle & Wang 2018) --------------------------------------
def gaussian_delta(epsilon: float, mu: float) -> float:
    """Smallest δ for which the Gaussian mechanism with ``μ = Δ/V`` is ``(ε, δ)``-DP.

    ``δ(ε) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)``, evaluated in log space so that large ε
    and small μ do not overflow.
    """
    if mu <= 0:
        return 0.0
    a = mu / 2.0 - epsilon / mu
    b = -mu / 2.0 - epsilon / mu
    first = math.exp(float(log_ndtr(a)))
    second = math.exp(min(epsilon + float(log_ndtr(b)), 0.0))
    return max(first - second, 0.0)


def gaussian_delta_exact(epsilon: float, mu: float) -> mpmath.mpf:
    """:func:`gaussian_delta` in ``DPS``-digit arithmetic, for checks that must not round."""
    with mpmath.workdps(DPS):
        eps, m = mpmath.mpf(epsilon), mpmath.mpf(mu)
        if m <= 0:
            return mpmath.mpf(0)
        a = m / 2 - eps / m
        b = -m / 2 - eps / m
        return mpmath.ncdf(a) - mpmath.exp(eps) * mpmath.ncdf(b)


def solve_mu(epsilon: float, delta: float) -> float:
    """Largest ``μ = Δ/V`` with ``gaussian_delta(ε, μ) ≤ δ`` (δ grows with μ), in float64."""
    lo, hi = 1e-12, 1.0
    while gaussian_delta(epsilon, hi) < delta:
        hi *= 2.0
        if hi > 1e6:
            raise PrivacyBudgetError("budget too loose to calibrate a Gaussian mechanism")
    from scipy.optimize import brentq  # lazily: scipy.optimize costs ≈ 0.4 s to import
    return brentq(lambda m: gaussian_delta(epsilon, m) - delta, lo, hi, xtol=1e-14, rtol=1e-13)


# -- reading an event as μ --------------------------------------------------------------------
def _mu_squared(event: Release) -> float:
    if isinstance(event, GaussianRelease):
        return event.mu * event.mu
    if isinstance(event, NoRelease):
        return 0.0
    if isinstance(event, Composed):
        return math.fsum(_mu_squared(e) for e in event.events)
    if isinstance(event, SelfComposed):
        return event.count * _mu_squared(event.event)
    if isinstance(event, WorstCase):  # ε and δ grow with μ: the worst case has the largest
        return max((_mu_squared(e) for e in event.cases), default=0.0)
    raise UnsupportedEventError(
        f"a Gaussian accountant cannot account {type(event).__name__}: only Gaussian "
        "releases, their compositions and worst cases")


def _exact_mu(event: Release) -> mpmath.mpf:
    """``μ`` in the current ``mpmath`` precision: a single release's ``Δ/std`` divided there
    (not in float64), a composition's from its float ``μ``."""
    if isinstance(event, GaussianRelease):
        return mpmath.mpf(event.l2_sensitivity) / mpmath.mpf(event.std)
    return mpmath.mpf(GaussianAccountant.mu(event))


class GaussianAccountant(Accountant):
    """Common part of the two Gaussian accountants: ``μ`` of an event, calibration, the
    exact check."""

    def supports(self, event: Release) -> bool:
        try:
            _mu_squared(event)
        except UnsupportedEventError:
            return False
        return True

    @staticmethod
    def mu(event: Release) -> float:
        """``μ`` of the single Gaussian release equivalent to ``event`` (a single release's
        own ``Δ/std``, read without a square root so that it is bit-for-bit that ratio)."""
        if isinstance(event, GaussianRelease):
            return event.mu
        return math.sqrt(_mu_squared(event))

    @abstractmethod
    def _mu_for(self, eps: float, dlt: float) -> float:
        """The largest ``μ`` this accountant proves ``(ε, δ)`` for, in float64."""

    @abstractmethod
    def satisfies(self, event: Release, epsilon: float, delta: float) -> bool:
        """Whether ``event`` is ``(ε, δ)``-DP by this accountant, decided in ``DPS``-digit
        arithmetic on the exact float inputs."""

    def noise_std(self, l2_sensitivity: float, epsilon: float, delta: float) -> float:
        """The smallest float std (searched upwards from the float64 root) that makes one
        Gaussian release of ``l2_sensitivity`` provably ``(ε, δ)``-DP (inputs checked by the
        caller)."""
        std = l2_sensitivity / self._mu_for(epsilon, delta)
        for attempt in range(10_000):
            if self.satisfies(GaussianRelease(l2_sensitivity, std), epsilon, delta):
                return std
            # the float root is within ~1e−13 relative: one ulp at a time, then larger steps
            std = math.nextafter(std, math.inf) if attempt < 64 else std * (1 + 1e-12)
        raise PrivacyBudgetError("could not find a noise std that provably meets the budget")


class AnalyticGaussianAccountant(GaussianAccountant):
    """The exact (ε, δ) of a Gaussian release (Balle & Wang 2018)."""

    name = "exact"

    def _mu_for(self, eps: float, dlt: float) -> float:
        return solve_mu(eps, dlt)

    def satisfies(self, event: Release, epsilon: float, delta: float) -> bool:
        with mpmath.workdps(DPS):
            return gaussian_delta_exact(epsilon, _exact_mu(event)) <= mpmath.mpf(delta)

    def delta(self, event: Release, epsilon: float) -> float:
        return gaussian_delta(epsilon, self.mu(event))

    def epsilon(self, event: Release, delta: float) -> float:
        """The smallest ε with ``δ(ε) ≤ δ``, found by bracketing in float64 and reported on
        the side where the inequality holds in exact arithmetic."""
        mu = self.mu(event)
        if gaussian_delta(0.0, mu) <= delta:
            return 0.0
        hi = 1.0
        while gaussian_delta(hi, mu) > delta:
            hi *= 2.0
        from scipy.optimize import brentq  # lazily: scipy.optimize costs ≈ 0.4 s to import
        root = brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-13,
                      rtol=1e-13)
        for _ in range(200):
            if gaussian_delta_exact(root, mu) <= delta:
                return root
            root += max(abs(root) * 1e-13, 1e-15)
        return hi


class ZCdpAccountant(GaussianAccountant):
    """Zhang et al.'s zCDP accounting (Lemma IV.8): ``ρ = μ²/2``, ``ε = ρ + 2√(ρ ln 1/δ)``."""

    name = "zcdp"

    @staticmethod
    def rho(event: Release) -> float:
        """The zCDP level ``ρ = μ²/2`` of ``event``."""
        mu = GaussianAccountant.mu(event)
        return mu * mu / 2.0

    def _mu_for(self, eps: float, dlt: float) -> float:
        return math.sqrt(2.0 * zcdp_rho(eps, dlt))

    def satisfies(self, event: Release, epsilon: float, delta: float) -> bool:
        with mpmath.workdps(DPS):
            mu = _exact_mu(event)
            ln = mpmath.log(1 / mpmath.mpf(delta))
            rho_budget = (mpmath.sqrt(mpmath.mpf(epsilon) + ln) - mpmath.sqrt(ln)) ** 2
            return mu * mu / 2 <= rho_budget

    def epsilon(self, event: Release, delta: float) -> float:
        return zcdp_epsilon(self.rho(event), delta)

    def delta(self, event: Release, epsilon: float) -> float:
        """Inverse of ``ε = ρ + 2√(ρ ln 1/δ)`` in δ: ``δ = exp(−(ε − ρ)²/(4ρ))`` for
        ``ε > ρ`` (1 otherwise: the bound says nothing there)."""
        rho = self.rho(event)
        if rho == 0:
            return 0.0
        if epsilon <= rho:
            return 1.0
        return math.exp(-((epsilon - rho) ** 2) / (4.0 * rho))
