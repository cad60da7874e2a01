"""Adaptive clipping inside the learner: the NumPy private step (and through it the
per-round mod), its state, its refusals, and the neighbouring-data rule through Flower's
ClientApp call path."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from flwr_corrnoise.adaptive_clipping import (
    AdaptiveClipping,
    AdaptiveClipState,
    epsilon_spent_adaptive,
)
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.learner import StepCounts, local_round, private_step
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms.participation import Participation
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings
from flwr_corrnoise.streams import NoiseStream

from ..flower import test_neighbouring_frontends as nb
from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

ADAPTIVE = {"adaptive-clip-quantile": 0.5, "adaptive-clip-lr": 0.2}


def settings(**kw: Any) -> PrivacySettings:
    base = dict(mechanism="toeplitz", epsilon=2.0, delta=1e-5, clip_norm=0.7, horizon=12,
                participation=Participation.min_separation(1, 3),
                adaptive=AdaptiveClipping(0.5, 0.2))
    return PrivacySettings(**{**base, **kw})


def test_the_step_is_clip_divide_noise_multiply_then_update_by_hand() -> None:
    """Each step's release is ``C_t·(clip(g, C_t)/C_t + e_t)``, ``e_t`` the unit-clip
    stream's increment; ``C_{t+1} = C_t·exp(−η(b̃_t − γ))`` with the step's count noise."""
    s = settings()
    state = LearnerState.create(s, [(5,)], seed=3)
    twin = NoiseStream.create("toeplitz", 12, [(5,)], s.calibration().std, 3,
                              factorization=s.factorization())
    clip = AdaptiveClipState.create(0.7, 3)
    sigma_b = s.count_noise()
    rng = np.random.default_rng(0)
    for t in range(8):
        g = rng.normal(size=5) * (0.2 if t % 2 else 3.0)  # clipped and unclipped steps
        got = private_step(state, s, lambda g=g: g, 5, StepCounts())
        c = clip.clip_norm
        norm = float(np.linalg.norm(g))
        row = g * min(1.0, c / norm) / c
        want = c * twin.add_next(row)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        clip.update(float(norm <= c), 1, t, s.adaptive, sigma_b)
        assert AdaptiveClipState.from_payload(state.payload).log_clip == clip.log_clip
    assert state.step == 8


def test_metrics_are_settings_only_and_epsilon_is_the_composed_accountants() -> None:
    s = settings()
    state = LearnerState.create(s, [(4,)], seed=1)
    res = local_round([np.zeros(4)], lambda p, i: np.full(4, 5.0), state, s, 4, 0.1)
    cal = s.calibration()
    assert dict(res.metrics) == {"steps": 4.0, "horizon": 12.0, "epsilon": 2.0, "delta": 1e-5,
                                 "epsilon-spent": pytest.approx(epsilon_spent_adaptive(
                                     s.factorization(), cal.std, s.count_noise(), 1e-5,
                                     "exact", s.participation, 4)),
                                 "noise-std": cal.std}
    assert cal.clip_norm == 1.0  # unit clip: noise-std is in units of the clip norm
    assert s.epsilon_spent(12) == pytest.approx(2.0, rel=1e-9)


def test_a_failed_round_rolls_the_clip_norm_back() -> None:
    s = settings()
    state = LearnerState.create(s, [(3,)], seed=2)
    local_round([np.zeros(3)], lambda p, i: np.full(3, 4.0), state, s, 2, 0.1)
    before = {k: v.copy() for k, v in state.payload.items()}

    def interrupted(params: list[np.ndarray], position: int) -> np.ndarray:
        if position == 3:
            raise KeyboardInterrupt
        return np.full(3, 4.0)

    with pytest.raises(KeyboardInterrupt):
        local_round([np.zeros(3)], interrupted, state, s, 3, 0.1)
    assert state.step == 2
    for k, v in before.items():
        np.testing.assert_array_equal(state.payload[k], v)


def test_state_round_trip_and_binding() -> None:
    s = settings()
    state = LearnerState.create(s, [(3,)], seed=2)
    local_round([np.zeros(3)], lambda p, i: np.full(3, 4.0), state, s, 3, 0.1)
    back = LearnerState.from_bytes(state.to_bytes())
    np.testing.assert_array_equal(back.payload["adaptive-clip"], state.payload["adaptive-clip"])
    back.check_binding(s)
    assert state.binding["adaptive-clip"] == {"quantile": 0.5, "lr": 0.2, "noise": None}
    with pytest.raises(PrivacyConfigError, match="adaptive-clip"):
        back.check_binding(settings(adaptive=None))


def test_config_keys() -> None:
    cfg = {"num-server-rounds": 3, "local-steps": 4, "data-reuse": "every-round",
           "delta": 1e-5, **ADAPTIVE, "adaptive-clip-noise": 30.0}
    s = settings_from_config(cfg)
    assert s.adaptive == AdaptiveClipping(0.5, 0.2, 30.0) and s.count_noise() == 30.0
    with pytest.raises(PrivacyConfigError, match="quantile"):
        settings_from_config({**cfg, "adaptive-clip-quantile": None})
    with pytest.raises(PrivacyConfigError, match="quantile must be in"):
        settings_from_config({**cfg, "adaptive-clip-quantile": 1.5})
    with pytest.raises(PrivacyConfigError, match="noise mechanism"):
        settings_from_config({**cfg, "mechanism": "none"})
    with pytest.raises(PrivacyConfigError, match="did you mean"):
        settings_from_config({**cfg, "adaptive-clip-quantil": 0.5})


def test_central_dp_refuses_it() -> None:
    from flwr.serverapp.strategy import FedAvg

    from flwr_corrnoise.flower.central_dp import CorrNoiseCentralDPStrategy
    with pytest.raises(PrivacyConfigError, match="central DP"):
        CorrNoiseCentralDPStrategy.from_run_config(FedAvg(), {
            "num-server-rounds": 3, "data-reuse": "every-round", **ADAPTIVE})


# -- the neighbouring-data rule through Flower's ClientApp call path ------------------------
def adaptive_context() -> Context:
    node = {**nb.LEARNER, **ADAPTIVE, "partition-id": 0}
    return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})


@pytest.mark.parametrize("kind", ("huge", "zero", "nan"))
@pytest.mark.parametrize("name", list(nb.NUMPY_FRONT_ENDS))
def test_neighbouring_data_give_the_same_reply_apart_from_the_arrays(
        name: str, kind: str, simulated: None) -> None:
    """Two learners with the same key whose data differ in one example (the odd one in
    round 2 moves that step's count and so every later clip norm): every non-array part
    of every reply is identical, and the arrays do differ in the rounds after it."""
    build = nb.front_end(name)
    small, small_arrays = nb.conversation(build("small"), adaptive_context())
    odd, odd_arrays = nb.conversation(build(kind), adaptive_context())
    assert odd == small
    assert all("error" not in t for t in small[0::2])
    assert len(small_arrays) == len(odd_arrays) == nb.ROUNDS
    assert not np.array_equal(small_arrays[-1], odd_arrays[-1])


def test_the_clip_norm_moves_and_never_leaves(simulated: None) -> None:
    """Over a round of large gradients the clip norm grows (no norm fits under it); the
    reply carries the noise std in units of the clip norm, the same as a fresh learner's
    calibration, and no other number."""
    ctxt = adaptive_context()
    app = nb.front_end("make_client_app")("huge")
    prints, _ = nb.conversation(app, ctxt)
    state = LearnerState.from_bytes(_stored_state(ctxt))
    clip = AdaptiveClipState.from_payload(state.payload)
    assert clip.clip_norm != pytest.approx(nb.LEARNER["clip-norm"])
    assert math.isfinite(clip.clip_norm)
    text = repr(prints)
    assert repr(clip.clip_norm) not in text and f"{clip.clip_norm:.6g}" not in text


def _stored_state(ctxt: Context) -> bytes:
    """The learner state a simulated learner keeps in ``context.state`` (or its offload)."""
    from flwr_corrnoise.flower.session import STATE_KEY

    return bytes(ctxt.state[STATE_KEY]["learner"])  # a small state: not offloaded


def test_evaluate_refusals_are_not_a_warning_per_learner_and_round(
        simulated: None, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 32: a run whose learners refuse client-side evaluation logs one line for the
    run (the server's, tests/flower/test_first_hour.py), not one per learner and round: the
    learner's refusal (code 4106, its reason in the reply) is a debug line."""
    import logging

    with caplog.at_level(logging.DEBUG, logger="flwr_corrnoise"):
        for partition in (0, 1):
            prints, _ = nb.conversation(nb.front_end("make_client_app")("small"),
                                        nb.context(partition))
            assert all(e["error"][0] == 4106 for e in prints[1::2])
    refusals = [r for r in caplog.records if "refuses the message" in r.getMessage()]
    assert len(refusals) == 2 * nb.ROUNDS
    assert all(r.levelno == logging.DEBUG for r in refusals)
