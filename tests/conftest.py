"""Shared test set-up: a private cache directory so tests never depend on (or pollute)
the user's cache of optimized factorizations."""

from __future__ import annotations

import os
import tempfile

# Set before flwr_corrnoise is imported anywhere in the test session.
os.environ.setdefault("FLWR_CORRNOISE_CACHE", tempfile.mkdtemp(prefix="flwr-corrnoise-cache-"))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
