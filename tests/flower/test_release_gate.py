"""The neighbouring-stream test: nothing leaves a learner but the noised arrays.

For every learner front end — ``make_client_app``, ``numpy_client_app`` around a
``CorrNoiseNumPyClient``, the PyTorch ``make_torch_client_app`` and ``TorchCorrNoiseClient``,
and ``CorrNoiseRoundMod`` around an unmodified app — two learners with the same noise seed
whose streams differ in one datum (a small one vs a huge-norm one, and vs a non-finite one)
get the same sequence of train, evaluate and query messages through Flower's real ClientApp
call path. Every part of every reply other than the noised arrays' values must be identical:
reply kind, error code and reason, record names, metric names and values, array keys,
shapes and dtypes. Once more through Flower's simulation engine (Ray).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
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

from ..flower_helpers import fingerprint
from ..messages import flower_message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

DIM, TAU, ROUNDS = 4, 3, 3
LEARNER = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-3,
           "clip-norm": 1.0, "data-reuse": "once", "horizon": ROUNDS * TAU}
#: the datum at this stream position differs between the two neighbours
POSITION = 4
NEIGHBOURS = {"small": 0.5, "huge": 1e9, "nonfinite": float("nan")}


def datum(kind: str, position: int) -> float:
    """The learner's stream: datum ``position`` (a scalar target); one position differs."""
    return NEIGHBOURS[kind] if position == POSITION else 0.1 * (position % 3)


def np_gradient(kind: str) -> Callable[[list[np.ndarray], int], list[np.ndarray]]:
    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        # least squares towards the datum: gradient x − y (NaN/huge for the odd datum)
        return [params[0] - datum(kind, position)]
    return gradient


def message(kind: str, x: np.ndarray, server_round: int) -> Message:
    return flower_message(x, server_round=server_round, kind=kind,
                          config={"local-steps": TAU, "learning-rate": 0.1})




def conversation(app: ClientApp, context: Context) -> list[dict[str, Any]]:
    """Train, evaluate and query messages over several rounds; the replies' fingerprints."""
    x = np.full((1, DIM), 0.2)  # the shape of the torch front ends' Linear(DIM, 1) weight
    prints = []
    for r in range(1, ROUNDS + 1):
        for kind in (MessageType.TRAIN, MessageType.EVALUATE, MessageType.QUERY):
            try:
                reply = app(message(kind, x, r), context)
            except ValueError as err:  # no function registered: Flower's own error reply
                prints.append({"unregistered": str(err)})
                continue
            prints.append(fingerprint(reply))
            if kind == MessageType.TRAIN and not reply.has_error():
                x = reply.content["arrays"].to_numpy_ndarrays()[0]
                assert np.all(np.isfinite(x))
    return prints


def ctx(tmp_path: Path | None = None, **node: Any) -> Context:
    cfg = {**LEARNER, **node}
    if tmp_path is not None:
        cfg["state-dir"] = str(tmp_path)
    # a server-written run config with a data-free seed: must not matter on a real node
    return Context(run_id=1, node_id=1, node_config=cfg, state=RecordDict(),
                   run_config={"seed": 3, "num-server-rounds": ROUNDS, "local-steps": TAU})


# -- the front ends -------------------------------------------------------------------------
def message_api(kind: str) -> ClientApp:
    def evaluate(msg: Message, context: Context) -> Message:  # data-dependent: must not run
        return Message(RecordDict({"metrics": MetricRecord({"loss": datum(kind, POSITION)})}),
                       reply_to=msg)
    return make_client_app(lambda context: np_gradient(kind), evaluate=evaluate)


class StreamClient(CorrNoiseNumPyClient):
    def __init__(self, context: Context, kind: str) -> None:
        self.kind = kind
        super().__init__(context)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        return np_gradient(self.kind)(parameters, position)

    def fit(self, parameters, config):  # a user who adds a data-dependent metric
        update, num, metrics = super().fit(parameters, config)
        return update, num, {**metrics, "my-loss": float(np.sum(parameters[0]) + datum(
            self.kind, POSITION))}

    def evaluate(self, parameters, config):
        return datum(self.kind, POSITION), 1, {}


def numpy_api(kind: str) -> ClientApp:
    return numpy_client_app(lambda context: StreamClient(context, kind))


def round_mod(kind: str) -> ClientApp:
    app = ClientApp(mods=[CorrNoiseRoundMod()])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):  # plain SGD on the user's side, one datum per step
            x = x - 0.1 * np_gradient(kind)([x], (r - 1) * TAU + t)[0]
        metrics = MetricRecord({"num-examples": 7, "train-loss": float(np.sum(x))})
        return Message(RecordDict({"arrays": ArrayRecord([x]), "metrics": metrics,
                                   "extra": ConfigRecord({"note": str(x[0])})}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"loss": datum(kind, POSITION)})}),
                       reply_to=msg)

    return app


