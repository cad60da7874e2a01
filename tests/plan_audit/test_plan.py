"""The plan before the run (issue 21 item 4), against a Monte Carlo run of the real noise.

Independent computation: draw the learners' actual noise streams (the factorization and
std the plan names), average ``m`` of them over the whole horizon as the server would, and
compare the measured noise norm (divided by the batch size) with the signal bound ``N·B_g``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.plan import PlanInput, format_plan, make_plan, noise_to_signal
from flwr_corrnoise.streams import NoiseStream

SMALL = PlanInput(model_size=4000, examples=120, batch_size=10, epochs=3, learners=4,
                  mechanism="blt", epsilon=2.0, delta=1e-5, clip_norm=0.7, rounds=3)


def test_noise_to_signal_matches_the_noise_the_learners_draw() -> None:
    settings, nsr_first, nsr_final, safe_lr = noise_to_signal(SMALL)
    cal = settings.calibration()
    n, m, b = settings.horizon, SMALL.learners, SMALL.batch_size
    total = np.zeros(SMALL.model_size)
    first = np.zeros(SMALL.model_size)
    worst = 0.0
    for learner in range(m):
        stream = NoiseStream.create("blt", n, SMALL.model_size, cal.std, seed=learner,
                                    factorization=settings.factorization())
        running = np.zeros(SMALL.model_size)
        for k in range(n):
            running += stream.next()
            if k == n // SMALL.rounds - 1:
                first += running
        total += running
    measured_final = np.linalg.norm(total / m / b) / (n * SMALL.clip_norm)
    measured_first = np.linalg.norm(first / m / b) / ((n // SMALL.rounds) * SMALL.clip_norm)
    assert measured_final == pytest.approx(nsr_final, rel=0.1)
    assert measured_first == pytest.approx(nsr_first, rel=0.1)
    # safe learning rate: at it, the model noise's per-coordinate std peaks at 0.1
    rows = np.sqrt(settings.factorization().row_errors())
    worst = safe_lr * cal.std * rows.max() / (b * math.sqrt(m))
    assert worst == pytest.approx(0.1)


def test_the_plan_calibrates_for_the_loop_and_ranks_its_levers() -> None:
    plan = make_plan(SMALL)
    assert plan.horizon == 36 and plan.participation.startswith("3 epochs of 12 steps")
    assert plan.std == SMALL.settings().calibration().std
    nsrs = [nsr for _, nsr in plan.levers]
    assert nsrs == sorted(nsrs)
    labels = dict(plan.levers)
    assert labels["learners per round 4 → 8"] == pytest.approx(plan.nsr_final / math.sqrt(2))
    assert labels["mechanism blt → independent"] > plan.nsr_final  # correlated noise helps
    text = format_plan(plan)
    assert "verdict:" in text and "levers, best first" in text


def test_verdicts_follow_the_noise() -> None:
    tiny_batch = make_plan(PlanInput(model_size=10**6, examples=50, batch_size=1, epochs=5,
                                     epsilon=0.5, delta=1e-6, rounds=5, mechanism="toeplitz"),
                           levers=False)
    assert tiny_batch.verdict.startswith("noise dominates: expect no learning")
    big = make_plan(PlanInput(model_size=10, examples=5000, batch_size=100, epochs=1,
                              learners=50, mechanism="toeplitz"), levers=False)
    assert big.verdict.startswith("signal dominates")
    lr_plan = make_plan(PlanInput(model_size=1000, examples=100, batch_size=10, epochs=2,
                                  rounds=2, learning_rate=100.0, mechanism="toeplitz"),
                        levers=False)
    assert "WARNING: learning rate 100 exceeds it" in format_plan(lr_plan)
    with pytest.raises(ValueError, match="batch size"):
        PlanInput(model_size=10, examples=5, batch_size=6, epochs=1)
    with pytest.raises(ValueError, match="signal"):
        PlanInput(model_size=10, examples=5, batch_size=1, epochs=1, signal=0.0)


@pytest.mark.parametrize("lr, momentum, warned", [
    (50.0, 0.0, True), (1e-4, 0.0, False),
    # issue 32: between the safe step size with momentum 0.9 and without, only the
    # heavy ball (which carries each step's noise into the next ~10) is warned of
    ("between", 0.9, True), ("between", 0.0, False)])
def test_the_device_step_warns_when_the_step_size_would_blow_the_model_up(
        monkeypatch: pytest.MonkeyPatch, lr: float | str, momentum: float,
        warned: bool) -> None:
    import logging

    import torch

    from flwr_corrnoise.plan import safe_learning_rate
    from flwr_corrnoise.settings import PrivacySettings
    from flwr_corrnoise.torch import PrivateOptimizer
    from flwr_corrnoise.torch import optimizer as optimizer_module

    # a handler on the module's own logger: independent of what other tests did to the
    # logging tree (propagation, levels) and of warnings this process already gave
    monkeypatch.setattr(optimizer_module, "_WARNED_STEP_SIZES", set())
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = optimizer_module.log
    # setLevel, not the attribute: it also clears the logging module's isEnabledFor cache
    # (simulations/multi_epoch.py, run by another test in this process, raises this
    # logger's level to ERROR)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    monkeypatch.setattr(logger, "disabled", False)
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        settings = PrivacySettings(mechanism="toeplitz", horizon=8)
        if lr == "between":
            lr = math.sqrt(safe_learning_rate(settings, 5) *
                           safe_learning_rate(settings, 5, momentum=0.9))
        opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                               model, settings, seed=3)
        x, y = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1])
        for _ in range(2):
            opt.zero_grad()
            opt.backward(x, y)
            opt.step()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    hits = [r for r in records if "exceeds the safe" in r.getMessage()]
    assert len(hits) == (1 if warned else 0)  # once, not every step
    assert (lr > safe_learning_rate(settings, 5, momentum=momentum)) == warned
    assert safe_learning_rate(settings, 5, momentum=0.9) < safe_learning_rate(settings, 5)
