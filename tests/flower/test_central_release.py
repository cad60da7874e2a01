"""Central DP releases the noised model and content-free metadata only (issue 20, item 3).

The neighbouring-stream comparison for :class:`~flwr_corrnoise.flower.CorrNoiseCentralDPStrategy`:
two runs whose learners differ in one datum of one learner (finite vs NaN, small vs huge,
a reply vs an error the app raised on that datum) must release the same everything — the
round metrics, the ``Result``'s metric histories, the strategy's ``rounds`` history,
Flower's own log of the run, whether the run stops and the text it stops with — except
the noised arrays. Client-side evaluation (a wrapped plain ``FedAvg`` evaluates on the
clients by default) is never released.

Flower's own round loop (``Strategy.start``) drives a real ``ClientApp`` through
:class:`LoopbackGrid`, which delivers each message in-process (a Flower simulation needs
Ray and takes far longer); the strategy, the app and the messages are Flower's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

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
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flwr_corrnoise.flower import CorrNoiseCentralDPStrategy, RunFailedError

from .test_strategy import FakeGrid, reply, task_identity  # noqa: F401  (autouse fixture)

DIM = 4
ROUNDS = 3
#: learner i's datum (a, b) for linear regression; learner 0's b is what neighbours change
A = [np.array([1.0, 0.5, -0.5, 0.25]), np.array([0.3, -1.0, 0.2, 0.1]),
     np.array([-0.4, 0.2, 1.0, 0.6])]
B = [0.7, -0.2, 0.4]
NEIGHBOURS = {"small": 0.7, "huge": 1e9, "nan": float("nan"), "raises": None}


def plain_app(b0: float | None, calls: dict[str, int]) -> ClientApp:
    """An unmodified Flower app: τ = 2 local SGD steps on its datum; it evaluates on its
    data when asked (the loss a wrapped FedAvg would release). ``b0 = None``: learner 0's
    datum makes the app raise, with the datum in the exception's text."""
    app = ClientApp()

    def datum(context: Context) -> tuple[np.ndarray, float]:
        i = int(context.node_config["partition-id"])
        if i == 0 and b0 is None:
            raise ValueError("datum b = 12.345 is out of range")  # data in the text
        return A[i], (B[i] if i else float(b0))  # type: ignore[arg-type]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls["train"] += 1
        a, b = datum(context)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        for _ in range(2):
            x = x - 0.1 * (a @ x - b) * a
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": 3,
                                                            "train-loss": (a @ x - b) ** 2})}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        calls["evaluate"] += 1
        a, b = datum(context)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 3,
                                                            "loss": (a @ x - b) ** 2})}),
                       reply_to=msg)

    return app


class LoopbackGrid(Grid):
    """Delivers each message to a real ``ClientApp`` in this process, one ``Context`` per
    node, and turns an exception into the ``Error`` reply a SuperNode sends (code 2, the
    exception in the reason, as Flower does)."""

    def __init__(self, app: ClientApp, nodes: int) -> None:
        self.app = app
        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i,
                                          node_config={"partition-id": i}, state=RecordDict(),
                                          run_config={}) for i in range(nodes)}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        out = []
        for msg in messages:
            try:
                out.append(self.app(msg, self.contexts[msg.metadata.dst_node_id]))
            except Exception as err:
                out.append(Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                         reason=f"{type(err)}:<'{err}'>"), reply_to=msg))
        return sorted(out, key=lambda m: m.metadata.src_node_id)

    def set_run(self, run: Any) -> None:  # the loop needs none of these
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    @property
    def run(self) -> Any:
        raise NotImplementedError


@contextmanager
def flower_log() -> Iterator[list[str]]:
    """Flower's log of the run (what ``flwr run --stream`` shows), at INFO."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("flwr"), Keep(logging.INFO)
    level = logger.level
    logger.setLevel(logging.INFO)  # another test may have quietened it
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def released(b0: float | None) -> tuple[dict[str, Any], np.ndarray, dict[str, int]]:
    """Everything a central-DP run around a *default* FedAvg (client evaluation on) makes
    public, but the arrays; the arrays; how often the app was called."""
    calls = {"train": 0, "evaluate": 0}
    grid = LoopbackGrid(plain_app(b0, calls), nodes=3)
    dp = CorrNoiseCentralDPStrategy(FedAvg(), mechanism="blt", epsilon=1.0, delta=1e-3,
                                    clip_norm=0.5, num_rounds=ROUNDS, min_learners=3, seed=11)
    with flower_log() as lines:
        result = dp.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(DIM)]),
                          num_rounds=ROUNDS)
    log = [re.sub(r"finished in [0-9.]+s", "finished in <time>s", line) for line in lines]
    meta = {
        "train_metrics_clientapp": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate_metrics_clientapp": {r: dict(m)
                                       for r, m in result.evaluate_metrics_clientapp.items()},
        "evaluate_metrics_serverapp": {r: dict(m)
                                       for r, m in result.evaluate_metrics_serverapp.items()},
        "array_keys": list(result.arrays.keys()),
        "rounds": dp.rounds,
        "flower_log": log,
    }
    return meta, result.arrays.to_numpy_ndarrays()[0], calls


def test_neighbouring_runs_release_the_same_metadata_and_no_client_evaluation() -> None:
    runs = {name: released(b0) for name, b0 in NEIGHBOURS.items()}
    base_meta, base_model, _ = runs["small"]
    assert len(base_meta["train_metrics_clientapp"]) == ROUNDS  # rounds were released
    assert any("aggregate_train: Received 3 results" in line
               for line in base_meta["flower_log"])  # the log was captured, not empty
    for name, (meta, model, calls) in runs.items():
        for key, value in base_meta.items():
            assert meta[key] == value, (name, key)
        # client evaluation: not asked for, so nothing to release
        assert meta["evaluate_metrics_clientapp"] == {}
        assert calls == {"train": 3 * ROUNDS, "evaluate": 0}, name
        assert np.all(np.isfinite(model))
        if name != "small":  # only the noised model tells the neighbours apart
            assert not np.array_equal(model, base_model), name
    metrics = base_meta["train_metrics_clientapp"][ROUNDS]
    assert set(metrics) == {"central-epsilon-spent", "central-noise-std",
                            "central-rounds-released", "epsilon-spent-max",
                            "epsilon-spent.node-100", "epsilon-spent.node-101",
                            "epsilon-spent.node-102"}


def test_zeroed_replies_stay_in_the_local_diagnostics(caplog: pytest.LogCaptureFixture) -> None:
    """What the released records leave out is kept for the (trusted) server's operator."""
    calls = {"train": 0, "evaluate": 0}
    grid = LoopbackGrid(plain_app(float("nan"), calls), nodes=3)
    dp = CorrNoiseCentralDPStrategy(FedAvg(fraction_evaluate=0.0), mechanism="blt", epsilon=1.0,
                                    delta=1e-3, clip_norm=0.5, num_rounds=ROUNDS, min_learners=3,
                                    seed=11)
    with caplog.at_level(logging.WARNING, logger="flwr_corrnoise"):
        dp.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(DIM)]), num_rounds=1)
    assert [len(d["zeroed"]) for d in dp.diagnostics] == [1]
    assert dp.diagnostics[0]["zeroed"][0]["node"] == 100
    assert "node 100 counts as zero" in caplog.text


