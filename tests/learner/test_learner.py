"""The shared local round and server aggregation (Zhang, Zhu, Fay & Johansson, "Locally
Differentially Private Online Federated Learning With Correlated Noise", Algorithm 1)."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.aggregation import aggregate, check_update
from flwr_corrnoise.flower.config import check_proposal, privacy_proposal, settings_from_config
from flwr_corrnoise.learner import NonFiniteError, local_round
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.privacy import calibrate
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings, privacy_metrics
from flwr_corrnoise.streams import HorizonExhaustedError, NoiseStream

SHAPES = [(3,), (2, 2)]


def quad_grad(target: np.ndarray):
    """Gradient of ½‖x − target − pos‖² on datum `pos`: easy to follow by hand."""

    def grad(params, position):
        flat = np.concatenate([p.ravel() for p in params])
        g = flat - target - position
        return [g[:3], g[3:].reshape(2, 2)]

    return grad


def params0() -> list[np.ndarray]:
    return [np.zeros(3), np.zeros((2, 2))]


def test_round_matches_algorithm_1_by_hand() -> None:
    settings = PrivacySettings("toeplitz", 2.0, 1e-3, clip_norm=0.5, horizon=8)
    state = LearnerState.create(settings, SHAPES, seed=3)
    target = np.arange(7.0)
    res = local_round(params0(), quad_grad(target), state, settings, tau=3, eta=0.1)
    # redo it by hand with an identical noise stream
    std = calibrate(2.0, 1e-3, 0.5, build_factorization("toeplitz", 8).sensitivity).std
    noise = NoiseStream.create("toeplitz", 8, 7, std, seed=3)
    z = np.zeros(7)
    hat = []
    for t in range(3):
        g = z - target - t
        g = g * min(1.0, 0.5 / np.linalg.norm(g))
        step = g + noise.next()
        hat.append(step)
        z = z - 0.1 * step
    expected = (np.zeros(7) - z) / (0.1 * 3)  # ĝ = (x − z)/(ητ)
    got = np.concatenate([u.ravel() for u in res.update])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert res.state.step == 3 and res.state.position == 3 and res.state.rounds == 1
    assert res.state is state
    assert res.metrics["epsilon-spent"] <= 2.0
    assert res.metrics["noise-std"] == pytest.approx(std)


def test_round_metrics_are_the_round_s_privacy_metrics_computed_when_read() -> None:
    """A round's metrics are ``privacy_metrics`` at the step count the round ended on —
    also when read after the same state has trained again — and ε spent is not computed
    until they are read (the in-process engines never read them)."""
    settings = PrivacySettings("blt", 2.0, 1e-3, clip_norm=0.5, horizon=12)
    state = LearnerState.create(settings, SHAPES, seed=5)
    first = local_round(params0(), quad_grad(np.arange(7.0)), state, settings, tau=3, eta=0.1)
    assert first.metrics._value is None  # type: ignore[attr-defined]
    second = local_round(params0(), quad_grad(np.arange(7.0)), state, settings, tau=3, eta=0.1)
    assert dict(first.metrics) == privacy_metrics(settings, 3)
    assert dict(second.metrics) == privacy_metrics(settings, 6)
    assert first.metrics["steps"] == 3.0 and second.metrics["steps"] == 6.0
    assert 0 < first.metrics["epsilon-spent"] < second.metrics["epsilon-spent"] <= 2.0
    with pytest.raises(TypeError):
        first.metrics["steps"] = 0.0  # type: ignore[index]


def test_clipping_bounds_each_step() -> None:
    """With a huge gradient, each step's contribution before noise has norm exactly B_g."""
    settings = PrivacySettings("independent", 1.0, 1e-3, clip_norm=0.25, horizon=4)
    state = LearnerState.create(settings, SHAPES, seed=0)
    state.noise.std = 0.0  # isolate the clipped gradient
    res = local_round(params0(), quad_grad(np.full(7, 1e6)), state, settings, tau=1, eta=1.0)
    assert np.linalg.norm(np.concatenate([u.ravel() for u in res.update])) == pytest.approx(0.25)
    assert res.diagnostics["clipped-steps"] == 1.0
    assert "clipped-fraction" not in res.metrics  # data-dependent: never released


