"""PyTorch learners: paper 000's private local round for any ``torch.nn.Module``.

Needs the ``torch`` extra (``pip install -e ".[torch]"``); nothing else in the package
imports this module, so the core stays NumPy/SciPy/Flower only.

Design — why the round itself is not rewritten in torch: the clip, the correlated-noise
increment and the SGD step are :func:`flwr_corrnoise.learner.local_round`, the one
implementation every engine uses, and the noise comes from the one
:class:`~flwr_corrnoise.streams.NoiseStream` whose calibration, covariance and
bit-for-bit restore are tested. The module only supplies the gradient:
:class:`ModuleGradient` loads the current local iterate into the model (on the model's
device), computes the loss on the next batch of the learner's stream, checks it is
finite, back-propagates and returns the gradient of **all** parameters. ``local_round``
then clips that gradient to ``B_g`` over all parameter tensors together (the sensitivity
the calibration assumes), adds one increment of the learner's single noise stream over
the whole parameter list, and takes the step — in float64, so a torch learner and a NumPy
learner with the same seed give the same update to float tolerance. Per step this moves
``d`` floats each way between the host and the model's device (``d`` ≈ 3·10⁵ for the
paper's CNN, under a millisecond); the learner's state is the stream's state (small for
the tree and BLT mechanisms) and is what ``context.state`` and the state directory keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from .flower.client import CorrNoiseNumPyClient, make_client_app
from .learner import LearnerState, NonFiniteError, PrivacySettings, RoundResult, local_round

#: a learner's data stream: position → (inputs, targets) of the batch used at that step
BatchStream = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def get_parameters(model: torch.nn.Module) -> list[np.ndarray]:
    """The model's parameters as float64 NumPy arrays, in ``model.parameters()`` order."""
    return [p.detach().cpu().numpy().astype(np.float64) for p in model.parameters()]


def set_parameters(model: torch.nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Load ``arrays`` into the model's parameters (cast to their dtype and device)."""
    params = list(model.parameters())
    if len(params) != len(arrays):
        raise ValueError(f"the model has {len(params)} parameter tensors, got {len(arrays)}")
    with torch.no_grad():
        for p, a in zip(params, arrays, strict=True):
            if tuple(p.shape) != tuple(np.shape(a)):
                raise ValueError(f"parameter of shape {tuple(p.shape)} got {np.shape(a)}")
            p.copy_(torch.as_tensor(np.asarray(a), dtype=p.dtype, device=p.device))


class ModuleGradient:
    """A gradient oracle (:data:`flwr_corrnoise.learner.GradientFn`) backed by a module.

    ``gradient(params, position)`` sets the module's parameters to ``params``, evaluates
    ``loss_fn(model(x), y)`` on ``batches(position)`` (moved to the model's device) and
    returns the gradient of every parameter as float64 arrays. A non-finite loss raises
    :class:`~flwr_corrnoise.learner.NonFiniteError`: ``local_round`` then counts that step's
    gradient as zero (the reply must not depend on whether a datum's loss is finite) and
    the model the learner holds is not poisoned. The last finite loss is kept in
    ``last_loss`` for the learner's own diagnostics; it is never sent.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, batches: BatchStream) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.batches = batches
        self.params = list(model.parameters())
        if not self.params:
            raise ValueError("the model has no parameters")
        self.device = self.params[0].device
        self.last_loss = math.nan

    def __call__(self, params: list[np.ndarray], position: int) -> list[np.ndarray]:
        set_parameters(self.model, params)
        x, y = self.batches(position)
        x, y = x.to(self.device), y.to(self.device)
        self.model.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"non-finite loss {value} at stream position {position}; "
                                 f"step not applied")
        loss.backward()
        self.last_loss = value
        grads = []
        for p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.detach().cpu().numpy().astype(np.float64))
        return grads


def torch_local_round(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: BatchStream,
    state: LearnerState,
    settings: PrivacySettings,
    tau: int,
    eta: float,
) -> RoundResult:
    """One private local round on ``model`` from its current parameters.

    Returns the round's result (the update ``ĝ`` to send, the advanced state); the model
    is left at the last local iterate ``z`` on success and untouched on failure.
    """
    start = get_parameters(model)
    grad = ModuleGradient(model, loss_fn, batches)
    try:
        result = local_round(start, grad, state, settings, tau, eta)
    except BaseException:
        set_parameters(model, start)
        raise
    z = [p - eta * tau * u for p, u in zip(start, result.update, strict=True)]
    set_parameters(model, z)
    if math.isfinite(grad.last_loss):  # data-dependent: local diagnostics only
        result.diagnostics["train-loss"] = grad.last_loss
    return result


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
) -> ClientApp:
    """A Message-API ``ClientApp`` whose learners train ``model_fn(context)`` privately on
    ``batches_fn(context)`` (see :func:`flwr_corrnoise.flower.make_client_app`)."""

    def gradient_factory(context: Context) -> ModuleGradient:
        return ModuleGradient(model_fn(context), loss_fn, batches_fn(context))

    return make_client_app(gradient_factory, config_defaults=config_defaults,
                           release_metrics=release_metrics)
