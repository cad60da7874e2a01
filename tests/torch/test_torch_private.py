"""The private step on the model's device (PrivateOptimizer, device_local_round): the
reference NumPy round at batch 1, per-example clipping against an independent per-example
loop, the noise V/b on the mean, non-finite examples, the horizon, bytes round trip."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_corrnoise.learner import local_round  # noqa: E402
from flwr_corrnoise.learner_state import LearnerState  # noqa: E402
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings  # noqa: E402
from flwr_corrnoise.streams import HorizonExhaustedError  # noqa: E402
from flwr_corrnoise.torch import (  # noqa: E402
    ModuleGradient,
    PrivateOptimizer,
    TorchNoiseStream,
    device_local_round,
    get_parameters,
)

D, K, TAU, ETA = 5, 3, 4, 0.1
CE = torch.nn.functional.cross_entropy


def settings(mechanism: str = "blt", horizon: int = 40, clip: float = 0.5) -> PrivacySettings:
    return PrivacySettings(mechanism=mechanism, epsilon=2.0, delta=1e-3, clip_norm=clip,
                           horizon=horizon)


def data(seed: int = 0, n: int = 64):
    g = np.random.default_rng(seed)
    return g.normal(size=(n, D)), g.integers(0, K, size=n)


class TwoTower(torch.nn.Module):
    """Four parameter tensors of different shapes; large gradients (clipping bites)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 2, 3)
        self.fc = torch.nn.Linear(2 * (D - 2), K)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x.unsqueeze(1))).flatten(1)) * 50.0


def linear_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(D, K).double()


class ReplayNoise:
    """A NumPy-facing view of a copy of the optimizer's torch stream, so the reference
    :func:`local_round` adds exactly the increments the device step adds."""

    def __init__(self, stream: TorchNoiseStream) -> None:
        self.stream = TorchNoiseStream.from_bytes(stream.to_bytes())
        self.dim = self.stream.dim

    secure = False  # torch streams are never secure (ChaCha20 is NumPy-only)

    def next(self) -> np.ndarray:
        return self.stream.next().numpy()

    def add_next(self, value: np.ndarray) -> np.ndarray:
        return value + self.next()

    def fork(self) -> ReplayNoise:
        twin = copy.copy(self)
        twin.stream = self.stream.fork()
        return twin


def batches(a, b, size: int = 1, dtype=None):
    return lambda i: (torch.from_numpy(a[i * size : (i + 1) * size]).to(dtype),
                      torch.from_numpy(b[i * size : (i + 1) * size]))


@pytest.mark.parametrize("mechanism", ["blt", "tree", "independent", "toeplitz", "none"])
@pytest.mark.parametrize("per_example", [True, False])
def test_device_round_equals_the_numpy_reference_at_batch_one(mechanism: str,
                                                              per_example: bool) -> None:
    """Batch 1: the device round (per-example clipping, or the whole-batch clip) is the
    reference ``learner.local_round`` — same update, same final iterate, float tolerance."""
    s = settings(mechanism)
    a, b = data()
    model = TwoTower().double()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=5)
    ref_model = copy.deepcopy(model)
    state = LearnerState(noise=ReplayNoise(private.noise) if private.noise else None)  # type: ignore[arg-type]
    position = 0
    for _ in range(3):
        x0 = get_parameters(ref_model)
        ref = local_round(x0, ModuleGradient(ref_model, CE, batches(a, b)), state, s, TAU, ETA)
        got = device_local_round(private, batches(a, b), TAU, position, per_example=per_example)
        position = got.position
        for u, v in zip(got.update, ref.update, strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-9, atol=1e-12)
        z = [p - ETA * TAU * u for p, u in zip(x0, ref.update, strict=True)]
        for p, q in zip(get_parameters(model), z, strict=True):
            np.testing.assert_allclose(p, q, rtol=1e-9, atol=1e-12)
        with torch.no_grad():  # the reference continues from the device iterate
            for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
                p.copy_(q)
    assert private.steps == 3 * TAU and position == 3 * TAU
    assert ref.diagnostics["clipped-steps"] > 0 if s.private else True


