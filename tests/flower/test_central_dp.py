"""Central DP with correlated noise (Zhang, Zhu & Johansson, "Differentially Private Online
Federated Learning with Correlated Noise") around FedAvg and FedAdam."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAdam, FedAvg

from flwr_corrnoise.apps.logreg_task import LogRegSetup, logistic_gradient
from flwr_corrnoise.flower import CorrNoiseCentralDPStrategy
from flwr_corrnoise.learner import clip_by_global_norm
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.streams import NoiseStream

from ..flower_helpers import local_sgd, simulate
from .test_strategy import FakeGrid, reply, task_identity  # noqa: F401

X = [np.zeros((2, 2)), np.ones(3)]


def wrapped(strategy, rounds: int = 3, min_learners: int = 2) -> CorrNoiseCentralDPStrategy:
    return CorrNoiseCentralDPStrategy(strategy, mechanism="toeplitz", epsilon=2.0, delta=1e-3,
                                      clip_norm=0.5, num_rounds=rounds, min_learners=min_learners,
                                      seed=17)


def replies(updates, weights=(4, 4, 4)):
    return [reply(RecordDict({"arrays": ArrayRecord([x + u for x, u in zip(X, upd,
                                                                           strict=True)]),
                              "metrics": MetricRecord({"num-examples": w})}), node=i + 1)
            for i, (upd, w) in enumerate(zip(updates, weights, strict=True))]


def flat(arrays) -> np.ndarray:
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


UPDATES = [[np.full((2, 2), 3.0), np.zeros(3)],
           [np.zeros((2, 2)), np.full(3, 0.01)],
           [np.full((2, 2), -1.0), np.full(3, 2.0)]]


def expected_mean(updates) -> np.ndarray:
    return np.mean([clip_by_global_norm(flat(u), 0.5)[0] for u in updates], axis=0)


def test_fedavg_gets_the_uniform_clipped_mean_plus_one_increment() -> None:
    dp = wrapped(FedAvg(fraction_evaluate=0.0))
    replica = NoiseStream.create("toeplitz", 3, [(2, 2), (3,)], dp.noise_std, seed=17)
    for r in (1, 2):
        list(dp.configure_train(r, ArrayRecord(X), ConfigRecord(), FakeGrid()))
        out, metrics = dp.aggregate_train(r, replies(UPDATES, weights=(1, 50, 7)))
        want = flat(X) + expected_mean(UPDATES) + replica.next()
        np.testing.assert_allclose(flat(out.to_numpy_ndarrays()), want, atol=1e-12)
        assert metrics["central-rounds-released"] == r
    assert dp.rounds[-1]["epsilon-spent"] < 2.0


def test_fedadam_steps_on_the_noisy_mean() -> None:
    """The noise is added before FedAdam's step, so FedAdam fed the noisy mean directly
    (one reply) produces the same model: its step is post-processing."""
    dp = wrapped(FedAdam(fraction_evaluate=0.0, eta=0.1))
    plain = FedAdam(fraction_evaluate=0.0, eta=0.1)
    replica = NoiseStream.create("toeplitz", 3, [(2, 2), (3,)], dp.noise_std, seed=17)
    for r in (1, 2):
        list(dp.configure_train(r, ArrayRecord(X), ConfigRecord(), FakeGrid()))
        list(plain.configure_train(r, ArrayRecord(X), ConfigRecord(), FakeGrid()))
        out, _ = dp.aggregate_train(r, replies(UPDATES))
        noisy = expected_mean(UPDATES) + replica.next()
        sizes = np.cumsum([a.size for a in X])[:-1]
        noisy_arrays = [p.reshape(a.shape) for p, a in zip(np.split(noisy, sizes), X,
                                                             strict=True)]
        ref, _ = plain.aggregate_train(r, replies([noisy_arrays], weights=(1,)))
        np.testing.assert_allclose(flat(out.to_numpy_ndarrays()),
                                   flat(ref.to_numpy_ndarrays()), atol=1e-12)


def test_calibration_on_the_average() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    dp = wrapped(FedAvg(), rounds=30, min_learners=5)
    _, C = build_factorization("toeplitz", 30).matrices()
    sens = np.linalg.norm(C, axis=0).max()
    # one datum moves the average of ≥ 5 clipped updates by ≤ 2·0.5/5, over columns of C
    multiplier = dp.noise_std / (2 * 0.5 * sens / 5)
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier=multiplier))
    assert acc.get_epsilon(1e-3) == pytest.approx(2.0, rel=2e-3)


def test_bad_replies_count_as_zero_and_too_few_release_nothing() -> None:
    """Whether and what is released must not depend on one reply being finite: a non-finite
    reply and an error reply count as zero contributions over all replies received."""
    dp = wrapped(FedAvg(fraction_evaluate=0.0), min_learners=2)
    list(dp.configure_train(1, ArrayRecord(X), ConfigRecord(), FakeGrid()))
    bad = replies([[np.full((2, 2), np.nan), np.zeros(3)], UPDATES[1], UPDATES[2]])
    bad.append(reply(Error(code=4101, reason="refused"), node=9))
    out, metrics = dp.aggregate_train(1, bad)
    replica = NoiseStream.create("toeplitz", 3, [(2, 2), (3,)], dp.noise_std, seed=17)
    clipped = [clip_by_global_norm(flat(u), 0.5)[0] for u in UPDATES[1:]]
    want = flat(X) + np.sum(clipped, axis=0) / 4 + replica.next()
    np.testing.assert_allclose(flat(out.to_numpy_ndarrays()), want, atol=1e-12)
    assert len(dp.diagnostics[-1]["zeroed"]) == 2  # the server's local log only
    assert "zeroed" not in dp.rounds[-1]  # the history holds no reply content
    per_learner = {k: v for k, v in metrics.items() if k.startswith("epsilon-spent.node-")}
    assert set(metrics.keys()) - set(per_learner) == {
        "central-epsilon-spent", "central-noise-std", "central-rounds-released",
        "epsilon-spent-max"}
    # every replying learner is covered by the same central ε
    assert len(per_learner) == 4
    assert set(per_learner.values()) == {metrics["central-epsilon-spent"]}
    list(dp.configure_train(2, ArrayRecord(X), ConfigRecord(), FakeGrid()))
    assert dp.aggregate_train(2, replies([UPDATES[0]], weights=(4,))) == (None, None)
    assert dp.stream.step == 1  # no noise used by the round that released nothing


def test_release_does_not_depend_on_one_reply_being_finite() -> None:
    """Neighbouring rounds: learner 0's reply finite vs non-finite. Both rounds are
    released, with the same metadata; only the noised model differs."""
    outs = []
    for first in (UPDATES[0], [np.full((2, 2), np.inf), np.zeros(3)]):
        dp = wrapped(FedAvg(fraction_evaluate=0.0), min_learners=3)
        list(dp.configure_train(1, ArrayRecord(X), ConfigRecord(), FakeGrid()))
        out, metrics = dp.aggregate_train(1, replies([first, UPDATES[1], UPDATES[2]]))
        assert out is not None
        outs.append((dict(metrics), dp.stream.step))
    (m0, s0), (m1, s1) = outs
    assert s0 == s1 == 1
    assert m0 == m1  # nothing counts the zeroed reply (tests/flower/test_central_release.py)


def test_wrapped_strategy_metrics_are_not_released() -> None:
    """Client metrics (a loss, an accuracy) are un-noised: they never reach the output."""
    dp = wrapped(FedAvg(fraction_evaluate=0.0), min_learners=3)
    list(dp.configure_train(1, ArrayRecord(X), ConfigRecord(), FakeGrid()))
    msgs = replies(UPDATES)
    for m in msgs:
        m.content["metrics"] = MetricRecord({**dict(m.content["metrics"]), "train-loss": 0.7})
    _, metrics = dp.aggregate_train(1, msgs)
    assert "train-loss" not in metrics


SMALL = LogRegSetup(num_learners=3, dim=5, rounds=3, tau=2, eta=0.3, test_size=50,
                    seed=9, data_seed=2)


@pytest.mark.slow
def test_central_dp_through_flower_simulation(tmp_path: Path) -> None:
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        grad = logistic_gradient(SMALL, int(context.node_config["partition-id"]))
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"]) - 1
        for t in range(SMALL.tau):
            x = x - SMALL.eta * grad([x], r * SMALL.tau + t)[0]
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": 1 + r})}),
                       reply_to=msg)

    seen: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        from flwr_corrnoise.apps.logreg import wait_for_nodes

        wait_for_nodes(grid, SMALL.num_learners)
        dp = CorrNoiseCentralDPStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=3),
                                        mechanism="blt", epsilon=1.0, delta=1e-3, clip_norm=0.4,
                                        num_rounds=SMALL.rounds, min_learners=3, seed=4)
        result = dp.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(SMALL.dim)]),
                          num_rounds=SMALL.rounds)
        seen["final"], seen["std"] = result.arrays.to_numpy_ndarrays()[0], dp.noise_std

    simulate(server, client, SMALL.num_learners)
    stream = NoiseStream.create("blt", SMALL.rounds, [(SMALL.dim,)], seen["std"], seed=4)
    x = np.zeros(SMALL.dim)
    for r in range(SMALL.rounds):
        deltas = []
        for i in range(SMALL.num_learners):
            deltas.append(clip_by_global_norm(local_sgd(SMALL, i, r, x) - x, 0.4)[0])
        x = x + np.mean(deltas, axis=0) + stream.next()
    np.testing.assert_allclose(seen["final"], x, atol=1e-9)
