"""The PyTorch learners' Flower front ends: the torch step inside a learner transaction.

:mod:`flwr_corrnoise.torch` holds the private step (the device optimizer and round, the
host reference) without Flower; this module only puts it behind Flower's interfaces, the
way every Flower front end does — one :class:`~flwr_corrnoise.flower.session.LearnerSession`
owns the settings, the proposal check, the lock, the stored state and the reply:

* :func:`make_torch_client_app` — a Message-API ``ClientApp`` running the round for you
  (``engine="device"``: :func:`~flwr_corrnoise.torch.device_local_round`; ``"host"``: the
  NumPy reference round through :class:`~flwr_corrnoise.torch.ModuleGradient`);
* :func:`private_optimizer` — the device optimizer in your own loop inside your own
  ``ClientApp`` (on :class:`~flwr_corrnoise.flower.PrivateSteps`);
* :class:`TorchCorrNoiseClient` — a legacy ``NumPyClient`` on the host reference round.

Needs the ``torch`` extra; :mod:`flwr_corrnoise.flower` imports this module only when one
of these names is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from ..data.loader import CyclicLoader
from ..learner_state import LearnerState
from ..settings import PrivacySettings
from ..torch.host import ModuleGradient
from ..torch.optimizer import PrivateOptimizer, device_local_round, refuse_secure_noise
from ..torch.params import BatchStream, LossFn, check_parameters, set_parameters
from .client import CorrNoiseNumPyClient, _refuse, make_client_app
from .session import LearnerSession, PrivateLearnerGuard, answer, round_config
from .steps import PrivateSteps

__all__ = [
    "FlowerPrivateOptimizer",
    "TorchCorrNoiseClient",
    "make_torch_client_app",
    "private_optimizer",
]


class TorchCorrNoiseClient(CorrNoiseNumPyClient):
    """A ``NumPyClient`` for a PyTorch model: ``fit`` is the private local round.

    ``batches(position)`` is the learner's data stream; ``evaluate`` (optional) is yours.
    """

    def __init__(
        self,
        context: Context,
        model: torch.nn.Module,
        loss_fn: LossFn,
        batches: BatchStream,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        evaluate_fn: Callable[[torch.nn.Module], tuple[float, int, dict[str, Any]]] | None = None,
    ) -> None:
        self.model = model
        self._gradient = ModuleGradient(model, loss_fn, batches)
        self._evaluate_fn = evaluate_fn
        super().__init__(context, settings, seed)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        return self._gradient(parameters, position)

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        if self._evaluate_fn is None:
            raise NotImplementedError("pass evaluate_fn to evaluate on the learner")
        set_parameters(self.model, parameters)
        return self._evaluate_fn(self.model)


def make_torch_client_app(
    model_fn: Callable[[Context], torch.nn.Module],
    batches_fn: Callable[[Context], BatchStream],
    loss_fn: LossFn = torch.nn.functional.cross_entropy,
    config_defaults: Mapping[str, Any] | None = None,
    *,
    release_metrics: Iterable[str] = (),
    engine: str = "device",
) -> ClientApp:
    """A Message-API ``ClientApp`` whose learners train ``model_fn(context)`` privately on
    ``batches_fn(context)`` (settings, state and replies as for
    :func:`flwr_corrnoise.flower.make_client_app`; ``batches(position)`` is the learner's
    stream, each position used at one step only).

    ``engine="device"`` (the default): each round is
    :func:`~flwr_corrnoise.torch.device_local_round` on the model's device — per-example
    clipping, the learner's :class:`~flwr_corrnoise.torch.TorchNoiseStream` (stored in the
    learner's state), the parameters cross to the host once per round. ``engine="host"``:
    the NumPy reference round (:func:`flwr_corrnoise.learner.local_round` through
    :class:`~flwr_corrnoise.torch.ModuleGradient`; float64, the batch clipped as a whole,
    ``d`` floats each way per step) — what a learner whose state holds a NumPy stream, or
    a secure-noise learner, must use.
    """
    if engine == "host":
        def gradient_factory(context: Context) -> ModuleGradient:
            return ModuleGradient(model_fn(context), loss_fn, batches_fn(context))

        return make_client_app(gradient_factory, config_defaults=config_defaults,
                               release_metrics=release_metrics)
    if engine != "device":
        raise ValueError(f"engine must be 'device' or 'host', not {engine!r}")

    app = ClientApp(mods=[PrivateLearnerGuard(False)])
    defaults = dict(config_defaults or {})

    def device_round(msg: Message, context: Context) -> Message:
        session = LearnerSession(context, kind="step", defaults=defaults,
                                 release_metrics=release_metrics, stream_positions=True)
        config = dict(msg.content["config"])  # type: ignore[arg-type]
        tau, eta = round_config(config)
        params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        shapes = [tuple(np.shape(a)) for a in params]
        model = model_fn(context)
        with session.transaction(config, shapes, steps=tau) as tx:
            private = _session_optimizer(
                PrivateOptimizer, torch.optim.SGD(model.parameters(), lr=eta), model,
                session.settings, tx.state, shapes, session.secure, loss_fn=loss_fn)
            set_parameters(model, params)
            out = device_local_round(private, batches_fn(context), tau, tx.state.position)
            tx.diagnostics = out.diagnostics
        return tx.reply(msg, out.update, num_examples=float(tau))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return answer(msg, device_round, msg, context)  # every failure: a data-free reply

    app.evaluate()(_refuse)
    app.query()(_refuse)
    return app


def _session_optimizer(
    cls: type[PrivateOptimizer], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
    settings: PrivacySettings, state: LearnerState, shapes: Sequence[tuple[int, ...]],
    secure: bool, **kwargs: Any,
) -> PrivateOptimizer:
    """The device optimizer on a Flower learner's state (the torch ``ClientApp`` and
    :func:`private_optimizer`): the model must be the server's arrays, the stream is
    moved to the model's device (:func:`~flwr_corrnoise.torch.optimizer.device_stream`),
    and the optimizer advances the learner's state in place, inside the session's
    transaction."""
    if secure:
        refuse_secure_noise()
    check_parameters(model.parameters(), shapes)
    return cls(optimizer, model, settings, state=state, **kwargs)


class EpochBatches:
    """A torch ``batch_sampler`` over a round's batches, one epoch per iteration: each
    ``iter()`` (a ``DataLoader`` calls it once per pass) hands out the next
    ``steps_per_epoch`` batches of :meth:`PrivateSteps.batches`, so the loader's record of
    what was handed out stays step-exact; a pass after the round's last is empty."""

    def __init__(self, private: PrivateSteps) -> None:
        assert private.loader is not None
        self.per_epoch = private.loader.steps_per_epoch
        self._batches = private.batches()

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.per_epoch):
            idx = next(self._batches, None)
            if idx is None:
                return
            yield [int(i) for i in idx]

    def __len__(self) -> int:
        return self.per_epoch