def per_example_reference(model, x, y, clip: float) -> list[np.ndarray]:
    """Σ_i clip(∇ℓ_i, B_g) by a plain loop of loss.backward() per example, clipped in
    NumPy over all parameters: an independent computation of what backward() sums."""
    total = None
    for i in range(len(x)):
        model.zero_grad()
        CE(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = np.concatenate([p.grad.detach().double().numpy().ravel()
                            for p in model.parameters()])
        if not np.all(np.isfinite(g)):
            g = np.zeros_like(g)
        norm = np.linalg.norm(g)
        g = g * min(1.0, clip / norm) if norm > 0 else g
        total = g if total is None else total + g
    return total  # type: ignore[return-value]


def summed(private: PrivateOptimizer) -> np.ndarray:
    return np.concatenate([p.grad.detach().double().numpy().ravel() for p in private.params])


def test_per_example_clipping_bounds_each_example() -> None:
    """One enormous example moves the clipped sum by at most 2·B_g (and contributes
    exactly B_g alone); backward() equals an independent per-example loop."""
    s = settings(clip=0.5)
    a, b = data(3, n=8)
    x, y = torch.from_numpy(a), torch.from_numpy(b)
    big = x.clone()
    big[3] *= 1e6
    model = TwoTower().double()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=1)
    private.backward(x, y)
    s_a = summed(private)
    np.testing.assert_allclose(s_a, per_example_reference(model, x, y, s.clip_norm), rtol=1e-9,
                               atol=1e-12)
    private.zero_grad()
    private.backward(big, y)
    s_big = summed(private)
    np.testing.assert_allclose(s_big, per_example_reference(model, big, y, s.clip_norm), rtol=1e-9,
                               atol=1e-12)
    assert np.linalg.norm(s_a - s_big) <= 2 * s.clip_norm * (1 + 1e-12)
    private.zero_grad()
    private.backward(big[3:4], y[3:4])
    assert np.linalg.norm(summed(private)) == pytest.approx(s.clip_norm, rel=1e-9)
    assert private.diagnostics()["clipped-examples"] > 0


def test_the_step_adds_the_increment_to_the_sum_and_divides_by_b() -> None:
    """grad = (Σ clip(g_i) + e[k]) / b: the noise on the mean is V/b — the noisy *sum* is
    the calibrated release (sensitivity 2·B_g), the mean its post-processing."""
    s = settings("blt")
    a, b = data(4, n=16)
    model = TwoTower().double()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=2)
    twin = TorchNoiseStream.from_bytes(private.noise.to_bytes())  # type: ignore[union-attr]
    private.backward(torch.from_numpy(a), torch.from_numpy(b))
    total = summed(private)
    private.step()
    e = twin.next().numpy()
    np.testing.assert_allclose(summed(private), (total + e) / 16, rtol=1e-12, atol=1e-14)
    assert twin.std == pytest.approx(s.calibration().std)  # type: ignore[union-attr]


def test_non_finite_example_contributes_zero() -> None:
    """A NaN example adds nothing (the sum equals the sum over the others); a batch whose
    gradient is NaN in whole-batch mode is a zero step — only noise, a finite model."""
    s = settings(clip=0.5)
    a, b = data(5, n=6)
    x, y = torch.from_numpy(a), torch.from_numpy(b)
    bad = x.clone()
    bad[2] = float("nan")
    model = TwoTower().double()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=3)
    twin = TorchNoiseStream.from_bytes(private.noise.to_bytes())  # type: ignore[union-attr]
    keep = torch.tensor([0, 1, 3, 4, 5])
    loss = private.backward(bad, y)
    assert torch.isfinite(loss)
    np.testing.assert_allclose(summed(private),
                               per_example_reference(model, x[keep], y[keep], s.clip_norm),
                               rtol=1e-9, atol=1e-12)
    assert private.diagnostics()["nonfinite-examples"] == 1.0
    private.zero_grad()
    CE(model(bad), y).backward()  # whole-batch mode: the batch gradient is NaN
    private.step()  # the first increment: backward() alone consumed none
    np.testing.assert_allclose(summed(private), twin.next().numpy(), rtol=1e-12)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_refuses_a_step_past_the_horizon() -> None:
    s = settings("tree", horizon=3)
    a, b = data()
    model = linear_model()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=0)
    for i in range(3):
        private.zero_grad()
        private.backward(*batches(a, b)(i))
        private.step()
    before = get_parameters(model)
    private.zero_grad()
    private.backward(*batches(a, b)(3))
    with pytest.raises(HorizonExhaustedError, match="3 steps"):
        private.step()
    for p, q in zip(get_parameters(model), before, strict=True):
        np.testing.assert_array_equal(p, q)
    restored = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s,
                                state=private.to_bytes())
    with pytest.raises(HorizonExhaustedError):
        device_local_round(restored, batches(a, b), 1, 3)


