"""Deprecated: the device noise stream moved to :mod:`flwr_corrnoise.torch.streams`.

``TorchNoiseStream`` and ``TorchOps`` are re-exported here for one release; import them
from :mod:`flwr_corrnoise.torch` (or :mod:`flwr_corrnoise.torch.streams`). Importing this
module still registers the ``"torch"`` stream backend (the new module does, on import) and
warns (``DeprecationWarning``).
"""

import warnings

from .torch.streams import TorchNoiseStream, TorchOps

__all__ = ["TorchNoiseStream", "TorchOps"]

warnings.warn("flwr_corrnoise.torch_streams is deprecated: import TorchNoiseStream from "
              "flwr_corrnoise.torch", DeprecationWarning, stacklevel=2)
