"""Server side on Flower: FedAvg with a server learning rate over noisy learner updates.

:class:`CorrNoiseFedAvg` is a ``flwr.serverapp.strategy.FedAvg``: it samples learners,
sends ``x^r`` with the round's config (``server-round``, ``local-steps`` τ,
``learning-rate`` η, and the privacy settings it *proposes* — learners check them against
their own and refuse weaker ones), and aggregates the replies with
:func:`flwr_corrnoise.aggregation.aggregate`, i.e. Zhang, Zhu, Fay & Johansson's ("Locally
Differentially Private Online Federated Learning With Correlated Noise") Algorithm 1 line 16,
``x^{r+1} = x^r − η_g·η·τ·mean_i ĝ_i``, over the learners that answered with a valid update. Replies
with a wrong shape or dtype, NaN/Inf or missing keys are rejected and logged; error replies (a
learner refusing a config or out of budget) are recorded. Per-learner privacy reports (ε spent,
steps, noise std) are kept in :attr:`privacy`. With a
:class:`~flwr_corrnoise.flower.checkpoint.ServerCheckpoint` the strategy saves its progress after
every round and :meth:`CorrNoiseFedAvg.start` resumes from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from ..aggregation import UpdateSum, check_update
from ..settings import NOISELESS, PrivacySettings
from ..settings_keys import lookup, reading, require
from .checkpoint import ServerCheckpoint, ServerProgress
from .config import privacy_proposal, settings_from_config
from .monitor import RoundWatch, learner_key, log_summary, privacy_report, start_config

log = logging.getLogger(__name__)

PRIVACY_KEYS = ("epsilon-spent", "epsilon", "delta", "noise-std", "steps", "horizon")


class CorrNoiseFedAvg(FedAvg):
    """FedAvg for correlated-noise local DP (Zhang et al., Algorithm 1).

    Parameters
    ----------
    local_steps : τ, local steps per round.
    learning_rate : η, the learners' local step size.
    server_learning_rate : η_g.
    privacy : the settings the server proposes to learners (sent as ``privacy-*`` keys);
        ``None`` sends no proposal. Learners never take these as their own.
    checkpoint : where to save the server's progress after every round; :meth:`start`
        resumes from it (see :mod:`flwr_corrnoise.flower.checkpoint`).
    max_idle_rounds : consecutive rounds without a single accepted update after which
        :meth:`aggregate_train` raises :class:`~flwr_corrnoise.flower.monitor.RunFailedError`
        (so the run fails instead of ending "completed" with an untrained model).
    Other keyword arguments go to ``FedAvg`` (``fraction_train``, ``min_train_nodes``,
    ``min_available_nodes``...). Client-side evaluation is off by default
    (``fraction_evaluate=0``): the server evaluates ``x^r`` centrally via ``evaluate_fn``.
    """

    def __init__(
        self,
        *,
        local_steps: int,
        learning_rate: float,
        server_learning_rate: float = 1.0,
        privacy: PrivacySettings | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 1,
        min_available_nodes: int = 1,
        checkpoint: ServerCheckpoint | None = None,
        max_idle_rounds: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_available_nodes=min_available_nodes,
            **kwargs,
        )
        if int(local_steps) != local_steps or local_steps < 1:
            raise ValueError(f"local_steps must be a positive integer, got {local_steps!r}")
        if not (np.isfinite(learning_rate) and learning_rate > 0):
            raise ValueError(f"learning_rate must be finite and > 0, got {learning_rate!r}")
        if not (np.isfinite(server_learning_rate) and server_learning_rate > 0):
            raise ValueError("server_learning_rate must be finite and > 0")
        self.local_steps = int(local_steps)
        self.learning_rate = float(learning_rate)
        self.server_learning_rate = float(server_learning_rate)
        self.proposal = privacy_proposal(privacy) if privacy is not None else {}
        self._models: dict[int, list[np.ndarray]] = {}
        self._dtypes: dict[int, list[np.dtype]] = {}
        #: per-learner privacy report, keyed by node id (latest round the learner answered)
        self.privacy: dict[int, dict[str, float]] = {}
        #: per-round log: accepted, rejected (with reasons) and error replies
        self.rounds: list[dict[str, Any]] = []
        #: server-side evaluations ``evaluate_fn`` returned, one per round from round 0
        self.evaluations: list[dict[str, float]] = []
        self.checkpoint = checkpoint
        #: rounds completed before this process started (restored from the checkpoint)
        self.round_offset = 0
        self._message_ttl: float | None = None
        self.watch = RoundWatch(max_idle_rounds, type(self).__name__)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], **kwargs: Any) -> CorrNoiseFedAvg:
        """The strategy the run config describes, read by the key table the learners read
        (:mod:`flwr_corrnoise.settings_keys`): ``local-steps``, ``learning-rate`` and
        ``num-server-rounds`` are required (a clear error, never a silent horizon of 1);
        ``mechanism``, ``epsilon``, ``delta``, ``clip-norm``, ``calibration``, ``horizon``
        make the proposal (defaults logged); ``server-learning-rate``, ``min-learners``
        (``min_available_nodes``) and ``max-idle-rounds``. ``kwargs`` override."""
        where = "run config"
        with reading(run_config, where):  # near-miss keys refused; one line of defaults
            tau = require(run_config, "local-steps", where, "τ is sent to the learners")
            eta = require(run_config, "learning-rate", where, "η is sent to the learners")
            require(run_config, "num-server-rounds", where, "it sets the horizon")
            privacy = settings_from_config(run_config, where)
            args: dict[str, Any] = {
                "local_steps": tau, "learning_rate": eta,
                "server_learning_rate": lookup(run_config, "server-learning-rate", where),
                "privacy": privacy if privacy.mechanism != NOISELESS else None,
                "min_available_nodes": lookup(run_config, "min-learners", where),
                "max_idle_rounds": lookup(run_config, "max-idle-rounds", where),
            }
        return cls(**{**args, **kwargs})

    def summary(self) -> None:
        """Our start-up summary: τ, η, η_g, the proposal and uniform averaging."""
        log_summary(self, "Correlated-noise local DP (Zhang et al.)", [
            f"local steps τ = {self.local_steps}, learning rate η = {self.learning_rate:g}, "
            f"server learning rate η_g = {self.server_learning_rate:g}",
            "privacy proposal: " + (", ".join(f"{k}={v}" for k, v in self.proposal.items())
                                    or "none"),
            f"the run fails after {self.watch.max_idle_rounds} consecutive round(s) without "
            f"an update",
        ])

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds in all, resuming after the checkpointed ones.

        Rounds are numbered from 1 across restarts (``evaluate_fn`` sees the true round
        number); a resumed run does not re-evaluate the checkpointed model.
        """
        progress = self.checkpoint.load() if self.checkpoint is not None else None
        if progress is not None:
            self.round_offset = progress.round
            self.privacy = progress.privacy
            self.rounds = progress.rounds
            self.evaluations = progress.evaluations
            initial_arrays = ArrayRecord(progress.arrays)
            log.info("resuming after round %d from %s", progress.round, self.checkpoint.path)

        def evaluate(local_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            server_round = self.round_offset + local_round
            if local_round == 0 and progress is not None:
                return None  # evaluated before the restart
            res = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            self.evaluations.append(dict(res) if res is not None else {})
            if self.checkpoint is not None and local_round > 0:
                self.checkpoint.save(ServerProgress(
                    round=server_round,
                    arrays=[np.asarray(a) for a in arrays.to_numpy_ndarrays()],
                    privacy=self.privacy, rounds=self.rounds, evaluations=self.evaluations,
                ))
            return res

        self._message_ttl = float(timeout)
        remaining = max(0, num_rounds - self.round_offset)
        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=remaining,
            timeout=timeout,
            train_config=start_config(train_config, self.round_config()),
            evaluate_config=evaluate_config,
            # no hook without anything to do: Flower would log an empty evaluation per round
            evaluate_fn=evaluate if evaluate_fn is not None or self.checkpoint else None,
        )
        if remaining:
            self.watch.check_end()
        if not result.arrays:  # nothing left to run: the checkpoint is the final model
            result.arrays = initial_arrays
        return result

    def round_config(self) -> dict[str, Any]:
        """The per-round keys this strategy adds to the train config."""
        return {
            "local-steps": self.local_steps,
            "learning-rate": self.learning_rate,
            **self.proposal,
        }

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        received = arrays.to_numpy_ndarrays()
        self._models[server_round] = [np.asarray(a, dtype=np.float64) for a in received]
        # the global model stays in the dtype it came in (a float32 model stays float32:
        # its learners' streams are float32, and the next round sends half the bytes)
        self._dtypes[server_round] = [
            a.dtype if np.issubdtype(a.dtype, np.floating) else np.dtype(np.float64)
            for a in received]
        for key, value in self.round_config().items():
            config[key] = value
        self.watch.bind(grid)  # a simulation fails on a learner's lost state (4104)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        for msg in messages:
            # rounds are numbered across restarts, so a learner's ledger names the true round
            msg.content["config"]["server-round"] = self.round_offset + server_round
            if self._message_ttl is not None:
                # a learner that was down must not pick up a stale round when it is back
                # (it would spend budget on an update nobody waits for any more)
                msg.metadata.ttl = min(msg.metadata.ttl, self._message_ttl)
        return messages

    @staticmethod
    def _reject(server_round: int, node: int, err: Exception) -> dict[str, Any]:
        """The record (and the log line) of a reply that cannot count."""
        log.warning("round %d: rejected the reply of learner %d: %s", server_round, node, err)
        return {"node": node, "reason": f"{type(err).__name__}: {err}"}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        x = self._models.pop(server_round)
        dtypes = self._dtypes.pop(server_round, None)
        replies = list(replies)
        errors: list[dict[str, Any]] = []
        rejected: list[tuple[int, dict[str, Any]]] = []
        # the replies that may count: (learner order, reply index, node, message, metrics)
        candidates: list[tuple[float, int, int, Message, dict[str, Any]]] = []
        for i, msg in enumerate(replies):
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                errors.append({"node": node, "code": msg.error.code, "reason": msg.error.reason})
                log.warning("round %d: learner %d sent an error: %s", server_round, node,
                            msg.error.reason)
                continue
            try:
                metrics = dict(msg.content["metrics"]) if "metrics" in msg.content else {}
            except Exception as err:  # malformed reply: reject it, keep the run going
                rejected.append((i, self._reject(server_round, node, err)))
                continue
            candidates.append((float(metrics.get("learner-id", node)), i, node, msg, metrics))
        # a fixed summation order (by learner id) makes runs reproducible bit for bit; each
        # reply's arrays are read, checked and added in that order, so the server holds one
        # update at a time, not all of them (UpdateSum)
        candidates.sort(key=lambda item: item[0])
        running = UpdateSum(x)
        accepted: list[tuple[int, float, dict[str, Any], int]] = []
        for order, i, node, msg, metrics in candidates:
            try:
                update = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
                check_update(update, x)
            except Exception as err:  # malformed reply: reject it, keep the run going
                rejected.append((i, self._reject(server_round, node, err)))
                continue
            running.add(update)
            accepted.append((i, order, metrics, node))
        new = running.step(self.learning_rate, self.server_learning_rate, self.local_steps)
        # what the replies report, in the order they came (as the records always were)
        reports: dict[str, dict[str, float]] = {}
        for _, order, metrics, node in sorted(accepted, key=lambda item: item[0]):
            report = {k: float(metrics[k]) for k in PRIVACY_KEYS if k in metrics}
            if report:  # keyed by partition id (learner-id) where the learner names one
                self.privacy[int(order)] = {**report,
                                            "round": float(self.round_offset + server_round)}
                reports[learner_key(metrics, node)] = report
        rejected_records = [record for _, record in sorted(rejected, key=lambda r: r[0])]
        self.rounds.append(
            {"round": self.round_offset + server_round, "accepted": len(accepted),
             "rejected": rejected_records, "errors": errors,
             "learners": [order for _, order, _, _ in accepted],
             # ε spent by each learner that answered, after this round (for reports)
             "epsilon-spent": {who: rep["epsilon-spent"] for who, rep in reports.items()
                               if "epsilon-spent" in rep}}
        )
        summary: dict[str, float] = {
            "num-updates": float(len(accepted)),
            "num-rejected": float(len(rejected)),
            "num-errors": float(len(errors)),
        }
        summary.update(privacy_report(reports))  # ε of every learner that answered
        spent = [r["epsilon-spent"] for r in self.privacy.values() if "epsilon-spent" in r]
        if spent:
            summary["epsilon-spent-max"] = max(spent)
        self.watch.observe(self.round_offset + server_round, replies, len(accepted))
        if dtypes is not None:  # aggregated in float64, sent on in the model's dtype
            new = [n.astype(dt, copy=False) for n, dt in zip(new, dtypes, strict=True)]
        return ArrayRecord(new), MetricRecord(summary)