def test_round_past_the_horizon_or_failing_changes_nothing() -> None:
    s = settings("blt", horizon=5)
    a, b = data()
    model = linear_model()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=0)
    device_local_round(private, batches(a, b), 2, 0)
    blob, before = private.to_bytes(), get_parameters(model)
    with pytest.raises(HorizonExhaustedError):
        device_local_round(private, batches(a, b), 4, 2)

    class Interrupted(BaseException):  # an interrupt, not a datum's failure
        pass

    def failing(i, error=Interrupted):
        if i == 3:
            raise error("the data source went away")
        return batches(a, b)(i)

    with pytest.raises(Interrupted):
        device_local_round(private, failing, 2, 2)
    assert private.to_bytes() == blob and private.steps == 2
    for p, q in zip(get_parameters(model), before, strict=True):
        np.testing.assert_array_equal(p, q)
    # an exception on a datum is no failure of the round: that step's gradient is zero
    out = device_local_round(private, lambda i: failing(i, OSError), 2, 2)
    assert private.steps == 4 and out.diagnostics["failed-examples"] == 1.0


@pytest.mark.parametrize("mechanism", ["blt", "tree", "toeplitz", "none"])
def test_state_round_trips_through_bytes_bit_for_bit(mechanism: str) -> None:
    """A new ClientApp instance: a fresh model at the global parameters and a fresh
    optimizer from the stored bytes continue exactly like the uninterrupted learner."""
    s = settings(mechanism)
    a, b = data()
    model = TwoTower()  # float32: the default
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=7)
    device_local_round(private, batches(a, b, 4, torch.float32), 3, 0)
    blob = private.to_bytes()
    model2 = copy.deepcopy(model)
    again = PrivateOptimizer(torch.optim.SGD(model2.parameters(), lr=ETA), model2, s,
                             state=blob)
    assert again.steps == 3 and again.to_bytes() == blob
    if s.private:
        assert again.noise.dtype == torch.float32  # type: ignore[union-attr]
    u1 = device_local_round(private, batches(a, b, 4, torch.float32), 3, 3).update
    u2 = device_local_round(again, batches(a, b, 4, torch.float32), 3, 3).update
    for p, q in zip(u1, u2, strict=True):
        np.testing.assert_array_equal(p, q)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_other_settings_or_foreign_parameters_are_refused() -> None:
    s = settings("blt")
    model = linear_model()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=7)
    blob = private.to_bytes()
    with pytest.raises(PrivacyConfigError, match="other privacy settings"):
        PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model,
                         settings("blt", clip=1.0), state=blob)
    with pytest.raises(ValueError, match="only one of them"):
        PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=1,
                         state=blob)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        PrivateOptimizer(torch.optim.SGD(other.parameters(), lr=ETA), model, s, seed=1)


def test_metrics_are_public_diagnostics_stay_local() -> None:
    """What may leave depends on settings and counters only: two learners on different
    data report identical metrics; the data-dependent counts are in diagnostics only."""
    s = settings("blt")
    out = []
    for seed in (0, 1):
        a, b = data(seed)
        a[0] = np.nan
        model = linear_model()
        private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s,
                                   seed=3)
        out.append(device_local_round(private, batches(a, b, 2), 3, 0))
    assert out[0].metrics == out[1].metrics
    assert set(out[0].metrics) == {"steps", "epsilon-spent", "epsilon", "delta", "noise-std",
                                   "horizon"}
    assert out[0].diagnostics["nonfinite-examples"] == 1.0
    assert all(np.all(np.isfinite(u)) for r in out for u in r.update)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_step_stays_on_the_device_and_restores() -> None:
    s = settings("blt")
    a, b = data()
    model = TwoTower().cuda()
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=7)
    assert private.noise.device.type == "cuda"  # type: ignore[union-attr]
    device_local_round(private, batches(a, b, 4, torch.float32), 2, 0)
    again = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s,
                             state=private.to_bytes())
    assert torch.equal(private.noise.next(), again.noise.next())  # type: ignore[union-attr]