def test_a_one_array_model_and_gradient_are_read_in_place_and_never_written() -> None:
    """One float64 array is flattened as a view (``learner._flatten``, no copy): the round
    must still never write to the caller's model or to the array the oracle returns, even
    when the oracle hands back the same buffer every step and clipping scales it."""
    settings = PrivacySettings("blt", 1.0, 1e-3, clip_norm=0.25, horizon=8)
    model = np.arange(6.0).reshape(2, 3)
    kept = np.full(6, 1e3)  # the oracle's own buffer: over the clip norm
    calls = []

    def grad(params, position):
        calls.append(params[0].copy())
        return [kept.reshape(2, 3)]

    res = local_round([model], grad, LearnerState.create(settings, [(2, 3)], seed=1),
                      settings, tau=3, eta=0.1)
    assert np.array_equal(model, np.arange(6.0).reshape(2, 3))
    assert np.array_equal(kept, np.full(6, 1e3))
    assert res.diagnostics["clipped-steps"] == 3.0
    assert np.array_equal(calls[0], model)  # step 1 sees the model, later steps move on
    assert not np.array_equal(calls[1], model)


def test_noiseless_round_is_plain_local_sgd() -> None:
    settings = PrivacySettings("none", horizon=10)
    state = LearnerState.create(settings, SHAPES, seed=None)
    assert state.noise is None
    target = np.ones(7)
    res = local_round(params0(), quad_grad(target), state, settings, tau=2, eta=0.5)
    z = np.zeros(7)
    for t in range(2):
        z = z - 0.5 * (z - target - t)
    np.testing.assert_allclose(np.concatenate([u.ravel() for u in res.update]), -z / 1.0)


def test_horizon_stops_the_learner_and_applies_nothing() -> None:
    settings = PrivacySettings("tree", horizon=4)
    state = LearnerState.create(settings, SHAPES, seed=1)
    res = local_round(params0(), quad_grad(np.zeros(7)), state, settings, tau=3, eta=0.1)
    with pytest.raises(HorizonExhaustedError, match="3 of the 4 steps"):
        local_round(params0(), quad_grad(np.zeros(7)), res.state, settings, tau=2, eta=0.1)
    assert res.state.step == 3 and res.state.noise.step == 3


def test_non_finite_gradient_counts_as_zero_and_the_noise_step_happens() -> None:
    """Whether a datum's gradient is finite is data: the round goes on, that step's
    gradient is zero, its noise increment is added, and only the diagnostics know."""
    settings = PrivacySettings("toeplitz", horizon=6)
    state = LearnerState.create(settings, SHAPES, seed=1)
    twin = LearnerState.create(settings, SHAPES, seed=1)

    def bad(params, position):
        if position == 1:
            return [np.full(3, np.nan), np.zeros((2, 2))]
        if position == 2:
            raise NonFiniteError("a non-finite loss")
        return [np.ones(3), np.ones((2, 2))]

    res = local_round(params0(), bad, state, settings, tau=3, eta=0.1)
    assert state.step == 3 and state.position == 3 and state.noise.step == 3
    assert res.diagnostics["nonfinite-steps"] == 2.0
    g0 = np.ones(7) * min(1.0, settings.clip_norm / np.sqrt(7))
    noise = [twin.noise.next() for _ in range(3)]
    want = (g0 + noise[0] + noise[1] + noise[2]) / 3
    np.testing.assert_allclose(np.concatenate([u.ravel() for u in res.update]), want)


