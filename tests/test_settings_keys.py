"""The one key table: docs in sync, defaults logged, required keys a clear error."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from flwr_corrnoise import settings_keys
from flwr_corrnoise.flower import (
    CorrNoiseCentralDPStrategy,
    CorrNoiseFedAvg,
    CorrNoiseLocalDPStrategy,
)
from flwr_corrnoise.flower.session import RUN_CONFIG_PROPOSAL, LearnerSession
from flwr_corrnoise.learner import PrivacyConfigError, PrivacySettings
from flwr_corrnoise.settings_keys import KEYS, ConfigKeyError, lookup, render_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_docs_show_the_table_generated_from_the_code() -> None:
    doc = (ROOT / "docs" / "flower.md").read_text()
    shown = re.search(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", doc,
                      re.S)
    assert shown is not None and shown.group(1) == render_markdown()
    for key in KEYS:
        assert f"| `{key}` |" in shown.group(1)


def test_every_key_the_code_proposes_or_reads_is_in_the_table() -> None:
    assert set(RUN_CONFIG_PROPOSAL) <= set(KEYS)
    assert "secure-noise" in KEYS and KEYS["secure-noise"].who == ("app", "node")
    assert KEYS["secure-noise"].side == "learner"


def test_a_missing_key_is_its_default_with_a_warning_once(caplog) -> None:
    settings_keys._warned.clear()
    with caplog.at_level(logging.WARNING, logger="flwr_corrnoise.settings_keys"):
        assert lookup({}, "epsilon", "test config") == 2.0
        assert lookup({}, "epsilon", "test config") == 2.0
        assert lookup({"epsilon": "0.5"}, "epsilon", "test config") == 0.5
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["flwr-corrnoise: no 'epsilon' in the test config; using the default 2.0"]
    with pytest.raises(ConfigKeyError, match="'epsilon' in the x is not a float"):
        lookup({"epsilon": "much"}, "epsilon", "x")


def test_no_silent_horizon_of_one() -> None:
    with pytest.raises(PrivacyConfigError, match="'local-steps' is missing"):
        PrivacySettings.from_config({"num-server-rounds": 10})
    with pytest.raises(PrivacyConfigError, match="'num-server-rounds' is missing"):
        PrivacySettings.from_config({"local-steps": 4})
    assert PrivacySettings.from_config({"num-server-rounds": 10, "local-steps": 4}).horizon == 40


@pytest.mark.parametrize("missing", ["num-server-rounds", "local-steps", "learning-rate"])
def test_server_strategies_need_their_round_keys(missing: str) -> None:
    cfg = {"num-server-rounds": 5, "local-steps": 2, "learning-rate": 0.1,
           "mechanism": "toeplitz"}
    del cfg[missing]
    with pytest.raises(ValueError, match=f"'{missing}' is missing from the run config"):
        CorrNoiseFedAvg.from_run_config(cfg)


def test_servers_and_learners_read_the_same_settings(simulated: None) -> None:
    from flwr.app import Context, RecordDict
    from flwr.serverapp.strategy import FedAvg

    cfg = {"num-server-rounds": 5, "local-steps": 2, "learning-rate": 0.1,
           "mechanism": "toeplitz", "epsilon": 1.5, "clip-norm": 0.5, "min-learners": 2}
    strategy = CorrNoiseFedAvg.from_run_config(cfg)
    learner = LearnerSession(Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                                     state=RecordDict(), run_config=cfg))
    learner.settings.check_proposal(strategy.proposal)  # agrees: not refused
    assert strategy.proposal == learner.settings.proposal()
    assert strategy.local_steps == 2 and strategy.min_available_nodes == 2
    assert CorrNoiseLocalDPStrategy(FedAvg(), cfg).proposal == learner.settings.proposal()
    central = CorrNoiseCentralDPStrategy.from_run_config(FedAvg(), cfg)
    assert (central.mechanism, central.num_rounds, central.calibration.epsilon) == (
        "toeplitz", 5, 1.5)
    # the central wrapper passes its minimum on to the wrapped strategy
    assert central.strategy.min_train_nodes == 2 and central.strategy.min_available_nodes == 2


def test_central_dp_refuses_a_strategy_without_node_minimums() -> None:
    from flwr.serverapp.strategy import Strategy

    class Bare(Strategy):
        def configure_train(self, *a): return []
        def aggregate_train(self, *a): return None, None
        def configure_evaluate(self, *a): return []
        def aggregate_evaluate(self, *a): return None
        def summary(self): pass

    with pytest.raises(ValueError, match="node minimums"):
        CorrNoiseCentralDPStrategy(Bare(), mechanism="toeplitz", epsilon=1.0, delta=1e-3,
                                   clip_norm=1.0, num_rounds=3, min_learners=2)
