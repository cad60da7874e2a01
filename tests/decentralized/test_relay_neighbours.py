"""Malformed data never changes a relay node's reply: the neighbouring-stream test for the
decentralized relay (issue 20, item 5), every algorithm of Chen & Wang, "Locally Differentially
Private Distributed Online Learning with Guaranteed Optimality" and Wang, Yang, Yao, Song & Wan,
"Revisiting Differentially Private Algorithms for Decentralized Online Learning".

Two relay nodes with the **same noise seed** (simulation rules) whose data differ in one
datum — a normal one vs a huge, a NaN, a too-short, a too-long or a wrong-label one, used
at step :data:`BAD_STEP` — get the same relay messages over every round, through Flower's
real ClientApp call path. Every non-array part of every reply (reply kind, error code and
reason, record names, metric names and values — ε included —, array keys, shapes and
dtypes) must be identical. (The old node refused the data set in the task's constructor, or
overflowed later: an error reply whose kind depended on one datum.)

On the in-process engine the rule is checked on the arrays too: a datum whose gradient
cannot be computed releases, bit for bit, what a datum with a zero gradient (a zero row)
releases, on every node at every step; and it is counted in the node's state only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from flwr_corrnoise.decentralized.engine import build_from_config, run
from flwr_corrnoise.decentralized.multiclass import MulticlassTask, synthetic_multiclass
from flwr_corrnoise.decentralized.tasks import (
    LogisticTask,
    Task,
    register_task,
    synthetic_shards,
)
from flwr_corrnoise.flower.relay import make_relay_client_app

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

NODE, STEPS, BAD_STEP = 1, 4, 1
N, DIM, CLASSES, FEATURES = 4, 5, 3, 4
#: the odd data; "zero" (a zero row: a zero data-term gradient) is the reference
ODD = ("huge", "nan", "short", "long", "label")
FAILING = ("nan", "short", "long", "label")
BASE = {"graph": "ring", "num-nodes": N, "steps": STEPS, "seed": 11, "data-seed": 2}
LOGREG = {**BASE, "task": "test-neighbour-logreg", "dim": DIM, "samples-per-node": 12,
          "noise-scale": 0.5, "init-scale": 0.0}
MULTICLASS = {**BASE, "task": "test-neighbour-multiclass", "epsilon": 5.0, "clip": 1.0,
              "block-length": 2, "horizon": STEPS}
ALGORITHMS = {"chen-wang": LOGREG, "dsgd": LOGREG, "dola": LOGREG, "pdop": LOGREG,
              "pd-ftgl": MULTICLASS, "pd-ocg": MULTICLASS, "pd-ogd": MULTICLASS}


def odd(kind: str, row: np.ndarray, label: float, bad_label: float) -> tuple[Any, float]:
    """The datum that replaces ``(row, label)`` in the neighbouring data set."""
    return {
        "zero": (np.zeros_like(row), label),
        "huge": (np.full_like(row, 1e300), label),
        "nan": (np.where(np.arange(row.size) == 0, np.nan, row), label),
        "short": (row[:-1], label),
        "long": (np.append(row, 0.5), label),
        "label": (row, bad_label),
    }[kind]


def _replace(X: np.ndarray, y: np.ndarray, index: int, kind: str, bad_label: float
             ) -> tuple[Any, Any, int | None]:
    """``X, y`` with datum ``index`` replaced; rows as a list (and the declared feature
    count) when the odd row has another length."""
    row, label = odd(kind, X[index], float(y[index]), bad_label)
    rows, labels = list(X), list(y)
    rows[index], labels[index] = row, label
    if np.size(row) != X.shape[1]:
        return rows, np.asarray(labels, dtype=float), X.shape[1]
    return np.stack(rows), np.asarray(labels, dtype=float), None


@register_task("test-neighbour-logreg")
def _logreg(cfg: Mapping[str, Any]) -> Task:
    """Node :data:`NODE`'s shard with the datum it uses at :data:`BAD_STEP` replaced by
    ``test-bad-datum`` (its own data, from its node config)."""
    shards = synthetic_shards(N, DIM, int(cfg["samples-per-node"]), int(cfg["data-seed"]))
    kw = {"horizon": int(cfg["horizon"]), "seed": int(cfg["data-seed"])}
    kind = str(cfg.get("test-bad-datum", ""))
    if kind:
        index = int(LogisticTask(shards, **kw).indices[NODE, BAD_STEP, 0])
        X, y, dim = _replace(*shards[NODE], index, kind, bad_label=2.0)
        shards[NODE] = (X, y)
        if dim is not None:
            kw["dim"] = dim
    return LogisticTask(shards, **kw)


@register_task("test-neighbour-multiclass")
def _multiclass(cfg: Mapping[str, Any]) -> Task:
    """The example learner :data:`NODE` sees at :data:`BAD_STEP` replaced."""
    X, y = synthetic_multiclass(120, FEATURES, CLASSES, int(cfg["data-seed"]))
    kw = {"copies": 4, "horizon": int(cfg["horizon"]), "seed": int(cfg["data-seed"]),
          "num_classes": CLASSES}
    kind = str(cfg.get("test-bad-datum", ""))
    if kind:
        index = int(MulticlassTask(X, y, N, **kw).indices[NODE, BAD_STEP])
        X, y, dim = _replace(X, y.astype(float), index, kind, bad_label=float(CLASSES))
        if dim is not None:
            kw["features"] = dim
    return MulticlassTask(X, y, N, **kw)


# -- the relay protocol ------------------------------------------------------------------
def message(step: int, inbox: ArrayRecord) -> Message:
    md = Metadata(run_id=1, message_id=f"m{step}", src_node_id=0, dst_node_id=100 + NODE,
                  reply_to_message_id="", group_id=str(step), created_at=time.time(),
                  ttl=3600.0, message_type="train")
    return Message(content=RecordDict({"inbox": inbox, "config": ConfigRecord(
        {"step": step, "steps": STEPS})}), metadata=md)


def signature(reply: Message) -> tuple[Any, ...]:
    """Everything in a reply but the arrays' values."""
    if reply.has_error():
        return ("error", reply.error.code, reply.error.reason)
    c = reply.content
    return ("reply", reply.metadata.message_type,
            {name: {k: (tuple(a.shape), a.dtype) for k, a in rec.items()}
             for name, rec in c.array_records.items()},
            {name: dict(rec) for name, rec in c.metric_records.items()},
            {name: dict(rec) for name, rec in c.config_records.items()})


