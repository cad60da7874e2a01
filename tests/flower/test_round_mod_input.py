"""``CorrNoiseRoundMod`` checks the server's model before it spends anything (issue 20, item 7).

A non-finite model (code 4103) or one of other shapes than the learner's noise stream, or
than the shapes it declared (code 4101), is refused with a fixed reason before the wrapped
app runs and before the state is touched: the stored state's bytes, the steps and ε spent
stay as they were, and the learner's next release is the one a twin learner that never saw
the bad message makes (same noise index, same metadata, same arrays bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from flwr_corrnoise.flower import CorrNoiseRoundMod
from flwr_corrnoise.flower.round_mod import ROUND_STATE_KEY, declared_shapes
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings

from .test_round_mod import Inner, context, train_message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

pytestmark = pytest.mark.usefixtures("simulated")  # reproducible seeds, as in a simulation

SETTINGS = PrivacySettings("toeplitz", epsilon=2.0, delta=1e-3, clip_norm=0.5, horizon=4)
MODEL = [np.zeros((2, 2)), np.ones(3)]
UPDATE = [np.full((2, 2), 0.1), np.full(3, -0.2)]


def state_bytes(ctxt: Context) -> bytes | None:
    if ROUND_STATE_KEY not in ctxt.state:
        return None
    return bytes(ctxt.state[ROUND_STATE_KEY]["learner"])  # type: ignore[index]


def good_round(mod: CorrNoiseRoundMod, ctxt: Context, r: int) -> Message:
    reply = mod(train_message(MODEL, **{"server-round": r}), ctxt, Inner(UPDATE))
    assert not reply.has_error(), reply.error.reason
    return reply


def assert_same_release(a: Message, b: Message) -> None:
    """Two replies with the same metadata and the same noised arrays, bit for bit."""
    assert dict(a.content["metrics"]) == dict(b.content["metrics"])
    for x, y in zip(a.content["arrays"].to_numpy_ndarrays(),
                    b.content["arrays"].to_numpy_ndarrays(), strict=True):
        assert x.tobytes() == y.tobytes()


def refuse(mod: CorrNoiseRoundMod, ctxt: Context, model: list[np.ndarray], code: int) -> str:
    """Send ``model``; it must be refused with ``code``, the wrapped app never called and
    the stored state unchanged. Returns the reason."""
    before, inner = state_bytes(ctxt), Inner([np.zeros_like(a) for a in model])
    reply = mod(train_message(model, **{"server-round": 9}), ctxt, inner)
    assert reply.has_error() and reply.error.code == code, (
        reply.error.reason if reply.has_error() else dict(reply.content["metrics"]))
    assert inner.calls == 0
    assert state_bytes(ctxt) == before
    return str(reply.error.reason)


NON_FINITE = {
    "nan": [np.zeros((2, 2)), np.array([1.0, np.nan, 1.0])],
    "inf": [np.full((2, 2), -np.inf), np.ones(3)],
}


@pytest.mark.parametrize("after_rounds", [0, 1])
def test_non_finite_server_model_is_refused_and_spends_nothing(after_rounds: int) -> None:
    mod, ctxt = CorrNoiseRoundMod(SETTINGS), context(seed=5)
    twin_mod, twin = CorrNoiseRoundMod(SETTINGS), context(seed=5)
    for r in range(after_rounds):
        assert_same_release(good_round(mod, ctxt, r + 1), good_round(twin_mod, twin, r + 1))
    steps = None if after_rounds == 0 else LearnerState.from_bytes(state_bytes(ctxt)).step
    reasons = {refuse(mod, ctxt, model, 4103) for model in NON_FINITE.values()}
    assert reasons == {"flwr-corrnoise: NonFiniteError: the global model received from the "
                       "server is not finite"}  # fixed: names no value, no position
    if after_rounds:
        assert LearnerState.from_bytes(state_bytes(ctxt)).step == steps == after_rounds
    # the next round is the twin's: same step, ε spent, noise index
    nxt, twin_nxt = good_round(mod, ctxt, 5), good_round(twin_mod, twin, 5)
    assert_same_release(nxt, twin_nxt)
    assert nxt.content["metrics"]["steps"] == after_rounds + 1


OTHER_SHAPES = {
    "bigger": [np.zeros((2, 2)), np.ones(4)],
    "same size, other shapes": [np.zeros(4), np.ones((3, 1))],
    "one array fewer": [np.zeros((2, 2))],
    "one array more": [np.zeros((2, 2)), np.ones(3), np.ones(1)],
}


def test_model_of_other_shapes_after_the_first_round_is_refused() -> None:
    mod, ctxt = CorrNoiseRoundMod(SETTINGS), context(seed=5)
    twin_mod, twin = CorrNoiseRoundMod(SETTINGS), context(seed=5)
    assert_same_release(good_round(mod, ctxt, 1), good_round(twin_mod, twin, 1))
    reasons = {refuse(mod, ctxt, model, 4101) for model in OTHER_SHAPES.values()}
    assert len(reasons) == 1 and "nothing was spent" in reasons.pop()
    assert LearnerState.from_bytes(state_bytes(ctxt)).noise.shapes == ((2, 2), (3,))
    assert_same_release(good_round(mod, ctxt, 2), good_round(twin_mod, twin, 2))


def test_a_first_model_of_the_wrong_size_cannot_fix_the_streams_shapes() -> None:
    """With declared shapes, a wrong first model is refused before a stream exists; the
    right model then creates the stream with the declared shapes."""
    declared = [(2, 2), (3,)]
    mod, ctxt = CorrNoiseRoundMod(SETTINGS, model_shapes=declared), context(seed=5)
    twin_mod, twin = CorrNoiseRoundMod(SETTINGS, model_shapes=declared), context(seed=5)
    for model in [[np.zeros(7)], *OTHER_SHAPES.values()]:
        refuse(mod, ctxt, model, 4101)
        assert state_bytes(ctxt) is None  # no stream, no step: nothing was locked
    refuse(mod, ctxt, NON_FINITE["nan"], 4103)
    assert_same_release(good_round(mod, ctxt, 1), good_round(twin_mod, twin, 1))
    assert LearnerState.from_bytes(state_bytes(ctxt)).noise.shapes == ((2, 2), (3,))
    refuse(mod, ctxt, [np.zeros(7)], 4101)
    assert_same_release(good_round(mod, ctxt, 2), good_round(twin_mod, twin, 2))


def test_shapes_can_be_declared_as_shapes_arrays_or_a_state_dict() -> None:
    want = ((2, 2), (3,))
    assert declared_shapes([(2, 2), (3,)]) == want
    assert declared_shapes([np.zeros((2, 2)), np.zeros(3)]) == want
    assert declared_shapes({"w": np.zeros((2, 2)), "b": np.zeros(3)}) == want
    assert declared_shapes(ArrayRecord(MODEL)) == want
    for bad in ([], [2, 3]):
        with pytest.raises(PrivacyConfigError):
            declared_shapes(bad)


def test_deployed_learner_keeps_its_files_on_a_bad_model(tmp_path: Path) -> None:
    """With a ``state-dir``: a refused model leaves every file there byte for byte."""
    def deployed() -> Context:  # a fresh process each message: empty context.state
        return Context(run_id=1, node_id=1,
                       node_config={"partition-id": 0, "noise-seed": 5,
                                    "state-dir": str(tmp_path)},
                       state=RecordDict(), run_config={})

    mod = CorrNoiseRoundMod(SETTINGS)
    good_round(mod, deployed(), 1)

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(tmp_path)): p.read_bytes()
                for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    before = files()
    assert any(name.endswith("learner.state") for name in before)
    for model, code in ((NON_FINITE["nan"], 4103), (OTHER_SHAPES["bigger"], 4101)):
        inner = Inner([np.zeros_like(a) for a in model])
        reply = mod(train_message(model), deployed(), inner)
        assert reply.has_error() and reply.error.code == code and inner.calls == 0
        assert files() == before
    assert good_round(mod, deployed(), 2).content["metrics"]["steps"] == 2
