"""The empirical privacy auditor (flwr_corrnoise.audit, `flwr-corrnoise audit`).

Two kinds of check. (1) Every mechanism and variant, run through the library's real private
step with independent noise keys: the empirical ε lower bound stays below the claimed ε,
the release's analytic ε (computed from B and the std of the streams that ran, not from C's
column norms as the calibration does) equals the claim, and the scores have the spread the
claimed noise implies. (2) The auditor can fail: noise a quarter of the calibrated std, or
one noise key for every execution, gives a lower bound above the claim. The statistics
(Clopper–Pearson, the Gaussian ε) are checked against independent computations.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import binom

from flwr_corrnoise.audit import (
    FALSIFIED_EXIT,
    VARIANTS,
    audit,
    clopper_pearson_upper,
    epsilon_from_counts,
    gaussian_epsilon,
)
from flwr_corrnoise.cli import main
from flwr_corrnoise.learner import PrivacySettings
from flwr_corrnoise.mechanisms import MECHANISMS
from flwr_corrnoise.privacy import epsilon_for_std

EPS, DELTA = 2.0, 1e-3

#: the efficient tree's online (Honaker) estimator at step k uses only the tree nodes
#: complete by k and so discards part of C·G + ξ: its release is *less* informative than
#: the mechanism the noise is calibrated for, and its exact ε is below the budget. Every
#: other mechanism's release determines C·G + ξ, so its exact ε is the budget itself.
LOSSY_RELEASE = {"efficient-tree"}


def _spread_ok(res, runs: int) -> None:
    """The scores are N(±μ/2, 1) under the claimed noise: their spread is 1 and their mean
    shift μ, each within 5 standard errors."""
    assert res.score_std == pytest.approx(1.0, abs=5 / math.sqrt(2 * (2 * runs - 2)))
    assert res.mu_empirical == pytest.approx(res.mu, abs=5 * math.sqrt(2 / runs) + 0.01)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_lower_bound_stays_below_the_claim(mechanism: str, variant: str) -> None:
    runs = 160
    res = audit(mechanism, variant=variant, steps=8, epsilon=EPS, delta=DELTA, runs=runs,
                seed=7)
    assert 0.0 <= res.epsilon_lower_bound < EPS
    assert not res.falsified
    assert res.noise_std_run == res.noise_std  # the streams ran with the calibrated std
    if mechanism in LOSSY_RELEASE:
        assert 0.0 < res.epsilon_analytic < EPS * (1 - 1e-3)
    else:  # the calibration, checked by a second computation of μ
        assert res.epsilon_analytic == pytest.approx(EPS, rel=1e-7)
    _spread_ok(res, runs)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mechanism", ["blt", "toeplitz", "independent", "optimized"])
def test_reused_data_the_audit_confirms_the_multi_participation_epsilon(
        mechanism: str, variant: str) -> None:
    """Issue 21: the canary is one datum used in each of 4 epochs (a fixed cyclic order);
    the learner calibrates for that participation. The release's μ, computed from B and the
    canary's footprint (not from C's Gram, as the calibration does), gives exactly the
    claimed ε — the worst pattern's sensitivity, reached — and the runs stay below it. The
    one-pass calibration would have been falsified: its ε for this canary is far above."""
    runs = 160
    res = audit(mechanism, variant=variant, steps=8, epochs=4, epsilon=EPS, delta=DELTA,
                runs=runs, seed=13)
    assert res.epochs == 4 and not res.falsified
    assert 0.0 <= res.epsilon_lower_bound < EPS
    assert res.epsilon_analytic == pytest.approx(EPS, rel=1e-7)
    _spread_ok(res, runs)
    once = PrivacySettings(mechanism=mechanism, epsilon=EPS, delta=DELTA,
                           horizon=8).calibration().std
    if variant == "central":  # the average of min_learners = 2 updates
        once /= 2
    assert res.noise_std > 1.5 * once  # reuse is paid for in noise


def test_the_auditor_has_power_at_its_default_size() -> None:
    """2000 runs: the scores' shift and spread match the claimed Gaussian closely, and the
    Gaussian fit recovers the claimed ε (an estimate, not a bound)."""
    runs = 2000
    res = audit("independent", variant="round", steps=8, runs=runs, seed=11)
    _spread_ok(res, runs)
    assert res.epsilon_gaussian_fit == pytest.approx(EPS, rel=0.35)
    assert res.epsilon_lower_bound < EPS


def test_rounds_of_several_steps_release_less_than_one_step() -> None:
    """τ = 2: the learner releases round means, post-processing of the per-step release,
    so the exact ε of what leaves it is below the budget (still calibrated for steps)."""
    res = audit("blt", variant="step", steps=8, tau=2, runs=100, seed=3)
    assert 0 < res.epsilon_analytic < EPS * 0.9
    assert res.epsilon_lower_bound < EPS
    _spread_ok(res, 100)


def test_secure_noise_passes_the_audit() -> None:
    res = audit("blt", variant="step", steps=8, runs=100, secure=True)
    assert res.epsilon_lower_bound < EPS
    assert res.epsilon_analytic == pytest.approx(EPS, rel=1e-7)
    _spread_ok(res, 100)


@pytest.mark.parametrize("variant", VARIANTS)
def test_too_little_noise_is_caught(variant: str) -> None:
    """A stream at a quarter of the calibrated std (true ε ≈ 11.7): the runs prove ε > 2."""
    res = audit("blt", variant=variant, steps=4, runs=800, noise_scale=0.25, seed=5)
    assert res.falsified and res.epsilon_lower_bound > EPS
    assert res.epsilon_analytic > 10  # the second check sees it too
    assert res.score_std == pytest.approx(0.25, rel=0.15)


@pytest.mark.parametrize("variant", VARIANTS)
def test_noise_that_does_not_vary_is_caught(variant: str) -> None:
    """One noise key for every execution (a learner whose seed is a constant): the noise
    never varies, the canary is seen exactly, ε = ∞ — the runs prove ε > 2."""
    res = audit("toeplitz", variant=variant, steps=4, runs=200, reuse_seed=True, seed=9)
    assert res.falsified and res.epsilon_lower_bound > EPS
    assert res.score_std < 1e-9 and math.isinf(res.epsilon_gaussian_fit)


# -- the statistics, against independent computations ----------------------------------------
def test_clopper_pearson_upper_bound_is_the_binomial_tail() -> None:
    n, sig = 50, 0.025
    for k in (0, 1, 7, 49):
        p = float(clopper_pearson_upper(k, n, sig))
        assert binom.cdf(k, n, p) == pytest.approx(sig, rel=1e-8)
    assert float(clopper_pearson_upper(n, n, sig)) == 1.0
    assert float(clopper_pearson_upper(0, n, sig)) == pytest.approx(1 - sig ** (1 / n))


def test_epsilon_from_perfectly_separated_counts() -> None:
    n, alpha = 100, 0.05
    upper = 1 - (alpha / 2) ** (1 / n)  # closed form for 0 errors out of n
    got = float(epsilon_from_counts(0, 0, n, n, DELTA, alpha))
    assert got == pytest.approx(math.log((1 - DELTA - upper) / upper), rel=1e-9)
    assert float(epsilon_from_counts(n // 2, n // 2, n, n, DELTA, alpha)) < 0  # a coin


@pytest.mark.parametrize("mu", [0.05, 0.4, 0.6919, 1.5, 4.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3, 0.1])
def test_gaussian_epsilon_matches_the_library_inverse(mu: float, delta: float) -> None:
    # epsilon_for_std with clip 1/2, sensitivity μ, std 1 is the library's ε at Δ/V = μ
    expected = epsilon_for_std(1.0, delta, 0.5, mu)
    assert gaussian_epsilon(mu, delta) == pytest.approx(expected, rel=1e-8, abs=1e-10)


# -- the command line ---------------------------------------------------------------------
def test_cli_prints_the_claim_beside_the_lower_bound(capsys) -> None:
    assert main(["audit", "--mechanism", "blt", "--steps", "8", "--runs", "100",
                 "--seed", "1", "--variant", "central"]) == 0
    text = capsys.readouterr().out
    lines = dict(line.split(None, 1) for line in text.strip().splitlines())
    assert float(lines["epsilon_claimed"]) == EPS
    assert 0 <= float(lines["epsilon_lower_bound"]) < EPS
    assert float(lines["epsilon_analytic"]) == pytest.approx(EPS, rel=1e-5)
    assert lines["verdict"].startswith("consistent")
    assert int(lines["runs"]) == 100 and float(lines["alpha"]) == 0.05

    code = main(["audit", "--mechanism", "independent", "--steps", "8", "--runs", "100",
                 "--variant", "round", "--reuse-seed", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == FALSIFIED_EXIT and out["falsified"] is True
    assert out["epsilon_lower_bound"] > out["epsilon_claimed"] == EPS
    assert out["verdict"].startswith("FALSIFIED")


@pytest.mark.parametrize("args", [
    ["--variant", "round", "--tau", "2"],      # one release per round
    ["--steps", "9", "--tau", "2"],            # not whole rounds
    ["--runs", "5"],                           # too few to split
    ["--secure", "--seed", "3"],               # secure noise takes no seed
    ["--epsilon", "-1"],
    ["--canary-step", "8"],                    # outside the horizon
])
def test_bad_audit_input_is_refused(capsys, args: list[str]) -> None:
    assert main(["audit", "--mechanism", "blt", "--steps", "8", *args]) == 2
    assert "error" in capsys.readouterr().err


def test_each_execution_draws_its_own_noise() -> None:
    """Without a seed every execution keys its stream from OS entropy: two audits differ."""
    a = audit("independent", variant="round", steps=4, runs=20)
    b = audit("independent", variant="round", steps=4, runs=20)
    assert not np.isclose(a.mu_empirical, b.mu_empirical, rtol=0, atol=1e-12)
