"""``flwr_corrnoise.torch``: the torch learners without Flower, per-example gradients from a
grad-sampler registry, and the old import paths kept for one release (issue 25 item 3).

The per-example gradients are checked against an independent computation: a loop of
single-example ``loss.backward()`` passes.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings  # noqa: E402
from flwr_corrnoise.torch import PrivateOptimizer, TorchNoiseStream, register_grad_sampler  # noqa: E402
from flwr_corrnoise.torch.grad_sample import PerExampleGradients, grad_sampler, sampled_layers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CE = torch.nn.functional.cross_entropy
D, K, B = 4, 3, 5


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and read the JSON it prints."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_torch_package_imports_no_flower() -> None:
    """Every module under ``flwr_corrnoise.torch`` imports without Flower, and importing the
    package registers the torch stream backend: a learner state holding a torch stream is
    read back by the core's ``LearnerState.from_bytes``."""
    got = run_python("""
import json, pkgutil, sys, importlib
import flwr_corrnoise.torch as t
names = [m.name for m in pkgutil.iter_modules(t.__path__, t.__name__ + ".")]
for name in names:
    importlib.import_module(name)
from flwr_corrnoise.learner_state import LearnerState
s = t.TorchNoiseStream.create("blt", horizon=4, dim=3, std=1.0, seed=1)
s.next()
back = LearnerState.from_bytes(LearnerState(step=1, position=1, noise=s).to_bytes())
print(json.dumps({"modules": names, "restored": type(back.noise).__name__,
                  "flwr": sorted(m for m in sys.modules if m == "flwr" or m.startswith("flwr."))}))
""")
    assert got["flwr"] == []
    assert {f"flwr_corrnoise.torch.{m}" for m in
            ("params", "grad_sample", "optimizer", "streams", "engine", "host")} <= set(
                got["modules"])
    assert got["restored"] == "TorchNoiseStream"


def test_the_core_and_the_flower_layer_import_no_torch(tmp_path: Path) -> None:
    """The core reads a torch learner state only through the backend table (no import of
    torch behind the caller's back: a clear error instead), and ``flwr_corrnoise.flower``
    loads its torch front ends only when one is asked for."""
    stream = TorchNoiseStream.create("blt", horizon=4, dim=3, std=1.0, seed=1)
    (tmp_path / "state").write_bytes(LearnerState(noise=stream).to_bytes())
    got = run_python(f"""
import json, sys
import flwr_corrnoise.flower
from flwr_corrnoise.learner_state import LearnerState
try:
    LearnerState.from_bytes(open({str(tmp_path / "state")!r}, "rb").read())
    error = ""
except ValueError as err:
    error = str(err)
print(json.dumps({{"error": error, "torch": "torch" in sys.modules}}))
""")
    assert got["torch"] is False
    assert "torch noise stream" in got["error"] and "flwr_corrnoise.torch" in got["error"]


def loop_gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                   ) -> list[list[np.ndarray]]:
    """Each example's gradient of every parameter, by a plain ``loss.backward()`` per
    example: the independent reference."""
    out = []
    for i in range(len(x)):
        model.zero_grad()
        CE(model(x[i : i + 1]), y[i : i + 1]).backward()
        out.append([p.grad.detach().numpy().copy() for p in model.parameters()])
    return out


def clipped_sum(per_example: list[list[np.ndarray]], clip: float) -> np.ndarray:
    """``Σ_i min(1, B_g/‖g_i‖)·g_i`` over all parameters together, in NumPy."""
    total = 0.0
    for grads in per_example:
        g = np.concatenate([a.ravel() for a in grads])
        total = total + g * min(1.0, clip / np.linalg.norm(g))
    return total  # type: ignore[return-value]


def private_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float,
                per_example: str = "auto") -> tuple[np.ndarray, PrivateOptimizer]:
    """The clipped per-example sum :meth:`PrivateOptimizer.backward` leaves in ``p.grad``."""
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                           PrivacySettings("blt", clip_norm=clip, horizon=4), seed=0,
                           per_example=per_example)
    opt.backward(x, y)
    return np.concatenate([p.grad.detach().numpy().ravel() for p in opt.params]), opt


def batch(shape: tuple[int, ...] = (B, D), seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 3,
            torch.randint(0, K, (shape[0],), generator=g))


def paper_cnn() -> torch.nn.Module:
    """The paper's CNN, from wherever the experiment code lives (it is moving out of the
    installed package: ``experiments/``)."""
    for name in ("experiments.cnn", "flwr_corrnoise.cnn"):
        try:
            return importlib.import_module(name).PaperCNN().double()
        except ModuleNotFoundError:
            continue
    raise AssertionError("the paper's CNN (PaperCNN) was not found")


