"""CorrNoiseFedAvg.aggregate_train on hand-made replies: valid ones are averaged exactly as
Algorithm 1 line 16; malformed ones are rejected without skewing the aggregate."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)

from flwr_corrnoise.flower import CorrNoiseFedAvg
from flwr_corrnoise.settings import PrivacySettings


def reply(content, node: int) -> Message:
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                  reply_to_message_id="x", group_id="1", created_at=time.time(), ttl=3600.0,
                  message_type=MessageType.TRAIN)
    if isinstance(content, Error):
        return Message(error=content, metadata=md)
    return Message(content=content, metadata=md)


def update(arrays, **metrics) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord(arrays),
                       "metrics": MetricRecord({"num-examples": 4, **metrics})})


@pytest.fixture(autouse=True)
def task_identity():
    """Outside a running ServerApp, Flower needs a task identity to build messages."""
    from flwr.supercore.task_identity import TaskIdentity

    keys = ("_run_id", "_node_id", "_task_id")
    saved = {k: TaskIdentity.__dict__.get(k) for k in keys}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    for k, v in saved.items():
        setattr(TaskIdentity, k, v)


class FakeGrid:
    def get_node_ids(self):
        return [1, 2, 3]


def strategy_at_round_1(x: list[np.ndarray]) -> CorrNoiseFedAvg:
    strat = CorrNoiseFedAvg(local_steps=4, learning_rate=0.1, server_learning_rate=2.0,
                            privacy=PrivacySettings("tree", horizon=40))
    config = ConfigRecord({})
    msgs = list(strat.configure_train(1, ArrayRecord(x), config, FakeGrid()))
    assert len(msgs) == 3
    # the round config carries τ, η and the privacy proposal
    assert config["local-steps"] == 4 and config["learning-rate"] == 0.1
    assert config["privacy-mechanism"] == "tree" and config["privacy-horizon"] == 40
    return strat


def test_valid_replies_follow_line_16() -> None:
    x = [np.array([1.0, -1.0]), np.zeros((2, 2))]
    strat = strategy_at_round_1(x)
    g1 = [np.array([1.0, 2.0]), np.ones((2, 2))]
    g2 = [np.array([3.0, 0.0]), -np.ones((2, 2))]
    arrays, metrics = strat.aggregate_train(
        1, [reply(update(g1, **{"epsilon-spent": 0.5, "learner-id": 0}), 1),
            reply(update(g2, **{"epsilon-spent": 0.7, "learner-id": 1}), 2)])
    new = arrays.to_numpy_ndarrays()
    scale = 2.0 * 0.1 * 4  # η_g·η·τ
    np.testing.assert_allclose(new[0], x[0] - scale * (g1[0] + g2[0]) / 2)
    np.testing.assert_allclose(new[1], x[1] - scale * (g1[1] + g2[1]) / 2)
    assert metrics["num-updates"] == 2 and metrics["epsilon-spent-max"] == 0.7
    assert strat.privacy[1]["epsilon-spent"] == 0.7  # keyed by learner-id
    assert metrics["epsilon-spent.learner-0"] == 0.5


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (update([np.ones(3), np.zeros((2, 2))]), "shape"),
        (update([np.array([np.nan, 1.0]), np.zeros((2, 2))]), "NaN or Inf"),
        (update([np.array([np.inf, 1.0]), np.zeros((2, 2))]), "NaN or Inf"),
        (update([np.array([1, 2], dtype=np.int64), np.zeros((2, 2))]), "dtype"),
        (update([np.ones(2)]), "arrays"),
        (RecordDict({"metrics": MetricRecord({"num-examples": 1})}), "KeyError"),
    ],
)
def test_malformed_reply_is_rejected_and_does_not_skew(bad: RecordDict, reason: str) -> None:
    x = [np.array([1.0, -1.0]), np.zeros((2, 2))]
    good = [np.array([1.0, 2.0]), np.ones((2, 2))]
    strat = strategy_at_round_1(x)
    arrays, metrics = strat.aggregate_train(1, [reply(update(good), 1), reply(bad, 2)])
    expected = CorrNoiseFedAvg(local_steps=4, learning_rate=0.1, server_learning_rate=2.0)
    expected.configure_train(1, ArrayRecord(x), ConfigRecord({}), FakeGrid())
    clean, _ = expected.aggregate_train(1, [reply(update(good), 1)])
    for a, b in zip(arrays.to_numpy_ndarrays(), clean.to_numpy_ndarrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert metrics["num-rejected"] == 1 and metrics["num-updates"] == 1
    (rej,) = strat.rounds[-1]["rejected"]
    assert rej["node"] == 2 and reason in rej["reason"]


def test_replies_are_summed_in_learner_order_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Replies arrive in any order and some are malformed: the model is ``aggregate`` of
    the valid updates in learner-id order, to the bit (float32 replies widen exactly);
    each reply's arrays are read only when its turn in that order comes, and the records
    (rejections, ε reports) keep the order the replies came in."""
    from flwr_corrnoise.aggregation import UpdateSum, aggregate

    rng = np.random.default_rng(7)
    x = [rng.standard_normal(5), rng.standard_normal((2, 3))]
    strat = strategy_at_round_1(x)
    ids = [4, 0, 3, 1, 2, 5]
    ups = {i: [rng.standard_normal(5).astype(np.float32 if i % 2 else np.float64),
               rng.standard_normal((2, 3))] for i in ids}
    bad = {3: [np.full(5, np.nan), np.zeros((2, 3))], 5: [np.ones(4), np.zeros((2, 3))]}
    replies = [reply(update(bad.get(i, ups[i]), **{"learner-id": i, "epsilon-spent": 0.1 * i}),
                     10 + i) for i in ids]
    read: list[int] = []
    added: list[int] = []
    real_add = UpdateSum.add

    def spy(self, upd):  # how many replies were read when each update is added
        added.append(len(read))
        real_add(self, upd)

    for msg, i in zip(replies, ids, strict=True):
        arrays = msg.content["arrays"]
        arrays.to_numpy_ndarrays = (lambda a=arrays, i=i: (read.append(i),
                                                           ArrayRecord.to_numpy_ndarrays(a))[1])
    monkeypatch.setattr(UpdateSum, "add", spy)
    new, metrics = strat.aggregate_train(1, replies)
    monkeypatch.undo()  # the reference below sums with the real UpdateSum
    valid = [i for i in sorted(ids) if i not in bad]
    want = aggregate(x, [[np.asarray(u, dtype=np.float64) for u in ups[i]] for i in valid],
                     0.1, 2.0, 4)
    for a, b in zip(new.to_numpy_ndarrays(), want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert read == sorted(ids)  # in learner order, each once
    assert added == [1, 2, 3, 5]  # each valid update added as soon as it was read
    assert [r["node"] for r in strat.rounds[-1]["rejected"]] == [13, 15]  # reply order
    assert strat.rounds[-1]["learners"] == [float(i) for i in valid]
    assert list(strat.rounds[-1]["epsilon-spent"]) == [f"learner-{i}" for i in ids
                                                       if i not in bad]
    assert metrics["num-updates"] == 4 and metrics["num-rejected"] == 2


def test_error_replies_are_recorded_and_model_kept_when_nobody_answers() -> None:
    x = [np.array([1.0, -1.0]), np.zeros((2, 2))]
    strat = strategy_at_round_1(x)
    arrays, metrics = strat.aggregate_train(
        1, [reply(Error(code=4102, reason="flwr-corrnoise: HorizonExhaustedError: ..."), 3)])
    for a, b in zip(arrays.to_numpy_ndarrays(), x, strict=True):
        np.testing.assert_array_equal(a, b)
    assert metrics["num-errors"] == 1
    assert strat.rounds[-1]["errors"][0]["code"] == 4102


@pytest.mark.parametrize(
    "kwargs",
    [{"local_steps": 0, "learning_rate": 0.1}, {"local_steps": 2, "learning_rate": -1.0},
     {"local_steps": 2, "learning_rate": 0.1, "server_learning_rate": float("nan")}],
)
def test_bad_strategy_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CorrNoiseFedAvg(**kwargs)
