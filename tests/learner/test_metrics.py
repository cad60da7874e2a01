"""Tests of the logistic losses, round optimum and dynamic regret (flwr_corrnoise.metrics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import expit

from flwr_corrnoise.metrics import _separable_by_lp as separable_by_lp
from flwr_corrnoise.metrics import (
    accuracy,
    dynamic_regret,
    dynamic_regret_curve,
    fit_logistic,
    is_separable,
    logistic_grad,
    logistic_loss,
    round_optimum,
)


def _noisy_data(m: int, d: int, seed: int, flip: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian features, labels from a random linear model with flipped labels, so that
    the data are not separable (m ≫ d)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, d))
    y = np.where(a @ rng.standard_normal(d) >= 0, 1.0, -1.0)
    y[rng.random(m) < flip] *= -1.0
    return a, y


def _newton_minimum(a: np.ndarray, y: np.ndarray, iters: int = 100) -> float:
    """An independent solver: damped Newton with the exact Hessian."""
    x = np.zeros(a.shape[1])
    for _ in range(iters):
        s = expit(-y * (a @ x))
        grad = -(a.T @ (y * s)) / len(y)
        hess = (a.T * (s * (1 - s))) @ a / len(y)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        f0 = logistic_loss(x, a, y)
        while logistic_loss(x - t * step, a, y) > f0 - 0.25 * t * grad @ step and t > 1e-12:
            t *= 0.5
        x = x - t * step
        if np.linalg.norm(grad) < 1e-14:
            break
    return logistic_loss(x, a, y)


def test_loss_at_zero_is_log_two() -> None:
    a, y = _noisy_data(10, 3, seed=0)
    assert logistic_loss(np.zeros(3), a, y) == pytest.approx(math.log(2.0))


def test_loss_hand_computed_and_stable_for_huge_margins() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]])
    y = np.array([1.0, -1.0])
    x = np.array([1.0, 0.5])
    # margins y·⟨x,a⟩ = 1 and −1
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0))) / 2
    assert logistic_loss(x, a, y) == pytest.approx(expected, rel=1e-14)
    big = logistic_loss(1e6 * x, a, y)  # margins ±1e6: loss ≈ (0 + 1e6)/2
    assert math.isfinite(big) and big == pytest.approx(0.5e6, rel=1e-12)
    assert logistic_loss(1e6 * np.array([1.0, -1.0]), a, y) == 0.0


def test_gradient_matches_finite_differences() -> None:
    a, y = _noisy_data(50, 6, seed=1)
    rng = np.random.default_rng(2)
    for _ in range(3):
        x = rng.standard_normal(6)
        h = 1e-6
        numeric = np.array(
            [
                (logistic_loss(x + h * e, a, y) - logistic_loss(x - h * e, a, y)) / (2 * h)
                for e in np.eye(6)
            ]
        )
        np.testing.assert_allclose(logistic_grad(x, a, y), numeric, rtol=1e-6, atol=1e-9)


def test_shape_validation() -> None:
    a, y = _noisy_data(5, 3, seed=0)
    with pytest.raises(ValueError):
        logistic_loss(np.zeros(4), a, y)
    with pytest.raises(ValueError):
        logistic_grad(np.zeros(3), a, y[:-1])
    with pytest.raises(ValueError):
        logistic_loss(np.zeros(3), a[:0], y[:0])


def test_accuracy_treats_zero_as_positive() -> None:
    a = np.array([[1.0], [-1.0], [0.0], [2.0]])
    y = np.array([1.0, -1.0, 1.0, -1.0])
    assert accuracy(np.array([1.0]), a, y) == 0.75
    assert accuracy(np.zeros(1), a, y) == 0.5  # predicts +1 everywhere


def test_separable_round_has_zero_optimum() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((80, 100))  # the paper's n·τ = 80 points in d = 100
    y = np.where(rng.random(80) < 0.5, 1.0, -1.0)  # arbitrary labels: still separable
    assert is_separable(a, y)
    assert round_optimum(a, y) == 0.0
    a2 = rng.standard_normal((200, 5))
    y2 = np.where(a2 @ rng.standard_normal(5) >= 0, 1.0, -1.0)
    assert is_separable(a2, y2) and round_optimum(a2, y2) == 0.0


def test_fast_certificate_agrees_with_the_lp() -> None:
    """The least-squares shortcut must never change the answer of the exact LP test."""
    rng = np.random.default_rng(11)
    seen = set()
    for m, d in [(80, 100), (30, 10), (60, 10), (200, 5), (15, 3)]:
        for _ in range(4):
            a = rng.standard_normal((m, d))
            y = np.where(a @ rng.standard_normal(d) >= 0, 1.0, -1.0)
            y[rng.random(m) < 0.05] *= -1.0
            answer = is_separable(a, y)
            assert answer == separable_by_lp(a, y)
            seen.add(answer)
    assert seen == {True, False}  # both outcomes exercised


def test_non_separable_optimum_matches_newton() -> None:
    for seed in range(3):
        a, y = _noisy_data(300, 5, seed=seed)
        assert not is_separable(a, y)
        value = round_optimum(a, y)
        assert 0.0 < value < math.log(2.0)
        assert value == pytest.approx(_newton_minimum(a, y), abs=1e-9)


def test_non_separable_optimum_hand_computed() -> None:
    # All points equal: with s = ⟨x, a⟩ the loss is (3·log(1+e^−s) + log(1+e^s))/4,
    # minimized at s = ln 3 with value (3·ln(4/3) + ln 4)/4.
    a = np.ones((4, 2))
    y = np.array([1.0, 1.0, 1.0, -1.0])
    assert not is_separable(a, y)
    expected = (3 * math.log(4 / 3) + math.log(4)) / 4
    assert round_optimum(a, y) == pytest.approx(expected, abs=1e-10)


def test_fit_logistic_is_stationary() -> None:
    a, y = _noisy_data(200, 4, seed=5)
    x = fit_logistic(a, y)
    assert np.linalg.norm(logistic_grad(x, a, y)) < 1e-8
    xr = fit_logistic(a, y, l2=0.1)
    assert np.linalg.norm(logistic_grad(xr, a, y) + 0.1 * xr) < 1e-8
    assert np.linalg.norm(xr) < np.linalg.norm(x)


def test_dynamic_regret_hand_computed() -> None:
    # Σ_r τ·(f^r(x^r) − (f^r)*) = 4·((0.7−0) + (0.5−0.1) + (0.4−0.2)) = 5.2
    assert dynamic_regret([0.7, 0.5, 0.4], [0.0, 0.1, 0.2], tau=4) == pytest.approx(5.2)
    np.testing.assert_allclose(
        dynamic_regret_curve([0.7, 0.5, 0.4], [0.0, 0.1, 0.2], tau=4), [2.8, 4.4, 5.2]
    )
    assert dynamic_regret([], [], tau=1) == 0.0


def test_dynamic_regret_equals_eq1_summed_per_datum() -> None:
    """Eq. (1) literally: Σ_r Σ_t (1/n) Σ_i (f_i^{r,t}(x^r) − (f^r)*)."""
    n, tau, rounds, d = 3, 2, 4, 5
    rng = np.random.default_rng(7)
    a = rng.standard_normal((rounds, n, tau, d))
    y = np.where(rng.random((rounds, n, tau)) < 0.5, 1.0, -1.0)
    models = rng.standard_normal((rounds, d))
    literal = 0.0
    means, optima = [], []
    for r in range(rounds):
        flat_a, flat_y = a[r].reshape(-1, d), y[r].reshape(-1)
        opt = round_optimum(flat_a, flat_y)
        for t in range(tau):
            for i in range(n):
                one = logistic_loss(models[r], a[r, i, t][None], y[r, i, t][None])
                literal += (one - opt) / n
        means.append(logistic_loss(models[r], flat_a, flat_y))
        optima.append(opt)
    assert dynamic_regret(means, optima, tau) == pytest.approx(literal, rel=1e-12)


def test_dynamic_regret_validation() -> None:
    with pytest.raises(ValueError):
        dynamic_regret([0.1, 0.2], [0.0], tau=1)
    with pytest.raises(ValueError):
        dynamic_regret([0.1], [0.0], tau=0)
