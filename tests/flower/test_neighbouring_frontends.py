"""Malformed data never changes a reply: the neighbouring-stream test, every front end.

Two learners with the **same noise seed** (simulation rules) whose streams differ in one
datum — a normal one vs a huge, a NaN, a too-short, a too-long or a wrong-label one — get
the same train and evaluate messages over three rounds through Flower's real ClientApp
call path; the odd datum sits in round 2, so round 3 shows that nothing sticks. Every
non-array part of every reply (reply kind, error code and reason, record names, metric
names and values, array keys, shapes and dtypes) must be identical. For the per-step
front ends the rule is stronger and checked on the arrays too: a datum whose gradient
cannot be computed releases exactly what a datum with a zero gradient releases (the same
seed cancels the noise), in every round. ``CorrNoiseLocalDPStrategy``'s round metrics on the two
neighbouring federations are compared as well.

The model is a 3-class linear classifier ``W`` (3×4, the weight of a bias-free
``torch.nn.Linear(4, 3)``); datum ``(x, y)``, softmax cross-entropy. A too-short ``x``
(one feature) broadcasts in the NumPy gradient and yields a gradient of the wrong size; a
too-long ``x`` and a label out of range raise in the user's code (NumPy and torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from flwr_corrnoise.flower import (
    CorrNoiseLocalDPStrategy,
    CorrNoiseNumPyClient,
    CorrNoiseRoundMod,
    PrivateSteps,
    make_client_app,
    numpy_client_app,
)

from ..flower_helpers import fingerprint
from ..messages import flower_message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

K, D, TAU, ROUNDS, LR = 3, 4, 3, 3, 0.1
#: the position of the datum that differs: round 2's second step
POSITION = TAU + 1
LEARNER = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-3, "clip-norm": 1.0,
           "data-reuse": "once", "horizon": ROUNDS * TAU, "noise-seed": 17}
#: the odd data; "zero" (x = 0: a zero gradient) is the reference for the failing ones
ODD = ("huge", "nan", "short", "long", "label")
FAILING = ("nan", "short", "long", "label")


def datum(kind: str, position: int) -> tuple[np.ndarray, int]:
    """Datum ``position`` of a learner's stream; only :data:`POSITION` depends on ``kind``."""
    x = 0.5 * np.sin(position + np.arange(D)) + 0.2
    y = position % K
    if position != POSITION or kind == "small":
        return x, y
    return {
        "zero": (np.zeros(D), y),
        "huge": (np.full(D, 1e9), y),
        "nan": (np.full(D, np.nan), y),
        "short": (np.ones(1), y),
        "long": (np.ones(D + 1), y),
        "label": (x, K),
    }[kind]


def np_gradient(w: np.ndarray, x: np.ndarray, y: int) -> np.ndarray:
    """The user's softmax cross-entropy gradient in W (written elementwise, as users do)."""
    logits = (w * x).sum(axis=1)  # a 1-feature x broadcasts; a long one raises
    p = np.exp(logits - logits.max())
    p /= p.sum()
    p[y] -= 1.0  # IndexError for a label out of range
    return np.outer(p, x)


def oracle(kind: str) -> Callable[[list[np.ndarray], int], list[np.ndarray]]:
    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        return [np_gradient(params[0], *datum(kind, position))]
    return gradient


def message(kind: str, w: np.ndarray, server_round: int, dst: int = 1) -> Message:
    return flower_message(w, server_round=server_round, kind=kind, dst=dst,
                          config={"local-steps": TAU, "learning-rate": LR})




def context(partition: int = 0, state_dir: Path | None = None) -> Context:
    node: dict[str, Any] = {**LEARNER, "partition-id": partition}
    if state_dir is not None:
        node["state-dir"] = str(state_dir)
    return Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config={})


def conversation(app: ClientApp, ctxt: Context) -> tuple[list[dict[str, Any]],
                                                         list[np.ndarray]]:
    """Train and evaluate messages over :data:`ROUNDS` rounds, each round from the model
    the learner released: the replies' fingerprints and the released arrays."""
    w = np.full((K, D), 0.1)
    prints, released = [], []
    for r in range(1, ROUNDS + 1):
        reply = app(message(MessageType.TRAIN, w, r), ctxt)
        prints.append(fingerprint(reply))
        if not reply.has_error():
            w = reply.content["arrays"].to_numpy_ndarrays()[0]
            released.append(w)
        prints.append(fingerprint(app(message(MessageType.EVALUATE, w, r), ctxt)))
    return prints, released


