"""Synthetic online data streams (pure numpy; no Flower or torch import).

See :mod:`flwr_corrnoise.data.synthetic` and ``docs/data.md``.
"""

from flwr_corrnoise.data.synthetic import BLOCK_SIZE, SyntheticConfig, SyntheticFederation

__all__ = ["BLOCK_SIZE", "SyntheticConfig", "SyntheticFederation"]