class SmallCNN(torch.nn.Module):
    """Conv2d layers (one with few input channels, one with many, stride and padding)
    and Linear layers: the hook path's cases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.c1 = torch.nn.Conv2d(1, 6, 3)
        self.c2 = torch.nn.Conv2d(6, 5, 3, stride=2, padding=1, bias=False)
        self.fc = torch.nn.Linear(5 * 3 * 3, 4)
        self.out = torch.nn.Linear(4, K)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.out(torch.relu(self.fc(h.flatten(1)))) * 20.0


@pytest.mark.parametrize("private", [True, False])
def test_hook_path_equals_the_torch_func_path(private: bool) -> None:
    """The fast per-example gradients (Linear: outer products, Conv2d: grouped conv or
    per-example conv2d_weight) give the same clipped sums as torch.func's vmap(grad) and
    as the independent per-example loop — with a NaN example and clipping that bites."""
    s = settings("blt" if private else "none", clip=10.0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 1, 7, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (7,), generator=g)
    x[4] = float("nan")
    sums = {}
    for mode in ("hooks", "func"):
        model = SmallCNN().double()
        opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s,
                               seed=0, per_example=mode)
        assert opt.per_example == mode
        opt.backward(x, y)
        sums[mode] = summed(opt)
        if private:
            assert 0 < opt.diagnostics()["clipped-examples"] < 6
    np.testing.assert_allclose(sums["hooks"], sums["func"], rtol=1e-9, atol=1e-12)
    keep = torch.tensor([0, 1, 2, 3, 5, 6])
    ref = per_example_reference(SmallCNN().double(), x[keep], y[keep], s.clip_norm if private
                                else np.inf)
    np.testing.assert_allclose(sums["hooks"], ref, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="hooks"):
        model = TwoTower()
        PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s,
                         per_example="hooks")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss", ["function", "module", "smoothed", "sum", "weighted"])
def test_cross_entropys_batched_losses_are_the_one_example_losses(dtype, loss: str) -> None:
    """grad_sample.per_example_losses: cross-entropy without class weights takes one call
    with ``reduction="none"`` instead of ``vmap``; the losses (NaN for an ignored target
    under a mean, as a batch of one gives) and their gradients equal ``vmap``'s bit for bit.
    Class weights change a batch of one's mean (it divides by the target's weight), so a
    weighted loss keeps ``vmap`` — and must equal it too."""
    from torch.func import vmap

    from flwr_corrnoise.torch.grad_sample import _plain_cross_entropy, per_example_losses

    fn = {"function": torch.nn.functional.cross_entropy,
          "module": torch.nn.CrossEntropyLoss(),
          "smoothed": torch.nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=3),
          "sum": torch.nn.CrossEntropyLoss(reduction="sum"),
          "weighted": torch.nn.CrossEntropyLoss(weight=torch.rand(K, dtype=dtype) + 0.5)}[loss]
    assert (_plain_cross_entropy(fn) is None) == (loss == "weighted")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, K, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, K, (40,), generator=g)
    y[5] = getattr(fn, "ignore_index", -100)
    fast = per_example_losses(fn, logits, y)
    slow = vmap(lambda o, t: fn(o.unsqueeze(0), t.unsqueeze(0)))(logits, y)
    assert torch.equal(torch.isnan(fast), torch.isnan(slow))
    assert bool(torch.isnan(fast[5])) == (loss in ("function", "module", "smoothed", "weighted"))
    assert torch.equal(fast.nan_to_num(), slow.nan_to_num())
    grads = [torch.autograd.grad(torch.where(torch.isfinite(v), v, 0.0).sum(), logits)[0]
             for v in (fast, slow)]
    assert torch.equal(grads[0], grads[1])


def test_losses_outside_the_fast_path_keep_vmaps_rule() -> None:
    """int32 class labels (the batched cross-entropy refuses them; a batch of one takes
    them) and an ``nn.CrossEntropyLoss`` with a forward hook go through ``vmap``: the
    labels still train (no example counted failed), the hook still runs."""
    from torch.func import vmap

    from flwr_corrnoise.torch.grad_sample import _plain_cross_entropy, per_example_losses

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(8, K, generator=g, dtype=torch.float64)
    y32 = torch.randint(0, K, (8,), generator=g, dtype=torch.int32)
    ce = torch.nn.functional.cross_entropy
    want = vmap(lambda o, t: ce(o.unsqueeze(0), t.unsqueeze(0)))(logits, y32)
    assert torch.equal(per_example_losses(ce, logits, y32), want)
    hooked = torch.nn.CrossEntropyLoss()
    hooked.register_forward_hook(lambda mod, inp, out: 2.0 * out)
    assert _plain_cross_entropy(hooked) is None
    assert torch.equal(per_example_losses(hooked, logits, y32.long()), 2.0 * want)
    s = settings("none", clip=1e9)
    model = SmallCNN().double()
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=0)
    x = torch.randn(5, 1, 7, 7, generator=g, dtype=torch.float64)
    opt.backward(x, torch.randint(0, K, (5,), generator=g, dtype=torch.int32))
    assert opt.diagnostics().get("failed-examples", 0) == 0
    assert float(np.abs(summed(opt)).sum()) > 0


def test_a_replaced_loss_function_is_the_one_per_example_gradients_use() -> None:
    """``PrivateOptimizer.loss_fn`` may be replaced between steps: the per-example
    gradients follow it (a loss scaled by 2 doubles every unclipped example's gradient)."""
    s = settings("none", clip=1e9)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 1, 7, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, K, (5,), generator=g)
    model = SmallCNN().double()
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model, s, seed=0)
    opt.backward(x, y)
    once = summed(opt)
    opt.zero_grad()
    opt.loss_fn = lambda out, t: 2.0 * torch.nn.functional.cross_entropy(out, t)
    opt.backward(x, y)
    np.testing.assert_allclose(summed(opt), 2.0 * once, rtol=1e-12, atol=1e-14)