def private_steps(kind: str) -> ClientApp:
    """The user's own loop with one PrivateSteps call per step (and a data-dependent metric
    and evaluate function the gate must keep on the learner)."""
    app = ClientApp(mods=[PrivateSteps.guard()])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):
            x = x - 0.1 * private.step(np_gradient(kind)([x], (r - 1) * TAU + t)[0])
        return private.reply([x], {"num-examples": 7, "train-loss": float(np.sum(x))})

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"loss": datum(kind, POSITION)})}),
                       reply_to=msg)

    return app


FRONT_ENDS: dict[str, Callable[[str], ClientApp]] = {
    "make_client_app": message_api,
    "numpy_client_app": numpy_api,
    "CorrNoiseRoundMod": round_mod,
    "PrivateSteps": private_steps,
}


def torch_front_ends() -> dict[str, Callable[[str], ClientApp]]:
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.flower import TorchCorrNoiseClient, make_torch_client_app

    def model_fn(context: Context) -> Any:
        torch.manual_seed(0)
        return torch.nn.Linear(DIM, 1, bias=False).double()

    def batches(kind: str) -> Callable[[int], tuple[Any, Any]]:
        def batch(position: int) -> tuple[Any, Any]:
            return (torch.ones(1, DIM, dtype=torch.float64),
                    torch.full((1, 1), datum(kind, position), dtype=torch.float64))
        return batch

    def mse(out: Any, y: Any) -> Any:
        return ((out - y) ** 2).mean()

    def torch_app(kind: str) -> ClientApp:
        """The device engine (the default): per-example clipping, a torch noise stream."""
        return make_torch_client_app(model_fn, lambda c: batches(kind), loss_fn=mse)

    def torch_host_app(kind: str) -> ClientApp:
        """The NumPy reference engine through ModuleGradient."""
        return make_torch_client_app(model_fn, lambda c: batches(kind), loss_fn=mse,
                                     engine="host")

    def torch_client(kind: str) -> ClientApp:
        return numpy_client_app(lambda c: TorchCorrNoiseClient(
            c, model_fn(c), mse, batches(kind),
            evaluate_fn=lambda m: (datum(kind, POSITION), 1, {})))

    def optimizer_app(kind: str) -> ClientApp:
        """The user's own PyTorch loop with the device optimizer (per-example clipping)."""
        from flwr_corrnoise.flower import private_optimizer

        app = ClientApp(mods=[PrivateSteps.guard()])

        @app.train()
        def train(msg: Message, context: Context) -> Message:
            model = model_fn(context)
            with torch.no_grad():
                model.weight.copy_(torch.from_numpy(
                    msg.content["arrays"].to_numpy_ndarrays()[0]))
            opt = private_optimizer(msg, context, torch.optim.SGD(model.parameters(), lr=0.1),
                                    model, loss_fn=mse)
            r = int(msg.content["config"]["server-round"])
            for t in range(TAU):
                opt.zero_grad()
                loss = opt.backward(*batches(kind)((r - 1) * TAU + t))
                opt.step()
            return opt.reply([p.detach().numpy() for p in model.parameters()],
                             {"num-examples": 7, "train-loss": float(loss)})

        @app.evaluate()
        def evaluate(msg: Message, context: Context) -> Message:
            return Message(RecordDict({"metrics": MetricRecord({"loss": datum(kind, POSITION)})}),
                           reply_to=msg)

        return app

    return {"make_torch_client_app": torch_app, "make_torch_client_app-host": torch_host_app,
            "TorchCorrNoiseClient": torch_client,
            "private_optimizer": optimizer_app}


def all_front_ends() -> dict[str, Callable[[str], ClientApp]]:
    return {**FRONT_ENDS, **torch_front_ends()}


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("front_end", ["make_client_app", "numpy_client_app",
                                       "CorrNoiseRoundMod", "PrivateSteps",
                                       "make_torch_client_app", "make_torch_client_app-host",
                                       "TorchCorrNoiseClient", "private_optimizer"])
@pytest.mark.parametrize("other", ["huge", "nonfinite"])
def test_neighbouring_streams_send_identical_replies_but_for_the_noised_arrays(
    front_end: str, other: str, tmp_path: Path
) -> None:
    """Real SuperNode rules (no simulation): seeds from OS entropy, so the two learners'
    noise differs — and still everything but the arrays' values is identical."""
    build = all_front_ends()[front_end]
    a = conversation(build("small"), ctx(tmp_path / "a"))
    b = conversation(build(other), ctx(tmp_path / "b"))
    assert a == b
    trains = a[0::3]
    assert all("error" not in t for t in trains), trains  # every round released
    assert all(t["metrics"].keys() <= {"steps", "horizon", "epsilon", "delta",
                                       "epsilon-spent", "noise-std", "rounds-noised",
                                       "num-examples", "learner-id", "server-round"}
               for t in trains)
    evaluates, queries = a[1::3], a[2::3]
    assert all(e.get("error", (0,))[0] == 4106 for e in evaluates)
    assert all(e.get("error", (0,))[0] == 4106 or "unregistered" in e for e in queries)


