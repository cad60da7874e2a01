"""The device engines: ``run_inprocess_device`` (sweeps) and ``make_torch_client_app``'s
default device ClientApp, against the NumPy reference engine and against each other."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402

from flwr_corrnoise.engine import run_inprocess  # noqa: E402
from flwr_corrnoise.flower import make_torch_client_app  # noqa: E402
from flwr_corrnoise.settings import PrivacySettings, derive_seed  # noqa: E402
from flwr_corrnoise.torch import (  # noqa: E402
    ModuleGradient,
    TorchNoiseStream,
    run_inprocess_device,
)

from ..flower.test_release_gate import message  # noqa: E402
from ..flower.test_strategy import task_identity  # noqa: E402, F401  (autouse)

DIM = 5


def linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(DIM, 1).double()


def stream(learner: int, scale: float = 1.0):
    """Learner ``learner``'s data: one (x, y) per position, a fixed function of both."""
    def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * learner + position)
        x = torch.randn(1, DIM, generator=g, dtype=torch.float64)
        return x * scale, x.sum(dim=1, keepdim=True) + 0.1
    return batch


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def test_noiseless_device_engine_is_the_reference_engine() -> None:
    """Same learners, positions and server step: the device engine's global model equals
    the NumPy reference engine's (float64 model, batch 1, no noise)."""
    settings = PrivacySettings(mechanism="none", horizon=12)
    kw = dict(settings=settings, rounds=4, tau=3, eta=0.05, eta_g=0.7)
    ref = run_inprocess(initial=[p.detach().numpy().copy() for p in linear().parameters()],
                        gradients=[ModuleGradient(linear(), mse, stream(i)) for i in range(3)],
                        **kw)
    dev = run_inprocess_device(model_fn=lambda i: linear(), batches=[stream(i) for i in range(3)],
                               loss_fn=mse, keep_models=True, **kw)
    for a, b in zip(ref.params, dev.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    assert len(dev.models) == 5 and not np.allclose(dev.models[0][0], dev.models[-1][0])


def test_private_device_engine_adds_each_learners_seeded_stream() -> None:
    """With a loss that does not depend on the parameters the global model moves by the
    noise only: ``x^R = x⁰ − η·η_g·(1/n)·Σ_i Σ_k e_i[k]``, ``e_i`` the stream seeded with
    ``derive_seed(seed, i)`` at the calibrated std — computed here from fresh streams."""
    settings = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0,
                               horizon=8)
    n, rounds, tau, eta, eta_g, seed = 2, 4, 2, 0.1, 0.5, 7
    dev = run_inprocess_device(
        model_fn=lambda i: linear(), batches=[stream(i) for i in range(n)],
        loss_fn=lambda out, y: 0.0 * out.sum(), settings=settings, rounds=rounds, tau=tau,
        eta=eta, eta_g=eta_g, seed=seed)
    x0 = [p.detach().numpy() for p in linear().parameters()]
    shapes = [tuple(p.shape) for p in x0]
    std = settings.calibration().std
    total = np.zeros(sum(p.size for p in x0))
    for i in range(n):
        s = TorchNoiseStream.create("blt", 8, shapes, std, derive_seed(seed, i),
                                    device=torch.device("cpu"), dtype=torch.float64)
        total += sum(s.next().numpy() for _ in range(rounds * tau))
    expect = np.concatenate([p.ravel() for p in x0]) - eta * eta_g * total / n
    got = np.concatenate([p.ravel() for p in dev.params])
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-10)
    assert [p.steps for p in dev.learners] == [8, 8]
    with pytest.raises(ValueError, match="exceed the horizon"):
        run_inprocess_device(model_fn=lambda i: linear(), batches=[stream(0)], loss_fn=mse,
                             settings=settings, rounds=5, tau=2, eta=eta)


def ctx(**node) -> Context:
    cfg = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-3,
           "clip-norm": 1.0, "data-reuse": "once", "horizon": 6, **node}
    return Context(run_id=1, node_id=1, node_config=cfg, state=RecordDict(),
                   run_config={"seed": 3})


def train_message(x: list[np.ndarray], server_round: int, tau: int = 2) -> Message:
    msg = message(MessageType.TRAIN, x[0], server_round)
    msg.content = RecordDict({"arrays": ArrayRecord(x), "config": ConfigRecord({
        "server-round": server_round, "local-steps": tau, "learning-rate": 0.1})})
    return msg


def test_device_client_app_is_the_device_engine(simulated: None) -> None:
    """Flower's ClientApp call path, three rounds, the learner's torch stream stored in
    ``context.state`` between messages: the replies give the same global models as the
    in-process device engine with one learner (seed from the run config's ``seed``)."""
    app = make_torch_client_app(lambda c: linear(), lambda c: stream(0), loss_fn=mse)
    context = ctx()
    x = [p.detach().numpy().copy() for p in linear().parameters()]
    for r in range(1, 4):
        reply = app(train_message(x, r), context)
        assert not reply.has_error(), reply.error
        update = reply.content["arrays"].to_numpy_ndarrays()
        x = [p - 0.1 * 2 * u for p, u in zip(x, update, strict=True)]
        assert reply.content["metrics"]["steps"] == 2 * r
    settings = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0, horizon=6)
    dev = run_inprocess_device(model_fn=lambda i: linear(), batches=[stream(0)], loss_fn=mse,
                               settings=settings, rounds=3, tau=2, eta=0.1, seed=3)
    for a, b in zip(x, dev.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    # the horizon is spent: a fourth round is refused and changes nothing
    before = bytes(context.state["flwr-corrnoise"]["learner"])
    reply = app(train_message(x, 4), context)
    assert reply.has_error() and "HorizonExhaustedError" in reply.error.reason
    assert bytes(context.state["flwr-corrnoise"]["learner"]) == before


def test_device_client_app_refuses_what_it_cannot_do_privately(simulated: None) -> None:
    """Secure noise is NumPy-only (the host engine serves it); a model that is not the
    arrays the server sent is refused; both before any step, with a clear reason."""
    app = make_torch_client_app(lambda c: linear(), lambda c: stream(0), loss_fn=mse)
    x = [p.detach().numpy().copy() for p in linear().parameters()]
    context = ctx(**{"secure-noise": True})
    reply = app(train_message(x, 1), context)
    assert reply.has_error() and "NumPy-only" in reply.error.reason
    assert "flwr-corrnoise" not in context.state
    host = make_torch_client_app(lambda c: linear(), lambda c: stream(0), loss_fn=mse,
                                 engine="host")
    assert not host(train_message(x, 1), ctx(**{"secure-noise": True, "noise-seed": None})
                    ).has_error()
    wrong = make_torch_client_app(lambda c: torch.nn.Linear(DIM, 2).double(),
                                  lambda c: stream(0), loss_fn=mse)
    reply = wrong(train_message(x, 1), ctx())
    assert reply.has_error() and "server sent" in reply.error.reason
    with pytest.raises(ValueError, match="engine"):
        make_torch_client_app(lambda c: linear(), lambda c: stream(0), engine="gpu")
