"""PrivateSteps: per-step noise in the user's own loop, with the library owning the rest.

Direct calls through Flower's real ClientApp call path (mods included). The neighbouring-
stream check for this front end is in ``test_release_gate.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_corrnoise.flower import PrivateSteps
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.learner import local_round
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import derive_seed

from .test_release_gate import message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

DIM, TAU, LR = 4, 3, 0.1
CFG = {"partition-id": 0, "mechanism": "toeplitz", "epsilon": 2.0, "delta": 1e-3,
       "clip-norm": 1.0, "data-reuse": "once",
"num-server-rounds": 2, "local-steps": TAU, "seed": 9}


def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
    return [params[0] - np.sin(position + np.arange(DIM))]


def app(*, fail_at: int | None = None, own_reply: bool = False, guard: bool = True) -> ClientApp:
    client = ClientApp(mods=[PrivateSteps.guard()] if guard else [])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):
            if fail_at == t:
                raise KeyError("secret datum 0.123")
            w = w - LR * private.step(gradient([w], (r - 1) * TAU + t)[0])
        if own_reply:
            return Message(RecordDict({"arrays": ArrayRecord([w]),
                                       "metrics": MetricRecord({"num-examples": 1})}),
                           reply_to=msg)
        return private.reply([w])

    @client.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:  # data-dependent: must not run
        return Message(RecordDict({"metrics": MetricRecord({"loss": 0.123})}), reply_to=msg)

    return client


def context(**extra: Any) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                   run_config={**CFG, **extra})


def train(client: ClientApp, ctx: Context, x: np.ndarray, server_round: int) -> Message:
    return client(message(MessageType.TRAIN, x, server_round), ctx)


def test_same_noise_and_model_as_the_strict_mode(simulated: None) -> None:
    """With the same seed, the user's loop through PrivateSteps releases exactly the model
    the strict mode's local round implies (x − η·τ·ĝ), round after round: the noise stream
    and counters survive in context.state."""
    ctx = context()
    settings = settings_from_config(CFG)
    state = LearnerState.create(settings, [(DIM,)], derive_seed(9, 0))
    x = np.full(DIM, 0.3)
    for r in (1, 2):
        reply = train(app(), ctx, x, r)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        got = reply.content["arrays"].to_numpy_ndarrays()[0]
        want = x - LR * TAU * local_round([x], gradient, state, settings, TAU, LR).update[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        metrics = reply.content["metrics"]
        assert metrics["steps"] == r * TAU and metrics["num-examples"] == 1.0
        assert metrics["epsilon-spent"] <= 2.0 + 1e-12 and metrics["learner-id"] == 0.0
        x = got
    assert metrics["epsilon-spent"] == pytest.approx(2.0)
    # the horizon (2 rounds × 3 steps) is used up: the next round is refused, data-free
    reply = train(app(), ctx, x, 3)
    assert reply.has_error() and reply.error.code == 4102


def test_a_failed_round_releases_nothing_and_changes_nothing(simulated: None) -> None:
    ctx = context()
    x = np.zeros(DIM)
    reply = train(app(fail_at=1), ctx, x, 1)
    assert reply.has_error() and reply.error.code == 4100
    assert "secret" not in reply.error.reason
    ok = train(app(), ctx, x, 1)  # the same noise as if the failed round never happened
    again = train(app(), context(), x, 1)
    np.testing.assert_array_equal(ok.content["arrays"].to_numpy_ndarrays()[0],
                                  again.content["arrays"].to_numpy_ndarrays()[0])
    assert ok.content["metrics"]["steps"] == TAU


def test_a_reply_the_gate_did_not_build_is_refused(simulated: None) -> None:
    reply = train(app(own_reply=True), context(), np.zeros(DIM), 1)
    assert reply.has_error() and reply.error.code == 4101
    assert "did not build" in reply.error.reason
    assert "SuperLink" not in reply.error.reason  # it used PrivateSteps: no stale-app hint


def test_a_train_function_without_private_steps_points_at_a_stale_app(simulated: None) -> None:
    """Issue 32: a local SuperLink that kept an older app directory runs that app's plain
    train function under the new app's guard; the refusal names the likely cause."""
    plain = ClientApp(mods=[PrivateSteps.guard()])

    @plain.train()
    def _train(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    reply = train(plain, context(), np.zeros(DIM), 1)
    assert reply.has_error() and reply.error.code == 4101
    assert "never created PrivateSteps" in reply.error.reason
    assert "SuperLink" in reply.error.reason


def test_without_the_guard_nothing_trains(simulated: None) -> None:
    with pytest.raises(Exception, match="guard"):
        train(app(guard=False), context(), np.zeros(DIM), 1)


def test_a_weaker_proposal_and_evaluation_are_refused(simulated: None) -> None:
    msg = message(MessageType.TRAIN, np.zeros(DIM), 1)
    msg.content["config"]["privacy-epsilon"] = 8.0
    reply = app()(msg, context())
    assert reply.has_error() and reply.error.code == 4101 and "ε 8" in reply.error.reason
    reply = app()(message(MessageType.EVALUATE, np.zeros(DIM), 1), context())
    assert reply.has_error() and reply.error.code == 4106


def test_secure_noise_step_is_trunc_g_of_the_clipped_gradient_plus_grid_noise() -> None:
    """With the learner's secure-noise opt-in (real SuperNode rules), each step's output is
    the stream's exact release trunc_g(clip(g)) + e: it lies on the noise's grid."""
    from flwr_corrnoise.secure_noise import granularity

    client = ClientApp(mods=[PrivateSteps.guard()])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        return private.reply([private.step(np.array([3.0, -4.0, 0.1, 1e-13]))])

    node = {**CFG, "secure-noise": True, "horizon": 4}
    del node["seed"]
    ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    reply = train_reply = client(message(MessageType.TRAIN, np.zeros(DIM), 1), ctx)
    assert not train_reply.has_error(), reply.error.reason if reply.has_error() else ""
    out = reply.content["arrays"].to_numpy_ndarrays()[0]
    g = granularity(float(reply.content["metrics"]["noise-std"]))
    np.testing.assert_array_equal(np.round(out / g) * g, out)  # on the grid, exactly
    assert not np.allclose(out, np.array([0.6, -0.8, 0.02, 0.0]))  # noised


def test_a_budget_too_large_for_the_secure_grid_is_refused_before_any_step() -> None:
    node = {"partition-id": 0, "mechanism": "independent", "epsilon": 1e14, "delta": 0.5,
            "clip-norm": 1.0, "data-reuse": "once",
"horizon": 2, "calibration": "zcdp", "secure-noise": True}
    ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})
    reply = train(app(), ctx, np.zeros(DIM), 1)
    assert reply.has_error() and reply.error.code == 4101
    assert "secure noise needs clip-norm" in reply.error.reason
    assert "flwr-corrnoise" not in ctx.state  # nothing stored


def test_a_model_of_another_size_than_the_noise_stream_is_refused(simulated: None) -> None:
    ctx = context()
    assert not train(app(), ctx, np.zeros(DIM), 1).has_error()
    reply = app()(message(MessageType.TRAIN, np.zeros(DIM + 1), 2), ctx)
    assert reply.has_error() and reply.error.code == 4101
    assert "noise stream was created for 4" in reply.error.reason