# -- the front ends: each the way a user writes it ------------------------------------------
def evaluate_on_data(kind: str) -> Callable[[Message, Context], Message]:
    def evaluate(msg: Message, ctxt: Context) -> Message:  # data-dependent: must not run
        x, y = datum(kind, POSITION)
        return Message(RecordDict({"metrics": MetricRecord({"loss": float(np.sum(x) + y)})}),
                       reply_to=msg)
    return evaluate


def message_api(kind: str) -> ClientApp:
    return make_client_app(lambda ctxt: oracle(kind), evaluate=evaluate_on_data(kind))


class StreamClient(CorrNoiseNumPyClient):
    def __init__(self, ctxt: Context, kind: str) -> None:
        self.kind = kind
        super().__init__(ctxt)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        return oracle(self.kind)(parameters, position)


def numpy_api(kind: str) -> ClientApp:
    return numpy_client_app(lambda ctxt: StreamClient(ctxt, kind))


def private_steps(kind: str, eager: bool = False) -> ClientApp:
    """The user's own loop; each step's gradient goes through ``private.step`` as a callable
    (exceptions in it count as a zero gradient) or, ``eager``, as the computed array."""
    app = ClientApp(mods=[PrivateSteps.guard()])

    @app.train()
    def train(msg: Message, ctxt: Context) -> Message:
        private = PrivateSteps(msg, ctxt)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):
            x, y = datum(kind, (r - 1) * TAU + t)
            g = np_gradient(w, x, y) if eager else (lambda w=w, x=x, y=y: np_gradient(w, x, y))
            w = w - LR * private.step(g)
        return private.reply([w], {"train-loss": float(np.sum(w))})

    app.evaluate()(evaluate_on_data(kind))
    return app


def round_mod(kind: str) -> ClientApp:
    app = ClientApp(mods=[CorrNoiseRoundMod()])

    @app.train()
    def train(msg: Message, ctxt: Context) -> Message:
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        r = int(msg.content["config"]["server-round"])
        for t in range(TAU):  # plain SGD, unguarded: the mod treats a failure as zero
            w = w - LR * np_gradient(w, *datum(kind, (r - 1) * TAU + t))
        return Message(RecordDict({"arrays": ArrayRecord([w]),
                                   "metrics": MetricRecord({"num-examples": TAU})}),
                       reply_to=msg)

    app.evaluate()(evaluate_on_data(kind))
    return app


def torch_front_ends() -> dict[str, Callable[[str], ClientApp]]:
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.flower import (
        TorchCorrNoiseClient,
        make_torch_client_app,
        private_optimizer,
    )

    def model_fn(ctxt: Context) -> Any:
        torch.manual_seed(0)
        return torch.nn.Linear(D, K, bias=False).double()

    def batches(kind: str) -> Callable[[int], tuple[Any, Any]]:
        def batch(position: int) -> tuple[Any, Any]:
            x, y = datum(kind, position)
            return torch.from_numpy(x[None, :]), torch.tensor([y])
        return batch

    loss = torch.nn.functional.cross_entropy

    def device_app(kind: str) -> ClientApp:
        return make_torch_client_app(model_fn, lambda c: batches(kind), loss_fn=loss)

    def host_app(kind: str) -> ClientApp:
        return make_torch_client_app(model_fn, lambda c: batches(kind), loss_fn=loss,
                                     engine="host")

    def client(kind: str) -> ClientApp:
        return numpy_client_app(lambda c: TorchCorrNoiseClient(c, model_fn(c), loss,
                                                               batches(kind)))

    def optimizer_loop(kind: str, user_pass: bool) -> ClientApp:
        """``private_optimizer`` in the user's loop: the library's per-example
        ``opt.backward`` or, ``user_pass``, the user's own forward and backward pass (the
        quickstart's loop) with each step in ``opt.guard()`` — a datum the user's code
        raises on is a zero-gradient step."""
        app = ClientApp(mods=[PrivateSteps.guard()])

        @app.train()
        def train(msg: Message, ctxt: Context) -> Message:
            model = model_fn(ctxt)
            with torch.no_grad():
                model.weight.copy_(torch.from_numpy(msg.content["arrays"].to_numpy_ndarrays()[0]))
            opt = private_optimizer(msg, ctxt, torch.optim.SGD(model.parameters(), lr=LR),
                                    model, loss_fn=loss)
            r = int(msg.content["config"]["server-round"])
            for t in range(TAU):
                x, y = batches(kind)((r - 1) * TAU + t)
                if not user_pass:
                    opt.zero_grad()
                    opt.backward(x, y)
                    opt.step()
                    continue
                with opt.guard():
                    opt.zero_grad()
                    loss(model(x), y).backward()  # raises on a wrong shape or label
                    opt.step()
            return opt.reply([p.detach().numpy() for p in model.parameters()])

        app.evaluate()(evaluate_on_data(kind))
        return app

    def optimizer_app(kind: str) -> ClientApp:
        return optimizer_loop(kind, user_pass=False)

    def guarded_app(kind: str) -> ClientApp:
        return optimizer_loop(kind, user_pass=True)

    return {"make_torch_client_app": device_app, "make_torch_client_app-host": host_app,
            "TorchCorrNoiseClient": client, "private_optimizer": optimizer_app,
            "private_optimizer-guard": guarded_app}


