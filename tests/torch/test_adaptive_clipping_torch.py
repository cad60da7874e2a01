"""Adaptive clipping on the torch device step (:class:`~flwr_corrnoise.torch.
PrivateOptimizer`): the same releases and clip norms as the NumPy private step, the
per-example count over a batch by hand, and the neighbouring-data rule through the torch
front ends."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_corrnoise.adaptive_clipping import AdaptiveClipping, AdaptiveClipState  # noqa: E402
from flwr_corrnoise.learner import StepCounts, private_step  # noqa: E402
from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.mechanisms.participation import Participation  # noqa: E402
from flwr_corrnoise.settings import PrivacySettings  # noqa: E402
from flwr_corrnoise.streams import NoiseStream  # noqa: E402
from flwr_corrnoise.torch import PrivateOptimizer  # noqa: E402

from ..flower import test_neighbouring_frontends as nb  # noqa: E402
from ..flower.test_strategy import task_identity  # noqa: E402, F401  (autouse: message identity)
from ..learner.test_adaptive_clipping_learner import adaptive_context  # noqa: E402

SETTINGS = PrivacySettings("toeplitz", 2.0, 1e-5, 0.7, 12,
                           participation=Participation.min_separation(1, 3),
                           adaptive=AdaptiveClipping(0.5, 0.2))


def clip_of(payload) -> float:
    return AdaptiveClipState.from_payload(payload).clip_norm


def test_whole_batch_steps_equal_the_numpy_private_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False).double()
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, SETTINGS,
                           seed=3)
    twin = LearnerState.create(SETTINGS, [(1, 3)], seed=3)
    rng = np.random.default_rng(0)
    for t in range(6):
        x = torch.tensor(rng.normal(size=(1, 3)) * (3.0 if t % 2 else 0.3))
        opt.zero_grad()
        ((model(x)) ** 2).sum().backward()
        g = model.weight.grad.detach().numpy().copy()
        opt.step()
        want = private_step(twin, SETTINGS, lambda g=g: g, 3, StepCounts())
        np.testing.assert_allclose(model.weight.grad.numpy().ravel(), want, atol=1e-12)
        assert clip_of(opt.state.payload) == pytest.approx(clip_of(twin.payload), rel=1e-12)


def test_per_example_batches_count_each_example() -> None:
    """A batch of b: Σ clip(g_i, C_t) + C_t·e_t, divided by b; then C_{t+1} from the count
    of examples with ‖g_i‖ ≤ C_t among the b."""
    model = torch.nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(0.5)
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, SETTINGS,
                           seed=4, loss_fn=lambda out, y: ((out - y) ** 2).sum())
    noise = NoiseStream.create("toeplitz", 12, [(1, 3)], SETTINGS.calibration().std, 4,
                               factorization=SETTINGS.factorization())
    hand = AdaptiveClipState.create(0.7, 4)
    rng = np.random.default_rng(1)
    w = np.full(3, 0.5)
    for t in range(4):
        x = rng.normal(size=(5, 3)) * np.array([[0.1], [0.2], [3.0], [4.0], [0.05]])
        y = np.zeros((5, 1))
        opt.zero_grad()
        opt.backward(torch.tensor(x), torch.tensor(y))
        opt.step()
        c = hand.clip_norm
        grads = 2 * (x @ w)[:, None] * x
        norms = np.linalg.norm(grads, axis=1)
        clipped = grads * np.minimum(1.0, c / norms)[:, None]
        want = (clipped.sum(axis=0) + c * noise.next()) / 5
        np.testing.assert_allclose(model.weight.grad.numpy().ravel(), want, atol=1e-12)
        hand.update(float(np.sum(norms <= c)), 5, t, SETTINGS.adaptive, SETTINGS.count_noise())
        assert clip_of(opt.state.payload) == pytest.approx(hand.clip_norm, rel=1e-12)


@pytest.mark.parametrize("kind", ("huge", "nan"))
@pytest.mark.parametrize("name", nb.TORCH_FRONT_ENDS)
def test_neighbouring_data_give_the_same_reply_through_torch_front_ends(
        name: str, kind: str, simulated: None) -> None:
    build = nb.front_end(name)
    small, _ = nb.conversation(build("small"), adaptive_context())
    odd, _ = nb.conversation(build(kind), adaptive_context())
    assert odd == small
    assert all("error" not in t for t in small[0::2])
