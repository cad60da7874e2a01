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
from flwr_corrnoise.flower.config import check_proposal, privacy_proposal, settings_from_config
from flwr_corrnoise.flower.session import RUN_CONFIG_PROPOSAL, LearnerSession
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings
from flwr_corrnoise.settings_keys import KEYS, ConfigKeyError, lookup, render_markdown

ROOT = Path(__file__).resolve().parents[2]


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
    assert warned == ["flwr-corrnoise: not set in the test config, using the defaults: "
                      "epsilon=2.0 (docs/flower.md#configuration-keys)"]
    with pytest.raises(ConfigKeyError, match="'epsilon' in the x is not a float"):
        lookup({"epsilon": "much"}, "epsilon", "x")


def _default_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "using the defaults" in r.getMessage()]


def test_the_defaults_are_one_start_up_line_per_reader(caplog, simulated: None) -> None:
    """A learner that sets none of the privacy keys, and a server whose run config sets
    none of them: one line each naming every default (not one warning per key), and not
    again for the next message of the same process."""
    from flwr.app import Context, RecordDict
    from flwr.serverapp.strategy import FedAvg

    settings_keys._warned.clear()
    run = {"num-server-rounds": 5, "local-steps": 2, "learning-rate": 0.1,
           "data-reuse": "once"}
    with caplog.at_level(logging.WARNING, logger="flwr_corrnoise"):
        for node in (1, 2):  # two messages in one process: the line once
            LearnerSession(Context(run_id=1, node_id=node, node_config={"partition-id": 0},
                                   state=RecordDict(), run_config=run))
        learner = _default_lines(caplog)
        caplog.clear()
        CorrNoiseFedAvg.from_run_config(run)
        server = _default_lines(caplog)
        caplog.clear()
        CorrNoiseLocalDPStrategy(FedAvg(), run)
        local = _default_lines(caplog)
    assert len(learner) == 1, learner
    for key, value in (("mechanism", "'blt'"), ("epsilon", "2.0"), ("delta", "1e-05"),
                       ("clip-norm", "1.0"), ("calibration", "'exact'")):
        assert f"{key}={value}" in learner[0]
    assert "learner's config" in learner[0]
    # the server's line holds its own keys too (server-learning-rate, min-learners, …)
    assert len(server) == 1 and "epsilon=2.0" in server[0]
    assert "server-learning-rate=1.0" in server[0] and "max-idle-rounds=3" in server[0]
    assert local == []  # the same run config's defaults were announced already
    # every default named in the line is the one the code used
    assert CorrNoiseFedAvg.from_run_config(run).proposal == privacy_proposal(
        PrivacySettings(horizon=10))


@pytest.mark.parametrize(("typo", "meant"), [
    ("epsilom", "epsilon"), ("clip_norm", "clip-norm"), ("Mechanism", "mechanism"),
    ("mechanisms", "mechanism"), ("epsilno", "epsilon"), ("learningrate", "learning-rate"),
])
def test_a_near_miss_key_is_an_error_that_says_what_was_meant(typo: str, meant: str,
                                                              simulated: None) -> None:
    """`epsilom = 0.5` must not run at the default ε = 2: the learner, the servers and the
    reference app refuse it, naming the key that was meant."""
    from flwr.app import Context, RecordDict
    from flwr.serverapp.strategy import FedAvg

    run = {"num-server-rounds": 5, "local-steps": 2, "learning-rate": 0.1, typo: 0.5}
    if meant == "learning-rate":
        del run["learning-rate"]
    want = f"{typo!r} in the run config is not a flwr-corrnoise key: did you mean {meant!r}"
    with pytest.raises(ConfigKeyError, match=re.escape(want)):
        CorrNoiseFedAvg.from_run_config(run)
    with pytest.raises(ConfigKeyError, match=re.escape(want)):
        CorrNoiseCentralDPStrategy.from_run_config(FedAvg(), run)
    with pytest.raises(PrivacyConfigError, match=re.escape(want)):
        CorrNoiseLocalDPStrategy(FedAvg(), run)
    # the learner: a PrivacyConfigError, so its error reply (code 4101) carries the text
    with pytest.raises(PrivacyConfigError, match=re.escape(f"did you mean {meant!r}")):
        LearnerSession(Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                               state=RecordDict(), run_config=run))
    node = {"partition-id": 0, typo: 0.5, "horizon": 10}
    with pytest.raises(PrivacyConfigError, match="in the learner's config is not a"):
        LearnerSession(Context(run_id=1, node_id=1, node_config=node, state=RecordDict(),
                               run_config={}))