def test_same_seed_neighbours_differ_only_in_the_contribution(simulated: None) -> None:
    """Simulation rules, same noise seed: the released arrays differ by exactly the
    clipped contributions (the noise cancels), and the non-finite datum's step counts as
    zero instead of changing the reply."""
    replies = {}
    for kind in ("small", "nonfinite"):
        app = message_api(kind)
        context = ctx(**{"noise-seed": 11})
        reply = app(message(MessageType.TRAIN, np.full(DIM, 0.2), 1), context)
        reply2 = app(message(MessageType.TRAIN, reply.content["arrays"].to_numpy_ndarrays()[0],
                             2), context)
        replies[kind] = (reply, reply2)
    first = [r[0].content["arrays"].to_numpy_ndarrays()[0] for r in replies.values()]
    np.testing.assert_array_equal(first[0], first[1])  # round 1 saw positions 0..2 only
    second = [r[1].content["arrays"].to_numpy_ndarrays()[0] for r in replies.values()]
    assert fingerprint(replies["small"][1]) == fingerprint(replies["nonfinite"][1])
    assert not np.allclose(second[0], second[1])


def test_allow_listed_metric_is_released_and_only_it(simulated: None) -> None:
    """A learner may accept to leak a metric (node config ``release-metrics``); others stay."""
    context = ctx(**{"noise-seed": 1, "release-metrics": "my-loss"})
    reply = numpy_api("small")(message(MessageType.TRAIN, np.full(DIM, 0.2), 1), context)
    assert "my-loss" in reply.content["metrics"]
    reply = round_mod("small")(message(MessageType.TRAIN, np.full(DIM, 0.2), 1),
                               ctx(**{"noise-seed": 1}))
    assert "train-loss" not in reply.content["metrics"]
    assert "extra" not in reply.content  # the wrapped app's other records are dropped
    assert reply.content["metrics"]["num-examples"] == 1.0  # uniform weights


def test_evaluation_opt_in_is_the_learners(simulated: None) -> None:
    context = ctx(**{"noise-seed": 1, "client-evaluation": True})
    reply = numpy_api("small")(message(MessageType.EVALUATE, np.full(DIM, 0.2), 1), context)
    assert not reply.has_error() and reply.content["metrics"]["loss"] == 0.5
    # the run config cannot opt in
    context = ctx(**{"noise-seed": 1})
    context.run_config["client-evaluation"] = True
    reply = numpy_api("small")(message(MessageType.EVALUATE, np.full(DIM, 0.2), 1), context)
    assert reply.has_error() and reply.error.code == 4106


def test_a_plain_numpy_client_is_refused() -> None:
    from flwr.client import NumPyClient

    class Plain(NumPyClient):
        def fit(self, parameters, config):
            return parameters, 1, {}

    reply = numpy_client_app(lambda c: Plain())(
        message(MessageType.TRAIN, np.zeros(DIM), 1), ctx())
    assert reply.has_error() and "not a CorrNoiseNumPyClient" in reply.error.reason


def test_user_code_errors_send_a_fixed_reason() -> None:
    """An exception in the user's code may quote data: the reply says only that the
    learner's code failed (code 4100); the details stay in the learner's log. (An exception
    in the gradient oracle itself is a zero gradient for that datum instead:
    tests/flower/test_neighbouring_frontends.py.)"""
    def failing(context: Context):
        raise KeyError(f"secret datum {datum('small', POSITION)}")
    reply = make_client_app(failing)(message(MessageType.TRAIN, np.zeros(DIM), 1), ctx())
    assert reply.has_error() and reply.error.code == 4100
    assert "secret" not in reply.error.reason


@pytest.mark.slow
def test_neighbouring_streams_through_flower_simulation(tmp_path: Path) -> None:
    """The same check through Flower's simulation engine (Ray): the strategy's record of
    every learner's reply metadata is identical for the two neighbouring streams."""
    from flwr.serverapp import Grid, ServerApp

    from flwr_corrnoise.flower import CorrNoiseFedAvg
    from flwr_corrnoise.settings import PrivacySettings

    from ..flower_helpers import simulate

    seen: dict[str, list[Any]] = {}
    for kind in ("small", "nonfinite"):
        server = ServerApp()
        records: list[Any] = []

        @server.main()
        def main(grid: Grid, context: Context, records=records) -> None:
            from flwr_corrnoise.apps.logreg import wait_for_nodes

            wait_for_nodes(grid, 2)
            strategy = CorrNoiseFedAvg(
                privacy=PrivacySettings("blt", 2.0, 1e-3, 1.0, ROUNDS * TAU),
                local_steps=TAU, learning_rate=0.1, min_train_nodes=2, min_available_nodes=2)
            strategy.start(grid=grid, initial_arrays=ArrayRecord([np.full(DIM, 0.2)]),
                           num_rounds=ROUNDS)
            records.append(sorted(tuple(sorted(v.items())) for v in strategy.privacy.values()))
            records.append([(r["accepted"], len(r["errors"]), len(r["rejected"]))
                            for r in strategy.rounds])

        app = make_client_app(lambda context, kind=kind: np_gradient(kind),
                              config_defaults={**LEARNER, "seed": 5})
        simulate(server, app, 2)
        seen[kind] = records
    assert seen["small"] and seen["small"] == seen["nonfinite"]
