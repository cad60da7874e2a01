"""A deployed learner's state cannot be rolled back, cloned or wiped unnoticed.

Why: a learner that continues from an older copy of its state, or from another learner's
state, adds noise that was already released — the difference of the two releases is the
difference of the clipped gradients, with no noise at all. The state records the learner's
identity (128 bits from OS entropy) and a commit generation; the ledger (append-only,
fsynced, written before the state) records both for every round; every load checks one
against the other and refuses a mismatch (code 4104) before anything is released, changing
nothing on disk.

Each test drives the real front ends (``make_client_app``, ``numpy_client_app``,
``CorrNoiseRoundMod``, ``PrivateSteps``) through Flower's ClientApp call path with real
Messages and Contexts whose node config has a ``state-dir``, under the real-SuperNode rules.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from flwr_corrnoise.flower import (
    CorrNoiseNumPyClient,
    CorrNoiseRoundMod,
    PrivateSteps,
    make_client_app,
    numpy_client_app,
)
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import (
    COMMITS_FILE,
    LEDGER_FILE,
    LOCK_FILE,
    MARKER_FILE,
    STATE_FILE,
    StateStore,
)

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)
from ..messages import flower_message

DIM, TAU = 3, 2
LEARNER = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-3,
           "clip-norm": 1.0, "data-reuse": "once", "horizon": 6 * TAU}


def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
    """Least squares towards a fixed, position-dependent target."""
    return [params[0] - 0.1 * (position % 3)]


class Client(CorrNoiseNumPyClient):
    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        return gradient(parameters, position)


def round_mod_app() -> ClientApp:
    app = ClientApp(mods=[CorrNoiseRoundMod()])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):
            x = x - 0.1 * gradient([x], (r - 1) * TAU + t)[0]
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    return app


def private_steps_app() -> ClientApp:
    app = ClientApp(mods=[PrivateSteps.guard()])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):
            x = x - 0.1 * private.step(gradient([x], (r - 1) * TAU + t)[0])
        return private.reply([x])

    return app


#: front end → (its ClientApp, the subdirectory of state-dir its session keeps)
FRONT_ENDS: dict[str, tuple[Callable[[], ClientApp], str]] = {
    "make_client_app": (lambda: make_client_app(lambda context: gradient), ""),
    "numpy_client_app": (lambda: numpy_client_app(Client), ""),
    "CorrNoiseRoundMod": (round_mod_app, "round-mod"),
    "PrivateSteps": (private_steps_app, ""),
}


@pytest.fixture(params=list(FRONT_ENDS))
def front(request: pytest.FixtureRequest) -> tuple[ClientApp, str]:
    make, sub = FRONT_ENDS[request.param]
    return make(), sub


def message(server_round: int) -> Message:
    return flower_message(np.full(DIM, 0.2), server_round=server_round,
                          config={"local-steps": TAU, "learning-rate": 0.1})


def train(app: ClientApp, state_dir: Path, server_round: int) -> Message:
    """One train message to a learner on a real SuperNode (a fresh Context each time, as
    after a restart: the state directory is the only memory)."""
    context = Context(run_id=1, node_id=1, node_config={**LEARNER, "state-dir": str(state_dir)},
                      state=RecordDict(), run_config={})
    return app(message(server_round), context)


def release(reply: Message) -> np.ndarray:
    assert not reply.has_error(), reply.error.reason
    return reply.content["arrays"].to_numpy_ndarrays()[0]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` but the lock (whose text names the current holder)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def assert_refused(reply: Message, what: str) -> None:
    """An error reply (code 4104) naming ``what``, with no content: nothing released."""
    assert reply.has_error(), "the learner released a round from an inconsistent state"
    assert reply.error.code == 4104, reply.error.reason
    assert what in reply.error.reason, reply.error.reason
    assert not reply.has_content()


@pytest.mark.parametrize("back", [1, 2])
def test_rolled_back_state_is_refused(tmp_path: Path, front, back: int) -> None:
    """Restoring an older copy of ``learner.state`` (one round back: the hardest case, next
    to a crash between ledger and state) is refused and changes nothing on disk."""
    app, sub = front
    state_file = tmp_path / sub / STATE_FILE
    copies = []
    for r in (1, 2, 3):
        release(train(app, tmp_path, r))
        copies.append(state_file.read_bytes())
    state_file.write_bytes(copies[-1 - back])  # the operator restores an older backup
    before = snapshot(tmp_path)
    reply = train(app, tmp_path, 4)
    assert_refused(reply, "rolled back")
    assert snapshot(tmp_path) == before


def test_state_cloned_into_a_learner_that_trained_is_refused(tmp_path: Path, front) -> None:
    """Learner A's state copied over learner B's (both trained) is refused in B's directory."""
    app, sub = front
    a, b = tmp_path / "a", tmp_path / "b"
    for r in (1, 2):
        release(train(app, a, r))
    release(train(app, b, 1))
    shutil.copyfile(a / sub / STATE_FILE, b / sub / STATE_FILE)
    before = snapshot(b)
    assert_refused(train(app, b, 3), "another learner")
    assert snapshot(b) == before
    release(train(app, a, 3))  # A itself goes on


