"""Learner side on Flower: the state lives in ``context.state``, the round in the core.

Flower re-creates client objects for every message, so :class:`CorrNoiseLearner` keeps
nothing on ``self`` between rounds: the noise stream, the step counter and the data-stream
position are serialized into ``context.state[STATE_KEY]`` (and, with a node-config
``state-dir``, on disk) after each successful round, and read back at the start of the
next. A refused or failed round leaves that state untouched. Settings, seed, state, ledger,
lock and every reply come from the shared :class:`~flwr_corrnoise.flower.session.LearnerSession`:
each round is one :class:`~flwr_corrnoise.flower.session.LearnerTransaction` around
:func:`~flwr_corrnoise.learner.local_round`, and the reply is built by the release gate —
as in every other front end.

Two front ends drive the same :class:`CorrNoiseLearner`:

* :class:`CorrNoiseNumPyClient`, a ``flwr.client.NumPyClient`` subclass for legacy apps: the
  user implements ``gradient(parameters, position)`` instead of ``fit``;
* :func:`make_client_app`, a Message-API ``ClientApp`` built from a gradient factory.

:func:`numpy_client_app` runs NumPyClients behind a Message-API ``ClientApp`` so they talk
to :class:`~flwr_corrnoise.flower.strategy.CorrNoiseFedAvg`. Both apps are guarded as a
whole (:class:`~flwr_corrnoise.flower.session.PrivateLearnerGuard`): evaluate and query
messages are refused unless the learner opts in to unaccounted client-side evaluation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp

from ..learner import GradientFn, local_round
from ..learner_state import LearnerState
from ..settings import PrivacyConfigError, PrivacySettings
from .session import (
    ERROR_CODES,
    GENERIC_ERROR,
    STATE_KEY,
    LearnerSession,
    LearnerTransaction,
    PrivateLearnerGuard,
    answer,
    deployed,
    error_code,
    learner_config,
    learner_seed,
    metric_record,
    refuse_query,
    round_config,
    run_config_proposal,
)

log = logging.getLogger(__name__)

__all__ = [
    "ERROR_CODES",
    "GENERIC_ERROR",
    "STATE_KEY",
    "CorrNoiseLearner",
    "CorrNoiseNumPyClient",
    "deployed",
    "error_code",
    "learner_config",
    "learner_seed",
    "make_client_app",
    "numpy_client_app",
    "run_config_proposal",
]


def model_dtype(parameters: Iterable[np.ndarray]) -> np.dtype:
    """float32 if every array of the model is float32, else float64: the dtype a fresh
    learner's noise stream is made in (a float32 model gets float32 buffers and noise)."""
    dtypes = {np.asarray(p).dtype for p in parameters}
    return np.dtype(np.float32) if dtypes == {np.dtype(np.float32)} else np.dtype(np.float64)


