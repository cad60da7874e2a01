"""The server side of local DP around the user's own strategy (per-step or per-round noise).

Why a wrapper: an app that adopts :class:`~flwr_corrnoise.flower.PrivateSteps` (per-step
noise in the user's loop) or :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod` (per-round
noise) keeps its FedAvg: the learners reply with noised models and equal weights, which
FedAvg's average is exactly right for. What FedAvg lacks is what this wrapper adds, in the
spirit of Flower's ``DifferentialPrivacyClientSideFixedClipping``:

* the **privacy proposal** from the run config, read by the same key table as the learners
  (``privacy-*`` keys in every round config; a learner refuses a weaker one);
* **per-learner ε** in the round metrics (``epsilon-spent.learner-<partition id>``) instead
  of FedAvg's weighted average of the learners' metrics;
* **failing loudly**: nothing released for ``max-idle-rounds`` consecutive rounds, or in the
  whole run, raises :class:`~flwr_corrnoise.flower.monitor.RunFailedError`;
* a start-up summary that says what is sent and how it is averaged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..plan import Plan, round_plan, summary_line
from ..settings import NOISELESS, PrivacyConfigError, PrivacySettings
from ..settings_keys import lookup, require, summarized
from .config import privacy_proposal, settings_from_config
from .monitor import (
    REPORTED,
    RoundWatch,
    WrappedStrategy,
    learner_key,
    log_summary,
    privacy_report,
    start_config,
)
from .session import PARTICIPATION_KEYS

log = logging.getLogger(__name__)


@summarized(error=PrivacyConfigError)  # near-miss keys refused as the learners refuse them
def budget_proposal(cfg: Mapping[str, Any], with_horizon: bool,
                    where: str = "run config") -> dict[str, Any]:
    """The ``privacy-*`` proposal of the budget keys alone (mechanism, ε, δ, clip norm, and
    the horizon when the run config fixes it), validated as a learner would read them."""
    mechanism = lookup(cfg, "mechanism", where)
    if mechanism == NOISELESS:
        return {}
    budget = PrivacySettings(mechanism=mechanism, epsilon=lookup(cfg, "epsilon", where),
                             delta=lookup(cfg, "delta", where),
                             clip_norm=lookup(cfg, "clip-norm", where))
    out = privacy_proposal(budget)
    del out["privacy-horizon"]  # PrivacySettings' placeholder, not the run's
    if with_horizon:
        out["privacy-horizon"] = int(cfg.get("horizon") or int(cfg["num-server-rounds"])
                                     * int(cfg["local-steps"]))
    return out


def privacy_lines(settings: PrivacySettings | None, left_to_learners: str | None,
                  unit: str) -> list[str]:
    """The start-up summary's privacy figures: ε, δ, the horizon, the uses of a datum and
    the calibrated noise std — what ``flwr run --stream`` shows before round 1 — or what
    the learners decide themselves."""
    if settings is None or not settings.private:
        if left_to_learners:
            return [f"{left_to_learners}: set by each learner (its CyclicLoader or its own "
                    "declaration); each learner logs its noise std on its first round"]
        return []
    cal = settings.calibration()
    assert cal is not None
    uses = settings.participation.participations(settings.horizon)
    return [f"ε = {cal.epsilon:g}, δ = {cal.delta:g} per learner over {settings.horizon} "
            f"{unit}; each datum used ≤ {uses}× ({cal.participation}); noise std "
            f"{cal.std:.4g} (noise multiplier {cal.noise_multiplier:.3g}, "
            f"{settings.mechanism}, {'exact' if cal.sensitivity_exact else 'bounded'} "
            "sensitivity)"]


class CorrNoiseLocalDPStrategy(WrappedStrategy, Strategy):
    """Wrap ``strategy`` (FedAvg family) for learners that noise their own replies.

    ``run_config`` (the ServerApp's ``context.run_config``) gives the proposal: the privacy
    keys of :mod:`flwr_corrnoise.settings_keys`, and the horizon ``horizon``, else
    ``num-server-rounds`` × ``local-steps`` (per-step) or ``num-server-rounds``
    (``per_round=True``, for :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`), and
    ``max-idle-rounds``. ``privacy`` given in code replaces the run config's proposal.

    A *server-side* Strategy wrapper, as Flower's
    ``DifferentialPrivacyClientSideFixedClipping`` is: the noise itself is added on the
    learners (:class:`~flwr_corrnoise.flower.PrivateSteps`,
    :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`, the roles Flower's ``LocalDpMod``
    plays).
    """

    def __init__(
        self,
        strategy: Strategy,
        run_config: Mapping[str, Any] | None = None,
        *,
        per_round: bool = False,
        privacy: PrivacySettings | None = None,
    ) -> None:
        self.strategy = strategy
        self.per_round = bool(per_round)
        cfg = dict(run_config or {})
        #: what the learners' data use is left to (a loader), when the run config does not
        #: fix the horizon and the participation
        self.left_to_learners: str | None = None
        if privacy is None and run_config is not None:
            if per_round and not cfg.get("horizon"):
                cfg["horizon"] = require(cfg, "num-server-rounds", "run config",
                                         "it is the per-round noise's horizon")
            horizon = bool(cfg.get("horizon") or (cfg.get("num-server-rounds")
                                                 and cfg.get("local-steps")))
            declared = any(k in cfg for k in PARTICIPATION_KEYS)
            if horizon and (declared or cfg.get("mechanism") == NOISELESS):
                privacy = settings_from_config(cfg, "run config", per_round=per_round)
            else:
                # a learner with a CyclicLoader derives its horizon and participation from
                # its loop (Flower's quickstart: no 'local-steps' in the run config): the
                # server proposes the budget only, and says so
                self.proposal = budget_proposal(cfg, horizon)
                self.left_to_learners = ", ".join(
                    what for what, known in (("the horizon", horizon),
                                             ("how often a datum is used", declared))
                    if not known)
        if self.left_to_learners is None:
            self.proposal = privacy_proposal(privacy) if privacy is not None and \
                privacy.mechanism != NOISELESS else {}
        #: the settings the proposal fixes completely (ε, δ, noise std, uses: the summary)
        self.settings = privacy
        self.watch = RoundWatch.from_run_config(run_config, type(self).__name__)
        #: per-learner privacy report (latest round each learner answered)
        self.privacy: dict[str, dict[str, float]] = {}

    def summary(self) -> None:
        variant = "per-round (Zhang et al., arXiv)" if self.per_round else "per-step (Zhang et al.)"
        log_summary(self, f"Correlated-noise local DP, {variant}, around "
                          f"{type(self.strategy).__name__}", [
            "privacy proposal: " + (", ".join(f"{k}={v}" for k, v in self.proposal.items())
                                    or "none (each learner's own settings)"),
            *privacy_lines(self.settings, self.left_to_learners,
                           "rounds" if self.per_round else "steps"),
            self.plan_line(),
            f"the run fails after {self.watch.max_idle_rounds} consecutive round(s) without "
            f"a released update",
        ])

    def plan_line(self) -> str:
        """The plan's verdict for the summary: per round, the server's own plan
        (:func:`~flwr_corrnoise.plan.round_plan`) at the model size being started; per
        step, where each learner prints it (its batch and data size fix the noise)."""
        if not self.per_round:
            return ("plan: each learner logs its own on its first round (its batch and data "
                    "size set the noise-to-signal); `flwr-corrnoise plan` before the run")
        if self.settings is None or self.model_size is None:
            return "plan: none (the noise is set by each learner)"
        plan = self.start_plan
        return "plan: none (no noise)" if plan is None else summary_line(plan)

    def server_plan(self, model_size: int) -> Plan | None:
        """Per-round noise (the mod): the plan at this model size with the wrapped
        strategy's fewest training nodes averaged per round
        (:func:`~flwr_corrnoise.plan.round_plan`). Per-step noise depends on each
        learner's batch and data size, which the learners plan themselves: ``None``."""
        if not self.per_round or self.settings is None:
            return None
        learners = int(getattr(self.strategy, "min_train_nodes", 1) or 1)
        return round_plan("round", self.settings, model_size, learners)

    def start_train_config(self, train_config: ConfigRecord | None) -> ConfigRecord:
        """The proposal in the logged train config (it is sent with every round)."""
        return start_config(train_config, self.proposal)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        for key, value in self.proposal.items():
            config[key] = value
        self.watch.bind(grid)  # a simulation fails on a learner's lost state (4104)
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        reports: dict[str, dict[str, float]] = {}
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content:
                continue
            metrics = msg.content["metrics"]
            who = learner_key(metrics, msg.metadata.src_node_id)  # type: ignore[arg-type]
            reports[who] = {k: float(metrics[k]) for k in REPORTED  # type: ignore[arg-type]
                            if k in metrics}
        arrays, _ = self.strategy.aggregate_train(server_round, replies)
        # the wrapped strategy's metrics are averages over learners: replaced by ours
        released = len([m for m in replies if not m.has_error()]) if arrays is not None else 0
        self.privacy.update({who: {**rep, "round": float(server_round)}
                             for who, rep in reports.items()})
        summary = {"num-updates": float(released),
                   "num-errors": float(sum(m.has_error() for m in replies)),
                   **privacy_report(reports)}
        self.watch.observe(server_round, replies, released)
        return arrays, MetricRecord(summary)

