"""One private step, one learner transaction, one state format, one metrics definition.

Every front end steps through :func:`~flwr_corrnoise.learner.private_step` (the torch device
step through its bookkeeping) and runs each message as one
:class:`~flwr_corrnoise.flower.session.LearnerTransaction`. These tests check the shared
pieces directly, on real Flower ``Context`` s and a real state directory: a round that
fails changes nothing and leaves the directory unlocked, a round past the horizon never
runs, a reply needs a committed round, the device optimizer stores (and reads back) the one
learner-state format — and still reads the format it wrote before — and every front end
releases the same privacy metadata.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from flwr_corrnoise import arraypack
from flwr_corrnoise.flower.session import RELEASED_METRICS, LearnerSession
from flwr_corrnoise.learner import StepCounts, local_round, private_step
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import StateStore
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings, privacy_metrics
from flwr_corrnoise.streams import HorizonExhaustedError

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

DIM = 3
SETTINGS = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0, horizon=6)


def session(tmp_path: Path) -> LearnerSession:
    """A deployed learner (state directory, strict rules: its seed from OS entropy)."""
    context = Context(run_id=1, node_id=1, node_config={"state-dir": str(tmp_path)},
                      state=RecordDict(), run_config={})
    return LearnerSession(context, settings=SETTINGS)


def steps(tx, n: int) -> list[np.ndarray]:
    """``n`` private steps on the transaction's state, gradient ones(DIM)·position."""
    return [private_step(tx.state, SETTINGS, lambda: np.full(DIM, tx.state.position + 1.0),
                         DIM, tx.counts) for _ in range(n)]


def files(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tmp_path.iterdir())
            if p.name != "learner.lock"}


def test_a_failed_round_changes_nothing_and_unlocks(tmp_path: Path) -> None:
    with session(tmp_path).transaction({"server-round": 1}, [(DIM,)], steps=2) as tx:
        steps(tx, 2)
    assert tx.committed and tx.state.step == 2
    before = files(tmp_path)
    failing = session(tmp_path).transaction({"server-round": 2}, [(DIM,)], steps=2)
    with pytest.raises(RuntimeError, match="the user's code"), failing as tx:
        expected = tx.state.noise.fork().next()  # type: ignore[union-attr]
        steps(tx, 2)
        raise RuntimeError("the user's code failed after two steps")
    # nothing was written (the round's state object is dropped, never stored) ...
    assert files(tmp_path) == before
    # ... and the lock is free: the next round opens and continues from step 2, with the
    # noise the failed round drew but never released
    with session(tmp_path).transaction({"server-round": 2}, [(DIM,)], steps=2) as again:
        assert (again.state.step, again.state.position, again.state.rounds,
                again.state.generation) == (2, 2, 0, 1)
        np.testing.assert_array_equal(again.state.noise.fork().next(),  # type: ignore[union-attr]
                                      expected)
        steps(again, 2)
    assert LearnerState.from_bytes(StateStore(tmp_path).load()).step == 4  # type: ignore[arg-type]


def test_a_round_past_the_horizon_never_runs(tmp_path: Path) -> None:
    with session(tmp_path).transaction({}, [(DIM,)], steps=5) as tx:
        steps(tx, 5)
    before = files(tmp_path)
    ran = []
    with pytest.raises(HorizonExhaustedError, match="5 of the 6 steps"), \
            session(tmp_path).transaction({}, [(DIM,)], steps=2):
        ran.append(True)
    assert not ran and files(tmp_path) == before
    with session(tmp_path).transaction({}, [(DIM,)], steps=1) as tx:  # unlocked, 1 step left
        steps(tx, 1)
    # the step itself refuses too
    with pytest.raises(HorizonExhaustedError), \
            session(tmp_path).transaction({}, [(DIM,)]) as tx:
        steps(tx, 1)


def test_a_weaker_proposal_or_another_model_size_is_refused_before_the_lock(
        tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match="ε 3 exceeds"):
        session(tmp_path).transaction({"privacy-epsilon": 3.0}, [(DIM,)]).open()
    with session(tmp_path).transaction({}, [(DIM,)], steps=1) as tx:
        steps(tx, 1)
    with pytest.raises(PrivacyConfigError, match="model has 4 parameters"):
        session(tmp_path).transaction({}, [(DIM + 1,)], steps=1).open()
    with session(tmp_path).transaction({}, [(DIM,)], steps=1) as tx:  # nothing held
        steps(tx, 1)


