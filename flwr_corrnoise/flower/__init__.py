"""The thin Flower layer: a Strategy and learner classes that call the shared core.

Nothing here re-implements the algorithm: the local round is
:func:`flwr_corrnoise.learner.local_round` and the server step
:func:`flwr_corrnoise.aggregation.aggregate`.

Every front end is exported here, with the settings they all take
(:class:`~flwr_corrnoise.settings.PrivacySettings`). The PyTorch ones
(:mod:`~flwr_corrnoise.flower.torch_app`: ``make_torch_client_app``, ``private_optimizer``,
``TorchCorrNoiseClient``, ``FlowerPrivateOptimizer``; and :mod:`~flwr_corrnoise.flower.training`'s
``private_training``, ``PrivateTrainLoader``) are imported when first asked for,
so that this package still imports without the ``torch`` extra.

The server-side Strategy wrappers are ``CorrNoiseLocalDPStrategy`` (learners noise their own
replies) and ``CorrNoiseCentralDPStrategy`` (the server noises the average), as Flower's
``DifferentialPrivacyClientSideFixedClipping`` / ``…ServerSideFixedClipping`` are.
"""

from importlib import import_module
from importlib.util import find_spec
from typing import Any

from .central_dp import CorrNoiseCentralDPStrategy
from .client import (
    CorrNoiseLearner,
    CorrNoiseNumPyClient,
    make_client_app,
    numpy_client_app,
)
from .local_dp import CorrNoiseLocalDPStrategy
from .monitor import RunFailedError, privacy_metrics_aggr
from .round_mod import CorrNoiseRoundMod
from .steps import PrivateSteps
from .strategy import CorrNoiseFedAvg

#: the PyTorch front ends, loaded from :mod:`.torch_app` on first use (they need torch)
_TORCH_NAMES = ("FlowerPrivateOptimizer", "PrivateTrainLoader", "TorchCorrNoiseClient",
                "make_torch_client_app", "private_optimizer", "private_training")
#: of those, the ones :mod:`.training` defines (a Flower quickstart's two-call adoption)
_TRAINING_NAMES = ("PrivateTrainLoader", "private_training")

__all__ = [
    "CorrNoiseCentralDPStrategy",
    "CorrNoiseFedAvg",
    "CorrNoiseLearner",
    "CorrNoiseLocalDPStrategy",
    "CorrNoiseNumPyClient",
    "CorrNoiseRoundMod",
    "PrivateSteps",
    "RunFailedError",
    "make_client_app",
    "numpy_client_app",
    "privacy_metrics_aggr",
    # a star import must not fail where torch is not installed
    *(_TORCH_NAMES if find_spec("torch") is not None else ()),
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        module = ".training" if name in _TRAINING_NAMES else ".torch_app"
        return getattr(import_module(module, __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
