"""Runs that release nothing fail with a reason; ε is reported per learner; honest logs.

Hand-made replies (fast); the same through Flower's simulation engine and ``flwr run`` is
in ``test_adoption.py``, ``test_flower_simulation.py`` and ``test_flwr_run.py``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.superlink.grid import InMemoryGrid

from flwr_corrnoise.flower import (
    CorrNoiseFedAvg,
    CorrNoiseLocalDPStrategy,
    RunFailedError,
    privacy_metrics_aggr,
)
from flwr_corrnoise.flower.monitor import RoundWatch, simulation_grid
from flwr_corrnoise.settings import PrivacySettings

from .test_strategy import FakeGrid, reply, task_identity  # noqa: F401  (autouse fixture)

X = [np.zeros(3)]
RUN = {"num-server-rounds": 4, "local-steps": 2, "learning-rate": 0.1, "mechanism": "toeplitz",
       "max-idle-rounds": 2, "data-reuse": "once"}


def model_reply(node: int, learner: int, eps: float):
    return reply(RecordDict({"arrays": ArrayRecord([np.ones(3) * learner]),
                             "metrics": MetricRecord({"num-examples": 1.0, "learner-id": learner,
                                                      "epsilon-spent": eps})}), node)


def refusal(node: int, code: int = 4101, reason: str = "refused: horizon 4000 exceeds 8"):
    return reply(Error(code=code, reason=reason), node)


def test_every_learner_refusing_fails_after_max_idle_rounds() -> None:
    strat = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), RUN)
    for r in (1, 2):
        config = ConfigRecord({})
        list(strat.configure_train(r, ArrayRecord(X), config, FakeGrid()))
        assert config["privacy-horizon"] == 8 and config["privacy-mechanism"] == "toeplitz"
        replies = [refusal(1), refusal(2), refusal(3, code=4102, reason="horizon used up")]
        if r == 1:
            assert strat.aggregate_train(r, replies)[0] is None
            continue
        with pytest.raises(RunFailedError) as info:
            strat.aggregate_train(r, replies)
    text = str(info.value)
    assert "2 consecutive round(s)" in text and "3 learner(s) replied, 0 update(s)" in text
    assert "2 × code 4101 (refused: horizon 4000 exceeds 8)" in text
    assert "1 × code 4102" in text


def test_a_released_round_resets_the_count() -> None:
    strat = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), RUN)
    for r, replies in enumerate([[refusal(1)], [model_reply(1, 0, 0.5)], [refusal(1)],
                                 [model_reply(1, 0, 0.9)]], start=1):
        list(strat.configure_train(r, ArrayRecord(X), ConfigRecord({}), FakeGrid()))
        strat.aggregate_train(r, replies)
    strat.watch.check_end()  # released twice: not a failure
    assert strat.privacy["learner-0"]["epsilon-spent"] == 0.9


@pytest.mark.parametrize("replies", [[], [refusal(7, code=0, reason="ClientApp raised")]])
def test_a_short_run_that_released_nothing_fails_at_its_end(replies) -> None:
    """Fewer rounds than max-idle-rounds, every SuperNode failing to run the app (Flower's
    own error codes) or no reply at all: the end of the run is the error."""
    strat = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), {**RUN, "max-idle-rounds": 5})
    strat.aggregate_train(1, replies)
    with pytest.raises(RunFailedError, match="without releasing a single round"):
        strat.watch.check_end()
    assert ("no learner replied" in strat.watch.last) == (not replies)


def test_corrnoise_fedavg_fails_loudly_too() -> None:
    strat = CorrNoiseFedAvg.from_run_config({**RUN, "max-idle-rounds": 1})
    list(strat.configure_train(1, ArrayRecord(X), ConfigRecord({}), FakeGrid()))
    with pytest.raises(RunFailedError, match="1 × code 4101"):
        strat.aggregate_train(1, [refusal(1)])


def test_per_learner_epsilon_by_partition_id() -> None:
    strat = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), RUN)
    list(strat.configure_train(1, ArrayRecord(X), ConfigRecord({}), FakeGrid()))
    arrays, metrics = strat.aggregate_train(
        1, [model_reply(11, 0, 0.4), model_reply(12, 1, 0.6), refusal(13)])
    np.testing.assert_allclose(arrays.to_numpy_ndarrays()[0], np.full(3, 0.5))  # uniform
    assert metrics["epsilon-spent.learner-0"] == 0.4
    assert metrics["epsilon-spent.learner-1"] == 0.6
    assert metrics["epsilon-spent-max"] == 0.6 and metrics["num-errors"] == 1.0
    # for a bare FedAvg: the same per-learner report as its train_metrics_aggr_fn
    records = [RecordDict({"m": MetricRecord({"learner-id": i, "epsilon-spent": e,
                                              "num-examples": 1.0})})
               for i, e in ((3, 0.2), (5, 0.3))]
    out = privacy_metrics_aggr(records, "num-examples")
    assert dict(out) == {"epsilon-spent.learner-3": 0.2, "epsilon-spent.learner-5": 0.3,
                         "epsilon-spent-max": 0.3}


def test_start_up_summary_says_what_is_sent_and_how_it_averages(caplog) -> None:
    strat = CorrNoiseFedAvg(local_steps=4, learning_rate=0.1,
                            privacy=PrivacySettings("tree", horizon=40))
    # Flower's logger may not propagate to the root (an earlier simulation in the same
    # process reconfigures it): capture on it directly
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    disabled, flwr_logger.disabled = flwr_logger.disabled, False
    try:
        with caplog.at_level(logging.INFO, logger="flwr"):
            strat.summary()
            CorrNoiseLocalDPStrategy(FedAvg(), RUN).summary()
    finally:
        flwr_logger.removeHandler(caplog.handler)
        flwr_logger.disabled = disabled
    assert "Weighted by" not in caplog.text
    assert "privacy-horizon=40" in caplog.text and "uniform mean" in caplog.text
    assert "privacy-horizon=8" in caplog.text  # 4 rounds × 2 local steps


def test_watch_rejects_a_nonsense_limit() -> None:
    with pytest.raises(ValueError, match="max-idle-rounds"):
        RoundWatch(0, "x")


class SimulationGrid(InMemoryGrid):
    """Flower's simulation grid, without the link state behind it (only its type counts)."""

    def __init__(self) -> None:  # no state factory: never sends anything here
        pass

    def get_node_ids(self):
        return [1, 2, 3]


