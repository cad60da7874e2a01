"""`flwr run` on a local simulation federation, with a private FLWR_HOME.

`flwr run` starts a managed `flower-superlink` (plus `flower-superexec`) that outlives the
run; this test gives it its own FLWR_HOME and ports and stops exactly that SuperLink, found
by the log file path inside our FLWR_HOME, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from experiments.logreg import run_logreg_inprocess
from flwr_corrnoise.apps.logreg_task import LogRegSetup

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "logreg-app"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def superlink_pids(flwr_home: Path) -> list[int]:
    """PIDs of the Flower processes whose command line names our FLWR_HOME.

    Read from /proc, not `ps`: piped `ps` output is cut at 80 columns, which hides the
    `--log-file` argument that carries the marker (the SuperLink would leak, unnoticed).
    The SuperLink's own children (`flower-superexec`) are found through its pid.
    """
    marker = str(flwr_home / "local-superlink")
    procs: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        procs[int(entry.name)] = (ppid, args)
    found = [pid for pid, (_, args) in procs.items()
             if "flower-superlink" in args and marker in args]
    found += [pid for pid, (ppid, args) in procs.items()
              if ppid in found and "flower-superexec" in args]
    return found


#: the ``flwr`` CLI of *this* environment (beside ``sys.executable``), not whatever ``PATH``
#: finds: a user's venv need not be activated
FLWR = Path(sys.executable).parent / "flwr"
needs_flwr = pytest.mark.skipif(not FLWR.exists(), reason=f"flwr CLI not beside {sys.executable}")


@contextmanager
def flwr_env(**extra: str) -> Iterator[dict[str, str]]:
    """An environment with its own ``FLWR_HOME`` and free ports for ``flwr run``; on exit,
    the background ``flower-superlink`` that ``flwr run`` leaves behind is stopped by its
    pid (only the ones under this home) and the home removed."""
    home = Path(tempfile.mkdtemp(prefix="flwrhome", dir="/tmp"))
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        **extra,
    }
    try:
        yield env
    finally:
        for pid in superlink_pids(home):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while superlink_pids(home) and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(home, ignore_errors=True)
    assert not superlink_pids(home)


#: how long the local SuperLink may take to come up on a loaded 2-core host (Flower's CLI
#: gives the one it starts 15 s, then kills it and fails the run)
SUPERLINK_START_S = 180.0


def start_local_superlink(env: dict[str, str]) -> None:
    """Start the local SuperLink that ``flwr run`` would start, with Flower's own function
    and command line (``flwr.cli.local_superlink._start_local_superlink``), waiting up to
    :data:`SUPERLINK_START_S` instead of Flower's 15 s; ``flwr run`` then finds it running
    (its health endpoint) and uses it. Why: under 4 test workers on 2 cores the SuperLink
    has missed Flower's 15 s, Flower killed it and ``flwr run`` exited 1 ("Failed to start
    local SuperLink ... See logs at .../superlink.log"), and a retry could race the first
    one's processes. :func:`flwr_env` stops it by its pid."""
    code = ("import flwr.cli.local_superlink as m\n"
            f"m.LOCAL_SUPERLINK_STARTUP_TIMEOUT = {SUPERLINK_START_S}\n"
            "m._is_local_superlink_started() or m._start_local_superlink(False)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=SUPERLINK_START_S + 60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def flwr_run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``flwr run ARGS`` on the local SuperLink :func:`start_local_superlink` started."""
    start_local_superlink(env)
    return subprocess.run([str(FLWR), "run", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@needs_flwr
def test_flwr_run_local_simulation(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run_config = (f"num-learners=3 dim=6 num-server-rounds=3 local-steps=2 mechanism='tree' "
                  f"seed=11 data-seed=4 test-size=100 results-dir='{out}'")
    with flwr_env() as env:
        proc = flwr_run([str(APP), "--stream",
                         # one actor (2 CPUs each): an actor imports Flower, Ray and the app
                         "--federation-config", "num-supernodes=3 client-resources-num-cpus=2",
                         "--run-config", run_config], env, tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        deadline = time.monotonic() + 60
        while not (out / "final_model.npy").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        final = np.load(out / "final_model.npy")
    setup = LogRegSetup(num_learners=3, dim=6, rounds=3, tau=2, mechanism="tree", seed=11,
                        data_seed=4, test_size=100)
    res = run_logreg_inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], atol=1e-10, rtol=0)


@needs_flwr
def test_flwr_run_of_a_run_every_learner_refuses_is_marked_failed(tmp_path: Path) -> None:
    """What makes `flwr run` report failure: an exception from the ServerApp. The adopted
    plain app (docs/adopt.md, per-step) declares ``data-reuse = "every-round"`` over
    ``local-examples = 3`` but its loop cycles through those 3 examples for 4 steps a round:
    the 4th step reuses an example beyond the declaration, so every learner's backstop
    (issue 32, docs/threat-model.md) refuses it before anything is released, the strategy
    raises RunFailedError, and Flower marks the run `finished:failed` with the backstop's
    reason (`flwr ls`). `flwr run` itself exits 0 once the run is submitted, even with
    --stream."""
    import json

    from ..adoption import harness

    app = harness.adopt("per-step", tmp_path / "app", {
        "max-idle-rounds": 1, "data-reuse": "every-round", "local-examples": 3})
    src = app / "plain_app.py"
    loop = "x, y = datum(partition, position)"
    assert loop in src.read_text()
    src.write_text(src.read_text().replace(loop, "x, y = datum(partition, position % 3)"))
    # this checkout's code in Flower's processes, whatever the working directory
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with flwr_env(PYTHONPATH=pythonpath) as env:
        proc = flwr_run([str(app), "--stream",
                         # one actor (2 CPUs each): every learner refuses, nothing to spread
                         "--federation-config", "num-supernodes=2 client-resources-num-cpus=2"],
                        env, app)
        assert proc.returncode == 0  # Flower's CLI: submitted, whatever the outcome
        runs: list = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ls = subprocess.run([str(FLWR), "ls", "--format", "json"], env=env, cwd=app,
                                capture_output=True, text=True, timeout=60)
            runs = json.loads(ls.stdout).get("runs", [])
            if runs and str(runs[0]["status"]).startswith("finished"):
                break
            time.sleep(1)
    assert len(runs) == 1 and runs[0]["status"] == "finished:failed", runs
    details = runs[0]["status-details"]
    assert "RunFailedError" in details or "nothing was released" in details
    assert "2 × code 4101" in details and "local-examples = 3" in details, details
    assert "twice in one round" in details, details
