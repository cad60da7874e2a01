"""Per-step noise for a Flower app written like Flower's ``quickstart-pytorch``, in a few lines.

Flower's quickstart keeps its training in a ``train(net, trainloader, epochs, lr, device)``
of its own (in ``task.py``): it builds ``torch.optim.SGD(..., momentum=0.9)`` there, loops
over a ``DataLoader(..., shuffle=True)`` for some local epochs, and never sees the Flower
message. Two calls make it private per step, and its loop stays as it is::

    # client_app.py
    app = ClientApp(mods=[PrivateSteps.guard()])
    ...
    trainloader, _ = load_data(partition_id, num_partitions, batch_size)
    trainloader = private_training(msg, context, model, trainloader)

    # task.py, in train()
    optimizer = private_optimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                                  net, criterion)

What :func:`private_training` does: it opens the learner's round for this message (a
:class:`~flwr_corrnoise.flower.PrivateSteps` with a
:class:`~flwr_corrnoise.data.loader.CyclicLoader` of ``len(trainloader.dataset)``
examples, ``trainloader.batch_size``, ``num-server-rounds`` rounds and the local epochs),
and returns a :class:`PrivateTrainLoader`: a ``DataLoader`` over the same dataset whose
batches come in the loader's fixed cyclic order, one epoch per pass — the user's
reshuffling is replaced by the order the ε accounts for (``rounds × epochs`` passes,
fixed-epoch participation). It makes the round findable through a
:class:`contextvars.ContextVar`, so :func:`private_optimizer` in ``task.py`` wraps the
optimizer without ``msg`` or ``context``.

What :func:`private_optimizer` (this form: an optimizer first) does: each
``optimizer.step()`` of the quickstart's own loop (``zero_grad(); loss =
criterion(net(images), labels); loss.backward(); step()``) is a private step on the
learner's correlated-noise stream:

* with the loss module (``criterion``, e.g. ``torch.nn.CrossEntropyLoss()``): **per-example
  clipping**. The optimizer watches the calls ``net(images)`` and ``criterion(out,
  labels)`` of the step and recomputes the batch's per-example gradients from that input
  and those labels (each example's gradient clipped to ``clip-norm``, summed, noised,
  divided by the loader's batch size), so the loop's own ``loss.backward()`` is replaced.
  A step of the user's forward or loss that raises on its data (a malformed image, a
  label out of range) does not end the round: the call returns a zero placeholder,
  the loop goes on, and the per-example recomputation counts exactly the failing examples
  as zero (the noise is still added) — the reply does not change.
* without it: **whole-batch clipping** (the step's gradient clipped as one, always
  sound, ``b``× noisier for a batch of ``b``); a raise in the user's code then ends the
  round with an error reply (wrap the step in ``optimizer.guard()`` to avoid that).

Refused, each with a clear error and nothing released: a step without the loader's batch;
a round whose loop took another number of steps than the loader's (pass ``epochs=``) or
drew batches it took no private step on (an optimizer built without
:func:`private_optimizer`); a second private optimizer in one round, or one for another
model; :func:`private_optimizer` outside a private round — refusing is safer than handing
the optimizer back unchanged: a train function whose round was not opened (a code path
without :func:`private_training`, a thread that does not see the round) would otherwise
train without noise, and only the guard's reply check would stand between that model
and a release.

The reply: the train function returns its reply as before (``Message(content=...,
reply_to=msg)``); the guard rebuilds it through the release gate — the model's arrays
(which must be the model the private optimizer trained) and the privacy metadata; of the
app's metrics only the names the learner allow-listed leave (the quickstart's
``train_loss`` is a function of the data and stays). Or return ``trainloader.reply(arrays,
metrics)`` yourself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar, Token
from functools import partial
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
from torch.utils.data import DataLoader

from ..data.loader import CyclicLoader
from ..data.sampling import CyclicPoissonLoader, Loader
from ..learner import check_horizon
from ..settings import PrivacyConfigError
from ..streams import HorizonExhaustedError
from .steps import PrivateSteps
from .torch_app import EpochBatches, FlowerPrivateOptimizer, _session_optimizer

log = logging.getLogger(__name__)

__all__ = ["PrivateTrainLoader", "RoundOptimizer", "private_training"]

#: the private round open in this train function (set by :func:`private_training`)
_ACTIVE: ContextVar[PrivateTrainLoader | None] = ContextVar(
    "flwr_corrnoise_private_training", default=None)

NO_ROUND = (
    "private_optimizer(optimizer, model) found no private round open: call "
    "trainloader = private_training(msg, context, model, trainloader) in the ClientApp's "
    "train function before the code that builds the optimizer (the round's noise, "
    "horizon and data order come from it); without it the optimizer would train "
    "without noise, so it is refused")


def _epochs_of(context: Context, epochs: int | None) -> int:
    if epochs is None:
        epochs = {**context.run_config, **context.node_config}.get("local-epochs")
        if epochs is None:
            raise PrivacyConfigError(
                "private_training needs the local epochs of the loop: pass epochs=, or "
                "set 'local-epochs' in the run config")
    if isinstance(epochs, bool) or int(epochs) != epochs or int(epochs) < 1:
        raise PrivacyConfigError(f"epochs must be a positive integer, got {epochs!r}")
    return int(epochs)


def _rounds_of(context: Context) -> int:
    rounds = {**context.run_config, **context.node_config}.get("num-server-rounds")
    if rounds is None:
        raise PrivacyConfigError(
            "private_training needs 'num-server-rounds' in the run config: the loader's "
            "horizon is rounds × epochs × steps per epoch")
    return int(rounds)


class _RoundBatches(EpochBatches):
    """The loader's batches, one epoch per pass; a pass after the round's last batch is
    empty, and says so once (the loop runs more passes than the round's epochs)."""

    def __iter__(self) -> Iterator[list[int]]:
        empty = True
        for idx in super().__iter__():
            empty = False
            yield idx
        if empty and not getattr(self, "_warned", False):
            self._warned = True
            log.warning("flwr-corrnoise: a pass over the private trainloader after the "
                        "round's last batch is empty: the round has %d epoch(s); pass "
                        "epochs= to private_training to match your loop", self.epochs)


class _TrainingSteps(PrivateSteps):
    """The round's :class:`PrivateSteps`: closing it also closes the private training
    (the round's ContextVar, the optimizer's watches), and the guard hands it a train
    function's own reply to rebuild through the gate (:meth:`adopt_reply`)."""

    training: PrivateTrainLoader | None = None

    def adopt_reply(self, reply: Message) -> Message:
        assert self.training is not None
        return self.training.adopt(reply)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.training is not None:
                self.training.release()


def _collate_sampled(collate: Callable[[list[Any]], Any], dataset: Any,
                     batch: list[Any]) -> Any:
    """A sampled step may draw nothing: its batch is the collation of one example cut to
    zero rows (the shapes, never the values, of the dataset's first example), so the loop
    runs the step as any other and its noise is still added."""
    if batch:
        return collate(batch)
    one = collate([dataset[0]])
    return _cut(one)


def _cut(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, list | tuple):
        return type(value)(_cut(v) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v) for k, v in value.items()}
    return value