def test_cpu_per_example_norms_equal_the_host_rule() -> None:
    """On the CPU the per-example squared norms of materialized and outer-product gradients
    are the host's row_sums_of_squares (one defined order, float64), within the clip
    margin's bound of an exact float64 reduction."""
    from flwr_corrnoise.learner import row_sums_of_squares
    from flwr_corrnoise.torch.grad_sample import Materialized, Outer

    g = torch.Generator().manual_seed(5)
    m = torch.randn(6, 3, 4, 5, generator=g)
    got = Materialized(m).sq()
    want = row_sums_of_squares(m.flatten(1).numpy())
    assert got.dtype == torch.float64 and np.array_equal(got.numpy(), want)
    delta, a = torch.randn(6, 7, generator=g), torch.randn(6, 90, generator=g)
    outer = Outer(delta, a).sq().numpy()
    exact = np.einsum("bi,bj->b", delta.double().numpy() ** 2, a.double().numpy() ** 2)
    np.testing.assert_allclose(outer, exact, rtol=1e-13)
    np.testing.assert_array_equal(outer, row_sums_of_squares(delta.numpy())
                                  * row_sums_of_squares(a.numpy()))


def _exact_sq(t: torch.Tensor):
    """‖t‖² in exact rational arithmetic, one term per distinct value (fast on the
    equal-valued vectors below, exact on any)."""
    from fractions import Fraction

    values, counts = np.unique(t.detach().double().numpy().ravel(), return_counts=True)
    return sum(int(c) * Fraction(float(v)) ** 2 for v, c in zip(values, counts, strict=True))


def test_a_float32_clip_is_within_the_clip_norm_exactly() -> None:
    """The sensitivity behind ε is B_g per example (or per step, whole-batch clipping).
    torch's float32 norms drift (here 7·10⁻⁵ of the norm on 3·10⁵ equal numbers), so a
    clip to B_g by them overshoots it; the norms are summed in float64 and the factor
    leaves the dtype's margin (learner.clip_margin). Checked in exact arithmetic: the
    whole-batch clip (PrivateOptimizer._clip_whole) and every per-example clipped gradient
    ``c_i·g_i`` (grad_sample.clip_factors), equal-valued and random, are within B_g — and
    the margin is negligible (≥ B_g·(1 − 10⁻⁶))."""
    from fractions import Fraction

    from flwr_corrnoise.torch.grad_sample import Materialized, clip_factors

    clip = 0.5
    model = torch.nn.Linear(1000, 300)
    private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=ETA), model,
                               settings(clip=clip), seed=1)
    bound = Fraction(clip) ** 2
    for value in (0.1, 3.7e-3, 1.0 / 3):
        grads = [torch.full((300, 1000), value), torch.full((300,), value)]
        clipped = private._clip_whole(grads, None)
        n2 = sum(_exact_sq(g) for g in clipped)
        assert n2 <= bound and float(n2) ** 0.5 >= clip * (1 - 1e-6), float(n2) ** 0.5
    gen = torch.Generator().manual_seed(3)
    for g in (torch.full((4, 300_000), 0.1), 5 * torch.randn(24, 1000, generator=gen)):
        c = clip_factors([Materialized(g)], torch.zeros(g.shape[0]), clip)[2]
        for i in range(g.shape[0]):
            n2 = _exact_sq(g[i] * c[i].to(g.dtype))  # as weighted_sum forms it (model dtype)
            assert n2 <= bound and float(n2) ** 0.5 >= clip * (1 - 1e-6), (i, float(n2) ** 0.5)