LOST = "flwr-corrnoise: StateIntegrityError: the offloaded learner state ... was rolled back"


@pytest.mark.parametrize("make", [
    lambda: CorrNoiseFedAvg.from_run_config({**RUN, "data-reuse": "once", "max-idle-rounds": 5}),
    lambda: CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0),
                                     {**RUN, "data-reuse": "once", "max-idle-rounds": 5}),
])
def test_a_lost_state_fails_a_simulation_in_the_round_it_arrives(make) -> None:
    """One learner's 4104 (state lost or refused) in a simulation: RunFailedError in that
    round, naming the node and the code, although the other learners released updates
    and max-idle-rounds is far away. In a deployment the same reply is one refusal among
    others (the run goes on; max-idle-rounds decides)."""
    assert simulation_grid(SimulationGrid()) and not simulation_grid(FakeGrid())
    for grid, fails in ((FakeGrid(), False), (SimulationGrid(), True)):
        strat = make()
        list(strat.configure_train(1, ArrayRecord(X), ConfigRecord({}), grid))
        replies = [model_reply(1, 0, 0.5), refusal(2, code=4104, reason=LOST),
                   model_reply(3, 2, 0.5)]
        if not fails:
            strat.aggregate_train(1, replies)
            assert strat.watch.idle == 0
            continue
        with pytest.raises(RunFailedError) as info:
            strat.aggregate_train(1, replies)
        text = str(info.value)
        assert "round 1: the learner on node 2 refused with code 4104" in text
        assert "was rolled back" in text


def test_other_refusals_do_not_fail_a_simulation_at_once() -> None:
    """Only a lost state is fatal at once: a learner out of budget (4102) or refusing the
    proposal (4101) is counted towards max-idle-rounds as before."""
    strat = CorrNoiseFedAvg.from_run_config({**RUN, "data-reuse": "once", "max-idle-rounds": 5})
    list(strat.configure_train(1, ArrayRecord(X), ConfigRecord({}), SimulationGrid()))
    strat.aggregate_train(1, [refusal(1), refusal(2, code=4102, reason="horizon used up"),
                              refusal(3, code=4105, reason="busy")])
    assert strat.watch.idle == 1