class FlowerPrivateOptimizer(PrivateOptimizer):
    """:class:`~flwr_corrnoise.torch.PrivateOptimizer` inside a Flower ``ClientApp``, built
    by :func:`private_optimizer`: its noise stream and counters are the learner's state that
    :class:`~flwr_corrnoise.flower.PrivateSteps` loads, locks and stores, and :meth:`reply`
    is the release gate's reply."""

    private: PrivateSteps

    def step(self) -> None:
        """The device step, refused unless the learner's loader handed out this step's
        batch (:meth:`batch_sampler`), when the app gave one."""
        self.private.check_batch_drawn()
        super().step()

    def batch_sampler(self) -> EpochBatches:
        """This round's batches of example indices in the loader's fixed cyclic order, for
        ``torch.utils.data.DataLoader(dataset, batch_sampler=opt.batch_sampler())``: each
        pass over the ``DataLoader`` is the next epoch of the round, so a quickstart-style
        ``for epoch in range(E): for x, y in trainloader:`` loop runs unchanged."""
        return EpochBatches(self.private)

    def reply(self, arrays: Any, metrics: Mapping[str, Any] | None = None) -> Message:
        """The train reply (see :meth:`PrivateSteps.reply`): ``arrays`` is the local model
        (e.g. ``ArrayRecord(model.state_dict())``) after the private steps. The steps taken
        are recorded in the learner's state before it is stored."""
        private = self.private
        diag = self.diagnostics()  # data-dependent: the learner's diagnostics file only
        counts = private.counts  # the steps are already in the shared learner state
        counts.clipped += int(diag["clipped-examples"])
        counts.nonfinite += int(diag["nonfinite-examples"])
        counts.failed += int(diag["failed-examples"])
        return private.reply(arrays, metrics)