class PrivateTrainLoader(DataLoader):
    """The private round of one train message, as the ``DataLoader`` to train on: the
    dataset of the user's loader, batches in the :class:`CyclicLoader`'s fixed order
    (``len(self)`` batches a pass, each pass the round's next epoch). Built by
    :func:`private_training`; also a context manager (``with private_training(...) as
    trainloader:``: an exception inside rolls the round back at once)."""

    def __init__(self, private: _TrainingSteps, like: DataLoader, model: torch.nn.Module,
                 epochs: int) -> None:
        batches = _RoundBatches(private)
        batches.epochs = epochs  # type: ignore[attr-defined]
        collate = like.collate_fn if not isinstance(private.loader, CyclicPoissonLoader) \
            else partial(_collate_sampled, like.collate_fn, like.dataset)
        super().__init__(like.dataset, batch_sampler=batches, collate_fn=collate,
                         num_workers=like.num_workers, pin_memory=like.pin_memory,
                         worker_init_fn=like.worker_init_fn, timeout=like.timeout)
        #: the round (settings, state, the release gate)
        self.private = private
        #: the loader whose participation the ε accounts for
        self.loader: Loader = private.loader  # type: ignore[assignment]
        self.settings = private.settings
        self.model = model
        self.optimizer: RoundOptimizer | None = None
        #: the steps this round takes: the loader's, fewer at the end of the horizon
        self.round_steps = min(self.loader.local_steps,
                               self.loader.horizon - private.first_step)
        self._token: Token[PrivateTrainLoader | None] | None = None
        self.closed = False

    # -- the round ----------------------------------------------------------------------
    def wrap(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
             criterion: torch.nn.Module | None, **kwargs: Any) -> RoundOptimizer:
        """The round's private optimizer (:func:`private_optimizer`'s new form)."""
        if self.closed:
            raise PrivacyConfigError("this private round is closed")
        if self.optimizer is not None:
            raise PrivacyConfigError("one private optimizer per round: this round's "
                                     "steps already belong to another")
        if model is not self.model:
            raise PrivacyConfigError(
                "private_optimizer wraps another model than the one private_training was "
                "given: the released arrays are that model's, so it must be the one trained")
        if criterion is None and isinstance(self.loader, CyclicPoissonLoader):
            raise PrivacyConfigError(
                "a sampled round needs per-example clipping: pass the loss module "
                "(private_optimizer(optimizer, model, criterion)); a loss averaged over a "
                "drawn batch would divide by its size, which must stay secret")
        if criterion is not None and not isinstance(criterion, torch.nn.Module):
            raise PrivacyConfigError(
                "criterion must be a loss module (e.g. torch.nn.CrossEntropyLoss()): the "
                "optimizer reads its calls for per-example clipping; leave it out for "
                "whole-batch clipping")
        private = self.private
        opt = _session_optimizer(RoundOptimizer, optimizer, model, private.settings,
                                 private.state, private.shapes, private.session.secure,
                                 **kwargs)
        opt.private = private
        private.external = True
        opt.watch(criterion)
        self.optimizer = opt
        return opt

    def check_steps(self) -> None:
        """Refuse a round whose loop did not take exactly the loader's steps, each on a
        batch it drew: its ε would not be the one printed, or a batch was trained on
        without noise. A function of the code that ran, not of the data."""
        taken, drawn = self.private.steps, self.private._issued
        if self.optimizer is None:
            raise PrivacyConfigError(
                f"this round drew {drawn} batch(es) from the private trainloader and took "
                "no private step: build the training loop's optimizer with "
                "private_optimizer(torch.optim.SGD(...), model, criterion), so that every "
                "step is clipped and noised")
        if drawn != taken:
            raise PrivacyConfigError(
                f"this round drew {drawn} batch(es) but took {taken} private step(s): "
                "every batch of the private trainloader must be one optimizer.step()")
        if taken != self.round_steps:
            raise PrivacyConfigError(
                f"the loop took {taken} of the round's {self.round_steps} steps "
                f"({self.loader.local_epochs} epoch(s) of {self.loader.steps_per_epoch}): "
                "pass epochs= to private_training equal to the passes your loop makes")

    def reply(self, arrays: ArrayRecord | Any,
              metrics: Mapping[str, Any] | None = None) -> Message:
        """The train reply through the release gate (:meth:`PrivateSteps.reply`): the
        model's arrays and the privacy metadata; of ``metrics`` only the allow-listed
        names."""
        self.check_steps()
        assert self.optimizer is not None
        return self.optimizer.reply(arrays, metrics)

    def adopt(self, reply: Message) -> Message:
        """Rebuild the train function's own reply through the gate: its ``arrays`` must
        be the trained model's state (else refused), its ``metrics`` are filtered by the
        allow-list, every other record stays on the learner."""
        if reply.has_error():
            raise PrivacyConfigError("the train function returned an error reply")
        records = reply.content.array_records
        record = records.get("arrays") if "arrays" in records else (
            next(iter(records.values())) if len(records) == 1 else None)
        if record is None:
            raise PrivacyConfigError("the train function's reply holds no 'arrays' "
                                     "ArrayRecord to release")
        model = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
        given = {k: np.asarray(a) for k, a in zip(record.keys(),
                                                  record.to_numpy_ndarrays(), strict=True)}
        same = list(given) == list(model) and all(
            np.shape(given[k]) == np.shape(model[k]) and
            np.array_equal(given[k], model[k], equal_nan=True) for k in model)
        if not same:
            raise PrivacyConfigError(
                "the train function's reply holds arrays that are not the state of the "
                "model private_training was given (the one the private optimizer "
                "trained): the learner refuses to release them")
        metrics = reply.content.metric_records.get("metrics")
        return self.reply(record, None if metrics is None else dict(metrics))

    def open(self) -> None:
        self._token = _ACTIVE.set(self)

    def release(self) -> None:
        """Close the round's side: the ContextVar and the optimizer's watches."""
        if self.closed:
            return
        self.closed = True
        if self.optimizer is not None:
            self.optimizer.unwatch()
        token, self._token = self._token, None
        try:
            if token is not None:
                _ACTIVE.reset(token)
        except (ValueError, RuntimeError):  # another context: clear it here
            _ACTIVE.set(None)
        if _ACTIVE.get() is self:
            _ACTIVE.set(None)

    def __enter__(self) -> PrivateTrainLoader:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if kind is not None:
            self.private.close()


