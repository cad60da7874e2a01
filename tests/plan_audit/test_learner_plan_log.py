"""The learner's first-round plan log (issue 32): it cannot see the data, so its signal is
the upper bound, and the line must say so — an optimistic verdict shown as if it were
measured would be a plan that does not tell the truth."""

from __future__ import annotations

import logging

import pytest

from flwr_corrnoise import PrivacySettings
from flwr_corrnoise.data.sampling import CyclicLoader
from flwr_corrnoise.flower.steps import log_plan


def test_the_learner_plan_log_says_its_signal_is_the_upper_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    settings = PrivacySettings("blt", 2.0, 1e-5, 1.0, 2250)
    with caplog.at_level(logging.INFO, logger="flwr_corrnoise.flower.steps"):
        log_plan(CyclicLoader(24000, 32, 3), settings, 62006)
    (line,) = [r.getMessage() for r in caplog.records if "flwr-corrnoise learner" in r.getMessage()]
    assert "d = 62006, 24000 examples per learner, batch 32, 3 epoch(s)" in line
    assert "signal: at its upper bound" in line
    assert "verdict:" in line and "(upper-bound signal, optimistic)" in line
    assert "measure_signal" in line  # where to get the measured figure
