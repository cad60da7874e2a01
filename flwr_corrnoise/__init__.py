"""flwr-corrnoise: locally differentially private online federated learning with
temporally correlated (matrix-factorization) noise, for Flower.

The core (mechanisms, noise streams, calibration) needs only NumPy and SciPy; the Flower
layer builds on it. See ``docs/`` and ``README.md``.

The names below are imported on first use (PEP 562 ``__getattr__``), not when the package
is: ``import flwr_corrnoise.cli`` (every ``flwr-corrnoise`` command) and any other
``import flwr_corrnoise.<module>`` run this file first, and importing all of them eagerly
put the streams, the learner and the data loader (ChaCha20, SciPy's optimizers) into the
start-up of commands that use none of them. ``from flwr_corrnoise import NoiseStream``
works as before; so does ``flwr_corrnoise.<submodule>`` after a bare
``import flwr_corrnoise``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .data.loader import CyclicLoader
    from .mechanisms import MECHANISMS, build_factorization
    from .mechanisms.participation import Participation
    from .privacy import (
        Calibration,
        PrivacyBudgetError,
        calibrate,
        calibrate_mechanism,
        epsilon_for_std,
        epsilon_spent,
    )
    from .settings import PrivacyConfigError, PrivacySettings
    from .streams import HorizonExhaustedError, NoiseStream

__version__ = "0.1.0"

#: exported name -> the submodule that defines it (imported when the name is first used)
_EXPORTS: dict[str, str] = {
    "CyclicLoader": ".data.loader",
    "PrivacyConfigError": ".settings",
    "PrivacySettings": ".settings",
    "MECHANISMS": ".mechanisms",
    "build_factorization": ".mechanisms",
    "Participation": ".mechanisms.participation",
    "Calibration": ".privacy",
    "PrivacyBudgetError": ".privacy",
    "calibrate": ".privacy",
    "calibrate_mechanism": ".privacy",
    "epsilon_for_std": ".privacy",
    "epsilon_spent": ".privacy",
    "HorizonExhaustedError": ".streams",
    "NoiseStream": ".streams",
}

__all__ = [
    "MECHANISMS",
    "Calibration",
    "CyclicLoader",
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


def __getattr__(name: str) -> Any:
    """An exported name, imported from its submodule on first use and then kept here; a
    submodule (``flwr_corrnoise.mechanisms`` after ``import flwr_corrnoise``), imported
    on first use, as the eager imports this file used to make left it available."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # the next lookup does not come here
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
