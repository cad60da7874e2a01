"""The plan's terms of issue 32 against closed forms: heavy-ball momentum and adaptive
clipping's own cost."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from flwr_corrnoise.adaptive_clipping import DEFAULT_COUNT_SHARE
from flwr_corrnoise.cli import build_parser
from flwr_corrnoise.plan import PlanInput, make_plan, momentum_rows

BASE = PlanInput(model_size=500, examples=60, batch_size=10, epochs=2, learners=3,
                 mechanism="independent", rounds=2)


def weights(k: int, beta: float) -> np.ndarray:
    """Heavy-ball weights of the updates u_1..u_k in the model after k steps, by running
    v ← βv + u, x ← x + v on unit impulses."""
    out = np.empty(k)
    for t in range(k):
        v = x = 0.0
        for s in range(k):
            v = beta * v + (1.0 if s == t else 0.0)
            x += v
        out[t] = x
    return out


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9])
def test_momentum_with_independent_noise_is_the_weights_norm(beta: float) -> None:
    """C = I: the model's noise after k steps is V·‖w‖, its signal bound B_g·Σw."""
    plan = make_plan(dataclasses.replace(BASE, momentum=beta), levers=False)
    n = plan.horizon
    w = weights(n, beta)
    want = plan.std * math.sqrt(500) * np.linalg.norm(w) / (10 * math.sqrt(3) * 1.0 * w.sum())
    assert plan.nsr_final == pytest.approx(want, rel=1e-12)
    w1 = weights(n // 2, beta)
    assert plan.nsr_first_round == pytest.approx(
        plan.std * math.sqrt(500) * np.linalg.norm(w1) / (10 * math.sqrt(3) * w1.sum()),
        rel=1e-12)
    peak = max(np.linalg.norm(weights(k, beta)) for k in range(1, n + 1))
    assert plan.safe_learning_rate == pytest.approx(0.1 * 10 * math.sqrt(3) /
                                                    (plan.std * peak), rel=1e-12)


def test_momentum_rows_against_the_inverse_encoder() -> None:
    """Correlated noise: the model's noise is V·‖wᵀC⁻¹‖ (the increments' noise V·C⁻¹ξ),
    computed here from the materialized C, not from B."""
    inputs = dataclasses.replace(BASE, mechanism="toeplitz", momentum=0.8)
    settings = inputs.settings()
    _, C = settings.factorization().matrices()
    Cinv = np.linalg.inv(C)
    noise, signal = momentum_rows(settings, 0.8)
    for k in (1, 5, settings.horizon):
        w = weights(k, 0.8)
        assert noise[k - 1] == pytest.approx(float(np.linalg.norm(w @ Cinv[:k])), rel=1e-10)
        assert signal[k - 1] == pytest.approx(w.sum(), rel=1e-12)
    plain = np.sqrt(settings.factorization().row_errors())
    np.testing.assert_allclose(momentum_rows(settings, 1e-300)[0], plain, rtol=1e-10)


def test_adaptive_clipping_costs_its_share_of_the_budget() -> None:
    fixed = make_plan(BASE, levers=False)
    adaptive = make_plan(dataclasses.replace(BASE, adaptive_quantile=0.5), levers=False)
    factor = 1 / math.sqrt(1 - DEFAULT_COUNT_SHARE)
    assert adaptive.nsr_final / fixed.nsr_final == pytest.approx(factor, rel=1e-9)
    assert fixed.safe_learning_rate / adaptive.safe_learning_rate == pytest.approx(
        factor, rel=1e-9)
    with pytest.raises(ValueError, match="central"):
        dataclasses.replace(BASE, mode="central", adaptive_quantile=0.5)
    with pytest.raises(ValueError, match="momentum"):
        dataclasses.replace(BASE, momentum=1.0)


def test_cli_plan_takes_momentum_and_adaptive_clipping() -> None:
    args = build_parser().parse_args(["plan", "--model-size", "500", "--examples", "60",
                                      "--batch-size", "10", "--epochs", "2", "--momentum",
                                      "0.9", "--adaptive-clip-quantile", "0.5"])
    out = args.func(_json(args))
    assert out["inputs"]["momentum"] == 0.9 and out["inputs"]["adaptive_quantile"] == 0.5


def _json(args):  # the parsed namespace with --json on
    args.json = True
    return args


def test_momentum_rows_above_the_exact_horizon_bound_the_noise(monkeypatch) -> None:
    """Past MOMENTUM_EXACT_STEPS the plan bounds ‖Σ β^{k−t} b_t‖ by Σ β^{k−t}‖b_t‖: never
    below the exact figure, equal to it for k = 1."""
    from flwr_corrnoise import plan as plan_module

    settings = dataclasses.replace(BASE, mechanism="toeplitz").settings()
    exact, signal = momentum_rows(settings, 0.9)
    monkeypatch.setattr(plan_module, "MOMENTUM_EXACT_STEPS", 1)
    bound, signal_b = momentum_rows(settings, 0.9)
    assert np.all(bound >= exact * (1 - 1e-12)) and bound[0] == pytest.approx(exact[0])
    np.testing.assert_array_equal(signal, signal_b)
