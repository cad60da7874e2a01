"""``python -m deploy.local``: a run that fails says so, and Flower's executables come from
this environment. Fast: the SuperLink's answers are stand-ins (``flwr ls`` as it prints
them); ``tests/flower/test_deployment.py`` runs the real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

import deploy.local as local
from deploy.local import CONNECTION, LocalDeployment

BIN = str(Path(sys.executable).parent)


def ls_answer(status: str, details: str = "") -> subprocess.CompletedProcess[str]:
    """What ``flwr ls --run-id 42 --format json`` prints for a run in ``status``."""
    out = json.dumps({"success": True, "runs": [
        {"run-id": "42", "status": status, "status-details": details}]})
    return subprocess.CompletedProcess(["flwr", "ls"], 0, out, "")


class Stand(LocalDeployment):
    """A deployment whose processes are stand-ins: ``flwr run`` prints that it started run
    42 and exits 0 (as the real one does whatever the run's outcome), and the SuperLink
    reports ``status``."""

    status = "finished:completed"
    details = ""
    calls: ClassVar[list[tuple[str, ...]]] = []

    def start(self) -> Stand:
        return self

    def close(self) -> None:
        pass

    def run_app(self, run_config: Any, *, app: str | None = None,
                timeout: float = 600) -> subprocess.Popen[str]:
        (self.logs / "flwr-run.log").write_text("Successfully started run 42\n")
        return subprocess.Popen([sys.executable, "-c", "pass"], text=True)

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        type(self).calls.append(args)
        return ls_answer(self.status, self.details)


@pytest.mark.parametrize("status, code", [
    ("finished:completed", 0), ("finished:failed", 1), ("finished:stopped", 1)])
def test_deploy_local_exits_non_zero_when_the_run_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        status: str, code: int) -> None:
    """``flwr run`` exits 0 for a run whose ServerApp raised; ``python -m deploy.local``
    asks the SuperLink and exits 1 unless the run completed, saying why."""
    details = "RunFailedError: flwr-corrnoise (CorrNoiseFedAvg): round 3: ... code 4104"
    monkeypatch.setattr(Stand, "status", status)
    monkeypatch.setattr(Stand, "details", details if status == "finished:failed" else "")
    monkeypatch.setattr(Stand, "calls", [])
    monkeypatch.setattr(local, "LocalDeployment", Stand)
    assert local.main(["--no-tls", "--workdir", str(tmp_path), "--nodes", "1"]) == code
    assert Stand.calls == [("ls", CONNECTION, "--run-id", "42", "--format", "json")]
    out = capsys.readouterr().out
    assert f"run 42 {status}" in out
    if status == "finished:failed":
        assert "code 4104" in out


def test_a_failing_flwr_run_or_no_run_is_a_failure(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dep = Stand(tmp_path, 1, tls=False)
    broken = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
    assert dep.outcome(broken) == (3, "flwr run exited with 3")
    silent = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    code, what = dep.outcome(silent)  # no "Successfully started run" in its log
    assert code == 1 and "started no run" in what
    (dep.logs / "flwr-run.log").write_text("Successfully started run 42\n")
    monkeypatch.setattr(Stand, "status", "running")
    silent = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    assert dep.outcome(silent, timeout=0) == (1, "run 42 running")


def test_flower_executables_come_from_this_environment(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower-superlink`` and ``flower-supernode`` are started from beside
    ``sys.executable``, and every process the deployment starts has that folder first on
    its ``PATH`` (they start ``flower-superexec`` by name), whatever ``PATH`` says."""
    for name in ("flower-superlink", "flower-supernode"):
        if not (Path(BIN) / name).exists():
            pytest.skip(f"{name} not installed beside {sys.executable}")
    monkeypatch.setenv("PATH", os.pathsep.join(["/elsewhere/bin", "/usr/bin"]))
    dep = LocalDeployment(tmp_path, 1, tls=False)
    assert dep.env["PATH"].split(os.pathsep) == [BIN, "/elsewhere/bin", "/usr/bin"]
    started: list[tuple[list[str], dict[str, str]]] = []

    class Popen:
        def __init__(self, args: list[str], env: dict[str, str], **kwargs: Any) -> None:
            started.append((args, env))
            self.pid, self.returncode = 0, 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(local.subprocess, "Popen", Popen)
    monkeypatch.setattr(dep, "_wait_for_port", lambda *args: None)
    dep.start_superlink()
    dep.start_node(0)
    for name, (args, env) in zip(("flower-superlink", "flower-supernode"), started,
                                 strict=True):
        assert args[0] == str(Path(BIN) / name)
        assert env["PATH"].split(os.pathsep)[0] == BIN
