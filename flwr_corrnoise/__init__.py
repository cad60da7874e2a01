"""flwr-corrnoise: locally differentially private online federated learning with
temporally correlated (matrix-factorization) noise, for Flower.

The core (mechanisms, noise streams, calibration) needs only NumPy and SciPy; the Flower
layer builds on it. See ``docs/`` and ``README.md``.
"""

from .data.loader import CyclicLoader
from .learner import PrivacyConfigError, PrivacySettings
from .mechanisms import MECHANISMS, Factorization, build_factorization
from .mechanisms.participation import Participation
from .privacy import (
    Calibration,
    PrivacyBudgetError,
    calibrate,
    calibrate_mechanism,
    epsilon_for_std,
    epsilon_spent,
)
from .streams import HorizonExhaustedError, NoiseStream

__version__ = "0.1.0"

__all__ = [
    "MECHANISMS",
    "Calibration",
    "CyclicLoader",
    "Factorization",
    "HorizonExhaustedError",
    "NoiseStream",
    "Participation",
    "PrivacyBudgetError",
    "PrivacyConfigError",
    "PrivacySettings",
    "__version__",
    "build_factorization",
    "calibrate",
    "calibrate_mechanism",
    "epsilon_for_std",
    "epsilon_spent",
]
