"""The Flower layer on Flower's real simulation engine.

Each test runs ``flwr.simulation.run_simulation`` with real virtual SuperNodes, so learner
objects are re-created for every message and everything a learner remembers must come back
from ``context.state``: two on Ray with two actors (a learner moves between processes),
the rest with the ClientApp in this process (``tests/flower_helpers.InProcessBackend``:
messages and Contexts still pickled in and out, as Ray ships them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from experiments.logreg import run_logreg_inprocess
from flwr_corrnoise.apps.logreg import logreg_apps, wait_for_nodes
from flwr_corrnoise.apps.logreg_task import (
    LogRegEvaluator,
    LogRegSetup,
    initial_parameters,
    logistic_gradient,
)
from flwr_corrnoise.flower import CorrNoiseFedAvg, CorrNoiseNumPyClient, numpy_client_app
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import PrivacySettings, derive_seed

from ..flower_helpers import backend_config, read_results, simulate

pytestmark = pytest.mark.slow

SMALL = LogRegSetup(num_learners=3, dim=6, rounds=4, tau=3, eta=0.2, mechanism="toeplitz",
                    test_size=200, seed=7, data_seed=3)


def inprocess(setup: LogRegSetup, schedule=None):
    ev = LogRegEvaluator(setup)
    return run_logreg_inprocess(setup, evaluate=ev, schedule=schedule), ev


@pytest.mark.parametrize("mechanism", ["toeplitz", "tree"])
def test_flower_simulation_matches_inprocess(tmp_path: Path, mechanism: str) -> None:
    """Same seeds → same global model (1e-10): the learner's noise stream and data position
    survive the round trip through context.state across rounds."""
    setup = SMALL.with_(mechanism=mechanism)
    server_app, client_app = logreg_apps(setup, str(tmp_path), progress=False)
    # toeplitz on Ray with two actors (a learner can run on either actor process, so what
    # it remembers must come back in context.state); the other mechanism in this process
    simulate(server_app, client_app, setup.num_learners,
             backend=backend_config(actors=2) if mechanism == "toeplitz" else None)
    final, summary = read_results(tmp_path)
    res, ev = inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], rtol=0, atol=1e-10)
    assert summary["final_accuracy"] == pytest.approx(ev.summary()["final_accuracy"])
    assert summary["dynamic_regret"] == pytest.approx(ev.summary()["dynamic_regret"], abs=1e-8)
    # every learner used exactly R·τ steps and spent exactly its budget
    for report in summary["learners"].values():
        assert report["steps"] == setup.rounds * setup.tau
        assert report["epsilon-spent"] == pytest.approx(setup.epsilon, rel=1e-9)
    # power: a learner that restarted its noise stream every round (state lost) would differ
    broken = inprocess_with_state_reset(setup)
    assert np.max(np.abs(broken - final)) > 1e-3


def test_offloaded_states_give_the_same_model(tmp_path: Path) -> None:
    """``state-offload = on``: every learner's state lives in a file under the run-level
    ``state-offload-dir`` with a handle in ``context.state``; the run is the in-process one
    to 1e-10 (the stream and data position survive the files), and each learner keeps at
    most two files: its last committed generation (= the rounds) and the one before."""
    from flwr_corrnoise.flower import make_client_app

    setup = SMALL.with_(mechanism="blt")
    server_app, _ = logreg_apps(setup, str(tmp_path), progress=False)
    states = tmp_path / "states"
    client_app = make_client_app(
        lambda context: logistic_gradient(setup, int(context.node_config["partition-id"])),
        config_defaults={**setup.to_run_config(), "state-offload": "on",
                         "state-offload-dir": str(states)})
    simulate(server_app, client_app, setup.num_learners)
    final, _ = read_results(tmp_path)
    res, _ = inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], rtol=0, atol=1e-10)
    folders = sorted(states.glob("run-*/node-*/flwr-corrnoise"))
    assert len(folders) == setup.num_learners
    for folder in folders:
        generations = sorted(int(f.name[1:].split("-")[0]) for f in folder.glob("g*.state"))
        assert generations == [setup.rounds - 1, setup.rounds]


def inprocess_with_state_reset(setup: LogRegSetup) -> np.ndarray:
    from flwr_corrnoise.aggregation import aggregate
    from flwr_corrnoise.learner import local_round
    from flwr_corrnoise.settings import derive_seed

    x = initial_parameters(setup)
    for r in range(setup.rounds):
        updates = []
        for i in range(setup.num_learners):
            state = LearnerState.create(setup.settings(), [(setup.dim,)],
                                        derive_seed(setup.seed, i))
            state.position = r * setup.tau  # data position kept, noise restarted
            grad = logistic_gradient(setup, i)
            updates.append(local_round(x, grad, state, setup.settings(), setup.tau,
                                       setup.eta).update)
        x = aggregate(x, updates, setup.eta, setup.eta_g, setup.tau)
    return x[0]


def test_learners_missing_rounds_stay_consistent(tmp_path: Path) -> None:
    """fraction-train 0.5: absent learners keep their step counters and streams; replaying
    Flower's participation in-process gives the same model."""
    setup = SMALL.with_(num_learners=4, rounds=5, fraction_train=0.5, mechanism="efficient-tree")
    server_app, client_app = logreg_apps(setup, str(tmp_path), progress=False)
    simulate(server_app, client_app, setup.num_learners)
    final, summary = read_results(tmp_path)
    schedule = summary["participation"]
    assert all(len(r) == 2 for r in schedule)
    counts = np.bincount(np.concatenate(schedule), minlength=4)
    assert counts.min() < setup.rounds  # somebody really missed a round
    res, _ = inprocess(setup, schedule=schedule)
    np.testing.assert_allclose(final, res.params[0], rtol=0, atol=1e-10)
    for state, count in zip(res.states, counts, strict=True):
        assert state.step == state.noise.step == count * setup.tau


