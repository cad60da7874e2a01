"""The host reference round for a torch model: the NumPy algorithm, the module as its oracle.

:class:`ModuleGradient` turns a ``torch.nn.Module`` into the gradient oracle of
:func:`flwr_corrnoise.learner.local_round`, the one NumPy implementation every engine uses:
it clips the step's gradient as a whole, adds the NumPy stream's increment and steps in
float64 (``d`` floats each way between host and device per step). Why keep it next to the
device path (:mod:`flwr_corrnoise.torch.optimizer`): it is the reference the device path is
tested against — at batch 1 both give the same update to float tolerance when fed the same
noise (``tests/torch/test_torch_private.py``) — and the path secure noise (NumPy-only) and a
learner whose stored stream is a NumPy stream must take.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..learner import NonFiniteError, RoundResult, local_round
from ..learner_state import LearnerState
from ..settings import PrivacySettings
from .params import BatchStream, LossFn, check_parameters, get_parameters, set_parameters

__all__ = ["ModuleGradient", "torch_local_round"]


class ModuleGradient:
    """A gradient oracle (:data:`flwr_corrnoise.learner.GradientFn`) backed by a module.

    ``gradient(params, position)`` sets the module's parameters to ``params``, evaluates
    ``loss_fn(model(x), y)`` on ``batches(position)`` (moved to the model's device) and
    returns the gradient of every parameter as float64 arrays. A non-finite loss raises
    :class:`~flwr_corrnoise.learner.NonFiniteError`: ``local_round`` then counts that step's
    gradient as zero (the reply must not depend on whether a datum's loss is finite) and
    the model the learner holds is not poisoned; so does any other exception on a datum
    (the loader, the model or the loss raising on a wrong-shape input or a label out of
    range: :func:`~flwr_corrnoise.learner.attempt_datum`). Parameters that are not the
    model's (a data-independent mismatch) are refused with
    :class:`~flwr_corrnoise.settings.PrivacyConfigError` instead. The last finite loss is
    kept in ``last_loss`` for the learner's own diagnostics; it is never sent.
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
        check_parameters(self.params, [np.shape(a) for a in params])
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