def test_the_registry_covers_every_layer_of_the_paper_cnn() -> None:
    """Every parameterized layer type of the paper's CNN has a grad sampler, so the fast
    path runs on it — and gives the per-example loop's clipped sum."""
    torch.manual_seed(0)
    model = paper_cnn()
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert {type(m) for m in layers} == {torch.nn.Conv2d, torch.nn.Linear}
    assert all(grad_sampler(m) is not None for m in layers)
    assert sampled_layers(model) is not None
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 4, 9])
    got, opt = private_sum(model, x, y, clip=0.05)
    assert opt.per_example == "hooks"
    want = clipped_sum(loop_gradients(model, x, y), 0.05)  # backward() took no step
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


class Scale(torch.nn.Module):
    """``out = a * weight`` for ``a`` of shape ``(b, features)`` (docs/pytorch.md's example)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, features, dtype=torch.float64))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.weight


def three_layers(middle: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 6).double(), torch.nn.Tanh(), middle,
                               torch.nn.Linear(6, K).double())


def test_an_unregistered_layer_falls_back_to_torch_func() -> None:
    """A layer type with no sampler: the whole model goes to torch.func, whose per-example
    gradients are the loop's, example by example and parameter by parameter."""

    class Unregistered(Scale):  # a subclass is another type: Scale's sampler does not apply
        pass

    model = three_layers(Unregistered(6))
    assert grad_sampler(model[2]) is None and sampled_layers(model) is None
    x, y = batch()
    pieces, losses = PerExampleGradients(model, CE)(x, y)
    reference = loop_gradients(model, x, y)
    for j, piece in enumerate(pieces):
        for i in range(B):
            np.testing.assert_allclose(piece.g[i].numpy(), reference[i][j],  # type: ignore[attr-defined]
                                       rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(losses.numpy(), [CE(model(x[i : i + 1]), y[i : i + 1]).item()
                                                for i in range(B)], rtol=1e-12)
    got, opt = private_sum(model, x, y, clip=0.1)
    assert opt.per_example == "func"
    np.testing.assert_allclose(got, clipped_sum(reference, 0.1), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="register_grad_sampler"):
        private_sum(model, x, y, clip=0.1, per_example="hooks")


def test_a_weight_shared_by_two_layers_takes_torch_func() -> None:
    """Two ``Linear`` layers holding one weight: each layer's sampler sees half of that
    weight's per-example gradient, so the model goes to torch.func — the loop's sum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 6).double(), torch.nn.Tanh(),
                                torch.nn.Linear(6, 6).double(), torch.nn.Tanh(),
                                torch.nn.Linear(6, 6).double(), torch.nn.Tanh(),
                                torch.nn.Linear(6, K).double())
    model[4].weight = model[2].weight  # the same Parameter in two layers
    assert sampled_layers(model) is None
    x, y = batch()
    got, opt = private_sum(model, x, y, clip=0.1)
    assert opt.per_example == "func"
    np.testing.assert_allclose(got, clipped_sum(loop_gradients(model, x, y), 0.1),
                               rtol=1e-9, atol=1e-12)


def test_a_registered_sampler_is_used_for_its_layer() -> None:
    """Registering a custom layer's sampler puts the model on the sampler path: the sampler
    is called, and the clipped sum is the loop's (and torch.func's)."""

    class MyScale(Scale):
        pass

    calls = []

    @register_grad_sampler(MyScale)
    def scale_grad_sample(layer, a, delta):  # type: ignore[no-untyped-def]
        calls.append(tuple(a.shape))
        return {"weight": a * delta}

    model = three_layers(MyScale(6))
    assert grad_sampler(model[2]) is scale_grad_sample
    x, y = batch()
    got, opt = private_sum(model, x, y, clip=0.1)
    assert opt.per_example == "hooks" and calls == [(B, 6)]
    want = clipped_sum(loop_gradients(model, x, y), 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    by_func, _ = private_sum(model, x, y, clip=0.1, per_example="func")
    np.testing.assert_allclose(got, by_func, rtol=1e-9, atol=1e-12)
    assert len(calls) == 1  # "func" does not call it


def test_a_sampler_that_skips_a_parameter_stops_the_step() -> None:
    """A sampler's bug is the code's, not a datum's: a refusal, never a silent zero step."""

    class Skips(Scale):
        pass

    @register_grad_sampler(Skips)
    def skips(layer, a, delta):  # type: ignore[no-untyped-def]
        return {}

    class WrongShape(Scale):
        pass

    @register_grad_sampler(WrongShape)
    def wrong_shape(layer, a, delta):  # type: ignore[no-untyped-def]
        return {"weight": (a * delta).sum(0)}  # summed over the batch: not per example

    x, y = batch()
    for layer, match in ((Skips(6), "no per-example gradient"), (WrongShape(6), "shape")):
        with pytest.raises(PrivacyConfigError, match=match):
            private_sum(three_layers(layer), x, y, clip=0.1)
