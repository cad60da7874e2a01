"""The empirical privacy auditor (flwr_corrnoise.audit, `flwr-corrnoise audit`).

Two kinds of check. (1) Every mechanism and variant, run through the library's real private
step with independent noise keys: the empirical ε lower bound stays below the claimed ε,
the noise that ran passes the law check, the release's analytic ε (computed from B and the
std of the streams that ran, not from C's column norms as the calibration does) equals the
claim, and the claimed-law scores have the spread the claimed noise implies — also with
reused data (fixed epochs, min-sep), float32 streams and every step front end. (2) The
auditor can fail, and does on every injected fault: no noise at one step (with and without
the canary placed there), a quarter of the calibrated std, one noise key for every
execution, one-pass accounting on a 4-epoch loop. The statistics (Clopper–Pearson, the
Gaussian ε, the law check's edges) are checked against independent computations.
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
    law_check,
)
from flwr_corrnoise.cli import main
from flwr_corrnoise.mechanisms import MECHANISMS
from flwr_corrnoise.privacy import epsilon_for_std
from flwr_corrnoise.settings import PrivacySettings

EPS, DELTA = 2.0, 1e-3

#: the efficient tree's online (Honaker) estimator at step k uses only the tree nodes
#: complete by k and so discards part of C·G + ξ: its release is *less* informative than
#: the mechanism the noise is calibrated for, and its exact ε is below the budget. Every
#: other mechanism's release determines C·G + ξ, so its exact ε is the budget itself.
LOSSY_RELEASE = {"efficient-tree"}


def _spread_ok(res, runs: int) -> None:
    """The claimed-law scores are N(±μ/2, 1) under the claimed noise: their spread is 1 and
    their mean shift the canary's μ, each within 5 standard errors; and the noise that ran
    passes the law check."""
    assert res.score_std == pytest.approx(1.0, abs=5 / math.sqrt(2 * (2 * runs - 2)))
    assert res.mu_empirical == pytest.approx(res.mu_canary,
                                             abs=5 * math.sqrt(2 / runs) + 0.01)
    assert not res.law_rejected
    assert res.law_lower_edge <= res.law_min_eigenvalue <= res.law_max_eigenvalue \
        <= res.law_upper_edge


def _caught(res) -> None:
    """The auditor fails the run: the verdict, and the CLI's exit status with it."""
    assert res.falsified
    assert res.verdict.startswith("FALSIFIED")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_lower_bound_stays_below_the_claim(mechanism: str, variant: str) -> None:
    runs = 160
    res = audit(mechanism, variant=variant, steps=8, epsilon=EPS, delta=DELTA, runs=runs,
                seed=7)
    assert 0.0 <= res.epsilon_lower_bound < EPS
    assert not res.falsified and res.verdict.startswith("consistent")
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
    _caught(res)
    assert res.epsilon_lower_bound > EPS  # the runs, and the law check, each see it
    assert res.law_rejected and res.law_max_eigenvalue < res.law_lower_edge
    assert res.epsilon_analytic > 10  # the analytic check sees it too
    assert res.score_std == pytest.approx(0.25, rel=0.15)


def test_half_the_noise_is_caught_by_the_law_check() -> None:
    """Half the calibrated std (true ε ≈ 4.7): 160 runs cannot prove ε > 2 from the
    releases' separation, but every whitened eigenvalue sits near 1/4, far below the
    edge the claimed law allows: the law is rejected, and the run fails."""
    res = audit("blt", variant="round", steps=8, runs=160, noise_scale=0.5, seed=3)
    assert res.epsilon_lower_bound < EPS  # the bound alone misses it at this size
    _caught(res)
    assert res.law_rejected and res.law_min_eigenvalue < res.law_lower_edge
    assert "less noise than claimed" in res.verdict


@pytest.mark.parametrize("variant", VARIANTS)
def test_noise_that_does_not_vary_is_caught(variant: str) -> None:
    """One noise key for every execution (a learner whose seed is a constant): the noise
    never varies, the canary is seen exactly, ε = ∞ — the runs prove ε > 2."""
    res = audit("toeplitz", variant=variant, steps=4, runs=200, reuse_seed=True, seed=9)
    _caught(res)
    assert res.epsilon_lower_bound > EPS and res.law_rejected
    assert res.score_std < 1e-9 and math.isinf(res.epsilon_gaussian_fit)


# -- the faults the claimed-law statistic missed ---------------------------------------------
#: (variant, front end, dtype): every code path the fault is injected into
PATHS = [("step", "local-round", "float64"), ("step", "private-step", "float64"),
         ("step", "local-round", "float32"), ("round", "local-round", "float64"),
         ("round", "local-round", "float32"), ("central", "local-round", "float64")]


