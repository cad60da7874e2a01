"""The CLI's start-up imports only what a command uses (issue 22, item 4).

Why: every ``flwr-corrnoise`` command is a fresh process, and what it imports before it
does anything is time the user waits (and time that used to leak into what the CLI says a
build took). One fresh interpreter (:func:`probe`) records, step by step, what
``sys.modules`` gained: a bare ``import flwr_corrnoise``; importing the CLI and parsing
``--help``, ``mechanism``, ``calibrate`` and ``plan``; running ``mechanism``; and, around
every registered mechanism's build as ``_build`` times it, what the build imported (it
must be nothing, or ``build_seconds`` would time an import). The tests below read it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scipy.stats import norm

from flwr_corrnoise.cli import main

# on one xdist worker: under ``--dist loadgroup`` a module fixture runs once on every worker
# that gets one of the module's tests, and :func:`probe` (a fresh interpreter importing and
# solving with a cold cache) ran two to four times a suite
pytestmark = pytest.mark.xdist_group("cli-startup")

#: never needed to parse a command or to run ``mechanism``/``calibrate``/``plan``
HEAVY = ("flwr", "ray", "torch", "matplotlib", "grpc")
#: parts of this library the parser does not need: they were imported by every command
#: before (the package's eager ``__init__`` and the ``decentralized`` choices)
NOT_FOR_PARSING = ("flwr_corrnoise.learner", "flwr_corrnoise.streams",
                   "flwr_corrnoise.secure_noise", "flwr_corrnoise.data",
                   "flwr_corrnoise.decentralized", "flwr_corrnoise.flower",
                   "flwr_corrnoise.torch", "cryptography")

PROBE = r"""
import contextlib, io, json, sys

def new(before):
    return sorted(set(sys.modules) - before)

out = {}
before = set(sys.modules)
import flwr_corrnoise
out["package"] = new(before)

before = set(sys.modules)
import flwr_corrnoise.cli as cli
parser = cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()) as shown, contextlib.suppress(SystemExit):
    parser.parse_args(["--help"])
out["help_text"] = shown.getvalue()
for argv in (["mechanism", "--name", "blt", "--steps", "64"],
             ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
              "--mechanism", "toeplitz", "--steps", "64"],
             ["plan", "--model-size", "1000", "--examples", "100", "--batch-size", "10"]):
    parser.parse_args(argv)
out["parse"] = new(before)

import flwr_corrnoise.mechanisms as mechanisms
real = mechanisms.build_factorization
during = {}

def watched(name, n, **params):
    seen = set(sys.modules)
    try:
        return real(name, n, **params)
    finally:
        during[name] = new(seen)

mechanisms.build_factorization = watched
before = set(sys.modules)
with contextlib.redirect_stdout(io.StringIO()) as shown:
    status = cli.main(["mechanism", "--name", "blt", "--steps", "64", "--json"])
out["mechanism"] = {"status": status, "result": json.loads(shown.getvalue()),
                    "imported": new(before)}
for name in mechanisms.MECHANISMS:
    cli._build(name, 24, parser.parse_args(["mechanism", "--name", name, "--steps", "24"]))