def test_state_roundtrip_continues_exactly() -> None:
    settings = PrivacySettings("efficient-tree", horizon=12)
    grad = quad_grad(np.arange(7.0))
    a = LearnerState.create(settings, SHAPES, seed=9)
    a = local_round(params0(), grad, a, settings, 3, 0.1).state
    b = LearnerState.from_bytes(a.to_bytes())
    ra = local_round(params0(), grad, a, settings, 3, 0.1)
    rb = local_round(params0(), grad, b, settings, 3, 0.1)
    for u, v in zip(ra.update, rb.update, strict=True):
        assert np.array_equal(u, v)
    with pytest.raises(ValueError, match="unreadable"):
        LearnerState.from_bytes(b"\x00junk")


def test_aggregate_is_algorithm_1_line_16() -> None:
    x = [np.array([1.0, 2.0]), np.array([[3.0]])]
    u1 = [np.array([1.0, 0.0]), np.array([[2.0]])]
    u2 = [np.array([3.0, 4.0]), np.array([[0.0]])]
    out = aggregate(x, [u1, u2], eta=0.1, eta_g=2.0, tau=4)
    np.testing.assert_allclose(out[0], [1.0 - 0.8 * 2.0, 2.0 - 0.8 * 2.0])
    np.testing.assert_allclose(out[1], [[3.0 - 0.8 * 1.0]])
    # no valid update: the model is kept
    np.testing.assert_array_equal(aggregate(x, [], 0.1, 1.0, 4)[0], x[0])


def test_check_update_rejects_malformed() -> None:
    ref = [np.zeros(2), np.zeros((1, 1))]
    check_update([np.ones(2), np.ones((1, 1))], ref)
    with pytest.raises(ValueError, match="shape"):
        check_update([np.ones(3), np.ones((1, 1))], ref)
    with pytest.raises(ValueError, match="NaN"):
        check_update([np.array([np.nan, 1.0]), np.ones((1, 1))], ref)
    with pytest.raises(ValueError, match="dtype"):
        check_update([np.ones(2, dtype=np.int64), np.ones((1, 1))], ref)
    with pytest.raises(ValueError, match="arrays"):
        check_update([np.ones(2)], ref)


@pytest.mark.parametrize(
    ("proposal", "match"),
    [
        ({"privacy-epsilon": 4.0}, "ε 4 exceeds"),
        ({"privacy-delta": 0.1}, "δ 0.1 exceeds"),
        ({"privacy-clip-norm": 10.0}, "clip norm 10 exceeds"),
        ({"privacy-horizon": 5000}, "horizon 5000 exceeds"),
        ({"privacy-mechanism": "none"}, "turn the noise off"),
        ({"privacy-mechanism": "tree"}, "switch to 'tree'"),
        ({"privacy-epsilon": float("nan")}, "ε nan exceeds"),
        ({"privacy-epsilon": "lots"}, "not a number"),
    ],
)
def test_weaker_proposals_are_refused(proposal: dict, match: str) -> None:
    settings = PrivacySettings("toeplitz", 2.0, 1e-3, 1.0, 4000)
    with pytest.raises(PrivacyConfigError, match=match):
        check_proposal(settings, proposal)


def test_equal_or_stricter_proposals_are_accepted() -> None:
    settings = PrivacySettings("toeplitz", 2.0, 1e-3, 1.0, 4000)
    check_proposal(settings, privacy_proposal(settings))
    check_proposal(settings, {"privacy-epsilon": 1.0, "privacy-horizon": 100})
    check_proposal(settings, {})


def test_settings_from_run_config() -> None:
    cfg = {"mechanism": "tree", "epsilon": 0.5, "delta": 1e-5, "clip-norm": 2.0,
           "data-reuse": "once", "num-server-rounds": 10, "local-steps": 4}
    s = settings_from_config(cfg)
    assert (s.mechanism, s.epsilon, s.delta, s.clip_norm, s.horizon) == ("tree", 0.5, 1e-5, 2.0, 40)
    with pytest.raises(PrivacyConfigError, match="unknown mechanism"):
        settings_from_config({"mechanism": "laplace", "horizon": 10})
    with pytest.raises(ValueError, match="ε must be"):
        settings_from_config({"epsilon": -1, "horizon": 10})


