"""A module's parameters as the NumPy arrays the core and the server exchange.

The core (:mod:`flwr_corrnoise.learner`, the engines, Flower's ``ArrayRecord``) speaks
float64 NumPy arrays in one order; a torch model holds tensors of its own dtype on its own
device. These functions are the one crossing between the two, in ``model.parameters()``
order (parameters only: buffers are not trained, so they are neither sent nor noised).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from ..settings import PrivacyConfigError

__all__ = ["BatchStream", "LossFn", "check_parameters", "get_parameters", "host_memory",
           "set_parameters"]

#: a learner's data stream: position → (inputs, targets) of the batch used at that step
BatchStream = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
#: ``loss_fn(outputs, targets)``, a scalar tensor
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def host_memory(*tensors: torch.Tensor) -> bool:
    """Whether NumPy can work on the tensors' memory in place (``tensor.numpy()`` a view,
    no copy): CPU tensors of the host's float dtypes, no autograd, no conjugate or
    negative views. Where the torch side hands its CPU tensors to the host's compiled
    loops (BLT's recurrence, the clip's norms) instead of running torch's own."""
    return all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
               and not t.requires_grad and not t.is_conj() and not t.is_neg()
               for t in tensors)


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


def check_parameters(params: Iterable[torch.Tensor], shapes: Sequence[Sequence[int]]) -> None:
    """Refuse a model whose parameters are not the arrays the server sent (a
    data-independent mismatch, so an error reply, not a zero step)."""
    if [tuple(p.shape) for p in params] != [tuple(s) for s in shapes]:
        raise PrivacyConfigError(
            "the model's parameters are not the arrays the server sent (order and "
            "shapes must match; send model parameters only, no buffers)")
