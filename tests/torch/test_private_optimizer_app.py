"""``private_optimizer``: the device optimizer inside a Flower ClientApp, on the learner
session of ``PrivateSteps`` (settings, state, lock, reply)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr.app import Context, Message, MessageType  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from flwr_corrnoise.flower import PrivateSteps, private_optimizer  # noqa: E402
from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.persistence import StateStore  # noqa: E402
from flwr_corrnoise.torch import TorchNoiseStream  # noqa: E402

from ..flower.test_release_gate import DIM, TAU, ctx, message  # noqa: E402
from ..flower.test_strategy import task_identity  # noqa: E402, F401  (autouse)


def app(use_host_step: bool = False) -> ClientApp:
    app = ClientApp(mods=[PrivateSteps.guard()])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.manual_seed(0)
        model = torch.nn.Linear(DIM, 1, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(msg.content["arrays"].to_numpy_ndarrays()[0]))
        opt = private_optimizer(msg, context, torch.optim.SGD(model.parameters(), lr=0.1),
                                model, loss_fn=lambda o, y: ((o - y) ** 2).mean())
        for _ in range(TAU):
            opt.zero_grad()
            ((model(torch.ones(1, DIM, dtype=torch.float64)) - 1.0) ** 2).sum().backward()
            if use_host_step:
                opt.private.step(np.zeros(DIM))  # mixing host and device noise: refused
            opt.step()
        return opt.reply([p.detach().numpy() for p in model.parameters()])

    return app


def train(application: ClientApp, context: Context, server_round: int) -> Message:
    return application(message(MessageType.TRAIN, np.full((1, DIM), 0.2), server_round),
                       context)


def stored(tmp_path: Path) -> LearnerState:
    data = StateStore(tmp_path).load()
    assert data is not None
    return LearnerState.from_bytes(data)


def test_the_device_stream_is_the_learners_state_and_continues(tmp_path: Path) -> None:
    context = ctx(tmp_path)
    for r in (1, 2):
        reply = train(app(), context, r)
        assert not reply.has_error(), reply.error
        assert reply.content["metrics"]["steps"] == r * TAU
        state = stored(tmp_path)
        assert isinstance(state.noise, TorchNoiseStream)  # restored as a device stream
        assert state.step == state.noise.step == state.position == r * TAU
    # the stored stream continues exactly where the optimizer's stopped
    expected = state.noise.fork().next()
    again = LearnerState.from_bytes(StateStore(tmp_path).load())  # type: ignore[arg-type]
    assert torch.equal(again.noise.next(), expected)  # type: ignore[union-attr]


def test_secure_noise_and_mixed_steps_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    reply = train(app(), ctx(tmp_path / "s", **{"secure-noise": True}), 1)
    assert reply.has_error() and "NumPy-only" in reply.error.reason
    assert StateStore(tmp_path / "s").load() is None  # nothing stored, nothing released
    reply = train(app(use_host_step=True), ctx(tmp_path / "m"), 1)
    assert reply.has_error() and "device optimizer" in reply.error.reason


def test_a_host_stream_that_released_noise_is_not_moved_to_the_device(tmp_path: Path) -> None:
    host = ClientApp(mods=[PrivateSteps.guard()])

    @host.train()
    def host_train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        x = msg.content["arrays"].to_numpy_ndarrays()[0]
        for _ in range(TAU):
            x = x - 0.1 * private.step(np.ones_like(x))
        return private.reply([x])

    context = ctx(tmp_path)
    assert not train(host, context, 1).has_error()
    reply = train(app(), context, 2)
    assert reply.has_error() and "host (NumPy) stream" in reply.error.reason
    assert stored(tmp_path).step == TAU  # unchanged

