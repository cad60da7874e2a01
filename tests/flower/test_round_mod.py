"""The per-round correlated-noise mod (Zhang, Zhu, Fay & Johansson's ("Locally Differentially
Private Online Federated Learning With Correlated Noise", arXiv version) variant) around unmodified
ClientApps."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

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
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_corrnoise.apps.logreg_task import LogRegSetup, logistic_gradient
from flwr_corrnoise.flower import CorrNoiseRoundMod
from flwr_corrnoise.flower.round_mod import ROUND_STATE_KEY, round_settings
from flwr_corrnoise.learner import clip_by_global_norm
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.mechanisms.base import prefix_sum_matrix
from flwr_corrnoise.settings import PrivacySettings, derive_seed
from flwr_corrnoise.streams import NoiseStream

from ..flower_helpers import local_sgd, simulate
from ..messages import flower_message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

pytestmark = pytest.mark.usefixtures("simulated")  # reproducible seeds, as in a simulation

SETTINGS = PrivacySettings("toeplitz", epsilon=2.0, delta=1e-3, clip_norm=0.5, horizon=3)


#: a new server round for every message that does not name one (a learner refuses a second
#: message for a round it released)
_ROUNDS = itertools.count(1)


def train_message(x: list[np.ndarray], **config) -> Message:
    config.setdefault("server-round", next(_ROUNDS))
    return flower_message(x, server_round=config.pop("server-round"), config=config,
                          group_id="1")


def context(seed: int = 5) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "noise-seed": seed},
                   state=RecordDict(), run_config={})


class Inner:
    """An unmodified 'ClientApp' body: returns received + a fixed update."""

    def __init__(self, update: list[np.ndarray]) -> None:
        self.update, self.calls = update, 0

    def __call__(self, msg: Message, ctxt: Context) -> Message:
        self.calls += 1
        x = msg.content["arrays"].to_numpy_ndarrays()
        out = [a + u for a, u in zip(x, self.update, strict=True)]
        return Message(RecordDict({"arrays": ArrayRecord(out),
                                   "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def test_clip_bounds_each_round_and_noise_is_the_stream_increment() -> None:
    x = [np.zeros((2, 2)), np.ones(3)]
    huge = [np.full((2, 2), 10.0), np.full(3, -7.0)]
    mod, ctxt = CorrNoiseRoundMod(SETTINGS), context(seed=5)
    replica = NoiseStream.create("toeplitz", 3, [(2, 2), (3,)], SETTINGS.calibration().std,
                                 seed=5)
    for r in range(3):
        reply = mod(train_message(x, **{"server-round": r + 1}), ctxt, Inner(huge))
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        released = np.concatenate([a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()])
        base = np.concatenate([a.ravel() for a in x])
        noise = replica.next()
        contribution = released - base - noise
        assert np.linalg.norm(contribution) == pytest.approx(SETTINGS.clip_norm, rel=1e-12)
        direction = np.concatenate([u.ravel() for u in huge])
        np.testing.assert_allclose(contribution, clip_by_global_norm(direction, 0.5)[0],
                                   atol=1e-12)
        metrics = reply.content["metrics"]
        assert metrics["rounds-noised"] == r + 1 and "update-clipped" not in metrics
        assert metrics["noise-std"] == pytest.approx(SETTINGS.calibration().std)
    assert metrics["epsilon-spent"] == pytest.approx(2.0, rel=1e-9)  # whole budget at R


def test_calibration_is_the_round_mechanisms_gaussian() -> None:
    """V = the analytic Gaussian for Δ = 2·B·max‖c_j‖ over the R×R factorization, checked
    against a materialized C and dp_accounting's PLD accountant."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    rounds = 40
    settings = round_settings({"mechanism": "toeplitz", "epsilon": 2.0, "delta": 1e-3,
                               "clip-norm": 0.3, "data-reuse": "once", "num-server-rounds": rounds})
    assert settings.horizon == rounds
    _, C = build_factorization("toeplitz", rounds).matrices()
    np.testing.assert_allclose(build_factorization("toeplitz", rounds).matrices()[0] @ C,
                               prefix_sum_matrix(rounds), atol=1e-10)
    sens = np.linalg.norm(C, axis=0).max()
    std = settings.calibration().std
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=std / (2 * 0.3 * sens)))
    assert acc.get_epsilon(1e-3) == pytest.approx(2.0, rel=2e-3)
    # the per-step algorithm over N = R·τ steps needs more noise per release
    per_step = PrivacySettings("toeplitz", 2.0, 1e-3, 0.3, horizon=rounds * 4)
    assert per_step.calibration().std > std


def test_weakening_proposal_is_refused_before_training() -> None:
    mod, ctxt, inner = CorrNoiseRoundMod(SETTINGS), context(), Inner([np.ones(3)])
    reply = mod(train_message([np.zeros(3)], **{"privacy-epsilon": 8.0}), ctxt, inner)
    assert reply.has_error() and reply.error.code == 4101
    assert "ε 8 exceeds this learner's 2" in reply.error.reason
    assert inner.calls == 0 and ROUND_STATE_KEY not in ctxt.state


