"""The plan for the round-level modes (issue 32): per-round noise (the mod) and central DP.
Quickstart-pytorch's per-round and central runs (d = 62k, 2 learners) destroyed the model
without a word; the plan now covers them, its figures are checked against an independent
computation (the materialized ``B`` and the variants' own calibration), and the servers warn
before round 1 when it says the run cannot learn."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import FedAvg, Strategy

from flwr_corrnoise.flower import CorrNoiseCentralDPStrategy, CorrNoiseLocalDPStrategy
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.mechanisms.participation import Participation
from flwr_corrnoise.plan import NO_LEARNING_NSR, PlanInput, make_plan
from flwr_corrnoise.variants import central_calibration, central_noise_std

from ..flower.test_server_summary import flower_log

D, R, M = 62006, 3, 2


def prefix_noise_norm(mechanism: str, rounds: int) -> float:
    """‖b_R‖: the last row of the materialized B (the noise on the final prefix sum)."""
    B, _ = build_factorization(mechanism, rounds).matrices()
    return float(np.linalg.norm(B[rounds - 1]))


@pytest.mark.parametrize("mode", ["round", "central"])
def test_round_mode_noise_to_signal_is_the_independent_figure(mode: str) -> None:
    plan = make_plan(PlanInput(model_size=D, examples=1, batch_size=1, epochs=1, learners=M,
                               mechanism="toeplitz", epsilon=2.0, delta=1e-5, rounds=R,
                               mode=mode), levers=False)
    cal = central_calibration("toeplitz", 2.0, 1e-5, 1.0, R,
                              participation=Participation.every_step(R))
    std = central_noise_std(cal, M) if mode == "central" else cal.std / math.sqrt(M)
    want = std * prefix_noise_norm("toeplitz", R) * math.sqrt(D) / (R * 1.0)
    assert plan.nsr_final == pytest.approx(want, rel=1e-9)
    assert plan.nsr_final > NO_LEARNING_NSR and "expect no learning" in plan.verdict
    assert plan.horizon == R and math.isinf(plan.safe_learning_rate)


def test_central_server_warns_before_round_one_at_quickstart_size() -> None:
    strategy = CorrNoiseCentralDPStrategy.from_run_config(
        FedAvg(), {"num-server-rounds": R, "min-learners": M, "mechanism": "blt",
                   "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0,
                   "data-reuse": "every-round"}, seed=1)
    warning = strategy.learnability(D)
    assert warning is not None and "not expected to learn" in warning
    assert "learners per round" in warning  # the levers come with it
    assert strategy.learnability(10) is None  # a tiny model: the noise leaves signal


def test_per_round_local_dp_warns_and_start_logs_it(caplog, monkeypatch) -> None:
    cfg = {"num-server-rounds": R, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-5,
           "clip-norm": 1.0, "data-reuse": "every-round"}
    strategy = CorrNoiseLocalDPStrategy(FedAvg(min_train_nodes=M), cfg, per_round=True)
    assert strategy.learnability(D) is not None
    assert CorrNoiseLocalDPStrategy(FedAvg(), {**cfg, "local-steps": 4}).learnability(D) \
        is None  # per-step: each learner plans with its own batch and data size

    class StopError(Exception):
        pass

    def refuse(*args, **kwargs):
        raise StopError

    # Flower's loop itself is not run: the warning comes before it
    monkeypatch.setattr(Strategy, "start", refuse)
    with flower_log(caplog, logging.WARNING), pytest.raises(StopError):
        strategy.start(None, ArrayRecord([np.zeros(D)]), num_rounds=R)  # type: ignore[arg-type]
    assert any("not expected to learn" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["round", "central"])
def test_start_up_summary_shows_the_figures_and_the_plans_verdict(mode, caplog,
                                                                  monkeypatch) -> None:
    """Flower's own start (which logs the summary before round 1, in the log that
    `flwr run --stream` shows) at the quickstart's size: ε, δ, the noise std, the uses of a
    datum and the plan's verdict, "expect no learning", labelled with its signal."""
    cfg = {"num-server-rounds": R, "min-learners": M, "mechanism": "blt", "epsilon": 2.0,
           "delta": 1e-5, "clip-norm": 1.0, "data-reuse": "every-round"}
    strategy = (CorrNoiseLocalDPStrategy(FedAvg(min_train_nodes=M), cfg, per_round=True)
                if mode == "round" else
                CorrNoiseCentralDPStrategy.from_run_config(FedAvg(), cfg, seed=1))

    class StopError(Exception):
        pass

    def summary_then_stop(self, *args, **kwargs):
        self.summary()  # what Flower's Strategy.start does first
        raise StopError

    monkeypatch.setattr(Strategy, "start", summary_then_stop)
    with flower_log(caplog, logging.INFO), pytest.raises(StopError):
        strategy.start(None, ArrayRecord([np.zeros(D)]), num_rounds=R)  # type: ignore[arg-type]
    text = "\n".join(r.getMessage() for r in caplog.records)
    plan = make_plan(PlanInput(model_size=D, examples=1, batch_size=1, epochs=1, learners=M,
                               mechanism="blt", epsilon=2.0, delta=1e-5, rounds=R,
                               mode=mode, round_participation=Participation.every_step(R)),
                     levers=False)
    assert f"{plan.nsr_final:.3g} at the end → noise dominates: expect no learning " \
           "(upper-bound signal, optimistic)" in text
    assert f"plan (d = {D}, {M} learner(s)" in text
    assert "each datum used ≤ 3×" in text and "1e-05" in text
    std = plan.std if mode == "round" else plan.std / M
    assert f"{std:.4g}" in text
