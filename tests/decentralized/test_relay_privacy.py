"""A decentralized relay node is a learner like any other: the relay can neither know nor
replay its noise, its state is locked, ledgered and bound to it, and nothing data-dependent
leaves it in an error reply (issue 20, items 2 and 5).

The nodes run under the real-SuperNode rules (a direct ClientApp call outside Flower's
simulation engine), through Flower's real ClientApp call path, unless a test says otherwise.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from flwr_corrnoise.decentralized.protocol import (
    ALGORITHMS,
    Inbox,
    NodeAlgorithm,
    State,
    register,
)
from flwr_corrnoise.decentralized.tasks import Task, register_task
from flwr_corrnoise.flower import session
from flwr_corrnoise.flower.relay import RelayNode, make_relay_client_app
from flwr_corrnoise.persistence import (
    COMMITS_FILE,
    DIAGNOSTICS_FILE,
    LEDGER_FILE,
    LOCK_FILE,
    MARKER_FILE,
    STATE_FILE,
    StateStore,
)

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

STEPS = 4
#: the run's definition, shipped as the app's defaults; ``init-scale = 0`` makes a node's
#: step-0 release pure noise (θ₀ = 0), so equal releases mean equal noise
CFG = {"algorithm": "chen-wang", "graph": "ring", "num-nodes": 4, "steps": STEPS, "dim": 5,
       "seed": 11, "task": "synthetic-logreg", "samples-per-node": 30, "noise-scale": 0.5,
       "init-scale": 0.0}
APP = make_relay_client_app(CFG)
#: what LearnerSession.error_reply answers for any exception that is not a known refusal
FIXED_REASON = ("flwr-corrnoise: the learner's code failed; the details stay in the "
                "learner's log")


def ctx(node: int = 1, state_dir: Path | None = None, run: Mapping[str, Any] | None = None,
        **node_config: Any) -> Context:
    """A fresh SuperNode process for graph node ``node`` (empty ``context.state``)."""
    nc: dict[str, Any] = {"node-index": node, **node_config}
    if state_dir is not None:
        nc["state-dir"] = str(state_dir)
    return Context(run_id=1, node_id=100 + node, node_config=nc, state=RecordDict(),
                   run_config=dict(run if run is not None else {"seed": 11}))


def step_message(step: int, senders: tuple[int, ...] = (), value: float = 0.1) -> Message:
    """The relay's train message for ``step``: the neighbours' ``y`` outboxes."""
    inbox = ArrayRecord()
    for j in senders if step > 0 else ():
        inbox[f"{j}/y"] = Array(np.full(CFG["dim"], value))
    md = Metadata(run_id=1, message_id=f"m{step}", src_node_id=0, dst_node_id=1,
                  reply_to_message_id="", group_id=str(step), created_at=time.time(),
                  ttl=3600.0, message_type="train")
    content = RecordDict({"inbox": inbox,
                          "config": ConfigRecord({"step": step, "steps": STEPS})})
    return Message(content=content, metadata=md)


def run_steps(app: Any, context: Context, steps: range) -> list[np.ndarray]:
    """Node 1 of the ring (neighbours 0 and 2) through ``steps``; its released outboxes."""
    out = []
    for t in steps:
        reply = app(step_message(t, (0, 2)), context)
        assert not reply.has_error(), reply.error.reason
        out.append(reply.content["outbox"]["y"].numpy())
    return out


def files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.exists() else set()


# -- item 2: the relay can neither know nor replay a node's noise -------------------------
def test_relay_cannot_know_a_nodes_seed() -> None:
    """Two real nodes without a state-dir, identical configs — the run config's ``seed``
    and the app's defaults included — draw different noise; their seeds are 128-bit OS
    entropy. (The old relay used the config's ``seed``: the relay knew the noise, ε = ∞.)"""
    a, b = (APP(step_message(0), ctx()) for _ in range(2))
    ya, yb = (r.content["outbox"]["y"].numpy() for r in (a, b))
    assert np.abs(ya).max() > 0 and not np.allclose(ya, yb)
    seeds = [RelayNode(ctx(), CFG).seed for _ in range(2)]
    assert seeds[0] != seeds[1] and min(seeds) >= 2**64  # fails with probability 2⁻⁶³


def test_simulation_keeps_reproducible_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the test above: under the simulation rules the same config gives the
    same noise (the run's seed), so the difference above comes from the seed policy."""
    monkeypatch.setattr(session, "in_simulation", lambda: True)
    a, b = (APP(step_message(0), ctx()).content["outbox"]["y"].numpy() for _ in range(2))
    np.testing.assert_array_equal(a, b)
    c = APP(step_message(0), ctx(**{"noise-seed": 3})).content["outbox"]["y"].numpy()
    assert not np.allclose(a, c)


@pytest.mark.parametrize("where", ["node config, deployed", "node config", "app defaults"])
def test_fixed_noise_seed_is_refused_outside_simulation(tmp_path: Path, where: str) -> None:
    """A ``noise-seed`` would replay the node's noise after a wiped state: refused (4101),
    with or without a state-dir, before anything is built or written."""
    state_dir = tmp_path / "node1"
    app, nc = APP, {"noise-seed": 5}
    if where == "app defaults":
        app, nc = make_relay_client_app({**CFG, "noise-seed": 5}), {}
    context = ctx(state_dir=state_dir if where == "node config, deployed" else None, **nc)
    reply = app(step_message(0), context)
    assert reply.has_error() and reply.error.code == 4101
    assert "noise-seed" in reply.error.reason
    assert files(state_dir) == set() and len(context.state) == 0


def test_wiped_state_with_its_ledger_is_refused(tmp_path: Path) -> None:
    """Every released step has a ledger line before the reply leaves; deleting the state
    and its marker while the ledger stays does not restart the node at step 0 (4104)."""
    run_steps(APP, ctx(state_dir=tmp_path), range(2))
    ledger = StateStore(tmp_path).ledger()
    assert [int(e["first-step"]) for e in ledger] == [0, 1]  # type: ignore[call-overload]
    (tmp_path / STATE_FILE).unlink()
    (tmp_path / MARKER_FILE).unlink()
    context = ctx(state_dir=tmp_path)  # a restarted SuperNode, the relay at step 0 again
    reply = APP(step_message(0), context)
    assert reply.has_error() and reply.error.code == 4104 and "ledger" in reply.error.reason
    assert files(tmp_path) == {LEDGER_FILE, COMMITS_FILE, LOCK_FILE, DIAGNOSTICS_FILE}
    assert len(context.state) == 0 and len(StateStore(tmp_path).ledger()) == 2


def test_rolled_back_cloned_or_foreign_state_is_refused(tmp_path: Path) -> None:
    """A state restored from a copy one round old (its ledger and commit log record a later
    round), a state of the same node index copied from another directory (another
    identity), or another node's whole directory, is refused (4104), not continued."""
    node1, saved = tmp_path / "node1", tmp_path / "node1-after-step1"
    run_steps(APP, ctx(state_dir=node1), range(2))
    shutil.copy(node1 / STATE_FILE, saved)
    run_steps(APP, ctx(state_dir=node1), range(2, 3))
    shutil.copy(saved, node1 / STATE_FILE)  # restore the backup, one round old
    for step in (2, 3):
        reply = APP(step_message(step, (0, 2)), ctx(state_dir=node1))
        assert reply.has_error() and reply.error.code == 4104
        assert "rolled back" in reply.error.reason
    # node 1 started afresh elsewhere, then given the first directory's state
    other = tmp_path / "node1-elsewhere"
    run_steps(APP, ctx(state_dir=other), range(2))
    shutil.copy(saved, other / STATE_FILE)
    reply = APP(step_message(2, (0, 2)), ctx(state_dir=other))
    assert reply.has_error() and reply.error.code == 4104 and "another" in reply.error.reason
    # node 2's whole state directory (state, marker, ledger, commits) copied into node 1's
    node2, clone = tmp_path / "node2", tmp_path / "clone"
    assert not APP(step_message(0), ctx(2, state_dir=node2)).has_error()
    shutil.copytree(node2, clone)
    reply = APP(step_message(1, (0, 2)), ctx(1, state_dir=clone))
    assert reply.has_error() and reply.error.code == 4104 and "node 2" in reply.error.reason


def test_a_state_directory_serves_one_execution_at_a_time(tmp_path: Path) -> None:
    """While another execution holds the state directory, a message is refused (4105) and
    nothing is released or written; afterwards the same message goes through."""
    held, done = threading.Event(), threading.Event()

    def other_execution() -> None:
        with StateStore(tmp_path).lock():
            held.set()
            done.wait(5)

    thread = threading.Thread(target=other_execution)
    thread.start()
    held.wait(5)
    try:
        context = ctx(state_dir=tmp_path)
        reply = APP(step_message(0), context)
        assert reply.has_error() and reply.error.code == 4105
        assert files(tmp_path) == {LOCK_FILE} and len(context.state) == 0
    finally:
        done.set()
        thread.join()
    run_steps(APP, ctx(state_dir=tmp_path), range(1))
    assert {STATE_FILE, LEDGER_FILE} <= files(tmp_path)


# -- item 5: no data-dependent text or array leaves a node --------------------------------
@register_task("test-relay-data-error")
def _failing_task(cfg: Mapping[str, Any]) -> Task:
    """A task whose data loading fails with the offending datum in its message."""
    raise ValueError("row 17 of the private shard has feature value 0.123456789")


class _NaiveMean(NodeAlgorithm):
    """A user's naive (non-private) algorithm: it releases the mean of the node's own two
    data points, un-noised — a huge datum overflows it to ``inf``."""

    name = "test-relay-naive-mean"
    local_dp = False
    privacy_fields: ClassVar[dict[str, int]] = {}

    def __init__(self, graph: Any, task: Any, config: Mapping[str, Any]) -> None:
        super().__init__(graph, 2)
        self.datum = float(config["test-datum"])  # the node's own (local) data

    def default_privacy(self, nodes: np.ndarray) -> dict[str, np.ndarray]:
        return {}

    def init(self, nodes: np.ndarray, run_seed: int,
             privacy: Mapping[str, np.ndarray]) -> State:
        return {"node": np.asarray(nodes), "step": np.zeros(len(nodes), dtype=np.int64)}

    def release(self, state: State) -> tuple[dict[str, np.ndarray], State]:
        data = np.full((len(state["node"]), 2, self.dim), self.datum)
        with np.errstate(over="ignore"):
            return {"y": data.mean(axis=1)}, state

    def update(self, state: State, inbox: Inbox) -> State:
        return dict(state, step=state["step"] + 1)

    def decision(self, state: State) -> np.ndarray:
        return np.zeros((len(state["node"]), self.dim))


if _NaiveMean.name not in ALGORITHMS:
    register(_NaiveMean.name)(_NaiveMean)


def test_data_dependent_failures_send_a_fixed_reason(tmp_path: Path) -> None:
    """A task constructor that fails on its data, and an overflow in the release, both give
    the fixed reason (4100): no datum and no non-finite array leaves the node, nothing is
    stored or ledgered. (The overflowing release used to go out as an ``inf`` array.)"""
    reply = make_relay_client_app({**CFG, "task": "test-relay-data-error"})(
        step_message(0), ctx())
    assert reply.has_error() and (reply.error.code, reply.error.reason) == (4100, FIXED_REASON)
    app = make_relay_client_app({**CFG, "algorithm": _NaiveMean.name})
    small = app(step_message(0), ctx(**{"test-datum": 1.0}))
    assert not small.has_error()  # the control: a small datum is released
    context = ctx(state_dir=tmp_path, **{"test-datum": 1e308})
    huge = app(step_message(0), context)
    assert huge.has_error() and (huge.error.code, huge.error.reason) == (4100, FIXED_REASON)
    assert files(tmp_path) == {LOCK_FILE} and len(context.state) == 0


def test_relay_refusals_keep_clear_reasons() -> None:
    """The node's own refusals are functions of the relay's message and its state, and say
    what is wrong: a replayed step (4110), a dropped sender (4111)."""
    context = ctx()
    run_steps(APP, context, range(1))
    replay = APP(step_message(0), context)
    assert replay.has_error() and replay.error.code == 4110 and "step 0" in replay.error.reason
    dropped = APP(step_message(1, (0,)), context)
    assert dropped.has_error() and dropped.error.code == 4111
    assert "neighbours" in dropped.error.reason


# -- the declared data bounds are the node's own privacy settings ------------------------
@pytest.mark.parametrize("proposal, defaults", [
    ({"feature-bound": 3.0}, {}),  # a larger bound: larger C and L, a larger ε
    ({"privacy-feature-bound": 1.5}, {}),
    ({"clip": 2.0}, {"clip": 1.0}),
    ({"privacy-clip": 0}, {"clip": 1.0}),  # a clip of 0 is none: the weakest
])
def test_a_weaker_bound_in_the_run_config_is_refused(proposal: dict[str, Any],
                                                     defaults: dict[str, Any]) -> None:
    """Chen & Wang's ("Locally Differentially Private Distributed Online Learning with Guaranteed
    Optimality") ε is computed from the feature bound and the clip, so on a real node they are its
    own (app defaults, node config) and a larger run-config value is a refused proposal (4101) —
    before anything is built, drawn or stored. A smaller one is not weaker: the node answers (with
    its own settings). (The old node took no notice: its ε stayed right for its own bound, but the
    server's proposal was never checked.)"""
    app = make_relay_client_app({**CFG, **defaults})
    context = ctx(run={"seed": 11, **proposal})
    reply = app(step_message(0), context)
    assert reply.has_error() and reply.error.code == 4101
    name = next(iter(proposal)).removeprefix("privacy-")
    assert name in reply.error.reason and "weaker" in reply.error.reason
    assert len(context.state) == 0
    stronger = {k: 0.5 for k in proposal}
    assert not app(step_message(0), ctx(run={"seed": 11, **stronger})).has_error()


def test_the_accountant_charges_the_bound_the_node_started_with(tmp_path: Path) -> None:
    """A node started with ``feature-bound = 2`` is refused a larger bound later (4101,
    nothing written); restarted with a smaller one it goes on, and the ε it reports at the
    end is the one for ``B = 2`` — the bound its first releases were made under — computed
    here from eq. (22) with ``C = 2B``, ``L = B²/4 + r``, not the one for the bound now."""
    from flwr_corrnoise.decentralized.chen_wang import StepSizes
    from flwr_corrnoise.decentralized.chen_wang_privacy import TIGHT, chen_wang_epsilon

    state_dir = tmp_path / "node1"
    run_steps(APP, ctx(state_dir=state_dir, **{"feature-bound": 2.0}), range(2))
    ledger = len(StateStore(state_dir).ledger())
    larger = APP(step_message(2, (0, 2)), ctx(state_dir=state_dir, **{"feature-bound": 3.0}))
    assert larger.has_error() and larger.error.code == 4101
    assert "feature-bound" in larger.error.reason and "weaker" in larger.error.reason
    assert len(StateStore(state_dir).ledger()) == ledger
    smaller = ctx(state_dir=state_dir, **{"feature-bound": 1.0})
    run_steps(APP, smaller, range(2, STEPS))
    final = APP(step_message(STEPS, (0, 2)), smaller)
    assert not final.has_error()
    reported = final.content["metrics"][f"epsilon {TIGHT}"]

    def eps(bound: float) -> float:
        reg, w_self = 1e-3, 0.6  # synthetic-logreg's r; ring W = 0.3·(A − D): |w_ii| = 0.6
        return float(chen_wang_epsilon(
            STEPS, StepSizes(), w_self=w_self, L=bound**2 / 4 + reg, C=2 * bound, dim=CFG["dim"],
            noise_scale=CFG["noise-scale"], exponent=0.1 + 0.01 * 2)[-1])

    assert reported == pytest.approx(eps(2.0), rel=1e-12)
    assert eps(1.0) < 0.9 * eps(2.0)
