"""Server side on Flower: FedAvg with a server learning rate over noisy learner updates.

:class:`CorrNoiseFedAvg` is a ``flwr.serverapp.strategy.FedAvg``: it samples learners,
sends ``x^r`` with the round's config (``server-round``, ``local-steps`` τ,
``learning-rate`` η, and the privacy settings it *proposes* — learners check them against
their own and refuse weaker ones), and aggregates the replies with
:func:`flwr_corrnoise.learner.aggregate`, i.e. paper 000's Algorithm 1 line 16,
``x^{r+1} = x^r − η_g·η·τ·mean_i ĝ_i``, over the learners that answered with a valid
update. Replies with a wrong shape or dtype, NaN/Inf or missing keys are rejected and
logged; error replies (a learner refusing a config or out of budget) are recorded.
Per-learner privacy reports (ε spent, steps, noise std) are kept in :attr:`privacy`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from ..learner import PrivacySettings, aggregate, check_update

log = logging.getLogger(__name__)

PRIVACY_KEYS = ("epsilon-spent", "epsilon", "delta", "noise-std", "steps", "horizon")


class CorrNoiseFedAvg(FedAvg):
    """FedAvg for correlated-noise local DP (paper 000, Algorithm 1).

    Parameters
    ----------
    local_steps : τ, local steps per round.
    learning_rate : η, the learners' local step size.
    server_learning_rate : η_g.
    privacy : the settings the server proposes to learners (sent as ``privacy-*`` keys);
        ``None`` sends no proposal. Learners never take these as their own.
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
        self.proposal = privacy.proposal() if privacy is not None else {}
        self._models: dict[int, list[np.ndarray]] = {}
        #: per-learner privacy report, keyed by node id (latest round the learner answered)
        self.privacy: dict[int, dict[str, float]] = {}
        #: per-round log: accepted, rejected (with reasons) and error replies
        self.rounds: list[dict[str, Any]] = []

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
        self._models[server_round] = [
            np.asarray(a, dtype=np.float64) for a in arrays.to_numpy_ndarrays()
        ]
        for key, value in self.round_config().items():
            config[key] = value
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        x = self._models.pop(server_round)
        accepted: list[tuple[float, list[np.ndarray]]] = []
        errors: list[dict[str, Any]] = []
        rejected: list[dict[str, Any]] = []
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                errors.append({"node": node, "code": msg.error.code, "reason": msg.error.reason})
                log.warning("round %d: learner %d sent an error: %s", server_round, node,
                            msg.error.reason)
                continue
            try:
                update = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
                check_update(update, x)
                metrics = dict(msg.content["metrics"]) if "metrics" in msg.content else {}
            except Exception as err:  # malformed reply: reject it, keep the run going
                rejected.append({"node": node, "reason": f"{type(err).__name__}: {err}"})
                log.warning("round %d: rejected the reply of learner %d: %s", server_round,
                            node, err)
                continue
            order = float(metrics.get("learner-id", node))
            accepted.append((order, [np.asarray(u, dtype=np.float64) for u in update]))
            report = {k: float(metrics[k]) for k in PRIVACY_KEYS if k in metrics}
            if report:
                self.privacy[node] = {**report, "round": float(server_round)}
        # a fixed summation order (by learner id) makes runs reproducible bit for bit
        accepted.sort(key=lambda item: item[0])
        new = aggregate(
            x,
            [u for _, u in accepted],
            self.learning_rate,
            self.server_learning_rate,
            self.local_steps,
        )
        self.rounds.append(
            {"round": server_round, "accepted": len(accepted), "rejected": rejected,
             "errors": errors, "learners": [order for order, _ in accepted]}
        )
        summary: dict[str, float] = {
            "num-updates": float(len(accepted)),
            "num-rejected": float(len(rejected)),
            "num-errors": float(len(errors)),
        }
        spent = [r["epsilon-spent"] for r in self.privacy.values() if "epsilon-spent" in r]
        if spent:
            summary["epsilon-spent-max"] = max(spent)
        return ArrayRecord(new), MetricRecord(summary)