def relay_run(cfg: Mapping[str, Any], kind: str) -> tuple[list[tuple[Any, ...]],
                                                          list[np.ndarray]]:
    """Node :data:`NODE` through rounds ``0..STEPS`` with the neighbours' messages fixed
    (all 0.05): each reply's signature and released arrays."""
    app = make_relay_client_app(cfg)
    node_config: dict[str, Any] = {"node-index": NODE}
    if kind:
        node_config["test-bad-datum"] = kind
    context = Context(run_id=1, node_id=100 + NODE, node_config=node_config,
                      state=RecordDict(), run_config={})
    signatures, arrays = [], []
    shapes: dict[str, tuple[int, ...]] = {}
    for step in range(STEPS + 1):
        inbox = ArrayRecord()
        for j in (NODE - 1, NODE + 1) if step > 0 else ():
            for key, shape in shapes.items():
                inbox[f"{j}/{key}"] = Array(np.full(shape, 0.05))
        reply = app(message(step, inbox), context)
        signatures.append(signature(reply))
        if not reply.has_error():
            out = reply.content["outbox"]
            shapes = shapes or {k: tuple(out[k].shape) for k in out}
            arrays.append(np.concatenate([np.zeros(0)] + [out[k].numpy().ravel()
                                                          for k in sorted(out)]))
    return signatures, arrays


@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_malformed_datum_changes_no_relay_reply(algorithm: str, kind: str,
                                                  simulated: None) -> None:
    """The same seed, data differing in one datum: identical replies but for the noised
    arrays, in the round that uses the datum and every later one (ε included)."""
    cfg = {**ALGORITHMS[algorithm], "algorithm": algorithm}
    normal, normal_arrays = relay_run(cfg, "")
    neighbour, neighbour_arrays = relay_run(cfg, kind)
    assert all(s[0] == "reply" for s in normal), normal  # the control: a run that works
    assert any(k.startswith("epsilon") for k in normal[-1][3]["metrics"])
    assert neighbour == normal
    # the datum did enter the computation: some released array moved
    assert any(not np.array_equal(a, b) for a, b in zip(normal_arrays, neighbour_arrays,
                                                        strict=True))


# -- the in-process engine: exactly a zero gradient --------------------------------------
def engine_run(cfg: Mapping[str, Any], kind: str) -> tuple[Any, Any]:
    _, algo = build_from_config({**cfg, "test-bad-datum": kind})
    return algo, run(algo, STEPS, run_seed=5, keep_outboxes=True)