out["during_build"] = during
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The record of one fresh interpreter (module docstring), with a fresh solver cache so
    that the solved mechanisms really solve."""
    cache = tmp_path_factory.mktemp("cache")
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=240, cwd=Path(cache).anchor,
                          env={**os.environ, "FLWR_CORRNOISE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _top(modules: list[str], names: tuple[str, ...]) -> list[str]:
    """The modules among ``modules`` that are one of ``names`` or inside one."""
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_importing_the_package_imports_none_of_its_modules(probe: dict) -> None:
    assert [m for m in probe["package"] if m.startswith("flwr_corrnoise.")] == []
    assert _top(probe["package"], ("numpy", "scipy", *HEAVY)) == []


def test_parsing_a_command_imports_only_the_parser_s_needs(probe: dict) -> None:
    """``--help`` and the three commands' arguments: the mechanism registry and the
    calibration methods, nothing of Flower, Ray, torch or matplotlib, nor the learner, the
    streams, the data loaders or the decentralized algorithms (each of which was imported
    by every command before)."""
    assert "flwr_corrnoise.mechanisms.registry" in probe["parse"]  # the probe saw imports
    assert _top(probe["parse"], HEAVY) == []
    assert _top(probe["parse"], NOT_FOR_PARSING) == []
    for command in ("mechanism", "calibrate", "plan", "decentralized", "simulate"):
        assert command in probe["help_text"]


def test_running_mechanism_imports_no_front_end(probe: dict) -> None:
    run = probe["mechanism"]
    assert run["status"] == 0 and run["result"]["name"] == "blt"
    assert _top(run["imported"], HEAVY) == []
    assert _top(run["imported"], ("flwr_corrnoise.flower", "flwr_corrnoise.torch",
                                  "flwr_corrnoise.decentralized", "flwr_corrnoise.data")) == []


def test_a_build_imports_nothing_so_build_seconds_times_only_the_build(probe: dict) -> None:
    """``_build`` starts its clock after its imports; a mechanism module that imported
    something on its first build (a SciPy submodule inside a function) would put that
    import into ``build_seconds``. Every registered mechanism is checked, solved ones
    included (fresh cache)."""
    from flwr_corrnoise.mechanisms import MECHANISMS

    during = probe["during_build"]
    assert set(during) == set(MECHANISMS)
    assert {name: mods for name, mods in during.items() if mods} == {}


def test_the_decentralized_choices_still_check_and_show(capsys) -> None:
    """Its ``--algorithm`` choices are looked up late, but a bad value is still a usage
    error that lists them, and ``--help`` still shows them."""
    from flwr_corrnoise.decentralized.engine import algorithm_names

    with pytest.raises(SystemExit) as exit_:
        main(["decentralized", "--algorithm", "nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(repr(name) in err for name in algorithm_names())
    with pytest.raises(SystemExit):
        main(["decentralized", "--help"])
    assert "{" + ",".join(algorithm_names()) + "}" in capsys.readouterr().out


def test_every_exported_name_still_imports_from_the_package() -> None:
    """``from flwr_corrnoise import X`` for every name in ``__all__`` gives the object its
    module defines; an unknown name is still an ``AttributeError``/``ImportError``."""
    import importlib

    import flwr_corrnoise

    namespace: dict[str, object] = {}
    exec("from flwr_corrnoise import *", namespace)
    for name in flwr_corrnoise.__all__:
        assert name in dir(flwr_corrnoise)
        if name != "__version__":
            where = importlib.import_module(flwr_corrnoise._EXPORTS[name], "flwr_corrnoise")
            assert namespace[name] is getattr(where, name) is getattr(flwr_corrnoise, name)
    assert flwr_corrnoise.mechanisms.MECHANISMS is namespace["MECHANISMS"]  # a submodule
    with pytest.raises(AttributeError):
        flwr_corrnoise.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from flwr_corrnoise import no_such_name", {})


#: ``calibrate … --json`` as the CLI printed it before the start-up change (commit 2acf36b,
#: same machine); the new code printed the same bytes
BEFORE = {
    ("toeplitz", "64", None): {
        "std": 6.163232717376192, "epsilon": 2.0, "delta": 1e-05, "clip_norm": 1.0,
        "sensitivity": 1.5455898900728597, "l2_sensitivity": 3.0911797801457195,
        "method": "exact", "mechanism": "toeplitz", "steps": 64,
        "participation": "each datum once", "sensitivity_exact": True,
        "noise_multiplier": 1.9938124456435382},
    ("tree", "64", "2"): {
        "std": 15.950499565148307, "epsilon": 2.0, "delta": 1e-05, "clip_norm": 1.0,
        "sensitivity": 4.0, "l2_sensitivity": 8.0, "method": "exact", "mechanism": "tree",
        "steps": 64, "participation": "2 epochs of 32 steps (fixed cyclic order)",
        "sensitivity_exact": True, "noise_multiplier": 1.9938124456435384},
}


@pytest.mark.parametrize("key", sorted(BEFORE, key=str))
def test_calibrate_prints_what_it_printed_before(key, capsys) -> None:
    """The same JSON as before the change, and each number checked independently: the
    Toeplitz square root's sensitivity is ‖(binom(2j, j)/4^j)_j‖₂; the tree's, a datum
    in both epochs, √(2·6 + 2²) = 4 (two leaves of 7 levels share only the root); the
    noise multiplier σ/Δ is the analytic Gaussian one (Balle & Wang): δ(ε) at it is the
    target, to rounding."""
    mechanism, steps, epochs = key
    argv = ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
            "--mechanism", mechanism, "--steps", steps, "--json"]
    assert main([*argv, *(["--epochs", epochs] if epochs else [])]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = BEFORE[key]
    assert list(out) == list(expected)
    for name, value in expected.items():
        if isinstance(value, float):
            assert out[name] == pytest.approx(value, rel=1e-12, abs=0), name
        else:
            assert out[name] == value, name
    n = int(steps)
    closed = (math.sqrt(sum((math.comb(2 * j, j) / 4**j) ** 2 for j in range(n)))
              if mechanism == "toeplitz" else math.sqrt(2 * math.log2(n) + 4))
    assert out["sensitivity"] == pytest.approx(closed, rel=1e-12)
    assert out["l2_sensitivity"] == pytest.approx(2 * closed, rel=1e-12)
    assert out["std"] == pytest.approx(out["noise_multiplier"] * out["l2_sensitivity"])
    m, eps = out["noise_multiplier"], out["epsilon"]
    delta = norm.cdf(1 / (2 * m) - eps * m) - math.exp(eps) * norm.cdf(-1 / (2 * m) - eps * m)
    assert delta <= out["delta"] and delta == pytest.approx(out["delta"], rel=1e-6)