NUMPY_FRONT_ENDS: dict[str, Callable[[str], ClientApp]] = {
    "make_client_app": message_api,
    "numpy_client_app": numpy_api,
    "PrivateSteps": private_steps,
    "CorrNoiseRoundMod": round_mod,
}
TORCH_FRONT_ENDS = ("make_torch_client_app", "make_torch_client_app-host",
                    "TorchCorrNoiseClient", "private_optimizer", "private_optimizer-guard")


def front_end(name: str) -> Callable[[str], ClientApp]:
    return NUMPY_FRONT_ENDS[name] if name in NUMPY_FRONT_ENDS else torch_front_ends()[name]


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("name", [*NUMPY_FRONT_ENDS, *TORCH_FRONT_ENDS])
def test_malformed_datum_changes_no_reply_in_any_front_end(
    name: str, kind: str, simulated: None
) -> None:
    """Issue 20 item 5: the round with the odd datum and every later round are answered
    exactly as for the neighbouring stream (a wrong-size datum or a bad label used to turn
    them into 4100, or 4101 naming the gradient's size); all rounds release."""
    build = front_end(name)
    small, _ = conversation(build("small"), context())
    odd, _ = conversation(build(kind), context())
    assert odd == small
    trains = small[0::2]
    assert all("error" not in t for t in trains), trains
    assert all(e["error"][0] == 4106 for e in small[1::2])  # evaluate refused, data-free


@pytest.mark.parametrize("kind", FAILING)
@pytest.mark.parametrize("name", [n for n in [*NUMPY_FRONT_ENDS, *TORCH_FRONT_ENDS]
                                  if n != "CorrNoiseRoundMod"])
def test_a_datum_without_a_gradient_is_a_zero_gradient(
    name: str, kind: str, simulated: None
) -> None:
    """Per-step front ends: a datum whose gradient cannot be computed (non-finite, wrong
    size, an exception in the user's code) releases exactly what a datum with a zero
    gradient releases — the same noise increment is added, nothing else changes."""
    build = front_end(name)
    zero_prints, zero = conversation(build("zero"), context())
    odd_prints, odd = conversation(build(kind), context())
    assert odd_prints == zero_prints and len(odd) == ROUNDS
    for a, b in zip(zero, odd, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ("huge", "nan", "short"))
