"""Calibration checked against independent computations: the paper's closed form, a
numerical integral of the privacy-loss distribution, and dp_accounting's PLD accountant."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.privacy import (
    PrivacyBudgetError,
    calibrate,
    calibrate_mechanism,
    delta_for_std,
    epsilon_for_std,
    epsilon_spent,
    gaussian_delta,
    zcdp_rho,
)

BUDGETS = [(0.5, 1e-3), (2.0, 1e-3), (1.0, 1e-5), (8.0, 1e-6), (0.1, 0.1)]


def delta_by_integration(epsilon: float, mu: float) -> float:
    """δ(ε) = E[(1 − e^{ε − L})₊] with the privacy loss L ~ N(μ²/2, μ²) (Gaussian PLD)."""
    m, s = mu * mu / 2, mu

    def integrand(x: float) -> float:
        return max(0.0, 1.0 - math.exp(epsilon - x)) * stats.norm.pdf(x, m, s)

    value, _ = integrate.quad(integrand, epsilon, m + 40 * s, limit=500, epsabs=1e-15)
    return value


@pytest.mark.parametrize(("eps", "delta"), BUDGETS)
def test_zcdp_matches_lemma_iv8(eps: float, delta: float) -> None:
    clip, sens = 0.7, 3.3
    rho = (math.sqrt(eps + math.log(1 / delta)) - math.sqrt(math.log(1 / delta))) ** 2
    cal = calibrate(eps, delta, clip, sens, method="zcdp")
    assert cal.std**2 == pytest.approx(2 * clip**2 * sens**2 / rho, rel=1e-12)
    assert zcdp_rho(eps, delta) == pytest.approx(rho)
    assert cal.method == "zcdp"


@pytest.mark.parametrize(("eps", "delta"), BUDGETS)
def test_exact_matches_independent_integration(eps: float, delta: float) -> None:
    cal = calibrate(eps, delta, 1.0, 2.0, method="exact")
    mu = cal.l2_sensitivity / cal.std
    assert delta_by_integration(eps, mu) == pytest.approx(delta, rel=1e-5)
    assert gaussian_delta(eps, mu) == pytest.approx(delta, rel=1e-9)


@pytest.mark.parametrize(("eps", "delta"), [(0.5, 1e-3), (2.0, 1e-3), (1.0, 1e-5)])
def test_exact_matches_dp_accounting_pld(eps: float, delta: float) -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    cal = calibrate(eps, delta, 1.0, 1.0, method="exact")
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=cal.noise_multiplier))
    assert acc.get_epsilon(delta) == pytest.approx(eps, rel=2e-3)
    # and the zCDP calibration is looser according to the accountant too
    loose = calibrate(eps, delta, 1.0, 1.0, method="zcdp")
    acc2 = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc2.compose(dp_accounting.GaussianDpEvent(noise_multiplier=loose.noise_multiplier))
    assert acc2.get_epsilon(delta) < eps


@pytest.mark.parametrize("eps", np.geomspace(0.01, 20, 15))
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 1e-3, 0.2])
def test_exact_never_looser_than_zcdp(eps: float, delta: float) -> None:
    exact = calibrate(eps, delta, 1.0, 1.0, method="exact")
    zcdp = calibrate(eps, delta, 1.0, 1.0, method="zcdp")
    assert exact.std <= zcdp.std


@pytest.mark.parametrize("method", ["zcdp", "exact"])
@pytest.mark.parametrize(("eps", "delta"), BUDGETS)
def test_inverse_recovers_epsilon(method: str, eps: float, delta: float) -> None:
    cal = calibrate(eps, delta, 1.3, 1.9, method=method)  # type: ignore[arg-type]
    back = epsilon_for_std(cal.std, delta, 1.3, 1.9, method=method)  # type: ignore[arg-type]
    assert back == pytest.approx(eps, rel=1e-8)
    if method == "exact":
        assert delta_for_std(cal.std, eps, 1.3, 1.9) == pytest.approx(delta, rel=1e-8)


def test_noise_scales_with_clip_and_sensitivity() -> None:
    base = calibrate(2.0, 1e-3, 1.0, 1.0).std
    assert calibrate(2.0, 1e-3, 3.0, 1.0).std == pytest.approx(3 * base)
    assert calibrate(2.0, 1e-3, 1.0, 2.5).std == pytest.approx(2.5 * base)


def test_calibrate_mechanism_uses_its_sensitivity() -> None:
    cal = calibrate_mechanism(2.0, 1e-3, 1.0, "tree", 1000)
    assert cal.sensitivity == pytest.approx(math.sqrt(10))
    assert cal.std == pytest.approx(calibrate(2.0, 1e-3, 1.0, math.sqrt(10)).std)


def test_epsilon_spent_grows_to_budget() -> None:
    cal = calibrate_mechanism(2.0, 1e-3, 1.0, "toeplitz", 64)
    spent = [epsilon_spent(cal.std, 1e-3, 1.0, "toeplitz", 64, k) for k in range(0, 65, 8)]
    assert spent[0] == 0.0
    assert np.all(np.diff(spent) > 0)
    assert spent[-1] == pytest.approx(2.0, rel=1e-8)
    # after one step only column entry h(0) = 1 has been released
    one = epsilon_spent(cal.std, 1e-3, 1.0, "toeplitz", 64, 1)
    assert one == pytest.approx(epsilon_for_std(cal.std, 1e-3, 1.0, 1.0))
    assert build_factorization("toeplitz", 64).prefix_sensitivity(1) == 1.0


@pytest.mark.parametrize(
    ("eps", "delta"),
    [(0, 1e-3), (-1, 1e-3), (float("nan"), 1e-3), (float("inf"), 1e-3), (1, 0), (1, 1),
     (1, -0.1), (1, float("nan")), ("a", 1e-3)],
)
def test_invalid_budget_raises(eps: object, delta: object) -> None:
    with pytest.raises(PrivacyBudgetError):
        calibrate(eps, delta, 1.0, 1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("clip", [0, -1, float("nan"), float("inf")])
def test_invalid_clip_raises(clip: float) -> None:
    with pytest.raises(PrivacyBudgetError, match="clip"):
        calibrate(1.0, 1e-3, clip, 1.0)


def test_unknown_method_raises() -> None:
    with pytest.raises(PrivacyBudgetError, match="method"):
        calibrate(1.0, 1e-3, 1.0, 1.0, method="rdp")  # type: ignore[arg-type]
