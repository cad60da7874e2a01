"""The tests that use a worker's Ray head are the ones ``tests/conftest.py`` groups on one
xdist worker (``RAY_HEAD_TESTS``), so that one head starts per run, not one per worker.
A test added on the head without its entry would start another head (≈ 15–20 s of CPU);
one left in the list after it stopped using the head would hold a worker for nothing."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests.conftest import RAY_HEAD_TESTS, on_ray_head

TESTS = Path(__file__).resolve().parents[1]
#: what starts or reaches the worker's head (tests/flower_helpers.py, tests/adoption)
USES_HEAD = ("ray_head()", "backend_config(", "ray=True")


def find_tests_on_the_head(root: Path) -> set[tuple[str, str]]:
    found = set()
    for path in root.rglob("test_*.py"):
        if path == Path(__file__).resolve():  # its own example below
            continue
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = ast.get_source_segment(source, node) or ""
                if any(use in body for use in USES_HEAD):
                    found.add((path.stem, node.name))
    return found


def test_every_test_on_the_ray_head_is_grouped() -> None:
    assert find_tests_on_the_head(TESTS) == RAY_HEAD_TESTS


def test_the_check_sees_a_new_test_on_the_head(tmp_path: Path) -> None:
    (tmp_path / "test_new.py").write_text(
        "def test_uses_it():\n    simulate(a, b, 2, backend_config(actors=2))\n\n"
        "def test_does_not():\n    simulate(a, b, 2)\n")
    assert find_tests_on_the_head(tmp_path) == {("test_new", "test_uses_it")}


def test_the_group_reaches_xdist(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup`` (pyproject.toml's addopts) xdist reads a test's groups into
    its node id (``…@ray-head``) when it collects; the conftest hook that adds the groups
    must run before that (``tryfirst``), or every head test is scheduled alone and each
    worker starts its own head. Checked on this worker's collected items."""
    config = request.config
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
        pytest.skip("not on an xdist worker with --dist loadgroup")
    items = request.session.items
    on_head = [item for item in items if on_ray_head(item)]
    if not on_head:
        pytest.skip("no test on the head was collected in this run")
    assert all(item.nodeid.endswith("@ray-head") for item in on_head)
    assert all(item.nodeid.endswith("@optimized-1024") for item in items
               if "near_optimal" in item.name)