@pytest.mark.parametrize("with_marker", [False, True])
def test_state_cloned_into_a_fresh_directory_is_refused(
        tmp_path: Path, front, with_marker: bool) -> None:
    """Learner A's state (and marker) copied into an empty directory has no ledger there to
    match: refused, rather than a second learner continuing A's noise stream."""
    app, sub = front
    a, b = tmp_path / "a", tmp_path / "b"
    release(train(app, a, 1))
    (b / sub).mkdir(parents=True)
    for name in (STATE_FILE, MARKER_FILE) if with_marker else (STATE_FILE,):
        shutil.copyfile(a / sub / name, b / sub / name)
    before = snapshot(b)
    assert_refused(train(app, b, 2), "ledger")
    assert snapshot(b) == before


def test_wiped_state_with_the_ledger_kept_is_refused(tmp_path: Path, front) -> None:
    """State and marker deleted, the ledger left: the learner released rounds and lost its
    state; it refuses rather than restart at step 0 and report ε spent from zero."""
    app, sub = front
    for r in (1, 2):
        release(train(app, tmp_path, r))
    (tmp_path / sub / STATE_FILE).unlink()
    (tmp_path / sub / MARKER_FILE).unlink()
    before = snapshot(tmp_path)
    assert_refused(train(app, tmp_path, 3), "ledger")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / sub / STATE_FILE).exists()


