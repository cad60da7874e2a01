"""Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021) in the local-DP setting:
its calibration against independent accountants, the closed form of the composition, the
clip-norm update, and its state."""

from __future__ import annotations

import itertools
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from flwr_corrnoise.accounting import PrivacyBudgetError
from flwr_corrnoise.accounting.gaussian import solve_mu
from flwr_corrnoise.adaptive_clipping import (
    DEFAULT_COUNT_SHARE,
    AdaptiveClipping,
    AdaptiveClipState,
    adaptive_release,
    calibrate_adaptive,
    epsilon_spent_adaptive,
)
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.mechanisms.participation import ONCE, Participation
from flwr_corrnoise.privacy import accountant, calibrate_factorization

CASES = [  # mechanism, horizon, participation, ε, δ, count noise
    ("blt", 64, ONCE, 2.0, 1e-5, None),
    ("toeplitz", 48, Participation.epochs(3, 16), 4.0, 1e-6, None),
    ("independent", 40, Participation.min_separation(1, 5), 1.0, 1e-5, 12.0),
]


def _dp_accounting_events(cal, sigma_b: float, uses: int) -> dpa.DpEvent:
    """The same release as dp_accounting reads it: one Gaussian of noise multiplier
    V/Δ (the matrix mechanism at unit clip) and ``uses`` Gaussians of sensitivity 1 and
    std σ_b (a datum's counts)."""
    return dpa.ComposedDpEvent([
        dpa.GaussianDpEvent(cal.std / cal.l2_sensitivity),
        dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma_b), uses)])


@pytest.mark.parametrize(("mech", "n", "part", "eps", "delta", "noise"), CASES)
def test_epsilon_is_dp_accountings_on_the_same_composed_events(mech, n, part, eps, delta,
                                                                noise) -> None:
    fact = build_factorization(mech, n)
    cal, sigma_b = calibrate_adaptive(fact, eps, delta, AdaptiveClipping(0.5, 0.01, noise),
                                      participation=part)
    uses = part.participations(n)
    ours = accountant("exact").epsilon(adaptive_release(fact, cal.std, sigma_b, part), delta)
    assert ours <= eps * (1 + 1e-9)
    assert ours == pytest.approx(eps, rel=1e-6)  # the budget is spent, not wasted
    event = _dp_accounting_events(cal, sigma_b, uses)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(event)
    assert pld.get_epsilon(delta) == pytest.approx(eps, rel=5e-3)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(event)
    assert rdp.get_epsilon(delta) >= eps * (1 - 1e-6)  # RDP is an upper bound: never below


@pytest.mark.parametrize(("mech", "n", "part", "eps", "delta", "noise"), CASES)
def test_mu_squared_adds_closed_form(mech, n, part, eps, delta, noise) -> None:
    """μ_g² + k/σ_b² = μ(ε, δ)², and without a given σ_b the counts take the default
    share of it; the gradient noise is the fixed-clip one at unit clip, larger by
    1/√(1 − share)."""
    fact = build_factorization(mech, n)
    cal, sigma_b = calibrate_adaptive(fact, eps, delta, AdaptiveClipping(0.5, 0.01, noise),
                                      participation=part)
    mu = solve_mu(eps, delta)
    k = part.participations(n)
    mu_g2, mu_b2 = (cal.l2_sensitivity / cal.std) ** 2, k / sigma_b**2
    assert mu_g2 + mu_b2 == pytest.approx(mu * mu, rel=1e-9)
    fixed = calibrate_factorization(fact, eps, delta, 1.0, "exact", part)
    assert cal.l2_sensitivity == pytest.approx(2 * fact.participation_sensitivity(part).value)
    if noise is None:
        assert mu_b2 / (mu * mu) == pytest.approx(DEFAULT_COUNT_SHARE, rel=1e-9)
        assert cal.std / fixed.std == pytest.approx(1 / math.sqrt(1 - DEFAULT_COUNT_SHARE),
                                                    rel=1e-9)
    else:
        assert sigma_b == noise


def test_zcdp_calibration_holds_on_the_composed_event() -> None:
    fact = build_factorization("toeplitz", 32)
    cal, sigma_b = calibrate_adaptive(fact, 2.0, 1e-5, AdaptiveClipping(), method="zcdp")
    rho = 0.5 * ((cal.l2_sensitivity / cal.std) ** 2 + 1 / sigma_b**2)
    assert accountant("zcdp").satisfies(adaptive_release(fact, cal.std, sigma_b, ONCE),
                                        2.0, 1e-5)
    assert rho == pytest.approx((math.sqrt(2 + math.log(1e5)) - math.sqrt(math.log(1e5))) ** 2,
                                rel=1e-9)