@pytest.mark.parametrize("given", [False, True], ids=["found", "given"])
@pytest.mark.parametrize(("variant", "front_end", "dtype"), PATHS)
def test_no_noise_at_one_step_is_caught(variant: str, front_end: str, dtype: str,
                                        given: bool) -> None:
    """The increment of step 5 of 8 zeroed in the learner's real stream (true ε = ∞). The
    statistic that whitened with the claimed covariance passed this (bound 0.4–0.6, even
    with the canary at step 5). Now phase 1 shows a direction without noise, the canary
    goes there (or is put there) and the runs separate D and D' perfectly: the bound is
    ln((1 − δ − u)/u), u the Clopper–Pearson bound on 0 errors; the law check rejects too.
    The analytic check reads the stream's parameters and cannot see it."""
    # 200 runs: 100 evaluate the chosen test, and 0 errors in 100 bound ε at ≈ 3.1 > 3
    res = audit("blt", variant=variant, front_end=front_end, dtype=dtype, steps=8, runs=200,
                noise_runs=200, seed=21, zero_noise_step=5, canary_step=5 if given else None)
    _caught(res)
    assert res.canary_step == 5 and res.zero_noise_step == 5
    assert res.false_positives == res.false_negatives == 0
    u = 1 - (res.alpha / 4) ** (1 / res.evaluation_runs)
    assert res.epsilon_lower_bound == pytest.approx(math.log((1 - DELTA - u) / u), rel=1e-9)
    assert res.epsilon_lower_bound > 3 * EPS / 2
    assert res.law_rejected and res.law_min_eigenvalue < 1e-6 < res.law_lower_edge
    # from the stream's parameters: the claim (worst first use; ≤ it at the given one)
    assert res.epsilon_analytic <= EPS * (1 + 1e-7)
    if not given:
        assert res.epsilon_analytic == pytest.approx(EPS, rel=1e-7)


