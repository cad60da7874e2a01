"""Shared test set-up: a private cache directory so tests never depend on (or pollute)
the user's cache of optimized factorizations; it is removed when the session ends."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Set before flwr_corrnoise is imported anywhere in the test session.
if "FLWR_CORRNOISE_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="flwr-corrnoise-cache-")
    os.environ["FLWR_CORRNOISE_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run direct ClientApp calls under the *simulation* rules (reproducible seeds, the run
    config as the learner's own), as Flower's simulation engine does; without it a direct
    call is treated as a real SuperNode (strict rules)."""
    from flwr_corrnoise.flower import session

    monkeypatch.setattr(session, "in_simulation", lambda: True)
