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


#: test modules whose slow tests start Ray (Flower's simulation engine, ``flwr run`` on a
#: local simulation federation, a ``ray start`` cluster). Under pytest-xdist they share one
#: worker (``--dist loadgroup``): a ``ray.init()`` on another worker could otherwise join
#: the cluster ``tests/test_ray_cluster.py`` starts, and two Ray instances on 2 cores only
#: slow each other down.
RAY_MODULES = frozenset({
    "test_adoption", "test_central_dp", "test_cli", "test_cnn", "test_dec_relay",
    "test_experiment", "test_flower_simulation", "test_flwr_run", "test_ray_cluster",
    "test_release_gate", "test_round_mod", "test_strategy_resume", "test_wang_relay",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every slow test of a Ray-using module into one xdist group (a no-op without
    pytest-xdist), and the tests that solve the N = 1024 optimized factorization into
    another, so that the solve happens once per worker that needs it."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if item.get_closest_marker("slow") and module in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif module in ("test_mechanisms", "test_blt") and (
                "1024" in item.name or "near_optimal" in item.name):
            item.add_marker(pytest.mark.xdist_group("optimized-1024"))