def test_epsilon_spent_grows_to_the_budget() -> None:
    fact = build_factorization("toeplitz", 40)
    part = Participation.epochs(2, 20)
    cal, sigma_b = calibrate_adaptive(fact, 2.0, 1e-5, AdaptiveClipping(), participation=part)
    spent = [epsilon_spent_adaptive(fact, cal.std, sigma_b, 1e-5, "exact", part, s)
             for s in (0, 1, 10, 21, 40)]
    assert spent[0] == 0.0
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(spent))
    assert spent[-1] == pytest.approx(2.0, rel=1e-6)
    # after one step: one count (sensitivity 1) and the first row of C, by hand
    mu1 = math.hypot(2 * fact.prefix_sensitivity(1) / cal.std, 1 / sigma_b)
    from flwr_corrnoise.accounting import GaussianRelease
    assert spent[1] == pytest.approx(
        accountant("exact").epsilon(GaussianRelease(mu1, 1.0), 1e-5), rel=1e-9)


def test_count_noise_that_spends_the_budget_is_refused() -> None:
    fact = build_factorization("toeplitz", 16)
    with pytest.raises(PrivacyBudgetError, match="whole budget"):
        calibrate_adaptive(fact, 0.5, 1e-5, AdaptiveClipping(noise=0.5))


@pytest.mark.parametrize("bad", [dict(quantile=0.0), dict(quantile=1.0), dict(lr=0.0),
                                 dict(lr=float("inf")), dict(noise=-1.0)])
def test_bad_settings_are_refused(bad) -> None:
    with pytest.raises(PrivacyBudgetError):
        AdaptiveClipping(**bad)


def test_lr_or_noise_without_a_quantile_is_refused() -> None:
    assert AdaptiveClipping.from_config(None, None, None) is None
    with pytest.raises(PrivacyBudgetError, match="quantile"):
        AdaptiveClipping.from_config(None, 0.1, None)


def test_update_is_geometric_and_uses_the_step_row() -> None:
    state = AdaptiveClipState.create(2.0, seed=7)
    ada = AdaptiveClipping(quantile=0.3, lr=0.1)
    z = state.count_normal(5)
    assert z == AdaptiveClipState.create(2.0, seed=7).count_normal(5)  # a function of (key, t)
    assert z == float(state.generator.row(0, 256)[5])  # element t mod 256 of row t // 256
    assert state.count_normal(300) == float(state.generator.row(1, 256)[44])
    new = state.update(unclipped=3, examples=4, step=5, adaptive=ada, sigma_b=2.0)
    assert new == pytest.approx(2.0 * math.exp(-0.1 * ((3 + 2.0 * z) / 4 - 0.3)), rel=1e-12)
    other = AdaptiveClipState.create(2.0, seed=8)
    assert other.count_normal(5) != z
    fresh = [AdaptiveClipState.create(1.0, None).generator.key for _ in range(3)]
    assert len(set(fresh)) == 3 and all(k.bit_length() > 64 for k in fresh)


def test_payload_round_trip_and_missing_state() -> None:
    state = AdaptiveClipState.create(0.5, seed=3)
    state.update(1, 1, 0, AdaptiveClipping(), 1.0)
    back = AdaptiveClipState.from_payload(state.to_payload())
    assert back.log_clip == state.log_clip and back.log_initial == state.log_initial
    assert back.count_normal(9) == state.count_normal(9)
    with pytest.raises(ValueError, match="adaptive"):
        AdaptiveClipState.from_payload({})


def test_clip_norm_tracks_the_quantile() -> None:
    """One datum a step, norms ~ |N(0, 4)|: the clip norm settles near the γ-quantile of
    the norms (the fixed point of E[b̄] = γ), from far above and far below."""
    rng = np.random.default_rng(0)
    from scipy.stats import halfnorm
    ada = AdaptiveClipping(quantile=0.7, lr=0.02)
    target = halfnorm.ppf(0.7, scale=2.0)
    for start in (100.0, 0.01):
        state = AdaptiveClipState.create(start, seed=11)
        tail = []
        for t in range(6000):
            norm = abs(rng.normal(0, 2.0))
            state.update(float(norm <= state.clip_norm), 1, t, ada, sigma_b=1.0)
            if t >= 4000:
                tail.append(state.clip_norm)
        assert np.median(tail) == pytest.approx(target, rel=0.15)
