"""Privacy calibration: from an ``(ε, δ)`` budget to the noise std ``V``, and back.

The whole release of one learner, ``B(C·G + V·ξ)``, is post-processing of a single
Gaussian mechanism ``C·G + V·ξ`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private
Online Federated Learning With Correlated Noise", eq. (4); Denisov et al. 2022, Thm 2.1 for adaptive
inputs). Replacing one datum of the learner's stream changes one clipped gradient by at most
``2·B_g`` in L2, so the mechanism's L2 sensitivity is ``Δ = 2·B_g·max_j ‖c_j‖`` (paper eq. (15)).

This module is the library's face for that one mechanism; the accounting itself lives in
:mod:`flwr_corrnoise.accounting`. The factorization describes the release
(:meth:`~flwr_corrnoise.mechanisms.Factorization.release`: a
:class:`~flwr_corrnoise.accounting.GaussianRelease`), and one of two accountants computes:

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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from .accounting import (
    GAUSSIAN_ACCOUNTANTS,
    GaussianAccountant,
    GaussianRelease,
    PrivacyBudgetError,
    check_budget,
)
from .accounting import gaussian as _gaussian
from .accounting.base import check_positive
from .accounting.calibration import Calibration
from .accounting.events import replace_one_l2
from .accounting.gaussian import gaussian_delta, gaussian_delta_exact
from .mechanisms.participation import ONCE, Participation, SampledParticipation

if TYPE_CHECKING:
    from .mechanisms.base import Factorization

Method = Literal["zcdp", "exact"]
METHODS: tuple[str, ...] = ("zcdp", "exact")

__all__ = [
    "METHODS",
    "Calibration",
    "Method",
    "Participation",
    "PrivacyBudgetError",
    "accountant",
    "calibrate",
    "calibrate_mechanism",
    "check_budget",
    "delta_for_std",
    "epsilon_for_std",
    "epsilon_spent",
    "gaussian_delta",
    "gaussian_delta_exact",
    "l2_sensitivity",
    "zcdp_epsilon",
    "zcdp_rho",
]


def accountant(method: str) -> GaussianAccountant:
    """The accountant a calibration ``method`` names (``"zcdp"`` or ``"exact"``)."""
    if method not in METHODS:
        raise PrivacyBudgetError(f"unknown calibration method {method!r}; use one of {METHODS}")
    return GAUSSIAN_ACCOUNTANTS[method]


def l2_sensitivity(clip_norm: float, sensitivity: float) -> float:
    """``Δ = 2·B_g·max_j ‖c_j‖``: replace-one-datum sensitivity of ``C·G`` (``B_g`` =
    ``clip_norm``)."""
    return replace_one_l2(clip_norm, sensitivity)


def zcdp_rho(epsilon: float, delta: float) -> float:
    """``ρ = (√(ε + ln 1/δ) − √(ln 1/δ))²``: the zCDP level that implies ``(ε, δ)``-DP."""
    eps, dlt = check_budget(epsilon, delta)
    return _gaussian.zcdp_rho(eps, dlt)


def zcdp_epsilon(rho: float, delta: float) -> float:
    """Inverse of :func:`zcdp_rho`: ``ε = ρ + 2·√(ρ·ln 1/δ)``."""
    rho = check_positive("ρ", rho)
    _, dlt = check_budget(1.0, delta)
    return _gaussian.zcdp_epsilon(rho, dlt)


def calibrate(
    epsilon: float,
    delta: float,
    clip_norm: float,
    sensitivity: float,
    method: Method = "exact",
    mechanism: str = "",
    steps: int = 0,
    participation: str = "each datum once",
    sensitivity_exact: bool = True,
) -> Calibration:
    """The noise std ``V`` that makes one learner's whole release ``(ε, δ)``-DP when each
    datum's gradient is clipped to L2 norm ``clip_norm`` (``B_g``; Flower's DP wrappers
    call it ``clipping_norm``, Opacus ``max_grad_norm``).

    ``sensitivity`` is the mechanism's ``max_j ‖c_j‖`` (see
    :attr:`flwr_corrnoise.mechanisms.Factorization.sensitivity`).
    """
    eps, dlt = check_budget(epsilon, delta)
    acc = accountant(method)
    delta_l2 = l2_sensitivity(clip_norm, sensitivity)
    return Calibration(
        std=acc.noise_std(delta_l2, eps, dlt),
        epsilon=eps,
        delta=dlt,
        clip_norm=float(clip_norm),
        sensitivity=float(sensitivity),
        l2_sensitivity=delta_l2,
        method=method,
        mechanism=mechanism,
        steps=steps,
        participation=participation,
        sensitivity_exact=sensitivity_exact,
    )


def calibrate_mechanism(
    epsilon: float, delta: float, clip_norm: float, mechanism: str, steps: int,
    method: Method = "exact", participation: Participation = ONCE,
    params: Mapping[str, Any] | None = None,
) -> Calibration:
    """:func:`calibrate` for a named mechanism and horizon (builds the factorization, with
    the mechanism's ``params`` if given).

    ``participation`` says how often one datum enters the ``steps`` steps (default: once,
    Zhang et al.'s stream); the sensitivity is the factorization's under it
    (:mod:`flwr_corrnoise.mechanisms.participation`), exact or a certified upper bound.
    """
    from .mechanisms import build_factorization

    return calibrate_factorization(build_factorization(mechanism, steps, **dict(params or {})),
                                   epsilon, delta, clip_norm, method, participation)


def calibrate_factorization(
    fact: Factorization, epsilon: float, delta: float, clip_norm: float,
    method: Method = "exact", participation: Participation = ONCE,
) -> Calibration:
    """**The** calibration of a built factorization: its sensitivity under
    ``participation`` (exact or a certified bound), then :func:`calibrate`. Every caller —
    a learner's settings (:meth:`~flwr_corrnoise.settings.PrivacySettings.calibration`),
    :func:`calibrate_mechanism`, central DP (:func:`~flwr_corrnoise.variants.
    central_calibration`) and the CLI — goes through it, so the chain "factorization →
    sensitivity → noise std" is written once."""
    if isinstance(participation, SampledParticipation):  # the amplified calibration
        from .amplification import CyclicPoissonSampling, calibrate_amplified

        return calibrate_amplified(epsilon, delta, clip_norm,
                                   CyclicPoissonSampling.of(participation, fact.n), fact,
                                   relation=participation.relation)
    sens = fact.participation_sensitivity(participation)
    return calibrate(epsilon, delta, clip_norm, sens.value, method, mechanism=fact.name,
                     steps=fact.n, participation=participation.describe(),
                     sensitivity_exact=sens.exact)


def epsilon_for_std(
    std: float, delta: float, clip_norm: float, sensitivity: float, method: Method = "exact"
) -> float:
    """The ε that noise std ``V`` buys at ``δ`` (the inverse of :func:`calibrate`)."""
    std = check_positive("noise std", std)
    _, dlt = check_budget(1.0, delta)
    acc = accountant(method)
    return acc.epsilon(GaussianRelease(l2_sensitivity(clip_norm, sensitivity), std), dlt)


def delta_for_std(
    std: float, epsilon: float, clip_norm: float, sensitivity: float
) -> float:
    """The δ that noise std ``V`` gives at ``ε`` (exact; for audits and reports)."""
    eps, _ = check_budget(epsilon, 0.5)
    release = GaussianRelease(l2_sensitivity(clip_norm, sensitivity),
                              check_positive("noise std", std))
    return accountant("exact").delta(release, eps)


def epsilon_spent(
    std: float, delta: float, clip_norm: float, mechanism: str, horizon: int, steps_done: int,
    method: Method = "exact", participation: Participation = ONCE,
    params: Mapping[str, Any] | None = None,
) -> float:
    """ε of what a learner has released after ``steps_done`` of its ``horizon`` steps.

    The first ``k`` noisy prefix sums are post-processing of the first rows of ``C·G + ξ``
    released by then, whose sensitivity is
    :meth:`~flwr_corrnoise.mechanisms.Factorization.prefix_sensitivity` (``k``) — never
    more than the full one, so this grows to the calibrated ε at ``k = N``. The
    factorization describes that release (:meth:`~flwr_corrnoise.mechanisms.Factorization.release`)
    and the accountant of ``method`` computes its ε. ``participation``: how often one
    datum enters the stream (the uses before ``steps_done`` count).
    """
    from .mechanisms import build_factorization

    if steps_done <= 0:
        return 0.0
    std = check_positive("noise std", std)
    _, dlt = check_budget(1.0, delta)
    fact = build_factorization(mechanism, horizon, **dict(params or {}))
    if isinstance(participation, SampledParticipation):  # the amplified blocks so far
        from .amplification import CyclicPoissonSampling, epsilon_spent_amplified

        return epsilon_spent_amplified(std, dlt, clip_norm,
                                       CyclicPoissonSampling.of(participation, horizon),
                                       fact.sensitivity, min(steps_done, horizon),
                                       participation.relation)
    acc = accountant(method)
    release = fact.release(
        clip_norm, std, steps=min(steps_done, horizon), participation=participation)
    return acc.epsilon(release, dlt)
