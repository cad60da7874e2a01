"""Apply a documented diff to the plain app and run the result on Flower's simulation engine.

Why ``_run_simulation`` with ``app_dir``: the public ``run_simulation`` gives the apps an
empty run config, but an adopted app's learners and server read theirs from the app's
``pyproject.toml`` as under ``flwr run``; with ``app_dir`` Flower's simulation runtime
fuses that config into every ClientApp's context exactly as ``flwr run`` does, and the
ServerApp gets the same config through its context.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from flwr.app import Context, RecordDict
from flwr.common.config import get_fused_config_from_dir
from flwr.simulation.run_simulation import EventType, _run_simulation

from ..flower_helpers import backend_config, in_process_backend

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "plain_app"
PLAIN_TORCH = HERE / "plain_torch_app"  # the same app in PyTorch (torch.optim.SGD)
#: an app written as Flower's quickstart-pytorch is (CNN, fixed partition, local epochs)
QUICKSTART = HERE / "quickstart_app"
#: Flower's own examples/quickstart-pytorch (Apache-2.0), its data loading made offline: a
#: package ``pytorchexample`` (client_app, server_app, task), not one ``plain_app.py``
FLOWER_QUICKSTART = HERE / "flower_quickstart"
VARIANTS = ("per-step", "per-round", "central", "per-step-torch")
QUICKSTART_VARIANTS = ("quickstart-per-step", "quickstart-per-round", "quickstart-central")
FLOWER_QUICKSTART_VARIANTS = ("flower-quickstart-per-step", "flower-quickstart-per-round",
                              "flower-quickstart-central")


def plain_dir(variant: str | None) -> Path:
    """The plain app a variant's diff patches (all keep their code in ``plain_app.py``,
    but Flower's quickstart, a package)."""
    if variant is not None and variant.startswith("flower-quickstart"):
        return FLOWER_QUICKSTART
    if variant is not None and variant.startswith("quickstart"):
        return QUICKSTART
    return PLAIN_TORCH if variant is not None and variant.endswith("-torch") else PLAIN


def diff_path(variant: str) -> Path:
    return HERE / f"{variant}.diff"


def changed_lines(diff: str) -> tuple[int, int]:
    """(added, removed) lines of a unified diff."""
    lines = diff.splitlines()
    added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    return added, removed


def adopt(variant: str | None, dest: Path, run_config: dict[str, object] | None = None) -> Path:
    """A copy of the plain app in ``dest`` with ``variant``'s diff applied (``None``: the
    plain app) and ``run_config`` entries set in its ``pyproject.toml`` (a value ``None``
    removes the key)."""
    shutil.copytree(plain_dir(variant), dest)
    if variant is not None:
        subprocess.run(["patch", "-p1", "--no-backup-if-mismatch", "-i",
                        str(diff_path(variant))], cwd=dest, check=True, capture_output=True)
    toml = dest / "pyproject.toml"
    text = toml.read_text()
    run_config = dict(run_config or {})
    if variant is not None and not variant.startswith(("quickstart", "flower-quickstart")):
        # the plain app is a stream (each example used once): the declaration every private
        # config must make (docs/adopt.md § 1), one config line
        run_config.setdefault("data-reuse", "once")
    for key, value in run_config.items():
        text = re.sub(rf"(?m)^{re.escape(key)} = .*\n", "", text)
        if value is not None:
            shown = f'"{value}"' if isinstance(value, str) else str(value).lower() \
                if isinstance(value, bool) else repr(value)
            text += f"{key} = {shown}\n"
    toml.write_text(text)
    return dest


def load(app_dir: Path, name: str) -> ModuleType:
    """Import the app's module under a unique ``name`` (Ray workers import it by name)."""
    src = app_dir / "plain_app.py"
    target = app_dir / f"{name}.py"
    shutil.copy(src, target)
    sys.path.insert(0, str(app_dir))
    # Ray's workers import the app by name, and this checkout's flwr_corrnoise
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(app_dir), str(HERE.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])
    spec = importlib.util.spec_from_file_location(name, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_package(app_dir: Path, package: str = "pytorchexample") -> tuple[ModuleType, ModuleType]:
    """Import an app package's ``client_app`` and ``server_app`` modules from ``app_dir``
    (a copy made by :func:`adopt`), dropping any earlier copy of the package from
    ``sys.modules`` first; Ray's workers import the same copy (``sys.path`` and
    ``PYTHONPATH``)."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]
    sys.path.insert(0, str(app_dir))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(app_dir), str(HERE.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])
    client = importlib.import_module(f"{package}.client_app")
    server = importlib.import_module(f"{package}.server_app")
    return client, server


def simulate(app_dir: Path, module: ModuleType, num_supernodes: int = 2, *,
             ray: bool = False) -> None:
    """Run the app's ServerApp and ClientApp on Flower's simulation runtime with the run
    config of its ``pyproject.toml``; a ServerApp exception is raised here. In this
    process (``tests/flower_helpers.InProcessBackend``), or on the worker's Ray head where
    ``ray`` (the Flower-quickstart test keeps Ray: it is the path its users run)."""
    cfg = get_fused_config_from_dir(app_dir, {})
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    with contextlib.nullcontext() if ray else in_process_backend():
        _run_simulation(num_supernodes=num_supernodes,
                        exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                        client_app=module.client_app, server_app=module.server_app,
                        backend_name="ray",
                        backend_config=backend_config() if ray else {},  # type: ignore[arg-type]
                        app_dir=str(app_dir), is_app=True, server_app_context=context)