class CorrNoiseLearner:
    """Binds the shared local round to one Flower ``Context`` through a
    :class:`~flwr_corrnoise.flower.session.LearnerSession`.

    ``gradient(parameters, position)`` returns the gradient on the datum at that position
    of the learner's stream. ``settings`` default to the learner's own config (see the
    session for who may set what).
    """

    def __init__(
        self,
        context: Context,
        gradient: GradientFn,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        config_defaults: Mapping[str, Any] | None = None,
        release_metrics: Iterable[str] = (),
    ) -> None:
        self.context = context
        self.gradient = gradient
        self.session = LearnerSession(context, kind="step", defaults=config_defaults,
                                      settings=settings, seed=seed,
                                      release_metrics=release_metrics,
                                      stream_positions=True)
        self.settings = self.session.settings
        self.seed = self.session.seed
        self.store = self.session.store
        #: the last committed round (:meth:`train`), which :meth:`reply` answers
        self.last: LearnerTransaction | None = None

    @property
    def last_state(self) -> LearnerState | None:
        """The state after the last successful :meth:`train`."""
        return None if self.last is None else self.last.state

    def train(
        self, parameters: list[np.ndarray], config: Mapping[str, Any]
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """One round: check the server's proposal, run τ steps, store the new state.

        Returns the noised update and the privacy metadata (nothing data-dependent)."""
        tau, eta = round_config(config)
        shapes = [tuple(np.shape(p)) for p in parameters]
        dtype = model_dtype(parameters)
        with self.session.transaction(config, shapes, steps=tau, dtype=dtype) as tx:
            result = local_round(parameters, self.gradient, tx.state, self.settings, tau, eta)
            tx.diagnostics = result.diagnostics
        self.last = tx
        metrics = self.session.privacy_metrics(result.state)
        metrics["num-examples"] = float(tau)
        update = result.update
        if dtype == np.float32:  # the reply in the model's dtype (post-processing)
            update = [np.asarray(u, dtype=np.float32) for u in update]
        return update, metrics

    def reply(self, msg: Message, update: list[np.ndarray], num_examples: float,
              user_metrics: Mapping[str, Any] | None = None) -> Message:
        """The gated train reply for the last round."""
        if self.last is None:
            raise PrivacyConfigError("reply() before a successful train()")
        return self.last.reply(msg, update, num_examples=num_examples,
                               user_metrics=user_metrics)


class CorrNoiseNumPyClient(NumPyClient):
    """A ``NumPyClient`` whose ``fit`` is Zhang, Zhu, Fay & Johansson's ("Locally Differentially
    Private Online Federated Learning With Correlated Noise") private local round.

    Adapt an existing NumPyClient by subclassing this class instead of ``NumPyClient``,
    passing the ``Context`` to ``__init__``, and replacing ``fit`` with
    ``gradient(parameters, position)`` — the gradient of your loss on datum ``position``
    of this learner's stream (if it raises on a datum, or returns a non-finite or
    wrong-size gradient, that step's gradient counts as zero). Behind
    :func:`numpy_client_app` the reply holds the noised update and the privacy metadata
    only; your ``evaluate`` is called only if the learner opts in to unaccounted
    client-side evaluation.
    """

    def __init__(
        self,
        context: Context,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        release_metrics: Iterable[str] = (),
    ) -> None:
        self.context = context
        self.learner = CorrNoiseLearner(context, self.gradient, settings, seed,
                                        release_metrics=release_metrics)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        """Gradient of the loss on datum ``position`` of this learner's stream."""
        raise NotImplementedError("subclasses implement gradient(parameters, position)")

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        update, metrics = self.learner.train(parameters, config)
        return update, int(metrics["num-examples"]), metrics


def make_client_app(
    gradient_factory: Callable[[Context], GradientFn],
    evaluate: Callable[[Message, Context], Message] | None = None,
    config_defaults: Mapping[str, Any] | None = None,
    *,
    release_metrics: Iterable[str] = (),
    allow_evaluation: bool = False,
) -> ClientApp:
    """A Message-API ``ClientApp`` running the private local round.

    ``gradient_factory(context)`` returns the learner's gradient oracle (it typically reads
    ``context.node_config["partition-id"]`` to pick the learner's data). The learner's
    privacy settings come from ``config_defaults`` < node config (and, in Flower's
    simulation engine only, the run config between them): keys ``mechanism``, ``epsilon``,
    ``delta``, ``clip-norm``, ``horizon`` or ``num-server-rounds``·``local-steps``,
    ``calibration``; in simulation also ``seed``/``noise-seed``. Refused rounds are answered
    with an ``Error`` reply (codes in :data:`ERROR_CODES`) and change nothing. A datum
    whose gradient cannot be computed (the oracle raises on it, or returns a non-finite or
    wrong-size gradient) is no refusal: that step's gradient counts as zero
    (:func:`~flwr_corrnoise.learner.local_round`), so the reply does not depend on it.

    **Each datum once, enforced.** The oracle is addressed by the learner's stream position,
    which moves on by one datum per step and is stored with the noise stream, so no datum
    is used twice: this strict mode is the paper's one-pass stream and needs no
    participation setting. What it cannot know is what the oracle returns for a position;
    an oracle that maps two positions to one example (a fixed dataset read in epochs)
    breaks the guarantee — use :class:`~flwr_corrnoise.flower.PrivateSteps` with a
    :class:`~flwr_corrnoise.data.loader.CyclicLoader` for such data.

    ``evaluate`` is only ever called if the learner opts in (``allow_evaluation=True`` or
    node config ``client-evaluation = true``): its answer depends on the learner's data and
    is **not** covered by the privacy budget. ``release_metrics`` names metrics the app
    accepts to leak (unaccounted); none by default.
    """
    app = ClientApp(mods=[PrivateLearnerGuard(allow_evaluation)])
    defaults = dict(config_defaults or {})

    def round_(msg: Message, context: Context) -> Message:
        learner = CorrNoiseLearner(context, gradient_factory(context),
                                   config_defaults=defaults, release_metrics=release_metrics)
        params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        update, metrics = learner.train(params, dict(msg.content["config"]))
        return learner.reply(msg, update, metrics["num-examples"])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return answer(msg, round_, msg, context)  # every failure: a clear, data-free reply

    app.evaluate()(evaluate or _refuse)
    app.query()(_refuse)
    return app


def numpy_client_app(
    client_fn: Callable[[Context], NumPyClient], *, allow_evaluation: bool = False
) -> ClientApp:
    """Run :class:`CorrNoiseNumPyClient` s behind a Message-API ``ClientApp``.

    Why: Flower 1.41's legacy ``flwr.client.ClientApp`` speaks the old record layout that
    the Message-API strategies do not read, and turns exceptions into error text that may
    hold data; this wrapper keeps the user's NumPyClient untouched, sends its ``fit`` result
    through the release gate, and answers a refused round clearly. The client's
    ``evaluate`` runs only with the learner's opt-in (``allow_evaluation=True`` or node
    config ``client-evaluation = true``), and its answer is unaccounted. A client that is
    not a :class:`CorrNoiseNumPyClient` is refused: it would release its raw update.
    """
    app = ClientApp(mods=[PrivateLearnerGuard(allow_evaluation)])

    def round_(msg: Message, context: Context) -> Message:
        client = client_fn(context)
        if not isinstance(client, CorrNoiseNumPyClient):
            raise PrivacyConfigError(
                f"{type(client).__name__} is not a CorrNoiseNumPyClient: its fit() would "
                f"release an un-noised update")
        params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        update, num_examples, metrics = client.fit(params, dict(msg.content["config"]))
        return client.learner.reply(msg, update, num_examples, user_metrics=metrics)

    def evaluation(msg: Message, context: Context) -> Message:
        client = client_fn(context)
        params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        loss, num, metrics = client.evaluate(params, dict(msg.content["config"]))
        record = metric_record({**metrics, "loss": loss, "num-examples": num})
        return Message(RecordDict({"metrics": record}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return answer(msg, round_, msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        # reached only with the learner's opt-in (the guard refuses otherwise)
        return answer(msg, evaluation, msg, context)

    app.query()(_refuse)
    return app


def _refuse(msg: Message, context: Context) -> Message:
    """Registered for the message types a private learner does not answer, so that the
    server gets a clear refusal (code 4106) instead of Flower's "no function registered"."""
    return refuse_query(msg)
