"""Shared test set-up: a private cache directory so tests never depend on (or pollute)
the user's cache of optimized factorizations; it is removed when the session ends. Every
factorization is solved at most once per session: the cache is shared by all xdist
workers (see :func:`pytest_collection_modifyitems`)."""

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
# The compiled noise kernel (flwr_corrnoise/compiled_kernel.py): a session folder of its own,
# built once here in the controller before any worker or process the tests start, so that
# they load it instead of each compiling a copy (and the user's cache is not written).
if "FLWR_CORRNOISE_KERNEL_CACHE" not in os.environ:
    _kernel = tempfile.mkdtemp(prefix="flwr-corrnoise-kernel-")
    os.environ["FLWR_CORRNOISE_KERNEL_CACHE"] = _kernel
    atexit.register(shutil.rmtree, _kernel, ignore_errors=True)
    from flwr_corrnoise import compiled_kernel as _compiled_kernel

    _compiled_kernel.prebuild()
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# One BLAS thread per process: four xdist workers share 2 cores, and a multi-threaded
# eigh/solve on an oversubscribed machine is 10–40× slower in wall time (solve_dual(400):
# 46 s with default threads, 1.2 s with one). Set before NumPy is imported in this process;
# workers and the Ray head inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Python's bytecode cache, on for this session even where the environment turns it off
# (PYTHONDONTWRITEBYTECODE=1, as on this project's machines): some 150 processes start
# during a run (xdist workers, Flower's SuperLink/SuperNode/ClientApp processes, Ray
# workers, scripts), and without a cache each compiles this checkout's modules again, and
# each xdist worker rewrites every test module's asserts again (≈ 20 s of CPU a worker to
# collect). The caches go to the __pycache__ folders .gitignore already lists. Removed
# here, before the workers and every process the tests start inherit the environment.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    import sys

    sys.dont_write_bytecode = False

import pytest


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run direct ClientApp calls under the *simulation* rules (reproducible seeds, the run
    config as the learner's own), as Flower's simulation engine does; without it a direct
    call is treated as a real SuperNode (strict rules)."""
    from flwr_corrnoise.flower import session

    monkeypatch.setattr(session, "in_simulation", lambda: True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop this process's Ray head (tests/flower_helpers.py), if a test started one."""
    import sys

    helpers = sys.modules.get("tests.flower_helpers")
    if helpers is not None:
        helpers.stop_ray_head()


#: (module, test) of the tests that call ``tests/flower_helpers.ray_head`` (directly, through
#: ``backend_config`` or the adoption harness's ``ray=True``); the other Flower tests run in
#: process (``flower_helpers.InProcessBackend``) or start their own processes
RAY_HEAD_TESTS = {
    ("test_one_release",
     "test_two_messages_to_one_node_in_one_round_release_once_in_flowers_simulation"),
    ("test_flower_scale_store", "test_state_handling_measures_rays_object_store"),
    ("test_flower_simulation", "test_flower_simulation_matches_inprocess"),
    ("test_flower_quickstart", "test_flower_quickstart_adopted_runs_privately_on_flower"),
    ("test_ray_cluster", "test_simulation_on_existing_ray_cluster"),
    ("test_cnn", "test_script_writes_csv_plot_and_checks_flower"),
    ("test_benchmarks", "test_flower_scale"),
    ("test_benchmarks", "test_flower_overhead"),
    ("test_state_offload", "test_offload_on_two_ray_nodes_without_a_shared_folder_fails"),
    ("test_experiment", "test_main_job_runs_the_demo"),
}


def on_ray_head(item: pytest.Item) -> bool:
    """Whether ``item`` (any parametrization of it) is one of :data:`RAY_HEAD_TESTS`."""
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
    return (module, getattr(item, "originalname", item.name)) in RAY_HEAD_TESTS


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 3 --dist loadgroup``, pyproject.toml), keep the tests that
    use the N = 1024 optimized factorization on one worker, so it is solved once (the
    cache directory above is shared: the workers inherit ``FLWR_CORRNOISE_CACHE`` from
    the controller, which loads this file first).

    The tests that run on a worker's Ray head (``tests/flower_helpers.ray_head``:
    :data:`RAY_HEAD_TESTS`) share one worker too, so that one head starts instead of one per
    worker (a head's raylet, GCS, agents and ``ray start`` cost ≈ 15–20 s of CPU, measured
    in a cgroup). Each worker's head is its own (free ports, its own ``--temp-dir``, named
    by address), and a plain ``ray.init()`` looks for ``ray_current_cluster`` only in Ray's
    default temp dir; so a Ray test elsewhere never joins another worker's cluster.
    """
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in ("test_mechanisms", "test_blt") and (
                "1024" in item.name or "near_optimal" in item.name):
            item.add_marker(pytest.mark.xdist_group("optimized-1024"))
        elif on_ray_head(item):
            item.add_marker(pytest.mark.xdist_group("ray-head"))
    # The order xdist hands the work out in (pyproject.toml's --no-loadscope-reorder keeps
    # it; xdist would otherwise put the groups first by size and the TLS crash test after
    # some 100 s of others). First the TLS crash test, the longest wall (≈ 190–320 s, most
    # of it Flower waiting for two 30 s heartbeats, little CPU): started at once, it runs
    # beside CPU-bound tests instead of ending the suite on one worker alone; then the Ray
    # head's group (≈ 220–250 s), the other groups, the slow tests, the rest (a stable sort:
    # file order otherwise kept).
    def rank(item: pytest.Item) -> int:
        if item.name in FIRST:
            return 0
        groups = [m.args[0] for m in item.iter_markers("xdist_group") if m.args]
        if groups:
            return 1 if "ray-head" in groups else 2
        return 3 if item.get_closest_marker("slow") is not None else 4

    items.sort(key=rank)


#: the tests xdist hands out first (see pytest_collection_modifyitems)
FIRST = {"test_tls_deployment_survives_a_supernode_crash"}