@pytest.mark.parametrize("kind", FAILING)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_datum_without_a_gradient_is_a_zero_gradient(algorithm: str, kind: str) -> None:
    """Every node's releases and decisions equal, bit for bit, those of the data set whose
    odd datum is a zero row (a zero data-term gradient); the zeroed datum is counted in
    node :data:`NODE`'s state, nowhere else; the reported ε is the same."""
    cfg = {**ALGORITHMS[algorithm], "algorithm": algorithm}
    algo, bad = engine_run(cfg, kind)
    _, zero = engine_run(cfg, "zero")
    for got, want in zip(bad.outboxes, zero.outboxes, strict=True):
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[key])
    np.testing.assert_array_equal(bad.decisions, zero.decisions)
    counted = bad.state["zeroed-data"]
    assert counted[NODE] >= 1 and np.all(np.delete(counted, NODE) == 0)
    assert np.all(zero.state["zeroed-data"] == 0)
    eps_bad, eps_zero = algo.epsilon(bad.state, STEPS), algo.epsilon(zero.state, STEPS)
    assert eps_bad.keys() == eps_zero.keys()
    for label in eps_bad:
        np.testing.assert_array_equal(eps_bad[label], eps_zero[label])


def test_a_task_that_raises_on_a_datum_gives_that_node_a_zero_data_term() -> None:
    """A task of the user's own whose ``grad`` raises for one node's data (or returns NaN):
    that node's data term counts as zero, its regularizer stays, the other nodes keep
    exactly their gradients, and the run goes on."""
    from flwr_corrnoise.decentralized.tasks import data_gradient

    base = LogisticTask(synthetic_shards(N, DIM, 12, 0), reg=0.1, horizon=STEPS)

    class Raising(LogisticTask):
        def grad_counted(self, theta: np.ndarray, X: np.ndarray, y: np.ndarray,
                         clip: float | None = None) -> tuple[np.ndarray, np.ndarray]:
            if np.any(X[:, 0, 0] > 10):  # "the user's code" fails on the odd datum
                raise IndexError("row 3 of node 1 has value 17")
            g, z = super().grad_counted(theta, X, y, clip)
            return np.where(X[:, :1, 0] < -10, np.nan, g), z

    task = Raising(base.shards, reg=0.1, horizon=STEPS)
    theta = np.random.default_rng(0).normal(size=(N, DIM))
    X, y = task.batch(np.arange(N), 0)
    want, _ = data_gradient(base, theta, X, y)
    for value in (50.0, -50.0):  # raises / a NaN gradient, for node 1 only
        X2 = X.copy()
        X2[NODE, 0, 0] = value
        g, zeroed = data_gradient(task, theta, X2, y)
        np.testing.assert_array_equal(np.delete(g, NODE, 0), np.delete(want, NODE, 0))
        np.testing.assert_array_equal(g[NODE], 0.1 * theta[NODE])
        assert zeroed.tolist() == [0, X.shape[1], 0, 0]


def test_zeroed_data_are_counted_on_the_node_only(tmp_path: Any) -> None:
    """A deployed node (real-SuperNode rules, ``state-dir``) counts the datum it zeroed in
    ``diagnostics.jsonl``, in the round that used it; its replies carry no such count."""
    import json

    app = make_relay_client_app({**LOGREG, "algorithm": "chen-wang"})
    context = Context(run_id=1, node_id=100 + NODE, state=RecordDict(), run_config={},
                      node_config={"node-index": NODE, "test-bad-datum": "nan",
                                   "state-dir": str(tmp_path)})
    for step in range(STEPS + 1):
        inbox = ArrayRecord()
        for j in (NODE - 1, NODE + 1) if step > 0 else ():
            inbox[f"{j}/y"] = Array(np.full(DIM, 0.05))
        reply = app(message(step, inbox), context)
        assert not reply.has_error(), reply.error.reason
        assert set(reply.content["metrics"]) <= {"step", "node-index"} | {
            k for k in reply.content["metrics"] if k.startswith("epsilon ")}
    lines = [json.loads(x) for x in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    zeroed = {int(e["server-round"]): int(e["zeroed-data"]) for e in lines}
    assert zeroed[BAD_STEP] == 0 and zeroed[BAD_STEP + 1] >= 1  # round t+1 uses step t's datum
