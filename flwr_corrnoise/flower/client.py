"""Learner side on Flower: the state lives in ``context.state``, the round in the core.

Flower re-creates client objects for every message, so :class:`CorrNoiseLearner` keeps
nothing on ``self`` between rounds: the noise stream, the step counter and the data-stream
position are serialized into ``context.state[STATE_KEY]`` after each successful round, and
read back at the start of the next. A refused or failed round leaves that state untouched.

Two front ends drive the same :class:`CorrNoiseLearner`:

* :class:`CorrNoiseNumPyClient`, a ``flwr.client.NumPyClient`` subclass for legacy apps: the
  user implements ``gradient(parameters, position)`` instead of ``fit``;
* :func:`make_client_app`, a Message-API ``ClientApp`` built from a gradient factory.

:func:`numpy_client_app` runs NumPyClients (ours or any) behind a Message-API ``ClientApp``
so they talk to :class:`~flwr_corrnoise.flower.strategy.CorrNoiseFedAvg` and refuse a bad
server configuration with a clear error reply.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from ..learner import (
    GradientFn,
    LearnerState,
    NonFiniteError,
    PrivacyConfigError,
    PrivacySettings,
    derive_seed,
    local_round,
)
from ..persistence import StateLostError, StateStore
from ..privacy import PrivacyBudgetError
from ..streams import HorizonExhaustedError

log = logging.getLogger(__name__)

#: key of the learner's record in ``context.state``
STATE_KEY = "flwr-corrnoise"

#: error codes of the replies a learner sends instead of an update
ERROR_CODES: dict[type[Exception], int] = {
    PrivacyConfigError: 4101,
    PrivacyBudgetError: 4101,
    HorizonExhaustedError: 4102,
    NonFiniteError: 4103,
    StateLostError: 4104,
}
GENERIC_ERROR = 4100


def error_code(err: Exception) -> int:
    for kind, code in ERROR_CODES.items():
        if isinstance(err, kind):
            return code
    return GENERIC_ERROR


#: run-config keys that carry privacy settings, and the proposal key each one maps to
RUN_CONFIG_PROPOSAL = {
    "mechanism": "privacy-mechanism",
    "epsilon": "privacy-epsilon",
    "delta": "privacy-delta",
    "clip-norm": "privacy-clip-norm",
    "horizon": "privacy-horizon",
}


def deployed(context: Context) -> bool:
    """A learner with a ``state-dir`` in its node config runs as a deployed SuperNode.

    Why it changes what the learner trusts: in deployment the run config is written by
    whoever launches the run (``flwr run``), i.e. the server side, so it may *propose*
    privacy settings but never set them; the learner's own settings come from the app's
    defaults and its node config only, and its noise seed from OS entropy.
    """
    return "state-dir" in context.node_config


def learner_config(
    context: Context, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The learner's own configuration: ``defaults`` (the app's), overridden by the run
    config (simulations only: see :func:`deployed`), overridden by the node config (what
    the learner's operator set)."""
    run = {} if deployed(context) else dict(context.run_config)
    return {**dict(defaults or {}), **run, **dict(context.node_config)}


def run_config_proposal(context: Context) -> dict[str, Any]:
    """A deployed learner treats the run config's privacy keys as a server proposal."""
    if not deployed(context):
        return {}
    rc = context.run_config
    return {prop: rc[key] for key, prop in RUN_CONFIG_PROPOSAL.items() if key in rc}


def learner_seed(context: Context, defaults: Mapping[str, Any] | None = None) -> int | None:
    """The noise seed: ``noise-seed`` in the node config, else (simulations only) derived
    from the run's ``seed`` and the ``partition-id``, else ``None``: OS entropy, as every
    deployed learner without an explicit ``noise-seed`` uses (a seed derived from the run
    config would be known to the server, which could then subtract the noise)."""
    cfg = learner_config(context, defaults)
    if cfg.get("noise-seed") is not None:
        return int(cfg["noise-seed"])
    if deployed(context):
        return None
    if cfg.get("seed") is not None and cfg.get("partition-id") is not None:
        return derive_seed(int(cfg["seed"]), int(cfg["partition-id"]))
    return None


