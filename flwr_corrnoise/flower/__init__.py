"""The thin Flower layer: a Strategy and learner classes that call the shared core.

Nothing here re-implements the algorithm: the local round is
:func:`flwr_corrnoise.learner.local_round` and the server step
:func:`flwr_corrnoise.learner.aggregate`.
"""

from .central_dp import CorrNoiseCentralDP
from .client import (
    STATE_KEY,
    CorrNoiseLearner,
    CorrNoiseNumPyClient,
    make_client_app,
    numpy_client_app,
)
from .local_dp import CorrNoiseLocalDP
from .monitor import RunFailedError, privacy_metrics_aggr
from .round_mod import CorrNoiseRoundMod
from .steps import PrivateSteps, PrivateStepsGuard
from .strategy import CorrNoiseFedAvg

__all__ = [
    "STATE_KEY",
    "CorrNoiseCentralDP",
    "CorrNoiseFedAvg",
    "CorrNoiseLearner",
    "CorrNoiseLocalDP",
    "CorrNoiseNumPyClient",
    "CorrNoiseRoundMod",
    "PrivateSteps",
    "PrivateStepsGuard",
    "RunFailedError",
    "make_client_app",
    "numpy_client_app",
    "privacy_metrics_aggr",
]