def private_training(
    msg: Message,
    context: Context,
    model: torch.nn.Module,
    trainloader: DataLoader,
    epochs: int | None = None,
    *,
    config_defaults: Mapping[str, Any] | None = None,
    release_metrics: Iterable[str] = (),
    order_seed: int = 0,
    sampling_cycle: int | None = None,
) -> PrivateTrainLoader:
    """Open this train message's private round and return the ``DataLoader`` to train on
    (:class:`PrivateTrainLoader`; the module docstring shows the whole adoption).

    ``trainloader``: the app's own loader; its dataset, batch size and collation are
    kept, its sampling (``shuffle=True``) is replaced by the :class:`CyclicLoader`'s fixed
    order. ``epochs``: the passes the loop makes each round (default: ``local-epochs`` of
    the run config); the rounds are ``num-server-rounds``. ``model``: the model the loop
    trains (the received arrays, in order; no buffers). ``config_defaults`` and
    ``release_metrics`` are as for :class:`PrivateSteps`. Needs
    ``ClientApp(mods=[PrivateSteps.guard()])``.

    ``sampling_cycle = b``: cyclic Poisson sampling instead of the fixed order
    (:class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`, ``b`` groups at rate
    ``b/len(trainloader)``, keyed by the learner's noise seed through a sub-key of its
    own; 1 = Poisson sampling, DP-SGD): the noise is calibrated to the amplified
    guarantee, a banded mechanism (``bandmf``) gets ``b`` bands, the batches' sizes vary
    and stay secret, and every step's noised sum is divided by the expected batch size.
    Per-example clipping (a criterion for :func:`private_optimizer`) is needed: a loss
    averaged over a drawn batch would divide by its secret size.
    """
    try:
        size = len(trainloader.dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise PrivacyConfigError("private_training needs a dataset with a length (a "
                                 "map-style dataset)") from err
    if trainloader.batch_size is None:
        raise PrivacyConfigError("private_training needs a DataLoader with a batch_size "
                                 "(not a batch_sampler of its own)")
    loader: Loader
    if sampling_cycle is None:
        loader = CyclicLoader(size, int(trainloader.batch_size), rounds=_rounds_of(context),
                              local_epochs=_epochs_of(context, epochs), order_seed=order_seed)
    else:
        loader = CyclicPoissonLoader(size, int(trainloader.batch_size),
                                     rounds=_rounds_of(context), key=None,
                                     local_epochs=_epochs_of(context, epochs),
                                     bands=int(sampling_cycle), order_seed=order_seed)
    private = _TrainingSteps(msg, context, config_defaults=config_defaults,
                             release_metrics=release_metrics, loader=loader)
    try:
        check_horizon(private.settings, private.first_step)  # nothing left: refused now
        out = PrivateTrainLoader(private, trainloader, model, loader.local_epochs)
        private.training = out
        out.open()
    except BaseException:
        private.close()
        raise
    return out


def round_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                    criterion: torch.nn.Module | None = None, **kwargs: Any
                    ) -> RoundOptimizer:
    """:func:`~flwr_corrnoise.flower.private_optimizer` with an optimizer first: the
    private optimizer of the round :func:`private_training` opened (refused outside
    one)."""
    training = _ACTIVE.get()
    if training is None or training.closed:
        raise PrivacyConfigError(NO_ROUND)
    return training.wrap(optimizer, model, criterion, **kwargs)