def test_non_finite_update_counts_as_zero_and_the_noise_is_released() -> None:
    """Whether the wrapped app's update is finite depends on the data: it must not change
    the reply. The round releases the noise alone (a zero update)."""
    mod, ctxt = CorrNoiseRoundMod(SETTINGS), context()
    replica = NoiseStream.create("toeplitz", 3, [(3,)], SETTINGS.calibration().std, seed=5)
    good = mod(train_message([np.zeros(3)]), ctxt, Inner([np.zeros(3)]))
    np.testing.assert_allclose(good.content["arrays"].to_numpy_ndarrays()[0], replica.next(),
                               atol=1e-12)
    bad = mod(train_message([np.zeros(3)]), ctxt, Inner([np.array([1.0, np.nan, 0.0])]))
    assert not bad.has_error()
    np.testing.assert_allclose(bad.content["arrays"].to_numpy_ndarrays()[0], replica.next(),
                               atol=1e-12)
    assert dict(bad.content["metrics"]).keys() == dict(good.content["metrics"]).keys()


def test_rounds_past_the_horizon_are_refused() -> None:
    mod, ctxt = CorrNoiseRoundMod(SETTINGS), context()
    for _ in range(3):
        assert not mod(train_message([np.zeros(3)]), ctxt, Inner([np.ones(3)])).has_error()
    inner = Inner([np.ones(3)])
    reply = mod(train_message([np.zeros(3)]), ctxt, inner)
    assert reply.has_error() and reply.error.code == 4102 and inner.calls == 0
    assert "stops contributing" in reply.error.reason


SMALL = LogRegSetup(num_learners=3, dim=5, rounds=4, tau=2, eta=0.3, test_size=50,
                    seed=9, data_seed=2)


def plain_app() -> ClientApp:
    """An ordinary Flower app, untouched except for the mod in its decorator."""
    app = ClientApp()
    mod = CorrNoiseRoundMod(config_defaults={"mechanism": "blt", "epsilon": 2.0,
                                             "delta": 1e-3, "clip-norm": 0.4, "data-reuse": "once",
                                             "num-server-rounds": SMALL.rounds,
                                             "seed": SMALL.seed})

    @app.train(mods=[mod])
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        grad = logistic_gradient(SMALL, pid)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"]) - 1
        for t in range(SMALL.tau):
            x = x - SMALL.eta * grad([x], r * SMALL.tau + t)[0]
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": 1})}),
                       reply_to=msg)

    return app


@pytest.mark.slow
def test_mod_on_an_unmodified_app_through_flower_simulation(tmp_path: Path) -> None:
    seen: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from flwr_corrnoise.apps.logreg import wait_for_nodes

        wait_for_nodes(grid, SMALL.num_learners)
        result = FedAvg(fraction_evaluate=0.0, min_available_nodes=SMALL.num_learners).start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(SMALL.dim)]),
            num_rounds=SMALL.rounds)
        seen["final"] = result.arrays.to_numpy_ndarrays()[0]

    simulate(server, plain_app(), SMALL.num_learners)
    # replay: plain local SGD, clip the round update, add the learner's round increment
    settings = PrivacySettings("blt", 2.0, 1e-3, 0.4, horizon=SMALL.rounds)
    streams = [NoiseStream.create("blt", SMALL.rounds, [(SMALL.dim,)],
                                  settings.calibration().std, seed=derive_seed(SMALL.seed, i))
               for i in range(SMALL.num_learners)]
    x = np.zeros(SMALL.dim)
    for r in range(SMALL.rounds):
        released = []
        for i in range(SMALL.num_learners):
            clipped, _ = clip_by_global_norm(local_sgd(SMALL, i, r, x) - x, 0.4)
            released.append(x + clipped + streams[i].next())
        x = np.mean(released, axis=0)
    np.testing.assert_allclose(seen["final"], x, atol=1e-9)
    assert not math.isclose(float(np.linalg.norm(x)), 0.0)


def test_deployed_mod_persists_and_refuses_a_lost_state(tmp_path, monkeypatch) -> None:
    def deployed_context() -> Context:  # a fresh process: empty context.state
        return Context(run_id=1, node_id=1,
                       node_config={"partition-id": 0, "noise-seed": 5,
                                    "state-dir": str(tmp_path)},
                       state=RecordDict(), run_config={"epsilon": 1.0})

    mod = CorrNoiseRoundMod(SETTINGS)
    replica = NoiseStream.create("toeplitz", 3, [(3,)], SETTINGS.calibration().std, seed=5)
    for _ in range(2):  # two rounds, each in a "restarted" process
        reply = mod(train_message([np.zeros(3)]), deployed_context(), Inner([np.zeros(3)]))
        np.testing.assert_allclose(reply.content["arrays"].to_numpy_ndarrays()[0],
                                   replica.next(), atol=1e-12)
    (tmp_path / "round-mod" / "learner.state").unlink()
    inner = Inner([np.zeros(3)])
    reply = mod(train_message([np.zeros(3)]), deployed_context(), inner)
    assert reply.has_error() and reply.error.code == 4104 and inner.calls == 0
    # as for the per-step learner, a mod on a real SuperNode treats the run config as a
    # proposal
    from flwr_corrnoise.flower import session

    monkeypatch.setattr(session, "in_simulation", lambda: False)
    weaker = Context(run_id=1, node_id=1, node_config={"partition-id": 0,
                                                       "state-dir": str(tmp_path / "w")},
                     state=RecordDict(), run_config={"epsilon": 9.0})
    reply = mod(train_message([np.zeros(3)]), weaker, inner)
    assert reply.has_error() and reply.error.code == 4101 and inner.calls == 0

