"""Server-side reporting and fail-loudly checks shared by every flwr-corrnoise strategy.

Why a run must fail loudly: a learner that refuses the server's proposal (a longer horizon,
another mechanism), is out of budget or cannot load the app answers with an ``Error``
reply, and Flower's FedAvg simply skips such replies. A run in which *every* learner
refuses then ends "completed" with the untrained model. :class:`RoundWatch` counts the
consecutive rounds in which nothing was released and raises :class:`RunFailedError`
(naming the error codes and how many learners sent them) after ``max-idle-rounds`` of
them, and at the end of a run that released nothing at all. In a simulation one refusal
is enough: a learner whose state is lost or refused (code 4104), or asked twice for one
round (4107; :data:`FATAL_IN_SIMULATION`), fails the run in the round its reply arrives,
naming the node and the code — one party runs the whole simulation, so a lost state there
is a fault of the run (a state-offload folder deleted or not shared by the machines of a
Ray cluster, a handle rolled back), never one
learner's own business, and the run would otherwise go on without that learner, silently.

What that exception does: an exception raised in a ServerApp's ``main`` makes Flower mark
the run ``finished:failed`` with the exception's text as its details (``flwr ls``), and
``flwr.simulation.run_simulation`` re-raises it. ``flwr run`` itself exits 0 once the run
is submitted (and after ``--stream`` ends), whatever its status: check ``flwr ls``.
Flower logs that exception with its traceback; for :data:`ONE_LINE_FAILURES` (a
configuration the library refused, a run that released nothing) the traceback says
nothing the one-line reason does not, so :class:`OneLineFailures`, a filter this module
puts on Flower's ``flwr`` logger, logs them as one line: ``ServerApp raised an exception:
PrivacyConfigError: …``. Other exceptions keep their traceback.

What the monitor may say about a round depends on who replied. A private learner's error
reply is built by the release gate (fixed code and reason, functions of its settings and
state), so local DP's failure text names codes and reasons. Under central DP the replies come
from unmodified apps whose errors may be raised by a datum: a ``content_free`` watch names
only participation and Flower's "could not load the app" codes in what it raises; the
details go to the server's local log.

Per-learner privacy: :func:`privacy_report` turns the replies' released metadata
(``epsilon-spent``, ``learner-id`` = the partition id) into one ``MetricRecord`` with a key
per learner, ``epsilon-spent.learner-<id>`` (node id where a reply names no partition),
so Flower's round log and ``Result.train_metrics_clientapp`` show every learner's ε —
not an average over learners.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log as flwr_log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from ..accounting import PrivacyBudgetError
from ..persistence import StateLostError
from ..plan import Plan, plan_warning
from ..settings import PrivacyConfigError
from ..settings_keys import ConfigKeyError, lookup
from .release_ledger import RoundReplayError
from .session import ERROR_CODES, QueryRefusedError

log = logging.getLogger(__name__)

#: released privacy metadata the server reports per learner
REPORTED = ("epsilon-spent", "epsilon", "delta", "steps", "horizon", "noise-std")

#: the code of a learner's refusal to answer an evaluate (or query) message it did not opt
#: in to (:class:`~flwr_corrnoise.flower.session.QueryRefusedError`)
EVALUATE_REFUSED = ERROR_CODES[QueryRefusedError]

#: Flower's error codes for a ClientApp that could not be loaded or installed: the app never
#: ran, so no data decided them (unlike CLIENT_APP_RAISED_EXCEPTION, which a datum may cause)
APP_NOT_LOADED_CODES = frozenset({int(ErrorCode.LOAD_CLIENT_APP_EXCEPTION),
                                  int(ErrorCode.INVALID_FAB)})


#: error codes that fail a simulation in the round they arrive (:meth:`RoundWatch.observe`):
#: a learner's state lost or refused (lost, rolled back, another learner's, an offload
#: folder not shared)
FATAL_IN_SIMULATION = frozenset({ERROR_CODES[StateLostError],
                                 # a second train message to one learner in one round: the
                                 # server (the simulation's own code) asked for noise twice
                                 ERROR_CODES[RoundReplayError]})


def simulation_grid(grid: object) -> bool:
    """Whether ``grid`` is Flower's simulation grid: ``InMemoryGrid``, which Flower's
    simulation runtime gives the ServerApp (``run_simulation`` and ``flwr run`` on a
    simulation federation alike); a deployment's ServerApp gets a gRPC grid. By name, so
    it holds whichever module Flower keeps it in."""
    return any(cls.__name__ == "InMemoryGrid" for cls in type(grid).__mro__)


class RunFailedError(RuntimeError):
    """The run released nothing for too long: raised from the ServerApp so that Flower
    marks the run failed (and ``run_simulation`` raises) instead of ending "completed"."""


#: failures whose reason is the whole story: a configuration the library refused (a
#: near-miss key, an impossible budget, an unknown mechanism) and a run that released
#: nothing. Flower logs them without a traceback (:class:`OneLineFailures`)
ONE_LINE_FAILURES: tuple[type[BaseException], ...] = (
    RunFailedError, ConfigKeyError, PrivacyConfigError, PrivacyBudgetError)


class OneLineFailures(logging.Filter):
    """On Flower's ``flwr`` logger: a record that carries one of
    :data:`ONE_LINE_FAILURES` (Flower's "ServerApp raised an exception", with
    ``exc_info``) becomes one line, the exception's kind and text, without the traceback.

    Why a filter on Flower's logger: the exception leaves the user's ServerApp ``main``
    and Flower's runner logs it; nothing between the two can drop the traceback, and the
    run must still fail (``flwr ls``: ``finished:failed`` with the same reason)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ONE_LINE_FAILURES):
            text = " ".join(str(exc).split())  # one line, whatever the text holds
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {text}"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def install_one_line_failures() -> None:
    """Put :class:`OneLineFailures` on Flower's ``flwr`` logger (once)."""
    flwr_logger = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineFailures) for f in flwr_logger.filters):
        flwr_logger.addFilter(OneLineFailures())