def test_no_noise_at_one_step_fails_the_command(capsys) -> None:
    code = main(["audit", "--mechanism", "toeplitz", "--variant", "round", "--steps", "8",
                 "--runs", "300", "--seed", "4", "--zero-noise-step", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == FALSIFIED_EXIT and out["falsified"] and out["law_rejected"]
    assert out["canary_step"] == out["zero_noise_step"] == 2
    assert out["verdict"].startswith("FALSIFIED") and "less noise" in out["verdict"]


def test_one_pass_accounting_on_a_four_epoch_loop_is_caught() -> None:
    """Settings that declare each datum once on a loop that uses it in 4 epochs: the noise
    is the one-pass calibration's and follows its law (the law check passes), but the
    canary moves 4 releases: true ε ≈ 7.0 for a claim of 2. The runs prove ε > 2 (at 3000
    runs the bound is 3.0 ± 0.3 for this μ: a miss is a 3.5σ event, and the seed is
    fixed); the analytic check, from B and the 4-use footprint, gives the true ε."""
    res = audit("toeplitz", variant="round", steps=8, epochs=4, accounted_epochs=1,
                runs=3000, noise_runs=500, seed=2)
    _caught(res)
    assert res.exceeds_claim and not res.law_rejected
    assert res.participation == "each datum once" and res.accounted_epochs == 1
    assert len(res.canary_uses) == 4 and np.all(np.diff(res.canary_uses) == 2)
    assert res.epsilon_analytic == pytest.approx(7.02, abs=0.01)
    # declared as what runs (4 epochs), the same loop passes
    ok = audit("toeplitz", variant="round", steps=8, epochs=4, runs=600, seed=2)
    assert not ok.falsified and ok.participation.startswith("4 epochs")
    assert ok.epsilon_analytic == pytest.approx(EPS, rel=1e-7)


# -- correct mechanisms pass: reuse modes, float32, every step front end ------------------------
MODES = {"once": {}, "epochs": {"epochs": 4}, "min-sep": {"min_sep": 3},
         "min-sep-k2": {"min_sep": 2, "max_participations": 2}, "float32": {"dtype": "float32"}}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("mechanism", ["blt", "independent", "toeplitz", "tree"])
def test_correct_mechanisms_pass(mechanism: str, mode: str) -> None:
    """The round variant (the per-round mod's release), N = 8: below the claim, the law
    accepted, the canary used as often as the participation allows, the analytic ε at most
    the claim (equal where the sensitivity is exact)."""
    runs = 200
    res = audit(mechanism, variant="round", steps=8, runs=runs, seed=31, **MODES[mode])
    assert not res.falsified and 0 <= res.epsilon_lower_bound < EPS
    _spread_ok(res, runs)
    assert res.epsilon_analytic <= EPS * (1 + 1e-7)
    if mechanism in ("independent", "toeplitz"):
        assert res.epsilon_analytic == pytest.approx(EPS, rel=1e-7)
    uses = {"once": 1, "float32": 1, "epochs": 4, "min-sep": 3, "min-sep-k2": 2}[mode]
    assert len(res.canary_uses) == uses
    if uses > 1:
        sep = {"epochs": 2, "min-sep": 3, "min-sep-k2": 2}[mode]
        assert np.all(np.diff(res.canary_uses) == sep)


@pytest.mark.parametrize(("front_end", "mode"), [
    ("local-round", "float32"), ("local-round", "min-sep"), ("private-step", "once"),
    ("private-step", "epochs")])
def test_step_front_ends_pass(front_end: str, mode: str) -> None:
    runs = 200
    res = audit("blt", variant="step", front_end=front_end, steps=8, runs=runs, seed=41,
                **MODES[mode])
    assert not res.falsified and res.front_end == front_end
    _spread_ok(res, runs)


def test_torch_optimizer_passes_and_a_missing_increment_is_caught() -> None:
    """The torch PrivateOptimizer (per-example clipping, the device stream) on a linear
    model: correct, it passes; with step 2's increment zeroed, it is caught."""
    pytest.importorskip("torch")
    ok = audit("blt", front_end="torch", steps=4, runs=60, seed=51)
    assert not ok.falsified and ok.front_end == "torch"
    assert ok.score_std == pytest.approx(1.0, abs=5 / math.sqrt(2 * (2 * 60 - 2)))
    bad = audit("blt", front_end="torch", dtype="float32", steps=4, runs=150, noise_runs=60,
                seed=52, zero_noise_step=2)
    _caught(bad)
    assert bad.canary_step == 2 and bad.epsilon_lower_bound > EPS and bad.law_rejected


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


def test_law_check_edges_hold_under_the_claim_and_reject_wrong_laws() -> None:
    """The Davidson–Szarek edges against simulated releases of a correlated law: 200
    samples of the claimed law never leave them (the bound allows 5% at α = 0.05 and is
    conservative); half the std, or one release without noise, is rejected. The edges
    contain the Marchenko–Pastur edges (1 ± √(p/n))² they are a finite-n version of."""
    rng = np.random.default_rng(0)
    rounds, dim, n = 8, 2, 400
    m = np.tril(rng.uniform(0.2, 1.0, (rounds, rounds)))  # a correlated increment matrix
    cov = m @ m.T

    def draw(matrix: np.ndarray) -> np.ndarray:
        return np.einsum("rk,nkd->nrd", matrix, rng.standard_normal((n, rounds, dim)))

    outside = 0
    for _ in range(200):
        lo_eig, hi_eig, lower, upper = law_check(draw(m), cov, 0.05)
        outside += not lower <= lo_eig <= hi_eig <= upper
    assert outside == 0
    ratio = math.sqrt(rounds * dim / n)
    assert lower < (1 - ratio) ** 2 and (1 + ratio) ** 2 < upper
    assert law_check(draw(m / 2), cov, 0.05)[0] < lower  # a quarter of the variance
    zeroed = m.copy()
    zeroed[5] = 0.0  # release 5 without noise
    assert law_check(draw(zeroed), cov, 0.05)[0] < 1e-12 < lower


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
    ["--zero-noise-step", "8"],                # outside the horizon
    ["--epochs", "2", "--min-sep", "2"],       # two participations at once
    ["--epochs", "2", "--accounted-epochs", "3"],  # 3 passes do not divide 8 steps
    ["--variant", "round", "--front-end", "torch"],  # a step front end
    ["--variant", "central", "--dtype", "float32"],  # the server stream is float64
    ["--min-sep", "3", "--canary-step", "3"],  # 3 uses from step 3 do not fit in 8
])
def test_bad_audit_input_is_refused(capsys, args: list[str]) -> None:
    assert main(["audit", "--mechanism", "blt", "--steps", "8", *args]) == 2
    assert "error" in capsys.readouterr().err


def test_each_execution_draws_its_own_noise() -> None:
    """Without a seed every execution keys its stream from OS entropy: two audits differ."""
    a = audit("independent", variant="round", steps=4, runs=20)
    b = audit("independent", variant="round", steps=4, runs=20)
    assert not np.isclose(a.mu_empirical, b.mu_empirical, rtol=0, atol=1e-12)