def test_an_apps_own_keys_are_not_taken_for_typos() -> None:
    """The reference app's keys, Flower's quickstarts' and the decentralized ones pass:
    only keys within one edit (two for long keys) of ours, or ours up to `_`/case, fail."""
    from flwr_corrnoise.apps.logreg_task import LogRegSetup

    own = [*LogRegSetup().to_run_config(), "results-dir", "round-timeout", "checkpoint-dir",
           "local-epochs", "fraction-evaluate", "fraction-train", "lr", "batch-size",
           "num-partitions", "noise-scale", "num-nodes", "data-path", "noise-std",
           "server-device", "use-wandb", "penalty", "local-iterations", "max-iter"]
    settings_keys.check_keys(dict.fromkeys(own, 1), "run config")  # no error
    assert {k: settings_keys.suggest(k) for k in ("beta", "num-learners", "data-seed")} == \
        dict.fromkeys(("beta", "num-learners", "data-seed"))
    # the rule itself, against a hand count of edits
    assert settings_keys._distance("epsilon", "epsilno") == 1  # a transposition
    assert settings_keys._distance("beta", "delta") == 2
    assert settings_keys._distance("num-learners", "min-learners") == 3


def test_a_key_is_compared_with_the_table_once_per_process() -> None:
    """A learner checks its run and node config on every message; an app key's edit
    distances to the whole table are computed once (``suggest`` is memoized), and the
    memoized answer is the computed one, for misses and near misses alike."""
    settings_keys.suggest.cache_clear()
    cfg = {"num-learners": 20, "results-dir": "x", "app-key-of-mine": 1}
    settings_keys.check_keys(cfg, "run config")
    misses = settings_keys.suggest.cache_info().misses
    for _ in range(3):
        settings_keys.check_keys(cfg, "run config")
    info = settings_keys.suggest.cache_info()
    assert info.misses == misses == len(cfg) and info.hits == 3 * len(cfg)
    for name in ("epsilom", "clip_norm", "num-learners", "app-key-of-mine"):
        assert settings_keys.suggest(name) == settings_keys.suggest.__wrapped__(name)
    assert settings_keys.suggest("epsilom") == "epsilon"
    with pytest.raises(ConfigKeyError, match="did you mean 'epsilon'"):
        settings_keys.check_keys({"epsilom": 0.5}, "run config")  # also when memoized


def test_no_silent_horizon_of_one() -> None:
    with pytest.raises(PrivacyConfigError, match="'local-steps' is missing"):
        settings_from_config({"num-server-rounds": 10})
    with pytest.raises(PrivacyConfigError, match="'num-server-rounds' is missing"):
        settings_from_config({"local-steps": 4})
    assert settings_from_config({"num-server-rounds": 10, "local-steps": 4,
                                        "data-reuse": "once"}).horizon == 40


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
           "mechanism": "toeplitz", "epsilon": 1.5, "clip-norm": 0.5, "data-reuse": "once",
           "min-learners": 2}
    strategy = CorrNoiseFedAvg.from_run_config(cfg)
    learner = LearnerSession(Context(run_id=1, node_id=1, node_config={"partition-id": 0},
                                     state=RecordDict(), run_config=cfg))
    check_proposal(learner.settings, strategy.proposal)  # agrees: not refused
    assert strategy.proposal == privacy_proposal(learner.settings)
    assert strategy.local_steps == 2 and strategy.min_available_nodes == 2
    assert CorrNoiseLocalDPStrategy(FedAvg(), cfg).proposal == privacy_proposal(learner.settings)
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
