"""Privacy calibration: from an ``(ε, δ)`` budget to the noise std ``V``, and back.

The whole release of one learner, ``B(C·G + V·ξ)``, is post-processing of a single
Gaussian mechanism ``C·G + V·ξ`` (paper 000, eq. (4); Denisov et al. 2022, Thm 2.1 for
adaptive inputs). Replacing one datum of the learner's stream changes one clipped gradient
by at most ``2·B_g`` in L2, so the mechanism's L2 sensitivity is
``Δ = 2·B_g·max_j ‖c_j‖`` (paper eq. (15)).

Two calibrations of ``V`` for that one Gaussian mechanism:

* ``"zcdp"`` — the paper's Lemma IV.8: ``V² = Δ²/(2ρ) = 2 B_g² sens² / ρ`` with
  ``ρ = (√(ε + ln 1/δ) − √(ln 1/δ))²`` (Bun & Steinke 2016, Prop. 1.3 and 1.6).
* ``"exact"`` — the analytic Gaussian mechanism (Balle & Wang 2018, Thm. 8): the mechanism
  with ``μ = Δ/V`` is ``(ε, δ)``-DP iff
  ``Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ) ≤ δ``. This is tight, so it never needs more noise
  than ``"zcdp"``.

The inverse (:func:`epsilon_for_std`) tells what ε a given ``V`` buys at a given ``δ``.

**Safe side.** A root finder in float64 lands within ~1e−13 of the exact ``V``, on either
side: ``δ`` could overshoot the budget by ~1e−11. :func:`calibrate` therefore checks the
returned ``V`` in 60-digit arithmetic (``mpmath``) and rounds it *up*, one float at a time,
until ``δ(ε, Δ/V) ≤ δ`` (or ``ρ(V) ≤ ρ(ε, δ)`` for zCDP) holds exactly for the float that is
returned; :func:`epsilon_for_std` returns the upper end of its bracket, the side on which
``δ(ε) ≤ δ`` holds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import mpmath
from scipy.optimize import brentq
from scipy.special import log_ndtr

Method = Literal["zcdp", "exact"]
METHODS: tuple[str, ...] = ("zcdp", "exact")


class PrivacyBudgetError(ValueError):
    """An impossible or malformed privacy budget / calibration input."""


def check_budget(epsilon: float, delta: float) -> tuple[float, float]:
    """Validate ``ε > 0`` finite and ``δ ∈ (0, 1)``; return them as floats."""
    try:
        eps, dlt = float(epsilon), float(delta)
    except (TypeError, ValueError) as err:
        raise PrivacyBudgetError(f"ε and δ must be numbers, got {epsilon!r}, {delta!r}") from err
    if not math.isfinite(eps) or eps <= 0:
        raise PrivacyBudgetError(f"ε must be a finite number > 0, got {epsilon!r}")
    if not math.isfinite(dlt) or not 0 < dlt < 1:
        raise PrivacyBudgetError(f"δ must lie strictly between 0 and 1, got {delta!r}")
    return eps, dlt


def _check_positive(name: str, value: float) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as err:
        raise PrivacyBudgetError(f"{name} must be a number, got {value!r}") from err
    if not math.isfinite(x) or x <= 0:
        raise PrivacyBudgetError(f"{name} must be a finite number > 0, got {value!r}")
    return x


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise PrivacyBudgetError(f"unknown calibration method {method!r}; use one of {METHODS}")
    return method


def l2_sensitivity(clip: float, sensitivity: float) -> float:
    """``Δ = 2·B_g·max_j ‖c_j‖``: replace-one-datum sensitivity of ``C·G``."""
    return 2.0 * _check_positive("clip norm", clip) * _check_positive("sensitivity", sensitivity)


# -- zCDP (paper 000, Lemma IV.8) ------------------------------------------------------------
def zcdp_rho(epsilon: float, delta: float) -> float:
    """``ρ = (√(ε + ln 1/δ) − √(ln 1/δ))²``: the zCDP level that implies ``(ε, δ)``-DP."""
    eps, dlt = check_budget(epsilon, delta)
    log_term = math.log(1.0 / dlt)
    return (math.sqrt(eps + log_term) - math.sqrt(log_term)) ** 2


def zcdp_epsilon(rho: float, delta: float) -> float:
    """Inverse of :func:`zcdp_rho`: ``ε = ρ + 2·√(ρ·ln 1/δ)``."""
    rho = _check_positive("ρ", rho)
    _, dlt = check_budget(1.0, delta)
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


def _solve_mu(epsilon: float, delta: float) -> float:
    """Largest ``μ = Δ/V`` with ``gaussian_delta(ε, μ) ≤ δ`` (δ grows with μ)."""
    lo, hi = 1e-12, 1.0
    while gaussian_delta(epsilon, hi) < delta:
        hi *= 2.0
        if hi > 1e6:
            raise PrivacyBudgetError("budget too loose to calibrate a Gaussian mechanism")
    return brentq(lambda m: gaussian_delta(epsilon, m) - delta, lo, hi, xtol=1e-14, rtol=1e-13)


#: working precision (decimal digits) of the exact checks
_DPS = 60


def gaussian_delta_exact(epsilon: float, mu: float) -> mpmath.mpf:
    """:func:`gaussian_delta` in ``_DPS``-digit arithmetic, for checks that must not round."""
    with mpmath.workdps(_DPS):
        eps, m = mpmath.mpf(epsilon), mpmath.mpf(mu)
        if m <= 0:
            return mpmath.mpf(0)
        a = m / 2 - eps / m
        b = -m / 2 - eps / m
        return mpmath.ncdf(a) - mpmath.exp(eps) * mpmath.ncdf(b)


def std_satisfies(
    std: float, epsilon: float, delta: float, l2_sens: float, method: str
) -> bool:
    """Whether noise std ``std`` makes a Gaussian mechanism with L2 sensitivity ``l2_sens``
    ``(ε, δ)``-DP, decided in ``_DPS``-digit arithmetic on the exact float inputs."""
    with mpmath.workdps(_DPS):
        mu = mpmath.mpf(l2_sens) / mpmath.mpf(std)
        if method == "zcdp":
            ln = mpmath.log(1 / mpmath.mpf(delta))
            rho_budget = (mpmath.sqrt(mpmath.mpf(epsilon) + ln) - mpmath.sqrt(ln)) ** 2
            return mu * mu / 2 <= rho_budget
        return gaussian_delta_exact(epsilon, mu) <= mpmath.mpf(delta)


def _round_up(std: float, epsilon: float, delta: float, l2_sens: float, method: str) -> float:
    """The smallest float ``≥ std`` (searched upwards) that passes :func:`std_satisfies`."""
    for attempt in range(10_000):
        if std_satisfies(std, epsilon, delta, l2_sens, method):
            return std
        # the float root is within ~1e−13 relative: one ulp at a time, then larger steps
        std = math.nextafter(std, math.inf) if attempt < 64 else std * (1 + 1e-12)
    raise PrivacyBudgetError("could not find a noise std that provably meets the budget")


@dataclass(frozen=True)
class Calibration:
    """The result of a calibration, with everything needed to audit it."""

    std: float  # V, the per-coordinate std of ξ
    epsilon: float
    delta: float
    clip: float  # B_g
    sensitivity: float  # max_j ‖c_j‖ of the mechanism
    l2_sensitivity: float  # Δ = 2·B_g·sensitivity
    method: str  # "zcdp" or "exact"
    mechanism: str = ""
    steps: int = 0

    @property
    def noise_multiplier(self) -> float:
        """``V/Δ``: the std in units of the L2 sensitivity."""
        return self.std / self.l2_sensitivity

    def as_dict(self) -> dict[str, float | str | int]:
        return {**asdict(self), "noise_multiplier": self.noise_multiplier}


def calibrate(
    epsilon: float,
    delta: float,
    clip: float,
    sensitivity: float,
    method: Method = "exact",
    mechanism: str = "",
    steps: int = 0,
) -> Calibration:
    """The noise std ``V`` that makes one learner's whole release ``(ε, δ)``-DP.

    ``sensitivity`` is the mechanism's ``max_j ‖c_j‖`` (see
    :attr:`flwr_corrnoise.mechanisms.Factorization.sensitivity`).
    """
    eps, dlt = check_budget(epsilon, delta)
    method = _check_method(method)  # type: ignore[assignment]
    delta_l2 = l2_sensitivity(clip, sensitivity)
    if method == "zcdp":
        std = delta_l2 / math.sqrt(2.0 * zcdp_rho(eps, dlt))
    else:
        std = delta_l2 / _solve_mu(eps, dlt)
    std = _round_up(std, eps, dlt, delta_l2, method)
    return Calibration(
        std=std,
        epsilon=eps,
        delta=dlt,
        clip=float(clip),
        sensitivity=float(sensitivity),
        l2_sensitivity=delta_l2,
        method=method,
        mechanism=mechanism,
        steps=steps,
    )


def calibrate_mechanism(
    epsilon: float, delta: float, clip: float, mechanism: str, steps: int, method: Method = "exact"
) -> Calibration:
    """:func:`calibrate` for a named mechanism and horizon (builds the factorization)."""
    from .mechanisms import build_factorization

    sens = build_factorization(mechanism, steps).sensitivity
    return calibrate(epsilon, delta, clip, sens, method, mechanism=mechanism, steps=steps)


def epsilon_for_std(
    std: float, delta: float, clip: float, sensitivity: float, method: Method = "exact"
) -> float:
    """The ε that noise std ``V`` buys at ``δ`` (the inverse of :func:`calibrate`)."""
    std = _check_positive("noise std", std)
    _, dlt = check_budget(1.0, delta)
    method = _check_method(method)  # type: ignore[assignment]
    mu = l2_sensitivity(clip, sensitivity) / std
    if method == "zcdp":
        return zcdp_epsilon(mu * mu / 2.0, dlt)
    if gaussian_delta(0.0, mu) <= dlt:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, mu) > dlt:
        hi *= 2.0
    root = brentq(lambda e: gaussian_delta(e, mu) - dlt, 0.0, hi, xtol=1e-13, rtol=1e-13)
    # report the safe side: the smallest ε found with δ(ε) ≤ δ in exact arithmetic
    for _ in range(200):
        if gaussian_delta_exact(root, mu) <= dlt:
            return root
        root += max(abs(root) * 1e-13, 1e-15)
    return hi


def delta_for_std(
    std: float, epsilon: float, clip: float, sensitivity: float
) -> float:
    """The δ that noise std ``V`` gives at ``ε`` (exact; for audits and reports)."""
    eps, _ = check_budget(epsilon, 0.5)
    mu = l2_sensitivity(clip, sensitivity) / _check_positive("noise std", std)
    return gaussian_delta(eps, mu)


def epsilon_spent(
    std: float, delta: float, clip: float, mechanism: str, horizon: int, steps_done: int,
    method: Method = "exact",
) -> float:
    """ε of what a learner has released after ``steps_done`` of its ``horizon`` steps.

    The first ``k`` noisy prefix sums are post-processing of the first rows of ``C·G + ξ``
    released by then, whose sensitivity is
    :meth:`~flwr_corrnoise.mechanisms.Factorization.prefix_sensitivity` (``k``) — never
    more than the full one, so this grows to the calibrated ε at ``k = N``.
    """
    from .mechanisms import build_factorization

    if steps_done <= 0:
        return 0.0
    sens = build_factorization(mechanism, horizon).prefix_sensitivity(min(steps_done, horizon))
    return epsilon_for_std(std, delta, clip, sens, method)
