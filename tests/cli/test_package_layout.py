"""The installed package is the library only (issue 25, item 4).

Experiment code — paper reproductions, the papers' data sets and their search paths, the demo,
results files — lives in the repository's ``experiments/`` and ``simulations/``, which are not
installed; the library never changes its user's environment; and the core dependencies pull
no Ray (``flwr[simulation]`` is an extra). Each check below reads the package's own source or
metadata, and each detector is first shown to catch a planted offence, so none can pass
vacuously.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import flwr_corrnoise

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(flwr_corrnoise.__file__).resolve().parent
#: top-level packages of the repository that are not installed
NOT_INSTALLED = ("experiments", "simulations", "benchmarks", "deploy", "tests")
#: what moved out of the package, by its old dotted name
MOVED_MODULES = ("experiment", "cnn", "demo", "data.mushrooms", "data.letter", "data.poker")
MOVED_ATTRIBUTES = {
    "data.idx": ("load_dataset", "paper_partition", "FASHION_MNIST_DEBIAN", "CACHE"),
    "apps.logreg_task": ("run_logreg_inprocess",),
}
#: the papers' data-set tasks, registered by experiments/tasks.py only
DATASET_TASKS = ("mushrooms", "letter", "poker")


def _sources() -> dict[str, ast.Module]:
    """Every module of the package, parsed: dotted name → AST."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def repository_imports(tree: ast.Module) -> list[str]:
    """The import statements (anywhere: module level or inside a function) that name a
    package of the repository that is not installed."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if n.split(".")[0] in NOT_INSTALLED]
    return found


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os") or (
        isinstance(node, ast.Name) and node.id == "environ")


def environ_mutations(tree: ast.Module) -> list[int]:
    """Line numbers where the code changes the process environment: assigning or deleting
    ``os.environ[...]``, calling a mutating method on it (``setdefault``, ``update``, ``pop``,
    ``popitem``, ``clear``, ``__setitem__``, ``__delitem__``), or ``os.putenv``/``os.unsetenv``.
    Reading (``os.environ.get``, ``os.environ[key]``) is allowed."""
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        if any(isinstance(t, ast.Subscript) and _is_os_environ(t.value) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if _is_os_environ(func.value) and func.attr in {
                    "setdefault", "update", "pop", "popitem", "clear", "__setitem__",
                    "__delitem__"}:
                lines.append(node.lineno)
            if (func.attr in {"putenv", "unsetenv"} and isinstance(func.value, ast.Name)
                    and func.value.id == "os"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_detectors_catch_what_they_look_for() -> None:
    """Planted offences (the old ``demo.py``'s two lines, an import of the experiments) are
    found; reads of the environment are not."""
    bad = ast.parse(
        "import os\nfrom os import environ\n"
        "def run():\n"
        "    os.environ.setdefault('FLWR_TELEMETRY_ENABLED', '0')\n"
        "    os.environ['A'] = '1'\n    del os.environ['A']\n    environ.update(B='2')\n"
        "    os.putenv('C', '3')\n"
        "    from experiments.demo import run_demo\n    import simulations.logreg\n")
    assert environ_mutations(bad) == [4, 5, 6, 7, 8]
    assert repository_imports(bad) == ["experiments.demo", "simulations.logreg"]
    fine = ast.parse("import os\nx = os.environ.get('A')\ny = os.environ['B']\n"
                     "from flwr_corrnoise.data import idx\n")
    assert environ_mutations(fine) == [] and repository_imports(fine) == []


def test_no_library_module_imports_the_experiments() -> None:
    offenders = {name: found for name, tree in _sources().items()
                 if (found := repository_imports(tree))}
    assert offenders == {}


def test_no_library_module_mutates_the_environment() -> None:
    offenders = {name: lines for name, tree in _sources().items()
                 if (lines := environ_mutations(tree))}
    assert offenders == {}


def test_no_hard_coded_system_data_paths_in_the_library() -> None:
    """The Debian locations of the papers' data sets are the experiments' search path."""
    pattern = re.compile(r"/usr/(share|lib)/")
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []


def test_moved_names_are_gone_from_the_package() -> None:
    import importlib
    import importlib.util

    for old in MOVED_MODULES:
        assert importlib.util.find_spec(f"flwr_corrnoise.{old}") is None, old
    for module, names in MOVED_ATTRIBUTES.items():
        mod = importlib.import_module(f"flwr_corrnoise.{module}")
        assert [n for n in names if hasattr(mod, n)] == [], module
    assert not (PACKAGE / "experiments").exists() and not (PACKAGE / "simulations").exists()


@pytest.mark.slow
def test_importing_the_whole_library_registers_no_dataset_task_and_touches_nothing() -> None:
    """In a fresh interpreter outside the repository (so ``experiments`` cannot be found by
    accident): import every module of the package; nothing of the repository gets imported,
    the environment is as Flower's own import left it, and the decentralized task registry
    holds no data-set task."""
    code = """
import importlib, json, os, pkgutil, sys
import flwr  # Flower sets GRPC_VERBOSITY when it is imported: its own, not ours
before = dict(os.environ)
import flwr_corrnoise
failed = {}
for info in pkgutil.walk_packages(flwr_corrnoise.__path__, "flwr_corrnoise."):
    try:
        importlib.import_module(info.name)
    except ImportError as err:  # an optional extra that is not installed
        failed[info.name] = str(err)
from flwr_corrnoise.decentralized.tasks import TASKS
print(json.dumps({"repo": sorted(m for m in sys.modules
                                 if m.split(".")[0] in NOT_INSTALLED),
                  "env_changed": sorted(k for k in set(before) | set(os.environ)
                                        if before.get(k) != os.environ.get(k)),
                  "tasks": sorted(TASKS), "failed": failed}))
""".replace("NOT_INSTALLED", repr(NOT_INSTALLED))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.anchor, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["repo"] == []
    assert out["env_changed"] == []
    assert not set(DATASET_TASKS) & set(out["tasks"])
    assert "synthetic-logreg" in out["tasks"]  # the registry itself was imported
    # only optional extras may be missing (torch); never a module of the package itself
    assert all("flwr_corrnoise" not in err for err in out["failed"].values()), out["failed"]


def _requirements(specs: list[str]) -> list[Requirement]:
    return [Requirement(s) for s in specs]


def test_core_dependencies_pull_no_ray_and_readme_extras_do() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirements(project["dependencies"])
    assert [r.name for r in core if r.name == "ray"] == []
    flwr = [r for r in core if r.name == "flwr"]
    assert flwr and all(not r.extras for r in flwr), "flwr[simulation] pulls Ray"
    extras = {k: _requirements(v) for k, v in project["optional-dependencies"].items()}
    # README's two commands install `.[plot]` and `.[dev]`: both run Ray simulations
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[plot]" && flwr-corrnoise simulate' in readme
    assert 'pip install -e ".[dev]" && python -m pytest -q' in readme
    for extra in ("simulation", "plot", "dev"):
        assert any(r.name == "flwr" and "simulation" in r.extras for r in extras[extra]), extra
    assert any(r.name == "matplotlib" for r in extras["plot"])


def test_only_the_library_is_packaged() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    include = tool["packages"]["find"]["include"]
    assert include == ["flwr_corrnoise*"]
    for top in NOT_INSTALLED:
        assert (ROOT / top).is_dir(), top  # they exist, in the repository only


def test_simulate_without_a_checkout_says_what_to_do(monkeypatch, capsys) -> None:
    """An install without the repository (a wheel on an edge device) has no demo: the CLI
    says so and how to get it, and exits 2, instead of a traceback."""
    from flwr_corrnoise import cli

    monkeypatch.delitem(sys.modules, "experiments", raising=False)
    monkeypatch.setattr(cli, "_checkout_root", lambda: None)
    assert cli.main(["simulate", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "not installed with the package" in err and "pip install -e" in err


@pytest.mark.parametrize("where", ["package", "cwd"])
def test_the_cli_finds_the_checkout(where: str, monkeypatch, tmp_path) -> None:
    """From an editable install (the package inside the checkout) or from the checkout's
    root as working directory; a directory that merely has an ``experiments/`` is not one."""
    from flwr_corrnoise import cli

    if where == "cwd":
        monkeypatch.setattr(cli, "__file__", str(tmp_path / "site" / "flwr_corrnoise" / "cli.py"))
        monkeypatch.chdir(ROOT)
    assert cli._checkout_root() == ROOT
    impostor = tmp_path / "other"
    (impostor / "experiments").mkdir(parents=True)
    (impostor / "experiments" / "__init__.py").write_text("")
    (impostor / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    monkeypatch.setattr(cli, "__file__", str(impostor / "flwr_corrnoise" / "cli.py"))
    monkeypatch.chdir(impostor)
    assert cli._checkout_root() is None