def test_private_steps_with_computed_arrays(kind: str, simulated: None) -> None:
    """``private.step(array)``: a gradient of the wrong size (or non-finite) is a zero
    gradient, not a 4101 error naming its size."""
    small, _ = conversation(private_steps("small", eager=True), context())
    odd, _ = conversation(private_steps(kind, eager=True), context())
    assert odd == small and all("error" not in t for t in small[0::2])
    if kind != "huge":
        _, zero = conversation(private_steps("zero", eager=True), context())
        _, got = conversation(private_steps(kind, eager=True), context())
        for a, b in zip(zero, got, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("per_round", [False, True])
@pytest.mark.parametrize("kind", ODD)
def test_local_dp_strategy_releases_the_same_round_metrics(
    kind: str, per_round: bool, simulated: None
) -> None:
    """``CorrNoiseLocalDPStrategy`` around FedAvg, two learners per round (one with the odd datum
    in the neighbouring federation): the round metrics it releases are identical."""
    from flwr.serverapp.strategy import FedAvg

    build = round_mod if per_round else private_steps
    run_config = {k: v for k, v in LEARNER.items() if k != "noise-seed"}
    if per_round:
        run_config["horizon"] = ROUNDS
    released: dict[str, list[Any]] = {}
    for world in ("small", kind):
        strategy = CorrNoiseLocalDPStrategy(FedAvg(), run_config, per_round=per_round)
        apps = [build("small"), build(world)]
        ctxts = [context(0), context(1)]
        if per_round:
            for c in ctxts:
                c.node_config["horizon"] = ROUNDS
        w = np.full((K, D), 0.1)
        out = []
        for r in range(1, ROUNDS + 1):
            replies = [app(message(MessageType.TRAIN, w, r, dst=i + 1), c)
                       for i, (app, c) in enumerate(zip(apps, ctxts, strict=True))]
            arrays, metrics = strategy.aggregate_train(r, replies)
            assert arrays is not None
            out.append(dict(metrics))
            w = arrays.to_numpy_ndarrays()[0]
        released[world] = out
    assert released[kind] == released["small"]


def test_zeroed_steps_are_counted_on_the_learner_only(tmp_path: Path, simulated: None) -> None:
    """The count of zeroed steps is a local diagnostic (``diagnostics.jsonl``), never in a
    reply."""
    for kind in ("small", "label"):
        app = message_api(kind)
        prints, _ = conversation(app, context(state_dir=tmp_path / kind))
        assert all("failed" not in json.dumps(p) for p in prints)
    lines = [json.loads(s) for s in
             (tmp_path / "label" / "diagnostics.jsonl").read_text().splitlines()]
    assert [line["failed-steps"] for line in lines] == [0.0, 1.0, 0.0]
    lines = [json.loads(s) for s in
             (tmp_path / "small" / "diagnostics.jsonl").read_text().splitlines()]
    assert [line["failed-steps"] for line in lines] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("per_example", ["hooks", "func"])
@pytest.mark.parametrize("kind", ["label", "nan"])
def test_one_bad_example_in_a_batch_zeroes_only_itself(per_example: str, kind: str) -> None:
    """Per-example clipping: a batch whose loss raises on one example (a label out of
    range) is retried example by example, so the clipped sum equals the sum over the other
    examples — zeroing the whole batch would move it by up to ``b·B_g``, past the ``2·B_g``
    the noise is calibrated for."""
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.settings import PrivacySettings
    from flwr_corrnoise.torch import PrivateOptimizer

    def summed(kind_: str, keep: list[int]) -> tuple[np.ndarray, dict[str, float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(D, K).double()
        opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model,
                               PrivacySettings("blt", clip_norm=0.3, horizon=ROUNDS * TAU), seed=1,
                               per_example=per_example)
        xs, ys = zip(*(datum("small", i) for i in range(6)), strict=True)
        x, y = torch.tensor(np.stack(xs)), torch.tensor(ys)
        if kind_ == "label":
            y[2] = K
        elif kind_ == "nan":
            x[2] = float("nan")
        opt.backward(x[keep], y[keep])
        return np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]), \
            opt.diagnostics()

    got, diag = summed(kind, list(range(6)))
    want, _ = summed("small", [0, 1, 3, 4, 5])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert diag["examples"] == 6.0
    assert diag["failed-examples" if kind == "label" else "nonfinite-examples"] == 1.0


def test_refusals_that_are_not_data_keep_their_error(simulated: None) -> None:
    """The rule covers data only: a model that does not match the server's arrays (the
    host engine) is refused (4101), not silently trained on zero gradients."""
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.flower import make_torch_client_app

    app = make_torch_client_app(lambda c: torch.nn.Linear(D + 1, K, bias=False).double(),
                                lambda c: (lambda i: (torch.zeros(1, D + 1),
                                                      torch.tensor([0]))),
                                engine="host")
    reply = app(message(MessageType.TRAIN, np.full((K, D), 0.1), 1), context())
    assert reply.has_error() and reply.error.code == 4101
    assert "not the arrays the server sent" in reply.error.reason


def test_an_interrupt_still_rolls_the_round_back() -> None:
    """Only a datum's ``Exception`` is a zero gradient; an interrupt stops the round and
    nothing changes (nothing was released, so no noise is reused)."""
    from flwr_corrnoise.learner import local_round
    from flwr_corrnoise.learner_state import LearnerState
    from flwr_corrnoise.settings import PrivacySettings

    class Interrupted(BaseException):
        pass

    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        if position == 1:
            raise Interrupted
        return oracle("small")(params, position)

    settings = PrivacySettings("blt", horizon=ROUNDS * TAU)
    state = LearnerState.create(settings, [(K, D)], seed=3)
    blob = state.to_bytes()
    with pytest.raises(Interrupted):
        local_round([np.full((K, D), 0.1)], gradient, state, settings, 3, LR)
    assert state.to_bytes() == blob