install_one_line_failures()


def learner_key(metrics: Mapping[str, Any], node: int) -> str:
    """``learner-<partition id>`` if the reply names one (released ``learner-id``), else
    ``node-<node id>``: the partition id is what a user knows their learners by."""
    if "learner-id" in metrics:
        return f"learner-{int(float(metrics['learner-id']))}"
    return f"node-{int(node)}"


def privacy_report(reports: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Per-learner ``epsilon-spent.<learner>`` entries and the maximum over learners."""
    out: dict[str, float] = {}
    for who, rep in sorted(reports.items()):
        if "epsilon-spent" in rep:
            out[f"epsilon-spent.{who}"] = float(rep["epsilon-spent"])
    spent = [v for k, v in out.items() if k.startswith("epsilon-spent.")]
    if spent:
        out["epsilon-spent-max"] = max(spent)
    return out


def privacy_metrics_aggr(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """A ``train_metrics_aggr_fn`` for Flower's FedAvg: per-learner ε instead of a
    weighted average of ε over learners (which no learner spent)."""
    reports: dict[str, dict[str, float]] = {}
    for i, rec in enumerate(records):  # no node ids here: "reply-<i>" without a learner-id
        for metrics in rec.metric_records.values():
            who = learner_key(metrics, i) if "learner-id" in metrics else f"reply-{i}"
            reports[who] = {k: float(metrics[k]) for k in REPORTED  # type: ignore[arg-type]
                            if k in metrics}
    return MetricRecord(privacy_report(reports))


class RoundWatch:
    """Consecutive rounds with nothing released, and the error codes that caused them.

    ``content_free=True`` (central DP, whose replies come from unmodified apps): the text
    kept in :attr:`last` and raised in :class:`RunFailedError` names the replies' count
    and :data:`APP_NOT_LOADED_CODES` only — no other code, no reason — while the full
    description goes to the local log."""

    def __init__(self, max_idle_rounds: int, what: str, *, content_free: bool = False) -> None:
        if int(max_idle_rounds) < 1:
            raise ValueError(f"max-idle-rounds must be >= 1, got {max_idle_rounds!r}")
        self.max_idle_rounds = int(max_idle_rounds)
        self.what = what
        self.content_free = bool(content_free)
        self.idle = 0
        self.released = 0
        self.last: str = ""
        #: whether the run is a simulation (:meth:`bind`): a 4104 then fails it at once
        self.simulation = False

    def bind(self, grid: object) -> None:
        """Note whether the strategy runs in a simulation (:func:`simulation_grid`); the
        strategies call it with the grid of every round they configure."""
        self.simulation = simulation_grid(grid)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any] | None, what: str) -> RoundWatch:
        """``max-idle-rounds`` from the run config. Its default is not announced on a line
        of its own: every strategy's start-up summary (:func:`log_summary`) states it."""
        return cls(lookup(run_config or {}, "max-idle-rounds", "run config", warn=False), what)

    @staticmethod
    def describe(server_round: int, replies: list[Message], released: int, *,
                 content_free: bool = False) -> str:
        """What happened in a round: replies, updates, and the error codes by count (with
        ``content_free``: only the codes of :data:`APP_NOT_LOADED_CODES`, no reasons)."""
        codes: Counter[int] = Counter()
        reasons: dict[int, str] = {}
        for msg in replies:
            if msg.has_error():
                code = int(msg.error.code)
                if content_free and code not in APP_NOT_LOADED_CODES:
                    continue
                codes[code] += 1
                reasons.setdefault(code, " ".join(str(msg.error.reason).split())[:300])
        text = (f"round {server_round}: {len(replies)} learner(s) replied, {released} "
                f"update(s) released")
        if codes and content_free:
            text += "; " + "; ".join(f"{n} × code {code} (the ClientApp could not be loaded)"
                                     for code, n in sorted(codes.items()))
        elif codes:
            text += "; error replies: " + "; ".join(
                f"{n} × code {code} ({reasons[code]})" for code, n in sorted(codes.items()))
        elif not replies:
            text += " (no learner replied: none connected, or all timed out)"
        return text

    def observe(self, server_round: int, replies: list[Message], released: int) -> None:
        """Record a round; raise :class:`RunFailedError` after too many idle ones, or — in
        a simulation (:meth:`bind`) — at once for a reply with a code of
        :data:`FATAL_IN_SIMULATION`, whatever else the round released."""
        if self.simulation and not self.content_free:
            self._fail_on_lost_state(server_round, replies)
        if released:
            self.idle, self.released = 0, self.released + 1
            return
        self.idle += 1
        self.last = self.describe(server_round, replies, released,
                                  content_free=self.content_free)
        # the local log gets the whole description (the server's own, never released)
        log.error("flwr-corrnoise: nothing released: %s",
                  self.describe(server_round, replies, released))
        if self.idle >= self.max_idle_rounds:
            raise RunFailedError(
                f"flwr-corrnoise ({self.what}): nothing was released for {self.idle} "
                f"consecutive round(s) (max-idle-rounds = {self.max_idle_rounds}); last "
                f"{self.last}. Codes 4101: a learner refuses the server's privacy proposal "
                f"or its own settings are invalid (compare the learners' keys with the run "
                f"config) or the server's model has other shapes than the learner's; 4102: "
                f"horizon used up; 4103: the server's model is not finite; 4104/4105: "
                f"learner state lost/busy; other codes: Flower's (the ClientApp could not "
                f"be loaded or raised)")

    def _fail_on_lost_state(self, server_round: int, replies: list[Message]) -> None:
        lost = [m for m in replies
                if m.has_error() and int(m.error.code) in FATAL_IN_SIMULATION]
        if not lost:
            return
        nodes = sorted(int(m.metadata.src_node_id) for m in lost)
        code = int(lost[0].error.code)
        reason = " ".join(str(lost[0].error.reason).split())[:1000]
        named = ", ".join(str(n) for n in nodes[:5]) + (
            f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        text = (f"flwr-corrnoise ({self.what}): round {server_round}: the learner on node "
                f"{named} refused with code {code} (its state is lost or refused: "
                f"{reason}). In a simulation every learner's state belongs to the run "
                f"(context.state or the state-offload folder), so a learner that cannot "
                f"continue its state is a fault of the run; it stops here rather than go on "
                f"without that learner")
        log.error("%s", text)
        raise RunFailedError(text)

    def check_end(self) -> None:
        """At the end of a run: a run that released nothing is a failure."""
        if self.released == 0:
            raise RunFailedError(
                f"flwr-corrnoise ({self.what}): the run ended without releasing a single "
                f"round; last {self.last or 'round: no round ran'}")


def log_summary(strategy: Strategy, title: str, lines: Iterable[str]) -> None:
    """A start-up summary of a (wrapped) strategy: its sampling and our lines, instead of
    FedAvg's "Weighted by: 'num-examples'" (our replies carry equal weights)."""
    info = logging.INFO  # Flower's logger: the summary sits in Flower's start-up log
    flwr_log(info, "\t├──> %s", title)
    for line in lines:
        flwr_log(info, "\t│\t├── %s", line)
    inner = getattr(strategy, "strategy", strategy)
    if hasattr(inner, "fraction_train"):
        flwr_log(info, "\t├──> Sampling (%s): fraction train %.2f | evaluate %.2f; minimum nodes "
                 "train %d | evaluate %d | available %d", type(inner).__name__,
                 inner.fraction_train, inner.fraction_evaluate, inner.min_train_nodes,
                 inner.min_evaluate_nodes, inner.min_available_nodes)
    flwr_log(info, "\t└──> Aggregation: uniform mean of the released updates (equal weights)")


def start_config(train_config: ConfigRecord | None, extra: Mapping[str, Any]) -> ConfigRecord:
    """The train config with the keys our strategy adds in every round, so that Flower's
    start-up log shows what is really sent (not "ConfigRecord (train): (empty!)")."""
    out = ConfigRecord(dict(train_config or {}))
    for key, value in extra.items():
        out[key] = value
    return out


class WrappedStrategy:
    """What our strategy wrappers (``CorrNoiseLocalDPStrategy``,
    ``CorrNoiseCentralDPStrategy``) share: evaluation is the wrapped strategy's
    (``self.strategy``) — under local DP a learner answers an evaluate message only if it
    opted in, so what it answers is its own release — and Flower's loop ends with
    ``self.watch``'s check that something was released. ``CorrNoiseCentralDPStrategy``
    overrides evaluation: its clients are unguarded apps, and their losses are not covered
    by the central guarantee."""

    strategy: Strategy
    watch: RoundWatch

    def start_train_config(self, train_config: ConfigRecord | None) -> ConfigRecord | None:
        """The train config Flower's start-up log shows (default: as given)."""
        return train_config

    def server_plan(self, model_size: int) -> Plan | None:
        """The plan of the noise this strategy adds or knows of, at this model size
        (:func:`~flwr_corrnoise.plan.round_plan`); ``None`` by default (no such noise)."""
        return None

    def learnability(self, model_size: int) -> str | None:
        """A warning text if :meth:`server_plan` leaves no signal at this model size
        (:func:`~flwr_corrnoise.plan.plan_warning`); ``None`` otherwise."""
        return plan_warning(self.server_plan(model_size))

    #: the model size of the run being started (:meth:`start` sets it before Flower's
    #: start-up summary, whose plan line needs it); ``None`` before a run
    model_size: int | None = None
    #: :meth:`server_plan` at :attr:`model_size`, made once by :meth:`start` for both the
    #: warning before round 1 and the summary's plan line
    start_plan: Plan | None = None

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn: Any = None) -> Result:
        """Flower's loop, and a failure if the run released nothing at all. Before round 1,
        a loud warning if the plan says the run cannot learn (:meth:`learnability`)."""
        self.model_size = sum(int(np.prod(a.shape)) for a in initial_arrays.values())
        self.start_plan = self.server_plan(self.model_size)
        warning = plan_warning(self.start_plan)
        if warning:  # in Flower's own log, which `flwr run --stream` shows
            flwr_log(logging.WARNING, "%s", warning)
        result = super().start(grid, initial_arrays, num_rounds, timeout,  # type: ignore[misc]
                               self.start_train_config(train_config), evaluate_config,
                               evaluate_fn)
        if num_rounds > 0:
            self.watch.check_end()
        return result

    #: set when every learner refused client-side evaluation (code 4106): from then on no
    #: evaluate messages are sent
    evaluation_refused: bool = False

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluate messages, until the learners have refused them
        all once: a learner refuses unless it opted in, and will go on refusing."""
        if self.evaluation_refused:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's aggregate of the answers. Refusals (code 4106: the
        learner did not opt in to unaccounted client-side evaluation) are logged once, not
        every round; when every learner refused, client-side evaluation is turned off."""
        replies = list(replies)
        refused = [m for m in replies if m.has_error() and int(m.error.code) == EVALUATE_REFUSED]
        if refused and not getattr(self, "_refusal_logged", False):
            self._refusal_logged = True
            every = len(refused) == len(replies)
            log.warning(
                "flwr-corrnoise: %d of %d learner(s) refuse client-side evaluation (code %d: "
                "a loss on their data is not covered by their ε; a learner answers only if it "
                "opted in with client-evaluation = true)%s. Evaluate the global model on the "
                "server instead: strategy.start(..., evaluate_fn=...) (docs/adopt.md, "
                "\"Evaluation\")", len(refused), len(replies), EVALUATE_REFUSED,
                "; client-side evaluation is off for the rest of the run" if every else
                "; their refusals are left out from now on")
        if refused and len(refused) == len(replies):
            self.evaluation_refused = True
            return None
        return self.strategy.aggregate_evaluate(
            server_round, [m for m in replies if not (
                m.has_error() and int(m.error.code) == EVALUATE_REFUSED)])
