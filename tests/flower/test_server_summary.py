"""The server's start-up summary tells the truth before round 1 (issue 32): the documented
one-line server (``CorrNoiseLocalDPStrategy(FedAvg(), context.run_config)``) starts for a
quickstart-style run config without ``local-steps`` (the learners' loader sets it), and
where the run config fixes the horizon and the data use it shows ε, δ, the uses of a datum
and the noise std the learners will calibrate — the same figures as theirs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from flwr.serverapp.strategy import FedAvg

from flwr_corrnoise.flower import CorrNoiseLocalDPStrategy
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.settings import PrivacyConfigError

QUICKSTART = {"num-server-rounds": 3, "local-epochs": 2, "lr": 0.1, "mechanism": "blt",
              "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0}


def summary(strategy: CorrNoiseLocalDPStrategy, caplog: pytest.LogCaptureFixture) -> str:
    """The start-up summary as Flower's logger prints it (captured on that logger: an
    earlier simulation in the same process may have stopped it propagating to the root)."""
    caplog.clear()
    with flower_log(caplog, logging.INFO):
        strategy.summary()
    return "\n".join(r.getMessage() for r in caplog.records)


@contextmanager
def flower_log(caplog: pytest.LogCaptureFixture, level: int) -> Iterator[None]:
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    disabled, flwr_logger.disabled = flwr_logger.disabled, False
    try:
        with caplog.at_level(level, logger="flwr"):
            yield
    finally:
        flwr_logger.removeHandler(caplog.handler)
        flwr_logger.disabled = disabled


def test_the_quickstart_server_line_starts_and_says_what_the_learners_set(caplog) -> None:
    strategy = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), QUICKSTART)
    assert strategy.proposal == {"privacy-mechanism": "blt", "privacy-epsilon": 2.0,
                                 "privacy-delta": 1e-5, "privacy-clip-norm": 1.0}
    text = summary(strategy, caplog)
    assert "privacy-epsilon=2.0" in text
    assert "the horizon, how often a datum is used: set by each learner" in text


@pytest.mark.parametrize("per_round", [False, True])
def test_the_summary_shows_the_learners_noise_std(per_round: bool, caplog) -> None:
    cfg = {**QUICKSTART, "local-steps": 4, "data-reuse": "every-round"}
    strategy = CorrNoiseLocalDPStrategy(FedAvg(), cfg, per_round=per_round)
    learner = settings_from_config(
        {**cfg, "horizon": 3} if per_round else cfg, per_round=per_round)
    cal = learner.calibration()
    text = summary(strategy, caplog)
    assert f"noise std {cal.std:.4g}" in text
    assert f"ε = 2, δ = 1e-05 per learner over {learner.horizon}" in text
    assert "each datum used ≤ 3×" in text


def test_a_bad_budget_is_still_refused_without_a_horizon() -> None:
    with pytest.raises(ValueError, match="ε must be"):
        CorrNoiseLocalDPStrategy(FedAvg(), {**QUICKSTART, "epsilon": -1.0})
    with pytest.raises(PrivacyConfigError, match="unknown mechanism"):
        CorrNoiseLocalDPStrategy(FedAvg(), {**QUICKSTART, "mechanism": "bltt"})