class RoundOptimizer(FlowerPrivateOptimizer):
    """The private optimizer of a :func:`private_training` round (see the module
    docstring): whole-batch clipping, or per-example clipping recomputed from the step's
    ``model(x)`` and ``criterion(out, y)`` calls when the criterion is given."""

    criterion: torch.nn.Module | None = None
    _warned_unseen = False

    def watch(self, criterion: torch.nn.Module | None) -> None:
        """Watch the model's and the criterion's calls (instance-level ``forward``
        wrappers, removed when the round closes)."""
        self.criterion = criterion
        self._seen: dict[str, Any] = {}
        self._recomputing = False
        self._patched: list[tuple[torch.nn.Module, bool, Any]] = []
        if criterion is None:
            return
        self.loss_fn = criterion.forward  # the per-example loss: the criterion itself
        self._patch(self.model, self._watched_forward)
        self._patch(criterion, self._watched_loss)

    def _patch(self, module: torch.nn.Module,
               make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        had = "forward" in module.__dict__
        self._patched.append((module, had, module.__dict__.get("forward")))
        module.forward = make(module.forward)  # type: ignore[method-assign]

    def unwatch(self) -> None:
        for module, had, saved in reversed(getattr(self, "_patched", [])):
            if had:
                module.forward = saved  # type: ignore[method-assign]
            else:
                module.__dict__.pop("forward", None)
        self._patched = []

    def _zero(self) -> torch.Tensor:
        """The placeholder a failing call returns: a zero leaf, so ``loss.backward()``
        and ``loss.item()`` in the user's loop still run (its gradient is recomputed)."""
        return torch.zeros((), device=self.device, requires_grad=True)

    def _watched_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._recomputing:
                return original(*args, **kwargs)
            x = args[0] if args else next(iter(kwargs.values()), None)
            self._seen = {"x": x}
            try:
                out = original(*args, **kwargs)
            except (PrivacyConfigError, HorizonExhaustedError):
                raise
            except Exception as err:  # the user's model raised on this step's data
                log.debug("the model raised on a step's input (recomputed per example): "
                          "%r", err)
                out = self._zero()
            self._seen["out"] = out
            return out
        return forward

    def _watched_loss(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def loss(*args: Any, **kwargs: Any) -> Any:
            if self._recomputing:
                return original(*args, **kwargs)
            self._seen["input"] = args[0] if args else kwargs.get("input")
            self._seen["target"] = args[1] if len(args) > 1 else kwargs.get("target")
            try:
                return original(*args, **kwargs)
            except (PrivacyConfigError, HorizonExhaustedError):
                raise
            except Exception as err:  # e.g. a label out of range
                log.debug("the loss raised on a step's data (recomputed per example): "
                          "%r", err)
                return self._zero()
        return loss

    def step(self) -> None:
        """One private step on the loader's batch: per-example (the step's watched
        input and labels, recomputed) or whole-batch clipping, the next correlated
        increment, the wrapped optimizer's step."""
        self.private.check_batch_drawn()
        if self.criterion is not None:
            seen, self._seen = self._seen, {}
            x, y = seen.get("x"), seen.get("target")
            if "out" in seen and seen.get("input") is seen["out"] and x is not None \
                    and y is not None:
                self._recomputing = True
                try:
                    with torch.enable_grad():
                        self.backward(x, y)
                finally:
                    self._recomputing = False
            else:  # a function of the loop's code: the step has no (input, labels) pair
                if not self._warned_unseen:
                    self._warned_unseen = True
                    log.warning(
                        "flwr-corrnoise: optimizer.step() without a criterion(model(x), y) "
                        "call since the last step: a zero-gradient step. Per-example "
                        "clipping reads the step's model input and labels from those calls")
                loader = self.private.loader
                assert loader is not None
                # the divisor is the loader's batch size for this step: not a data count
                self.zero_gradient(per_example=True,
                                   batch_size=len(loader.indices(self.state.step)))
        super().step()