def private_optimizer(first: Any, *args: Any, **kwargs: Any) -> FlowerPrivateOptimizer:
    """Per-step correlated noise in the user's own PyTorch loop, in two forms:

    * ``private_optimizer(optimizer, model, criterion=None)`` — the optimizer first: the
      private optimizer of the round that
      :func:`~flwr_corrnoise.flower.training.private_training` opened in this train
      message (found through a ``ContextVar``, so code that never sees ``msg`` — the
      ``train()`` of Flower's quickstart ``task.py`` — can build it); refused outside
      one. With the loss module ``criterion`` its steps clip per example, without it
      the whole batch (:mod:`flwr_corrnoise.flower.training`).
    * ``private_optimizer(msg, context, optimizer, model, *, loader=None, ...)`` — the
      round opened here (:func:`private_optimizer_for`).
    """
    if isinstance(first, torch.optim.Optimizer):
        from .training import round_optimizer

        return round_optimizer(first, *args, **kwargs)
    return private_optimizer_for(first, *args, **kwargs)


def private_optimizer_for(
    msg: Message,
    context: Context,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    *,
    config_defaults: Mapping[str, Any] | None = None,
    release_metrics: Iterable[str] = (),
    loader: CyclicLoader | None = None,
    **kwargs: Any,
) -> FlowerPrivateOptimizer:
    """Per-step correlated noise in the user's own PyTorch loop inside a Flower
    ``ClientApp`` (the app needs ``ClientApp(mods=[PrivateSteps.guard()])``)::

        opt = private_optimizer(msg, context, torch.optim.SGD(model.parameters(), lr=lr), model)
        for x, y in my_stream(context, steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # or opt.backward(x, y): per-example clipping
            opt.step()                        # clip + next correlated increment + SGD step
        return opt.reply(ArrayRecord(model.state_dict()), metrics)

    Why on top of :class:`~flwr_corrnoise.flower.PrivateSteps`: one learner session owns
    the settings, the proposal check, the lock, the stored state and the reply, whichever
    loop runs; the optimizer only supplies the device step. The learner's stream is a
    :class:`~flwr_corrnoise.torch.TorchNoiseStream` on the model's device, stored in the
    learner's state like any stream. A fresh learner's stream is made from the learner's
    seed on the model's device; a stored host (NumPy) stream that has released noise
    cannot be moved to the device (its generator differs), so that is refused, as is
    secure noise (ChaCha20 is NumPy-only: use :meth:`PrivateSteps.step`). The model's
    parameters must be the received arrays (same order and shapes: no buffers).
    ``kwargs`` go to :class:`~flwr_corrnoise.torch.PrivateOptimizer` (``loss_fn``,
    ``noise_dtype``, ``per_example``).

    With ``loader=CyclicLoader(len(trainset), batch_size, rounds=R, local_epochs=E)`` the
    horizon, the local steps and the fixed-epoch participation come from the loop
    (:mod:`flwr_corrnoise.data.loader`): iterate
    ``DataLoader(trainset, batch_sampler=opt.batch_sampler())``; a step without a batch
    from it is refused.
    """
    private = PrivateSteps(msg, context, config_defaults=config_defaults,
                           release_metrics=release_metrics, loader=loader)
    try:
        opt = _session_optimizer(FlowerPrivateOptimizer, optimizer, model, private.settings,
                                 private.state, private.shapes, private.session.secure,
                                 **kwargs)
        opt.private = private
        private.external = True  # its own step() would mix host and device noise
    except BaseException:
        private.close()
        raise
    return opt
