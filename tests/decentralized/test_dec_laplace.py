"""Laplace sampler, schedules, stream state and pure-ε helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from flwr_corrnoise.cipher_noise import CipherGaussian
from flwr_corrnoise.decentralized.laplace import (
    LaplaceStream,
    ScaleSchedule,
    basic_composition,
    epsilon_of_laplace,
    laplace,
    scale_for_epsilon,
)


def test_laplace_law_mean_variance_ks() -> None:
    rng = CipherGaussian.from_seed(0)
    b = 0.7
    x = laplace(rng, b, 200_000)
    assert abs(x.mean()) < 5 * math.sqrt(2) * b / math.sqrt(x.size)
    assert x.var() == pytest.approx(2 * b * b, rel=0.02)
    assert stats.kstest(x[:20_000], stats.laplace(scale=b).cdf).pvalue > 0.01
    # and it is not a Gaussian of the same variance (the test can fail)
    assert stats.kstest(x[:20_000], stats.norm(scale=math.sqrt(2) * b).cdf).pvalue < 1e-6


def test_per_coordinate_scales_and_zero_scale() -> None:
    rng = CipherGaussian.from_seed(1)
    scales = np.array([0.0, 1.0, 3.0])
    x = laplace(rng, scales, (50_000, 3))
    assert np.all(x[:, 0] == 0)
    assert np.allclose(x[:, 1:].std(axis=0) / np.sqrt(2), [1.0, 3.0], rtol=0.03)
    with pytest.raises(ValueError):
        laplace(rng, -1.0, 3)
    with pytest.raises(ValueError):
        laplace(rng, np.nan, 3)
    with pytest.raises(ValueError):
        laplace(rng, np.ones(4), 3)


def test_schedules() -> None:
    t = np.arange(5)
    s = ScaleSchedule.chen_wang(sigma=2.0, varsigma=0.3)
    assert np.allclose(s.scale(t), 2 / math.sqrt(2) * (t + 1) ** 0.3)
    assert np.allclose(ScaleSchedule("geometric", 0.5, 0.98).scale(t), 0.5 * 0.98**t)
    assert np.allclose(ScaleSchedule("inverse", 0.35).scale(t), 0.35 / (t + 1))
    assert ScaleSchedule("constant", 2.0).scale(3) == 2.0
    with pytest.raises(ValueError):
        ScaleSchedule("cubic", 1.0)
    with pytest.raises(ValueError):
        ScaleSchedule("geometric", 1.0, 1.5)
    with pytest.raises(ValueError):
        ScaleSchedule("power", math.inf, 0.1)


def test_stream_roundtrip_continues_exactly() -> None:
    sched = ScaleSchedule.chen_wang(1.0, 0.1)
    a = LaplaceStream(4, sched, seed=[7, 1])
    first = [a.next() for _ in range(3)]
    b = LaplaceStream.from_bytes(a.to_bytes())
    assert b.step == 3
    assert np.array_equal(a.next(), b.next())
    ref = LaplaceStream(4, sched, seed=[7, 1])
    assert all(np.array_equal(ref.next(), f) for f in first)
    # the noise scale grows as the schedule says
    big = LaplaceStream(1, ScaleSchedule("power", 1.0, 0.5), seed=3, _step=9999)
    assert big.current_scale()[0] == pytest.approx(100.0)
    # zero base = noise off, same draws consumed
    off = LaplaceStream(4, ScaleSchedule.chen_wang(0.0, 0.1), seed=[7, 1])
    on = LaplaceStream(4, sched, seed=[7, 1])
    assert np.all(off.next() == 0) and np.any(on.next() != 0)
    # same position in the generator: the same state, so the next raw draws agree
    assert off.rng.state == on.rng.state
    assert np.array_equal(off.rng.next_laplace(5), on.rng.next_laplace(5))
    with pytest.raises(ValueError):
        LaplaceStream.from_bytes(a.to_bytes()[:-3])


def test_epsilon_helpers_against_density_ratio() -> None:
    # ε = Δ/b is the sup of the log density ratio of Lap(0,b) and Lap(Δ,b): check numerically
    b, delta = 0.8, 1.3
    x = np.linspace(-20, 20, 40001)
    ratio = stats.laplace(scale=b).logpdf(x) - stats.laplace(loc=delta, scale=b).logpdf(x)
    assert epsilon_of_laplace(delta, b) == pytest.approx(np.abs(ratio).max(), rel=1e-9)
    assert scale_for_epsilon(delta, epsilon_of_laplace(delta, b)) == pytest.approx(b)
    assert epsilon_of_laplace(1.0, 0.0) == math.inf and epsilon_of_laplace(0.0, 0.0) == 0.0
    assert basic_composition([0.5, 0.25, 1.0]) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        scale_for_epsilon(1.0, 0.0)
    with pytest.raises(ValueError):
        basic_composition([-1.0])
