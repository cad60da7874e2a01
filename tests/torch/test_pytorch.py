"""The PyTorch helper: same update as the NumPy learner, clipping over all parameters,
non-finite steps refused, Flower's NumPyClient and Message-API paths."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr.app import Context, RecordDict  # noqa: E402

from flwr_corrnoise.flower import TorchCorrNoiseClient  # noqa: E402
from flwr_corrnoise.learner import local_round  # noqa: E402
from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.settings import PrivacySettings  # noqa: E402
from flwr_corrnoise.torch import (  # noqa: E402
    ModuleGradient,
    get_parameters,
    set_parameters,
    torch_local_round,
)

D, K, TAU, ETA = 5, 3, 4, 0.1
SETTINGS = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=0.5, horizon=40)


def data(seed: int = 0, n: int = 64):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, D)), g.integers(0, K, size=n)


def linear_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(D, K).double()


def numpy_softmax_gradient(a: np.ndarray, b: np.ndarray):
    """The gradient of mean cross-entropy for a linear model, in closed form."""

    def grad(params, position):
        w, c = params
        x, y = a[position : position + 1], b[position : position + 1]
        logits = x @ w.T + c
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        return [p.T @ x / len(y), p.sum(axis=0) / len(y)]

    return grad


def torch_batches(a, b):
    return lambda i: (torch.from_numpy(a[i : i + 1]), torch.from_numpy(b[i : i + 1]))


@pytest.mark.parametrize("mechanism", ["blt", "tree", "independent", "none"])
def test_torch_and_numpy_learners_give_the_same_update(mechanism: str) -> None:
    settings = PrivacySettings(mechanism=mechanism, epsilon=2.0, delta=1e-3, clip_norm=0.5,
                               horizon=40)
    a, b = data()
    model = linear_model()
    x0 = get_parameters(model)
    shapes = [p.shape for p in x0]
    s_np = LearnerState.create(settings, shapes, seed=5)
    s_t = LearnerState.create(settings, shapes, seed=5)
    for _ in range(3):
        ref = local_round(get_parameters(model), numpy_softmax_gradient(a, b), s_np,
                          settings, TAU, ETA)
        got = torch_local_round(model, torch.nn.functional.cross_entropy, torch_batches(a, b),
                                s_t, settings, TAU, ETA)
        for u, v in zip(got.update, ref.update, strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)
        assert (s_t.step, s_t.position) == (s_np.step, s_np.position)
    # the model holds the last local iterate z = x − η·τ·ĝ
    assert s_t.step == 3 * TAU


class TwoTower(torch.nn.Module):
    """Several parameter tensors of different shapes, and a large gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 2, 3)
        self.fc = torch.nn.Linear(2 * (D - 2), K)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x.unsqueeze(1))).flatten(1)) * 50.0


def test_clipping_bounds_each_step_over_all_parameter_tensors() -> None:
    """The step minus its noise increment (drawn again from a twin stream with the same
    seed) has norm exactly B_g over all four tensors together when the gradient is large."""
    a, b = data(1)
    model = TwoTower().double()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert len(shapes) == 4
    state = LearnerState.create(SETTINGS, shapes, seed=9)
    twin = LearnerState.create(SETTINGS, shapes, seed=9)  # the same noise, drawn separately
    batch = lambda i: (torch.from_numpy(a[i : i + 4]), torch.from_numpy(b[i : i + 4]))  # noqa: E731
    grad = ModuleGradient(model, torch.nn.functional.cross_entropy, batch)
    raw = grad(get_parameters(model), 0)
    # clipping bites
    assert np.sqrt(sum(float(np.sum(g**2)) for g in raw)) > 10 * SETTINGS.clip_norm
    res = local_round(get_parameters(model), grad, state, SETTINGS, 1, ETA)
    noise = twin.noise.next()  # type: ignore[union-attr]
    step = np.concatenate([u.ravel() for u in res.update]) - noise
    assert np.linalg.norm(step) == pytest.approx(SETTINGS.clip_norm, rel=1e-9)
    assert res.diagnostics["clipped-steps"] == 1.0


def test_non_finite_loss_is_a_zero_step_and_never_poisons_the_model() -> None:
    """A non-finite loss on one datum: that step's gradient counts as zero (the reply must
    not depend on it), the model stays finite, the event is a local diagnostic."""
    a, b = data(2)
    a[2] = np.nan
    model = linear_model()
    before = get_parameters(model)
    state = LearnerState.create(SETTINGS, [p.shape for p in before], seed=1)
    res = torch_local_round(model, torch.nn.functional.cross_entropy, torch_batches(a, b),
                            state, SETTINGS, TAU, ETA)
    assert state.step == TAU and res.diagnostics["nonfinite-steps"] >= 1.0
    assert "train-loss" not in res.metrics
    assert all(np.all(np.isfinite(p)) for p in get_parameters(model))


def test_set_parameters_checks_shapes() -> None:
    model = linear_model()
    with pytest.raises(ValueError, match="parameter tensors"):
        set_parameters(model, [np.zeros((K, D))])
    with pytest.raises(ValueError, match="shape"):
        set_parameters(model, [np.zeros((D, K)), np.zeros(K)])


def test_numpy_client_path_matches_the_core(simulated: None) -> None:
    a, b = data(3)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                  state=RecordDict(), run_config={"mechanism": "blt", "horizon": 40,
                                                  "clip-norm": 0.5, "data-reuse": "once",
"seed": 4})
    model = linear_model()
    x0 = get_parameters(model)
    client = TorchCorrNoiseClient(ctx, model, torch.nn.functional.cross_entropy,
                                  torch_batches(a, b))
    update, n, metrics = client.fit(x0, {"local-steps": TAU, "learning-rate": ETA})
    state = LearnerState.create(client.learner.settings, [p.shape for p in x0],
                                client.learner.seed)
    ref = local_round(x0, numpy_softmax_gradient(a, b), state, client.learner.settings,
                      TAU, ETA)
    assert n == TAU and metrics["steps"] == TAU
    for u, v in zip(update, ref.update, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_model_gives_the_cpu_update() -> None:
    a, b = data(4)
    cpu, gpu = linear_model(), linear_model().cuda()
    shapes = [p.shape for p in cpu.parameters()]
    s1, s2 = (LearnerState.create(SETTINGS, shapes, seed=2) for _ in range(2))
    r1 = torch_local_round(cpu, torch.nn.functional.cross_entropy, torch_batches(a, b), s1,
                           SETTINGS, TAU, ETA)
    r2 = torch_local_round(gpu, torch.nn.functional.cross_entropy, torch_batches(a, b), s2,
                           SETTINGS, TAU, ETA)
    for u, v in zip(r1.update, r2.update, strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-7, atol=1e-9)
    assert next(gpu.parameters()).is_cuda
