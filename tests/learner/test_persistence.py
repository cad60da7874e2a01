"""A deployed learner: state on disk (atomic, restart-safe), settings and seed its own."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from flwr_corrnoise.apps.logreg_task import LogRegSetup, logistic_gradient
from flwr_corrnoise.flower.client import (
    CorrNoiseLearner,
    deployed,
    error_code,
    learner_seed,
)
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import MARKER_FILE, STATE_FILE, StateLostError, StateStore
from flwr_corrnoise.settings import PrivacyConfigError

SETUP = LogRegSetup(num_learners=2, dim=4, rounds=5, tau=2, eta=0.1, mechanism="blt")
NODE = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-3,
        "clip-norm": 1.0, "data-reuse": "once", "horizon": 10}
CONFIG = {"local-steps": 2, "learning-rate": 0.1}


def context(state_dir, run_config=None, **node) -> Context:
    return Context(run_id=1, node_id=1, node_config={**NODE, "state-dir": str(state_dir), **node},
                   state=RecordDict(), run_config=dict(run_config or {}))


def learner(ctx: Context) -> CorrNoiseLearner:
    return CorrNoiseLearner(ctx, logistic_gradient(SETUP, 0))


def test_restarted_learner_continues_exactly(tmp_path, simulated) -> None:
    x = [np.zeros(4)]
    ctx = context(tmp_path, **{"noise-seed": 3})
    uninterrupted = [learner(ctx).train(x, CONFIG)[0][0] for _ in range(3)]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp files left
    other = tmp_path / "b"
    first = learner(context(other, **{"noise-seed": 3})).train(x, CONFIG)[0][0]
    # a "restart": a new process, an empty context.state, the same state directory
    rest = [learner(context(other, **{"noise-seed": 3})).train(x, CONFIG)[0][0]
            for _ in range(2)]
    np.testing.assert_array_equal(np.array([first, *rest]), np.array(uninterrupted))
    state = LearnerState.from_bytes((other / STATE_FILE).read_bytes())
    assert state.step == state.noise.step == 6 and state.position == 6


def test_lost_state_is_refused_not_restarted(tmp_path) -> None:
    ctx = context(tmp_path)
    learner(ctx).train([np.zeros(4)], CONFIG)
    (tmp_path / STATE_FILE).unlink()
    with pytest.raises(StateLostError, match="trained before") as err:
        learner(context(tmp_path)).train([np.zeros(4)], CONFIG)
    assert error_code(err.value) == 4104
    assert not (tmp_path / STATE_FILE).exists()  # nothing was written


def test_corrupt_state_is_refused_and_left_untouched(tmp_path) -> None:
    learner(context(tmp_path)).train([np.zeros(4)], CONFIG)
    (tmp_path / STATE_FILE).write_bytes(b"garbage")
    with pytest.raises(StateLostError, match="corrupt"):
        learner(context(tmp_path)).train([np.zeros(4)], CONFIG)
    assert (tmp_path / STATE_FILE).read_bytes() == b"garbage"


def test_deployed_settings_ignore_the_run_config_and_refuse_weaker_proposals(tmp_path) -> None:
    weaker = {"epsilon": 8.0, "seed": 1, "num-server-rounds": 100}
    ctx = context(tmp_path, run_config=weaker)
    lrn = learner(ctx)
    assert deployed(ctx) and lrn.settings.epsilon == 2.0 and lrn.settings.horizon == 10
    with pytest.raises(PrivacyConfigError, match="ε 8 exceeds this learner's 2"):
        lrn.train([np.zeros(4)], CONFIG)
    assert not (tmp_path / STATE_FILE).exists() and not (tmp_path / MARKER_FILE).exists()
    # equal or stricter run-config values are fine
    learner(context(tmp_path / "ok", run_config={"epsilon": 1.0})).train([np.zeros(4)], CONFIG)


def test_deployed_seed_is_never_derived_from_the_run_config(tmp_path) -> None:
    run = {"seed": 7}
    assert learner_seed(context(tmp_path, run_config=run)) is None  # OS entropy
    a = learner(context(tmp_path / "a", run_config=run)).train([np.zeros(4)], CONFIG)[0][0]
    b = learner(context(tmp_path / "b", run_config=run)).train([np.zeros(4)], CONFIG)[0][0]
    assert not np.allclose(a, b)  # same data, same run config, independent noise

def test_simulations_keep_reproducible_seeds(simulated) -> None:
    sim = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                  run_config={"seed": 7})
    assert learner_seed(sim) is not None  # simulations stay reproducible


def test_deployed_learner_needs_its_own_horizon(tmp_path) -> None:
    ctx = Context(run_id=1, node_id=1,
                  node_config={"partition-id": 0, "mechanism": "blt", "state-dir": str(tmp_path)},
                  state=RecordDict(), run_config={"num-server-rounds": 10, "local-steps": 2})
    with pytest.raises(PrivacyConfigError, match="needs its horizon"):
        learner(ctx)


def test_store_marker_and_atomic_save(tmp_path) -> None:
    store = StateStore(tmp_path / "s")
    assert store.load() is None and not store.started
    store.save(b"one")
    store.save(b"two")
    assert store.started and store.load() == b"two"
    assert sorted(p.name for p in store.directory.iterdir()) == [MARKER_FILE, STATE_FILE]


def test_ledger_tiles_the_released_noise_indices(tmp_path) -> None:
    """Every committed round has a ledger line; the lines' step ranges tile 0..step."""
    ctx = context(tmp_path / "s")
    x = [np.zeros(SETUP.dim)]
    for r in (1, 2, 3):
        learner(ctx).train(x, {**CONFIG, "server-round": r})
    lines = StateStore(tmp_path / "s").ledger()
    assert [(e["server-round"], e["first-step"], e["steps"]) for e in lines] == [
        (1, 0, 2), (2, 2, 2), (3, 4, 2)]
    state = LearnerState.from_bytes((tmp_path / "s" / STATE_FILE).read_bytes())
    assert state.step == 6 and [e["position"] for e in lines] == [0, 2, 4]


def test_ledger_keeps_the_redone_round_not_the_crashed_one(tmp_path) -> None:
    """A crash between the ledger line and the state write leaves a line whose steps
    were never released; the redo repeats its first step and replaces it."""
    store = StateStore(tmp_path / "s")
    store.log_round({"server-round": 4, "first-step": 6, "steps": 2})  # crashed
    store.log_round({"server-round": 5, "first-step": 6, "steps": 2})  # redone
    store.log_round({"server-round": 6, "first-step": 8, "steps": 2})
    assert [e["server-round"] for e in store.ledger()] == [5, 6]


def test_refused_round_writes_no_ledger_line(tmp_path) -> None:
    ctx = context(tmp_path / "s")
    with pytest.raises(PrivacyConfigError):
        learner(ctx).train([np.zeros(SETUP.dim)], {**CONFIG, "privacy-epsilon": 8.0})
    assert StateStore(tmp_path / "s").ledger() == []
