"""The plan's measured signal term (issue 32): ``‖E clip(g)‖ / B_g`` from a local sample of
gradients, checked against closed forms, the torch measurement against an explicit loop of
single-example backward passes, and the plan and CLI that use it."""

from __future__ import annotations

import dataclasses
import math
from math import comb
from pathlib import Path

import numpy as np
import pytest

from flwr_corrnoise.cli import main
from flwr_corrnoise.plan import (
    PlanInput,
    estimate_signal,
    format_plan,
    make_plan,
    read_signal_sample,
    signal_from_gradients,
    signal_from_norms,
    verdict,
    with_signal,
)

BASE = PlanInput(model_size=500, examples=60, batch_size=10, epochs=2, learners=3,
                 mechanism="independent", rounds=2)


def two_point_sample(k: int, n: int) -> np.ndarray:
    """``k`` gradients (3, 4) and ``n − k`` gradients (3, −4): norm 5, clipped at 1 to
    (0.6, ±0.8); with fair signs the expected clipped gradient is (0.6, 0)."""
    return np.array([[3.0, 4.0]] * k + [[3.0, -4.0]] * (n - k))


def test_the_estimate_is_unbiased_for_the_squared_mean_clipped_gradient() -> None:
    """Exact expectation over every sample of 5 fair signs (binomial weights): the
    estimate's square averages to ‖E c‖² = 0.36, where the plain ‖mean‖² would give
    0.36 + tr(Σ)/n = 0.36 + 0.64/5."""
    n = 5
    mean_sq = sum(comb(n, k) / 2 ** n * signal_from_gradients(two_point_sample(k, n), 1.0)
                  .fraction ** 2 for k in range(n + 1))
    assert mean_sq == pytest.approx(0.36, rel=1e-12)
    one = signal_from_gradients(two_point_sample(3, n), 1.0)
    # by hand: S = (3, 0.8), Σ‖c‖² = 5 → (9.64 − 5)/20
    assert one.fraction == pytest.approx(math.sqrt(4.64 / 20), rel=1e-12)
    assert one.norm_fraction == 1.0 and one.alignment == pytest.approx(one.fraction)


def test_norms_below_the_clip_norm_and_aligned_gradients() -> None:
    g = np.outer([0.2, 0.5, 2.0, 4.0], [0.6, 0.8])  # one direction, norms 0.2 … 4
    est = signal_from_gradients(g, 1.0)
    # aligned: ‖E c‖ = mean min(‖g‖, 1) = (0.2 + 0.5 + 1 + 1)/4 and the estimator is exact
    # (all c_i equal direction: ‖S‖² − Σ‖c_i‖² = Σ_{i≠j} ‖c_i‖‖c_j‖)
    cross = (2.7 ** 2 - (0.04 + 0.25 + 1 + 1)) / 12
    assert est.fraction == pytest.approx(math.sqrt(cross), rel=1e-12)
    assert est.norm_fraction == pytest.approx(2.7 / 4, rel=1e-12)
    norms_only = signal_from_norms(np.linalg.norm(g, axis=1), 1.0)
    assert norms_only.fraction == pytest.approx(2.7 / 4) and norms_only.alignment is None
    assert "still an upper bound" in norms_only.basis


