"""Central DP with correlated noise: a wrapper around any FedAvg-family strategy (Zhang, Zhu &
Johansson, "Differentially Private Online Federated Learning with Correlated Noise").

With a trusted aggregator, one correlated-noise stream on the server replaces one per
learner: the noise is added once, to the *average*, so it is ``m`` times smaller for the
same guarantee than if each of ``m`` learners noised its own update. Flower ships the
independent-noise version (``DifferentialPrivacyServerSideFixedClipping``); this is the
matrix-factorization one, built on the same mechanisms, streams and calibration.

Per round ``r`` the wrapper clips each learner's update ``Δ_i = returned_i − x^r`` to
``clip_norm`` ``B`` (global L2), adds the **same** increment ``e[r]`` of the server's
``R×R`` noise stream to every clipped reply, and hands the replies to the wrapped strategy.
A FedAvg-family strategy averages the replies with weights summing to one, so it sees
``x^r + mean_i clip(Δ_i) + e[r]``: the noise is on the average *before* the wrapped
strategy's own step (FedAdam's, FedYogi's...), which is then post-processing. (Adding the
noise to the wrapped strategy's *output* would not be: an adaptive optimizer's step is a
nonlinear function of the data.)

**Guarantee.** Neighbouring datasets replace one datum of one learner; each datum is used
in one round (online learning). **Whether and what the server releases never depends on
one reply's content**: a round is released iff at least ``min_learners`` replies arrived
(any kind — participation, not data, decides), and every reply that is an error, malformed
or non-finite counts as a **zero contribution** (``Δ_i = 0``) instead of being dropped
(dropping it would change the denominator, and whether the round is released, with one
learner's data). The released model is ``x^r + (1/m)·Σ_i clip(Δ_i) + e[r]`` with ``m`` the
number of replies (``≥ min_learners``), so one datum moves it by at most
``2B/min_learners``, and the released sequence is one Gaussian mechanism with L2
sensitivity ``2·B·max_j‖c_j‖/min_learners`` over the ``R×R`` factorization — calibrated by
:func:`flwr_corrnoise.privacy.calibrate`. The wrapped strategy receives that one noised
average (every carrier reply holds it, with weight 1), so its own step is post-processing;
**no un-noised client metrics** are released: the wrapped strategy's aggregated metrics are
replaced by the wrapper's privacy report. The server is trusted: it sees every learner's
clipped update. Not for robust (non-linear) aggregators such as the median or Krum.

**What is released, exactly.** The noised model, and metadata that is a function of the
settings, the round counter and participation (who replied, how many): ε spent, the noise
std, the rounds released, ε per replying node. *Nothing that depends on a reply's content*
— not how many replies were zeroed, not which ones, not an error's code or text, not a
client metric — reaches the round metrics, ``Result``, :attr:`CorrNoiseCentralDPStrategy.rounds`,
Flower's round log or a :class:`~flwr_corrnoise.flower.monitor.RunFailedError`'s text. Such
details stay in the server's local log (the ``flwr_corrnoise`` logger) and
:attr:`CorrNoiseCentralDPStrategy.diagnostics`. The wrapped strategy is handed one identical
carrier per reply (error replies included), so even its own log ("Received N results and 0
failures") counts participation only.

**No client-side evaluation.** A wrapped FedAvg would send evaluate messages and release
the mean of the clients' losses on their data: un-noised and outside the budget. The
wrapper sends no evaluate messages (a loud warning when the wrapped strategy would have)
and drops any evaluate replies; evaluate the released model on the server
(``start(..., evaluate_fn=...)``), which is post-processing.

**Stopping a run.** The run fails (``max-idle-rounds``) only on facts that do not depend on
the data: rounds with fewer than ``min_learners`` replies, rounds past the horizon, and
rounds in which *every* reply is Flower's "the ClientApp could not be loaded" error
(:data:`~flwr_corrnoise.flower.monitor.APP_NOT_LOADED_CODES`: no data was touched). A
ClientApp that raises on every learner counts as zero contributions and is reported loudly
in the server's log, but does not stop the run: whether the app raises may depend on a
datum, and stopping would release that bit.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..aggregation import check_update
from ..learner import clip_by_global_norm
from ..mechanisms.participation import ONCE, Participation
from ..plan import Plan, round_plan, summary_line
from ..privacy import Calibration, epsilon_spent
from ..settings import PrivacyConfigError, PrivacySettings
from ..settings_keys import lookup, reading, require
from ..streams import NoiseStream
from ..variants import central_calibration, central_noise_std
from .config import settings_from_config
from .monitor import (
    APP_NOT_LOADED_CODES,
    RoundWatch,
    RunFailedError,
    WrappedStrategy,
    learner_key,
    log_summary,
    privacy_report,
)

log = logging.getLogger(__name__)


class CorrNoiseCentralDPStrategy(WrappedStrategy, Strategy):
    """Wrap ``strategy`` (FedAvg family) with server-side clipping and correlated noise.

    The correlated-noise counterpart of Flower's
    ``DifferentialPrivacyServerSideFixedClipping`` (whose ``clipping_norm`` is our
    ``clip_norm``).

    ``min_learners`` is passed on to the wrapped strategy's node minimums
    (``min_train_nodes``, ``min_available_nodes``): a strategy without them is refused,
    since it could start rounds that can never be released. A round starts only when
    ``min_learners`` SuperNodes are connected; after ``connect_timeout`` seconds without
    them, and after ``max_idle_rounds`` consecutive rounds with nothing released, the run
    stops with :class:`~flwr_corrnoise.flower.monitor.RunFailedError`.
    :meth:`from_run_config` reads everything from the run config (the key table).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        mechanism: str,
        epsilon: float,
        delta: float,
        clip_norm: float,
        num_rounds: int,
        min_learners: int,
        method: str = "exact",
        seed: int | None = None,
        max_idle_rounds: int = 3,
        connect_timeout: float = 60.0,
        participation: Participation = ONCE,
    ) -> None:
        if isinstance(min_learners, bool) or int(min_learners) < 1:
            raise ValueError(f"min_learners must be a positive integer, got {min_learners!r}")
        for attr in ("min_train_nodes", "min_available_nodes"):
            if not hasattr(strategy, attr):
                raise ValueError(
                    f"CorrNoiseCentralDPStrategy needs a strategy with node minimums (FedAvg "
                    f"family) to pass min_learners = {min_learners} on to; "
                    f"{type(strategy).__name__} has no {attr!r}")
            if int(getattr(strategy, attr)) < int(min_learners):
                log.info("CorrNoiseCentralDPStrategy: %s.%s raised to min_learners = %d",
                         type(strategy).__name__, attr, int(min_learners))
                setattr(strategy, attr, int(min_learners))
        self.strategy = strategy
        self.mechanism = mechanism
        self.num_rounds = int(num_rounds)
        self.min_learners = int(min_learners)
        self.method = method
        # Δ of the *sum* is 2·B·sens; the average over ≥ min_learners is that / min_learners
        self.participation = participation
        #: the server's stream factorization: a BLT optimized for the participation
        self.settings = PrivacySettings(mechanism=mechanism, epsilon=epsilon, delta=delta,
                                        clip_norm=clip_norm, horizon=self.num_rounds,
                                        method=method, participation=participation)
        self.calibration: Calibration = central_calibration(
            mechanism, epsilon, delta, clip_norm, self.num_rounds, method,  # type: ignore[arg-type]
            participation=participation, params=self.settings.mechanism_params(),
        )
        self.noise_std = central_noise_std(self.calibration, self.min_learners)
        self.seed = seed
        self.stream: NoiseStream | None = None
        self.current: list[np.ndarray] | None = None
        self.keys: list[str] | None = None
        self.released = 0
        # content_free: a RunFailedError's text names participation and "could not load"
        # codes only, never an error text a plain ClientApp may have written from its data
        self.watch = RoundWatch(max_idle_rounds, type(self).__name__, content_free=True)
        self.connect_timeout = float(connect_timeout)
        #: per-round history, safe to publish: round, replies received, released, ε spent
        #: (functions of participation and the counters only)
        self.rounds: list[dict[str, Any]] = []
        #: the server's local diagnostics: which replies counted as zero and why. They
        #: depend on the learners' data: never released, never in the metrics or history
        self.diagnostics: list[dict[str, Any]] = []
        if float(getattr(strategy, "fraction_evaluate", 0.0) or 0.0) > 0.0:
            log.warning(
                "CorrNoiseCentralDPStrategy: %s(fraction_evaluate=%g) would evaluate on the "
                "clients and release their aggregated loss on their data, un-noised and outside "
                "the central budget; client-side evaluation is OFF under central DP (no evaluate "
                "messages are sent). Evaluate the released model on the server with "
                "start(..., evaluate_fn=...), and pass fraction_evaluate=0.0 to silence this.",
                type(strategy).__name__, float(strategy.fraction_evaluate))  # type: ignore[attr-defined]

    @classmethod
    def from_run_config(
        cls, strategy: Strategy, run_config: Mapping[str, Any], *, seed: int | None = None
    ) -> CorrNoiseCentralDPStrategy:
        """The wrapper the run config describes, read by the key table the learners read:
        ``mechanism``, ``epsilon``, ``delta``, ``clip-norm`` (of each round update),
        ``calibration``, ``horizon`` (rounds; else the required ``num-server-rounds``),
        ``min-learners``, ``max-idle-rounds``, ``connect-timeout``."""
        where = "run config"
        with reading(run_config, where):  # near-miss keys refused; one line of defaults
            rounds = lookup(run_config, "horizon", where) or require(
                run_config, "num-server-rounds", where, "it is the central noise's horizon")
            s = settings_from_config({**dict(run_config), "horizon": rounds}, where,
                                            per_round=True)
            server = {"min_learners": lookup(run_config, "min-learners", where),
                      "max_idle_rounds": lookup(run_config, "max-idle-rounds", where),
                      "connect_timeout": lookup(run_config, "connect-timeout", where)}
        if s.adaptive is not None:  # a learner's own clip norm; the server's is fixed
            raise PrivacyConfigError(
                "adaptive-clip-quantile is a learner's (local DP) setting: central DP clips "
                "every round update to the fixed clip-norm; unset it in the run config")
        return cls(strategy, mechanism=s.mechanism, epsilon=s.epsilon, delta=s.delta,
                   clip_norm=s.clip_norm, num_rounds=s.horizon, method=s.method,
                   participation=s.participation, seed=seed, **server)

    # -- training --------------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        deadline = time.monotonic() + self.connect_timeout
        while len(nodes := list(grid.get_node_ids())) < self.min_learners:
            if time.monotonic() > deadline:
                raise RunFailedError(
                    f"CorrNoiseCentralDPStrategy: only {len(nodes)} SuperNode(s) connected after "
                    f"{self.connect_timeout:g} s, but a round is released only with at least "
                    f"min-learners = {self.min_learners} replies; start more SuperNodes or "
                    f"lower min-learners")
            time.sleep(0.2)
        self.current = [np.asarray(a, dtype=np.float64) for a in arrays.to_numpy_ndarrays()]
        self.keys = list(arrays.keys())
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current is None or self.keys is None:
            raise RuntimeError("configure_train must run before aggregate_train")
        x = self.current
        replies = list(replies)
        total = np.zeros(sum(p.size for p in x))
        zeroed: list[dict[str, Any]] = []
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            try:
                if msg.has_error():
                    raise ValueError(f"error reply {msg.error.code}")
                (record,) = msg.content.array_records.values()
                update = record.to_numpy_ndarrays()
                check_update(update, x)
                delta = np.concatenate([(np.asarray(u, dtype=np.float64) - p).ravel()
                                        for u, p in zip(update, x, strict=True)])
            except Exception as err:  # a zero contribution, never a change of what is released
                zeroed.append({"node": node, "reason": f"{type(err).__name__}: {err}"})
                log.warning("round %d: the reply of node %d counts as zero (local log only, "
                            "never released): %s", server_round, node, err)
                continue
            total += clip_by_global_norm(delta, self.calibration.clip_norm)[0]
        # content-dependent: the server's local diagnostics only
        self.diagnostics.append({"round": server_round, "zeroed": zeroed})
        entry: dict[str, Any] = {"round": server_round, "replies": len(replies),
                                 "released": False}
        self.rounds.append(entry)
        if len(replies) < self.min_learners:
            log.warning("round %d: %d replies < min_learners = %d: nothing released",
                        server_round, len(replies), self.min_learners)
            self.watch.observe(server_round, replies, 0)
            return None, None
        if self.released >= self.num_rounds:
            log.warning("round %d: the noise is calibrated for %d rounds, all used: nothing "
                        "released", server_round, self.num_rounds)
            self.watch.observe(server_round, replies, 0)
            return None, None
        if self.stream is None:
            self.stream = NoiseStream.create(self.mechanism, self.num_rounds,
                                             [np.shape(p) for p in x], self.noise_std,
                                             self.seed,
                                             factorization=self.settings.factorization())
        flat = np.concatenate([p.ravel() for p in x]) + total / len(replies) + self.stream.next()
        self.released += 1
        arrays, offset = {}, 0
        for key, p in zip(self.keys, x, strict=True):
            arrays[key] = Array(flat[offset : offset + p.size].reshape(p.shape))
            offset += p.size
        content = RecordDict({"arrays": ArrayRecord(arrays),
                              "metrics": MetricRecord({self._weight_key(): 1.0})})
        # one identical carrier per reply, error replies included: what the wrapped strategy
        # sees (and logs: "Received N results and 0 failures") is participation, not content.
        # New messages: the caller's replies are left as they were.
        prepared = [Message(content=content, metadata=copy.deepcopy(msg.metadata))
                    for msg in replies]
        arrays_out, _ = self.strategy.aggregate_train(server_round, prepared)
        spent = min(epsilon_spent(self.calibration.std, self.calibration.delta,
                                  self.calibration.clip_norm, self.mechanism, self.num_rounds,
                                  self.released, self.method,  # type: ignore[arg-type]
                                  self.participation, self.settings.mechanism_params()),
                    self.calibration.epsilon)
        entry.update({"released": True, "epsilon-spent": spent})
        report = {"central-epsilon-spent": spent, "central-noise-std": self.noise_std,
                  "central-rounds-released": float(self.released)}
        # every replying learner's data is covered by the same central guarantee: ε per
        # learner (by node id: a plain app's reply names no partition)
        report.update(privacy_report({
            learner_key({}, int(m.metadata.src_node_id)): {"epsilon-spent": spent}
            for m in replies}))
        # Idle only if no reply could even load the app (Flower's codes, no data touched): a
        # misconfiguration. A reply that raised may have raised on a datum, so an all-error
        # round is released (zero contributions) and reported in the local log only.
        unloaded = sum(m.has_error() and int(m.error.code) in APP_NOT_LOADED_CODES
                       for m in replies)
        if zeroed and len(zeroed) == len(replies) and unloaded < len(replies):
            log.error("round %d: every reply counted as zero (local log only): the released "
                      "model moved by the noise alone; check the ClientApp: %s", server_round,
                      RoundWatch.describe(server_round, replies, 0))
        self.watch.observe(server_round, replies, int(unloaded < len(replies)))
        return arrays_out, MetricRecord(report)

    # -- evaluation: never on the clients ----------------------------------------------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No evaluate messages: the clients' answers (a loss on their data) would be an
        un-noised release outside the central budget. Evaluate on the server instead."""
        if float(getattr(self.strategy, "fraction_evaluate", 0.0) or 0.0) > 0.0:
            log.warning("round %d: client-side evaluation is off under central DP (not "
                        "covered by its guarantee); no evaluate messages sent", server_round)
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Nothing: client evaluation results are never released under central DP."""
        replies = list(replies)
        if replies:
            log.warning("round %d: %d evaluate replies dropped: client metrics are not "
                        "released under central DP", server_round, len(replies))
        return None

    def _weight_key(self) -> str:
        return str(getattr(self.strategy, "weighted_by_key", "num-examples"))

    def plan_line(self) -> str:
        """The plan's verdict for the summary: the plan :meth:`start` made at the model
        size being started."""
        plan = None if self.model_size is None else self.start_plan
        return "plan: none (no model yet)" if plan is None else summary_line(plan)

    def server_plan(self, model_size: int) -> Plan | None:
        """Central noise on the average of ``min-learners`` updates at this model size
        (:func:`~flwr_corrnoise.plan.round_plan`)."""
        return round_plan("central", self.settings, model_size, self.min_learners)

    # -- everything else is the wrapped strategy's ------------------------------------------
    def summary(self) -> None:
        """Ours, not the wrapped FedAvg's: the carriers have equal weights."""
        log_summary(self, f"Correlated-noise central DP around {type(self.strategy).__name__}", [
            f"{self.mechanism} noise over {self.num_rounds} rounds, (ε, δ) = "
            f"({self.calibration.epsilon:g}, {self.calibration.delta:g}), clip "
            f"{self.calibration.clip_norm:g} per round update",
            f"released only with ≥ {self.min_learners} replies; std on the average "
            f"{self.noise_std:.4g}; each datum used ≤ "
            f"{self.settings.participation.participations(self.num_rounds)}× "
            f"({self.calibration.participation})",
            self.plan_line(),
            f"the run fails after {self.watch.max_idle_rounds} consecutive round(s) without "
            f"a release",
            "client-side evaluation: off (not covered by central DP; use evaluate_fn)",
        ])

