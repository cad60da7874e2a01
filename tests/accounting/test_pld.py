"""The PLD accountant (flwr_corrnoise/accounting/pld.py) against an independent computation:
``dp_accounting``'s PLD on the same events, for both neighbouring relations, and the exact
analytic Gaussian (Balle & Wang 2018) where there is no subsampling."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest

from flwr_corrnoise.accounting import (
    AnalyticGaussianAccountant,
    Composed,
    GaussianRelease,
    NoRelease,
    PrivacyBudgetError,
    SelfComposed,
)
from flwr_corrnoise.accounting.events import WorstCase
from flwr_corrnoise.accounting.pld import (
    ADD_REMOVE,
    REPLACE_ONE,
    PLDAccountant,
    PoissonSubsampledGaussian,
    PrivacyLoss,
    calibrate_noise_multiplier,
    dpsgd_event,
    subsampled_gaussian_pld,
)

DPA_RELATION = {REPLACE_ONE: dpa.NeighboringRelation.REPLACE_ONE,
                ADD_REMOVE: dpa.NeighboringRelation.ADD_OR_REMOVE_ONE}
GRID = 1e-3  # coarser than the default 1e-4, the same on both sides: seconds per test


def dpa_epsilon(relation: str, q: float, sigma: float, k: int, delta: float,
                grid: float = GRID) -> float:
    acc = dpa.pld.PLDAccountant(DPA_RELATION[relation], value_discretization_interval=grid)
    acc.compose(dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), k))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("relation", [REPLACE_ONE, ADD_REMOVE])
@pytest.mark.parametrize(("q", "sigma", "k"), [
    (0.01, 0.8, 100), (0.01, 2.0, 1), (0.2, 0.7, 1), (0.2, 2.0, 100),
    (1.0, 0.9, 1), (1.0, 4.0, 30), (0.05, 1.1, 400),
])
def test_epsilon_equals_dp_accounting(relation: str, q: float, sigma: float, k: int) -> None:
    ours = PLDAccountant(relation, GRID).epsilon(dpsgd_event(q, sigma, k), 1e-5)
    assert ours == pytest.approx(dpa_epsilon(relation, q, sigma, k, 1e-5), rel=1e-6)


@pytest.mark.parametrize("relation", [REPLACE_ONE, ADD_REMOVE])
def test_delta_equals_dp_accounting(relation: str) -> None:
    q, sigma, k = 0.04, 1.0, 200
    acc = dpa.pld.PLDAccountant(DPA_RELATION[relation], value_discretization_interval=GRID)
    acc.compose(dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), k))
    ours = PLDAccountant(relation, GRID)
    for eps in (0.5, 1.5, 4.0):
        assert ours.delta(dpsgd_event(q, sigma, k), eps) == pytest.approx(
            acc.get_delta(eps), rel=1e-6)


def test_default_grid_equals_dp_accounting() -> None:
    """At the default η = 10⁻⁴ too (the grid a calibration uses)."""
    for relation in (REPLACE_ONE, ADD_REMOVE):
        ours = PLDAccountant(relation).epsilon(dpsgd_event(0.05, 1.0, 100), 1e-6)
        assert ours == pytest.approx(dpa_epsilon(relation, 0.05, 1.0, 100, 1e-6, 1e-4),
                                     rel=1e-6)


@pytest.mark.parametrize(("relation", "sensitivity"), [(REPLACE_ONE, 2.0), (ADD_REMOVE, 1.0)])
@pytest.mark.parametrize(("sigma", "k"), [(0.8, 1), (5.0, 10), (20.0, 1000)])
def test_unsampled_equals_the_exact_gaussian(relation: str, sensitivity: float, sigma: float,
                                             k: int) -> None:
    """q = 1: k Gaussian steps are one Gaussian mechanism of μ = s·√k/σ (s = 2 for
    replace-one, the library's 2·B_g, 1 for add/remove); the PLD is above the exact ε (it
    is pessimistic) and within 10⁻⁶ of it at the default grid."""
    exact = AnalyticGaussianAccountant().epsilon(
        GaussianRelease(sensitivity * math.sqrt(k), sigma), 1e-5)
    ours = PLDAccountant(relation).epsilon(dpsgd_event(1.0, sigma, k), 1e-5)
    assert exact <= ours <= exact * (1 + 1e-6)
    # the same Gaussian release handed over as such
    release = GaussianRelease(sensitivity * math.sqrt(k), sigma)
    assert PLDAccountant(relation).epsilon(release, 1e-5) == pytest.approx(exact, rel=1e-6)


def test_delta_is_pessimistic_against_the_exact_gaussian() -> None:
    """Connect-the-dots is the chord of the true δ(e^ε): above it between grid points,
    equal (to rounding) on them."""
    release = GaussianRelease(2.0, 1.3)
    acc = PLDAccountant(REPLACE_ONE, GRID)
    for eps in (0.1, 0.7, 0.7005, 2.0, 5.0):
        exact = AnalyticGaussianAccountant().delta(release, eps)
        assert exact * (1 - 1e-12) <= acc.delta(release, eps) <= exact * 1.01 + 1e-15


def test_compositions_and_worst_cases() -> None:
    """A composition of different events equals dp_accounting's; a worst case is its worst
    case; nothing released costs nothing."""
    acc = PLDAccountant(ADD_REMOVE, GRID)
    mixed = Composed((dpsgd_event(0.1, 1.0, 30), dpsgd_event(0.02, 0.8, 50),
                      GaussianRelease(1.0, 3.0)))
    ref = dpa.pld.PLDAccountant(DPA_RELATION[ADD_REMOVE], value_discretization_interval=GRID)
    ref.compose(dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 30),
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(0.8)), 50),
        dpa.GaussianDpEvent(3.0)]))
    assert acc.epsilon(mixed, 1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-5)
    worse, better = dpsgd_event(0.1, 1.0, 30), dpsgd_event(0.1, 2.0, 30)
    assert acc.epsilon(WorstCase((better, worse)), 1e-5) == acc.epsilon(worse, 1e-5)
    assert acc.epsilon(NoRelease(), 1e-5) == 0.0
    assert acc.epsilon(SelfComposed(worse, 0), 1e-5) == 0.0


def test_self_composition_equals_repeated_composition() -> None:
    single = subsampled_gaussian_pld(0.1, 1.0, ADD_REMOVE, GRID)
    repeated = single.compose(single).compose(single)
    assert repeated.epsilon(1e-5) == pytest.approx(single.self_compose(3).epsilon(1e-5),
                                                   rel=1e-9)


def test_directions() -> None:
    """Add/remove composes its two dominating pairs separately (remove is the worse one
    here); replace-one has one symmetric pair; with q = 1 add and remove coincide."""
    assert len(subsampled_gaussian_pld(0.1, 1.0, ADD_REMOVE, GRID).directions) == 2
    assert len(subsampled_gaussian_pld(1.0, 1.0, ADD_REMOVE, GRID).directions) == 1
    assert len(subsampled_gaussian_pld(0.1, 1.0, REPLACE_ONE, GRID).directions) == 1
    # replace-one costs more than add/remove for the same σ (its shift is 2 wide at q = 1)
    event = dpsgd_event(0.1, 1.0, 50)
    assert PLDAccountant(REPLACE_ONE, GRID).epsilon(event, 1e-5) > \
        PLDAccountant(ADD_REMOVE, GRID).epsilon(event, 1e-5)
    # the labels
    assert PLDAccountant(REPLACE_ONE).name == "pld (replace-one)"
    assert PLDAccountant(ADD_REMOVE).name == "pld (add-remove)"


@pytest.mark.parametrize("direction", ["remove", "add", "replace"])
@pytest.mark.parametrize("q", [0.01, 0.3, 1.0])
def test_inverse_loss(direction: str, q: float) -> None:
    """The closed-form inverse of each pair's privacy loss (what the interval masses are
    computed from) inverts the loss."""
    loss = PrivacyLoss(direction, q, 0.9)  # type: ignore[arg-type]
    x = np.linspace(-6.0, 6.0, 41)
    np.testing.assert_allclose(loss.inverse(loss.loss(x)), x, rtol=1e-7, atol=1e-7)
    assert np.all(np.diff(loss.loss(x)) < 0)  # decreasing: the intervals are well defined


@pytest.mark.parametrize("relation", [REPLACE_ONE, ADD_REMOVE])
def test_calibration_equals_dp_accounting(relation: str) -> None:
    """The smallest σ meeting (ε, δ) equals dp_accounting's calibration, meets the budget,
    and a σ smaller by rtol does not."""
    eps, delta, q, k = 2.0, 1e-5, 0.05, 60
    sigma = calibrate_noise_multiplier(eps, delta, q, k, relation, GRID, rtol=1e-5)
    ref = dpa.calibrate_dp_mechanism(
        lambda: dpa.pld.PLDAccountant(DPA_RELATION[relation],
                                      value_discretization_interval=GRID),
        lambda s: dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)),
                                          k),
        eps, delta, bracket_interval=dpa.ExplicitBracketInterval(sigma * 0.99, sigma * 1.01),
        tol=1e-6)
    assert sigma == pytest.approx(ref, rel=2e-5)
    acc = PLDAccountant(relation, GRID)
    assert acc.epsilon(dpsgd_event(q, sigma, k), delta) <= eps
    assert acc.epsilon(dpsgd_event(q, sigma * (1 - 2e-5), k), delta) > eps


def test_refusals() -> None:
    for bad in (0.0, -0.1, 1.5, math.nan):
        with pytest.raises(PrivacyBudgetError):
            PoissonSubsampledGaussian(bad, 1.0)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(PrivacyBudgetError):
            PoissonSubsampledGaussian(0.1, bad)
    with pytest.raises(PrivacyBudgetError, match="relation"):
        PLDAccountant("zero-out")
    with pytest.raises(PrivacyBudgetError):
        calibrate_noise_multiplier(1.0, 1e-5, 0.1, 0)
    from flwr_corrnoise.accounting import LaplaceRelease

    assert not PLDAccountant().supports(LaplaceRelease(1.0, 1.0))
    assert PLDAccountant().supports(dpsgd_event(0.1, 1.0, 3))