def test_a_reply_needs_a_committed_round(tmp_path: Path) -> None:
    from ..flower.test_release_gate import message

    tx = session(tmp_path).transaction({}, [(DIM,)], steps=1)
    tx.open()
    steps(tx, 1)
    with pytest.raises(PrivacyConfigError, match="before the round was committed"):
        tx.reply(message("train", np.zeros(DIM), 1), [np.zeros(DIM)], num_examples=1.0)
    tx.abort()
    assert StateStore(tmp_path).load() is None  # nothing stored, nothing released


def test_local_round_is_tau_private_steps() -> None:
    """``local_round``'s update is the mean of ``private_step``'s releases, bit for bit."""
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=5)
    twin = LearnerState.from_bytes(state.to_bytes())
    x, eta = [np.linspace(-1.0, 1.0, DIM)], 0.1

    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        return [params[0] * (position + 2.0)]

    result = local_round(x, gradient, state, SETTINGS, 3, eta)
    z, total, counts = x[0].copy(), np.zeros(DIM), StepCounts()
    for _ in range(3):
        g = private_step(twin, SETTINGS, partial(gradient, [z.copy()], twin.position), DIM,
                         counts)
        z -= eta * g
        total += g
    np.testing.assert_array_equal(result.update[0], total / 3)
    assert result.diagnostics == counts.diagnostics(3)
    assert (state.step, state.position) == (twin.step, twin.position) == (3, 3)


def test_the_device_optimizer_stores_the_learner_state_and_reads_its_old_format() -> None:
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import PrivateOptimizer, device_local_round

    settings = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=0.5, horizon=6)
    g = np.random.default_rng(0)
    a, b = g.normal(size=(12, 4)), g.integers(0, 2, size=12)

    def batches(i: int):
        return torch.from_numpy(a[i : i + 1]), torch.from_numpy(b[i : i + 1])

    def optimizer(**kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
        return PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, settings,
                                **kwargs)

    private = optimizer(seed=9)
    device_local_round(private, batches, 3, 0)
    blob = private.to_bytes()
    stored = LearnerState.from_bytes(blob)  # the one format every front end stores
    assert (stored.step, stored.position, stored.rounds) == (3, 3, 1)
    stored.check_binding(settings)
    # the optimizer's earlier format: steps, binding and stream, without the counters
    legacy = arraypack.pack({
        "format": np.array(1, dtype=np.int64), "steps": np.array(3, dtype=np.int64),
        "binding": np.array(json.dumps(stored.binding, sort_keys=True)),
        "noise": np.frombuffer(private.noise.to_bytes(), dtype=np.uint8)})  # type: ignore[union-attr]
    updates = []
    for state in (blob, legacy):
        again = optimizer(state=state)
        assert again.steps == 3
        updates.append(device_local_round(again, batches, 3, 3).update)
    for u, v in zip(*updates, strict=True):
        np.testing.assert_array_equal(u, v)
    model = torch.nn.Linear(4, 2).double()
    other = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0, horizon=6)
    with pytest.raises(PrivacyConfigError, match="other privacy settings"):
        PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, other,
                         state=legacy)


def test_every_front_end_releases_the_same_privacy_metadata(tmp_path: Path) -> None:
    """The NumPy round, the release gate and the device optimizer report one definition
    (:func:`~flwr_corrnoise.settings.privacy_metrics`), all of it on the gate's list."""
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=1)
    result = local_round([np.zeros(DIM)], lambda p, i: [np.ones(DIM)], state, SETTINGS, 2, 0.1)
    expected = privacy_metrics(SETTINGS, 2)
    assert result.metrics == expected
    assert set(expected) == {"steps", "horizon", "epsilon", "delta", "epsilon-spent",
                             "noise-std"} and set(expected) <= RELEASED_METRICS
    assert session(tmp_path).privacy_metrics(state) == expected
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import PrivateOptimizer

    model = torch.nn.Linear(DIM, 1, bias=False).double()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, SETTINGS,
                               seed=1)
    for _ in range(2):
        private.zero_grad()
        model(torch.ones(1, DIM, dtype=torch.float64)).sum().backward()
        private.step()
    assert private.metrics() == expected