X = [np.zeros(3)]


def one_round(strategy: CorrNoiseCentralDPStrategy, r: int, messages: list[Message]) -> Any:
    list(strategy.configure_train(r, ArrayRecord(X), ConfigRecord(), FakeGrid()))
    try:
        out, metrics = strategy.aggregate_train(r, messages)
    except RunFailedError as err:
        return ("failed", str(err))
    return ("released" if out is not None else "nothing",
            None if metrics is None else dict(metrics))


def update(values: list[float], node: int = 1) -> Message:
    return reply(RecordDict({"arrays": ArrayRecord([np.array(values)]),
                             "metrics": MetricRecord({"num-examples": 2.0})}), node=node)


@pytest.mark.parametrize("min_learners", [1, 2])
def test_whether_the_run_stops_does_not_depend_on_a_reply(min_learners: int) -> None:
    """One learner, ``max-idle-rounds = 1``. Its reply is an update, a non-finite update,
    or the error its app raised on a datum (code 2, the datum in the reason). With
    ``min_learners = 1`` every round is released and the run goes on; with 2 every round
    fails for participation — with a text that names no reply's content."""
    outcomes = {}
    for name, msg in {
        "update": update([0.1, 0.2, 0.3]),
        "nan": update([np.nan, 0.2, 0.3]),
        "raised": reply(Error(code=int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION),
                              reason="ValueError: datum b = 12.345 is out of range"), node=1),
        "raised-other": reply(Error(code=int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION),
                                    reason="KeyError: 'label-7'"), node=1),
    }.items():
        dp = CorrNoiseCentralDPStrategy(FedAvg(fraction_evaluate=0.0), mechanism="toeplitz",
                                        epsilon=2.0, delta=1e-3, clip_norm=0.5, num_rounds=3,
                                        min_learners=min_learners, seed=3, max_idle_rounds=1)
        outcomes[name] = [one_round(dp, r, [msg]) for r in (1, 2)]
    assert len({repr(o) for o in outcomes.values()}) == 1, outcomes
    first = outcomes["update"][0]
    assert first[0] == ("released" if min_learners == 1 else "failed")
    if min_learners == 2:
        assert "1 learner(s) replied" in first[1]


def test_a_run_whose_app_cannot_be_loaded_still_fails_loudly() -> None:
    """Flower's "could not load the ClientApp" (code 1) on every reply: no data was
    touched, so stopping reveals nothing; the text names the code, not its reason."""
    dp = CorrNoiseCentralDPStrategy(FedAvg(fraction_evaluate=0.0), mechanism="toeplitz",
                                    epsilon=2.0, delta=1e-3, clip_norm=0.5, num_rounds=3,
                                    min_learners=2, seed=3, max_idle_rounds=2)
    broken = [reply(Error(code=int(ErrorCode.LOAD_CLIENT_APP_EXCEPTION),
                          reason="ModuleNotFoundError: no module 'app'"), node=n)
              for n in (1, 2)]
    assert one_round(dp, 1, broken)[0] == "released"  # zero contributions + noise
    outcome, text = one_round(dp, 2, broken)
    assert outcome == "failed"
    assert "2 × code 1 (the ClientApp could not be loaded)" in text
    assert "ModuleNotFoundError" not in text


def test_client_evaluation_is_neither_asked_for_nor_released() -> None:
    """A wrapped FedAvg evaluates on the clients by default: the wrapper sends no evaluate
    message, and evaluate replies handed to it (a loss on a client's data) are dropped."""
    dp = CorrNoiseCentralDPStrategy(FedAvg(), mechanism="toeplitz", epsilon=2.0, delta=1e-3,
                                    clip_norm=0.5, num_rounds=3, min_learners=2, seed=3)
    assert list(dp.configure_evaluate(1, ArrayRecord(X), ConfigRecord(), FakeGrid())) == []
    losses = [reply(RecordDict({"metrics": MetricRecord({"num-examples": 5.0,
                                                          "loss": loss})}), node=n)
              for n, loss in ((1, 0.25), (2, 7.5))]
    assert dp.aggregate_evaluate(1, losses) is None