def _exact_norm_squared(values: np.ndarray):
    """‖v‖² in exact rational arithmetic (every float is a rational: no rounding)."""
    from fractions import Fraction

    return sum(Fraction(float(x)) ** 2 for x in np.asarray(values, dtype=np.float64).ravel())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_clipped_release_never_exceeds_the_clip_norm_exactly(dtype: type) -> None:
    """The sensitivity the accounting assumes is B_g per step. Clipping to exactly B_g in
    floating point overshoots it (the norm, the factor and each product are rounded, and a
    float32 stream rounds the release again: before the margin, 44 % of clipped float32
    releases were above B_g); so every release's **exact** norm (rational arithmetic) is
    checked ≤ B_g — gradients far above the clip norm and just around it — while the
    margin costs at most 10⁻⁶ of it."""
    from fractions import Fraction

    from flwr_corrnoise.learner import clip_by_global_norm

    settings = PrivacySettings("independent", 1.0, 1e-3, clip_norm=0.7, horizon=400)
    shapes = [(129,), (8, 16)]
    size = 129 + 128
    state = LearnerState.create(settings, shapes, seed=0, dtype=dtype)
    state.noise.std = 0.0  # the release is the clipped gradient, rounded to the dtype
    rng = np.random.default_rng(7)
    bound = Fraction(0.7) ** 2
    closest = 0.0
    for trial in range(60):
        g = rng.standard_normal(size)
        scale = [1e3, 1.0, 0.7 / np.linalg.norm(g) * (1 + 1e-9 * rng.standard_normal())][trial % 3]
        g = g * scale
        model = trial % 2 and dtype  # a float32 stream: float32 steps for a float32 model
        res = local_round([np.zeros(129, dtype=model or None),
                           np.zeros((8, 16), dtype=model or None)],
                          lambda p, t, g=g: [g[:129], g[129:].reshape(8, 16)],
                          state, settings, tau=1, eta=1.0)
        release = np.concatenate([u.ravel() for u in res.update])
        assert release.dtype == (np.float32 if model == np.float32 else np.float64)
        assert np.array_equal(release, release.astype(dtype))  # formed in the stream's dtype
        n2 = _exact_norm_squared(release)
        assert n2 <= bound, (trial, float(n2) ** 0.5)
        closest = max(closest, float(n2) ** 0.5)
        clipped, _ = clip_by_global_norm(g, 0.7, dtype)  # the rule alone: the same bound
        assert _exact_norm_squared(np.asarray(clipped).astype(dtype)) <= bound
    assert closest >= 0.7 * (1 - 1e-6)  # the margin is negligible for training


def test_a_float32_learner_steps_in_float32_and_zeroes_what_float32_cannot_hold() -> None:
    """A float32 model with a float32 stream steps in float32 (learner.step_dtype): the
    gradient code gets float32 parameters and the update is float32. A gradient the user's
    code returns in float64 beyond float32's range (1e39) is not representable in the
    step: it counts as non-finite (zero, its noise still added), never a NaN or an
    infinite release; a float64 model with the same float32 stream steps in float64."""
    settings = PrivacySettings("blt", 1.0, 1e-3, clip_norm=0.5, horizon=8)
    state = LearnerState.create(settings, SHAPES, seed=4, dtype=np.float32)
    seen = []

    def grad(params, position):
        seen.append({p.dtype for p in params})
        return [np.full(3, 1e39), np.zeros((2, 2))] if position == 1 else \
            [np.full(3, 0.1), np.full((2, 2), 0.2)]

    res = local_round([np.zeros(3, np.float32), np.zeros((2, 2), np.float32)], grad, state,
                      settings, tau=2, eta=0.1)
    assert seen == [{np.dtype(np.float32)}] * 2
    assert all(u.dtype == np.float32 and np.all(np.isfinite(u)) for u in res.update)
    assert res.diagnostics["nonfinite-steps"] == 1.0
    res = local_round([np.zeros(3), np.zeros((2, 2))], grad, state, settings, tau=2, eta=0.1)
    assert seen[2:] == [{np.dtype(np.float64)}] * 2
    assert all(u.dtype == np.float64 for u in res.update)