def test_consistent_state_loads_and_continues(tmp_path: Path, front) -> None:
    """Across restarts the state, marker and ledger agree on identity and generation, and
    the learner goes on; ε spent grows with the steps."""
    app, sub = front
    spent = []
    for r in (1, 2, 3):
        reply = train(app, tmp_path, r)
        release(reply)
        spent.append(reply.content["metrics"]["epsilon-spent"])
    assert spent == sorted(spent) and spent[0] < spent[-1]
    directory = tmp_path / sub
    state = LearnerState.from_bytes((directory / STATE_FILE).read_bytes())
    assert state.generation == 3
    assert isinstance(state.learner_id, str) and len(bytes.fromhex(state.learner_id)) == 16
    # each round: a ledger line before the state, a commit line after it; both name the
    # learner's identity and the round's generation
    for name in (LEDGER_FILE, COMMITS_FILE):
        lines = [json.loads(x) for x in (directory / name).read_text().splitlines()]
        assert [(e["identity"], e["generation"]) for e in lines] == [
            (state.learner_id, g) for g in (1, 2, 3)], name
    assert json.loads((directory / MARKER_FILE).read_text())["identity"] == state.learner_id
    assert [e["first-step"] for e in StateStore(directory).ledger()] == [
        0, state.step // 3, 2 * state.step // 3]


def test_a_crash_between_ledger_and_state_is_redone(tmp_path: Path, front, monkeypatch) -> None:
    """A crash after the round's ledger line but before its state was written released
    nothing (the commit line, and the reply, come after the state): the next message
    redoes that round from the stored state, with the same noise indices — and the
    release equals an uninterrupted learner's with the same noise."""
    app, sub = front
    release(train(app, tmp_path, 1))
    real_save = StateStore.save

    def crash(self: StateStore, *args: Any, **kwargs: Any) -> None:
        raise OSError("simulated crash before the state was written")

    monkeypatch.setattr(StateStore, "save", crash)
    assert train(app, tmp_path, 2).has_error()
    monkeypatch.setattr(StateStore, "save", real_save)
    state_before = LearnerState.from_bytes((tmp_path / sub / STATE_FILE).read_bytes())
    assert state_before.generation == 1
    # an uninterrupted twin: the same state, in its own directory (identity and ledger too)
    twin = tmp_path / "twin"
    shutil.copytree(tmp_path / sub, twin / sub)
    lines = (twin / sub / LEDGER_FILE).read_text().splitlines()
    assert len(lines) == 2  # round 1, and round 2's line, never committed
    (twin / sub / LEDGER_FILE).write_text(lines[0] + "\n")  # round 1 only
    redone = release(train(app, tmp_path, 2))
    np.testing.assert_array_equal(redone, release(train(app, twin, 2)))
    state = LearnerState.from_bytes((tmp_path / sub / STATE_FILE).read_bytes())
    assert state.generation == 2 and state.learner_id == state_before.learner_id
    assert [e["first-step"] for e in StateStore(tmp_path / sub).ledger()] == [
        0, state_before.step]


def legacy(directory: Path) -> None:
    """Turn a learner's directory into one written before identities existed: a state
    without identity or generation, ledger lines without them, no commit log, a marker that
    only says when it started."""
    state = LearnerState.from_bytes((directory / STATE_FILE).read_bytes())
    state.learner_id, state.generation = None, 0
    (directory / STATE_FILE).write_bytes(state.to_bytes())
    lines = [json.loads(x) for x in (directory / LEDGER_FILE).read_text().splitlines()]
    (directory / LEDGER_FILE).write_text("".join(
        json.dumps({k: v for k, v in e.items() if k not in ("identity", "generation")}) + "\n"
        for e in lines))
    (directory / COMMITS_FILE).unlink()
    (directory / MARKER_FILE).write_text(json.dumps({"started": 0.0}))


def test_a_state_from_before_identities_loads_if_it_matches_its_ledger(tmp_path: Path) -> None:
    """Older on-disk states stay loadable when their step ends the ledger's last round, and
    are identified from their next commit on; an older one (rolled back) is refused."""
    app, _ = FRONT_ENDS["make_client_app"]
    app = app()
    for r in (1, 2):
        release(train(app, tmp_path, r))
    old_state = LearnerState.from_bytes((tmp_path / STATE_FILE).read_bytes())
    legacy(tmp_path)
    release(train(app, tmp_path, 3))
    state = LearnerState.from_bytes((tmp_path / STATE_FILE).read_bytes())
    assert state.learner_id is not None and state.generation == 1
    assert state.step == old_state.step + TAU
    # a rolled-back older-format state: its step is behind the older ledger's last round.
    # (One round back cannot be told from a crash before the state was written: older
    # ledgers have no commit log. Two rounds back can.)
    other = tmp_path / "other"
    release(train(app, other, 1))
    first = (other / STATE_FILE).read_bytes()
    for r in (2, 3):
        release(train(app, other, r))
    (other / STATE_FILE).write_bytes(first)
    legacy(other)
    before = snapshot(other)
    assert_refused(train(app, other, 4), "rolled back")
    assert snapshot(other) == before


def test_an_append_cut_short_by_a_crash_is_skipped(tmp_path: Path) -> None:
    """A ledger line torn by a crash (no newline, unparsable) announced nothing that
    happened: the learner goes on, and its next line is a line of its own."""
    app, _ = FRONT_ENDS["make_client_app"]
    app = app()
    release(train(app, tmp_path, 1))
    with open(tmp_path / LEDGER_FILE, "a") as fh:
        fh.write('{"first-step": 2, "gener')
    release(train(app, tmp_path, 2))
    assert [e["first-step"] for e in StateStore(tmp_path).ledger()] == [0, TAU]