class LogisticNumPyClient(CorrNoiseNumPyClient):
    """A user's NumPyClient adapted to correlated noise: `fit` replaced by `gradient`."""

    def __init__(self, context: Context, setup: LogRegSetup) -> None:
        pid = int(context.node_config["partition-id"])
        self.grad = logistic_gradient(setup, pid)
        super().__init__(context, setup.settings(), seed=derive_seed(setup.seed, pid))

    def gradient(self, parameters, position):
        return self.grad(parameters, position)


def test_numpy_client_gives_the_same_model(tmp_path: Path) -> None:
    setup = SMALL
    server_app, _ = logreg_apps(setup, str(tmp_path), progress=False)
    client_app = numpy_client_app(lambda context: LogisticNumPyClient(context, setup))
    simulate(server_app, client_app, setup.num_learners)
    final, _ = read_results(tmp_path)
    res, _ = inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], rtol=0, atol=1e-10)


def test_weakening_server_is_refused_and_nothing_applied(tmp_path: Path) -> None:
    """A server proposing a larger ε gets clear error replies, the model is not moved, and
    the run fails loudly (it used to end "completed" with the untrained model)."""
    from flwr_corrnoise.flower import RunFailedError

    setup = SMALL.with_(rounds=2)
    _, client_app = logreg_apps(setup, str(tmp_path), progress=False)
    seen: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, setup.num_learners)
        weaker = PrivacySettings("toeplitz", epsilon=8.0, delta=1e-3, clip_norm=1.0,
                                 horizon=setup.horizon)
        strategy = CorrNoiseFedAvg(local_steps=setup.tau, learning_rate=setup.eta,
                                   privacy=weaker, min_available_nodes=setup.num_learners)
        seen["strategy"] = strategy
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_parameters(setup)),
                                num_rounds=setup.rounds)
        seen["final"] = result.arrays.to_numpy_ndarrays()[0]

    with pytest.raises(RunFailedError, match=rf"{setup.num_learners} × code 4101"):
        simulate(server_app, client_app, setup.num_learners)
    assert "final" not in seen  # no result from a run that released nothing
    rounds = seen["strategy"].rounds
    assert len(rounds) == setup.rounds
    for r in rounds:
        assert r["accepted"] == 0 and len(r["errors"]) == setup.num_learners
        for err in r["errors"]:
            assert err["code"] == 4101
            assert "ε 8 exceeds this learner's 2" in err["reason"]