def test_a_sample_that_cannot_resolve_the_mean_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be told from zero"):
        signal_from_gradients(np.array([[1.0, 0.0], [-1.0, 0.0]]), 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        estimate_signal(np.ones(2), np.ones(1), 1.0)
    with pytest.raises(ValueError, match="finite"):
        signal_from_norms(np.array([1.0, np.nan]), 1.0)


def test_the_plan_divides_by_the_measured_signal_and_labels_it() -> None:
    upper = make_plan(BASE, levers=False)
    est = signal_from_gradients(two_point_sample(3, 5), 1.0)
    measured = make_plan(with_signal(BASE, est), levers=False)
    assert measured.nsr_final == pytest.approx(upper.nsr_final / est.fraction, rel=1e-12)
    assert measured.nsr_first_round == pytest.approx(upper.nsr_first_round / est.fraction)
    assert measured.verdict == verdict(measured.nsr_final)
    assert "(upper-bound signal, optimistic)" in format_plan(upper)
    text = format_plan(measured)
    assert "(measured signal)" in text and "measured on 5 gradients" in text
    stated = make_plan(dataclasses.replace(BASE, signal=0.5), levers=False)
    assert "(stated signal)" in format_plan(stated)


def test_cli_reads_a_sample_file(tmp_path: Path, capsys) -> None:
    sample = tmp_path / "grads.csv"
    sample.write_text("\n".join(f"{a},{b}" for a, b in two_point_sample(3, 5)))
    norms = tmp_path / "norms.txt"
    norms.write_text("0.2\n0.5\n2\n4\n")
    assert read_signal_sample(str(norms), 1.0).fraction == pytest.approx(2.7 / 4)
    args = ["plan", "--model-size", "500", "--examples", "60", "--batch-size", "10",
            "--epochs", "2", "--learners", "3", "--mechanism", "independent", "--rounds", "2"]
    assert main([*args, "--grad-norm-sample", str(sample)]) == 0
    out = capsys.readouterr().out
    assert "(measured signal)" in out and "measured on 5 gradients" in out
    assert main([*args, "--grad-norm-sample", str(sample), "--signal", "0.5"]) != 0
    assert "not both" in capsys.readouterr().err


def test_torch_measurement_equals_the_explicit_per_example_loop() -> None:
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import measure_signal

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(24, 6), torch.randint(0, 3, (24,))
    grads = []
    for i in range(20):  # max_examples cuts the second batch
        model.zero_grad()
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads.append(np.concatenate([p.grad.double().numpy().ravel()
                                     for p in model.parameters()]))
    before = [p.detach().clone() for p in model.parameters()]
    clip = float(np.median(np.linalg.norm(grads, axis=1)))  # half the examples clipped
    got = measure_signal(model, loss_fn, [(x[:12], y[:12]), (x[12:], y[12:])], clip,
                         max_examples=20)
    want = signal_from_gradients(np.array(grads), clip)
    assert got.examples == 20
    assert got.fraction == pytest.approx(want.fraction, rel=1e-5)
    assert got.norm_fraction == pytest.approx(want.norm_fraction, rel=1e-5)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(),
                                                       strict=True))


def test_the_plans_clipping_is_the_private_steps() -> None:
    """The measured signal clips as the run will (issue 32): ``measure_signal`` and
    ``PrivateOptimizer`` call one rule (``grad_sample.clip_factors``), so the signal
    measured on a batch equals the one computed from the clipped sum the private step
    forms on that batch (its ``.grad`` before the noise) with the explicit loop's clipped
    norms."""
    torch = pytest.importorskip("torch")
    from flwr_corrnoise import PrivacySettings
    from flwr_corrnoise.torch import PrivateOptimizer, measure_signal

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(12, 6), torch.zeros(12, dtype=torch.long)
    norms = []
    for i in range(12):
        model.zero_grad()
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
        norms.append(float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))))
    clip = float(np.median(norms))  # half the examples clipped
    clipped = np.minimum(norms, clip)
    got = measure_signal(model, loss_fn, [(x, y)], clip, max_examples=12)
    opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                           PrivacySettings("blt", 2.0, 1e-5, clip, 4), seed=1, loss_fn=loss_fn)
    opt.zero_grad()
    opt.backward(x, y)
    step_sum = np.concatenate([p.grad.double().numpy().ravel() for p in model.parameters()])
    want = estimate_signal(step_sum, clipped, clip)
    assert got.examples == 12 and 0 < got.fraction < 1
    assert got.fraction == pytest.approx(want.fraction, rel=1e-5)
    assert got.norm_fraction == pytest.approx(want.norm_fraction, rel=1e-5)