class CorrNoiseLearner:
    """Binds the shared local round to one Flower ``Context``.

    ``gradient(parameters, position)`` returns the gradient on the datum at that position
    of the learner's stream. ``settings`` default to the learner's run/node config.
    """

    def __init__(
        self,
        context: Context,
        gradient: GradientFn,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        config_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.context = context
        self.gradient = gradient
        self.defaults = dict(config_defaults or {})
        cfg = learner_config(context, self.defaults)
        if deployed(context) and settings is None and not (
            cfg.get("horizon") or cfg.get("num-server-rounds")
        ):
            raise PrivacyConfigError(
                "a deployed learner needs its horizon ('horizon' in its node config): the "
                "run config's round count is the server's, not the learner's"
            )
        self.settings = settings or PrivacySettings.from_config(cfg)
        self.seed = learner_seed(context, self.defaults) if seed == "from-context" else seed
        self.store = StateStore(str(context.node_config["state-dir"])) if deployed(
            context) else None

    def load_state(self, shapes: list[tuple[int, ...]]) -> LearnerState:
        """The stored state (on disk for a deployed learner), or a fresh one on the
        learner's first round; a lost or corrupt state is an error, never a fresh start."""
        if self.store is not None:
            data = self.store.load()
            if data is None:
                return LearnerState.create(self.settings, shapes, self.seed)
            try:
                return LearnerState.from_bytes(data)
            except ValueError as err:
                raise StateLostError(f"the learner state {self.store.state_path} is "
                                     f"corrupt, refusing to train: {err}") from err
        if STATE_KEY in self.context.state:
            record = self.context.state[STATE_KEY]
            return LearnerState.from_bytes(bytes(record["learner"]))  # type: ignore[index]
        return LearnerState.create(self.settings, shapes, self.seed)

    def save_state(self, state: LearnerState) -> None:
        data = state.to_bytes()
        if self.store is not None:
            self.store.save(data)  # before the reply leaves: a crash releases nothing
        self.context.state[STATE_KEY] = ConfigRecord({"learner": data})

    def train(
        self, parameters: list[np.ndarray], config: Mapping[str, Any]
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """One round: check the server's proposal, run τ steps, store the new state."""
        self.settings.check_proposal({**run_config_proposal(self.context), **dict(config)})
        try:
            tau = int(config["local-steps"])
            eta = float(config["learning-rate"])
        except (KeyError, TypeError, ValueError) as err:
            raise PrivacyConfigError(
                f"the server's round config lacks a valid 'local-steps'/'learning-rate': {err!r}"
            ) from err
        shapes = [tuple(np.shape(p)) for p in parameters]
        state = self.load_state(shapes)
        first_step, position = state.step, state.position
        result = local_round(parameters, self.gradient, state, self.settings, tau, eta)
        if self.store is not None:  # the operator's audit log of the noise indices released
            self.store.log_round({
                "server-round": int(config.get("server-round", -1)),
                "first-step": first_step, "steps": result.state.step - first_step,
                "position": position, "time": time.time(),
            })
        self.save_state(result.state)
        metrics = dict(result.metrics)
        pid = learner_config(self.context, self.defaults).get("partition-id")
        if pid is not None:
            metrics["learner-id"] = float(pid)
        metrics["num-examples"] = float(tau)
        return result.update, metrics


class CorrNoiseNumPyClient(NumPyClient):
    """A ``NumPyClient`` whose ``fit`` is paper 000's private local round.

    Adapt an existing NumPyClient by subclassing this class instead of ``NumPyClient``,
    passing the ``Context`` to ``__init__``, and replacing ``fit`` with
    ``gradient(parameters, position)`` — the gradient of your loss on datum ``position``
    of this learner's stream. ``evaluate`` stays yours.
    """

    def __init__(
        self,
        context: Context,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
    ) -> None:
        self.context = context
        self.learner = CorrNoiseLearner(context, self.gradient, settings, seed)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        """Gradient of the loss on datum ``position`` of this learner's stream."""
        raise NotImplementedError("subclasses implement gradient(parameters, position)")

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        update, metrics = self.learner.train(parameters, config)
        return update, int(metrics["num-examples"]), metrics


def _error_reply(msg: Message, err: Exception) -> Message:
    reason = f"flwr-corrnoise: {type(err).__name__}: {err}"
    log.warning("learner refuses round: %s", reason)
    return Message(Error(code=error_code(err), reason=reason), reply_to=msg)


def _metric_record(metrics: Mapping[str, Any]) -> MetricRecord:
    return MetricRecord(
        {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, int | float | np.floating | np.integer) and not isinstance(v, bool)
        }
    )


def make_client_app(
    gradient_factory: Callable[[Context], GradientFn],
    evaluate: Callable[[Message, Context], Message] | None = None,
    config_defaults: Mapping[str, Any] | None = None,
) -> ClientApp:
    """A Message-API ``ClientApp`` running the private local round.

    ``gradient_factory(context)`` returns the learner's gradient oracle (it typically reads
    ``context.node_config["partition-id"]`` to pick the learner's data). The learner's
    privacy settings come from ``config_defaults`` < run config < node config (keys
    ``mechanism``, ``epsilon``, ``delta``, ``clip-norm``, ``horizon`` or
    ``num-server-rounds``·``local-steps``, ``calibration``, ``seed``/``noise-seed``).
    Refused rounds are answered with an ``Error`` reply (codes in :data:`ERROR_CODES`)
    and change nothing.
    """
    app = ClientApp()
    defaults = dict(config_defaults or {})

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        try:
            learner = CorrNoiseLearner(
                context, gradient_factory(context), config_defaults=defaults
            )
            params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
            update, metrics = learner.train(params, dict(msg.content["config"]))
        except Exception as err:  # every failure becomes a clear reply, not a crash
            return _error_reply(msg, err)
        content = RecordDict({"arrays": ArrayRecord(update), "metrics": _metric_record(metrics)})
        return Message(content, reply_to=msg)

    if evaluate is not None:
        app.evaluate()(evaluate)
    return app


def numpy_client_app(client_fn: Callable[[Context], NumPyClient]) -> ClientApp:
    """Run NumPyClients behind a Message-API ``ClientApp`` (``arrays``/``config`` layout).

    Why: Flower 1.41's legacy ``flwr.client.ClientApp`` speaks the old record layout that
    the Message-API strategies do not read, and turns exceptions into opaque errors; this
    wrapper keeps the user's NumPyClient untouched and answers a refused round clearly.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        try:
            client = client_fn(context)
            params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
            update, num_examples, metrics = client.fit(params, dict(msg.content["config"]))
        except Exception as err:
            return _error_reply(msg, err)
        record = _metric_record({**metrics, "num-examples": num_examples})
        return Message(RecordDict({"arrays": ArrayRecord(update), "metrics": record}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        try:
            client = client_fn(context)
            params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
            loss, num, metrics = client.evaluate(params, dict(msg.content["config"]))
        except Exception as err:
            return _error_reply(msg, err)
        record = _metric_record({**metrics, "loss": loss, "num-examples": num})
        return Message(RecordDict({"metrics": record}), reply_to=msg)

    return app
