"""Deprecated: the in-process device engine moved to :mod:`flwr_corrnoise.torch.engine`.

``run_inprocess_device`` and ``DeviceRunResult`` are re-exported here for one release;
import them from :mod:`flwr_corrnoise.torch`. Importing this module warns
(``DeprecationWarning``).
"""

import warnings

from .torch.engine import DeviceRunResult, run_inprocess_device

__all__ = ["DeviceRunResult", "run_inprocess_device"]

warnings.warn("flwr_corrnoise.torch_engine is deprecated: import run_inprocess_device from "
              "flwr_corrnoise.torch", DeprecationWarning, stacklevel=2)
