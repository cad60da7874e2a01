"""Deprecated: the PyTorch learners moved; this module re-exports them for one release.

* :mod:`flwr_corrnoise.torch` (imports no Flower): ``PrivateOptimizer``,
  ``device_local_round``, ``DeviceRound``, ``ModuleGradient``, ``torch_local_round``,
  ``get_parameters``, ``set_parameters``, ``BatchStream``, ``LossFn``;
* :mod:`flwr_corrnoise.flower` (defined in :mod:`flwr_corrnoise.flower.torch_app`):
  ``make_torch_client_app``, ``private_optimizer``, ``TorchCorrNoiseClient``,
  ``FlowerPrivateOptimizer``.

Why: this module imported Flower at the top, so the torch step could not be used without
it; the torch code is now :mod:`flwr_corrnoise.torch` and the Flower glue lives with the
other Flower front ends. Importing this module warns (``DeprecationWarning``).
"""

import warnings

from .flower.torch_app import (
    FlowerPrivateOptimizer,
    TorchCorrNoiseClient,
    make_torch_client_app,
    private_optimizer,
)
from .torch.host import ModuleGradient, torch_local_round
from .torch.optimizer import (
    PRIVATE_STATE_FORMAT,
    DeviceRound,
    PrivateOptimizer,
    device_local_round,
    device_stream,
)
from .torch.params import BatchStream, LossFn, get_parameters, set_parameters

__all__ = [
    "PRIVATE_STATE_FORMAT",
    "BatchStream",
    "DeviceRound",
    "FlowerPrivateOptimizer",
    "LossFn",
    "ModuleGradient",
    "PrivateOptimizer",
    "TorchCorrNoiseClient",
    "device_local_round",
    "device_stream",
    "get_parameters",
    "make_torch_client_app",
    "private_optimizer",
    "set_parameters",
    "torch_local_round",
]

warnings.warn("flwr_corrnoise.pytorch is deprecated: import the torch learners from "
              "flwr_corrnoise.torch and the Flower apps (make_torch_client_app, "
              "private_optimizer, TorchCorrNoiseClient) from flwr_corrnoise.flower",
              DeprecationWarning, stacklevel=2)
