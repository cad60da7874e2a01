"""δ's default (issue 32): one value for the learner, the server's proposal and ``plan``,
and a declared data size ``n`` refuses ``δ ≥ 1/n``."""

from __future__ import annotations

import pytest

from flwr_corrnoise.cli import build_parser
from flwr_corrnoise.data.loader import CyclicLoader
from flwr_corrnoise.flower.config import privacy_proposal, settings_from_config
from flwr_corrnoise.flower.steps import check_loader
from flwr_corrnoise.plan import PlanInput, make_plan
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings, check_delta_for
from flwr_corrnoise.settings_keys import KEYS


def test_learner_server_and_plan_agree_on_the_default() -> None:
    default = KEYS["delta"].default
    assert default == 1e-5
    assert PrivacySettings().delta == default
    assert PlanInput(model_size=10, examples=10, batch_size=1, epochs=1).delta == default
    plan_args = build_parser().parse_args(["plan", "--model-size", "10", "--examples", "10",
                                           "--batch-size", "1", "--epochs", "1"])
    assert plan_args.delta == default
    learner = settings_from_config({"num-server-rounds": 2, "local-steps": 3,
                                    "data-reuse": "every-round"})
    assert learner.delta == default
    assert privacy_proposal(learner)["privacy-delta"] == default


@pytest.mark.parametrize(("n", "delta", "refused"), [
    (1000, 1e-3, True), (1000, 9.99e-4, False), (999, 1e-3, False), (10**6, 1e-5, True),
    (50, 1e-5, False)])
def test_delta_at_least_one_over_n_is_refused(n: int, delta: float, refused: bool) -> None:
    """The boundary n·δ ≥ 1, in the plan and in a loader's learner."""
    def plan() -> PlanInput:
        return PlanInput(model_size=10, examples=n, batch_size=1, epochs=1, delta=delta,
                         mechanism="independent")

    loader = CyclicLoader(num_examples=n, batch_size=n, rounds=1)
    settings = PrivacySettings("independent", delta=delta, horizon=1)
    if refused:
        with pytest.raises(ValueError, match="1/n"):
            check_delta_for(delta, n)
        with pytest.raises(ValueError, match="1/n"):
            make_plan(plan(), levers=False)
        with pytest.raises(PrivacyConfigError, match="1/n"):
            check_loader(loader, settings, {})
    else:
        check_delta_for(delta, n)
        make_plan(plan(), levers=False)
        check_loader(loader, settings, {})
