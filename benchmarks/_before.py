"""An earlier copy of the package, imported beside this checkout's for a side-by-side run
(``--before DIR``: a directory holding ``flwr_corrnoise/``, e.g. from
``git archive REV flwr_corrnoise | tar -x -C DIR``). Shared by the benchmark scripts (run as
``python benchmarks/NAME.py``, so this directory is on ``sys.path``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

#: the name the earlier copy is imported under, so both packages live in one process
NAME = "flwr_corrnoise_before"


def import_before(path: str) -> ModuleType:
    """The package at ``path/flwr_corrnoise``, imported as :data:`NAME`."""
    pkg = os.path.join(path, "flwr_corrnoise")
    spec = importlib.util.spec_from_file_location(
        NAME, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
    if spec is None or spec.loader is None:
        raise SystemExit(f"no package at {pkg}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module
