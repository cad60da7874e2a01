"""The console script, run as a user runs it (a real subprocess) and in-process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flwr_corrnoise.cli import main
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.privacy import calibrate


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flwr_corrnoise.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mechanism_json_subprocess() -> None:
    proc = run_cli("mechanism", "--name", "toeplitz", "--steps", "4000", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    fact = build_factorization("toeplitz", 4000)
    assert out["sensitivity"] == pytest.approx(fact.sensitivity)
    assert out["rmse"] == pytest.approx(fact.rmse)
    assert out["max_error"] == pytest.approx(fact.max_error)
    assert out["build_seconds"] >= 0


def test_mechanism_optimized_reports_certificate(capsys) -> None:
    assert main(["mechanism", "--name", "optimized", "--steps", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sensitivity"] == pytest.approx(1.0)
    assert out["rmse"] >= out["lower_bound_rmse"]
    assert out["optimality_gap"] <= 1e-4


def test_calibrate_json_subprocess() -> None:
    proc = run_cli(
        "calibrate", "--epsilon", "2", "--delta", "1e-3", "--clip", "1",
        "--mechanism", "tree", "--steps", "1000", "--method", "zcdp", "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = calibrate(2, 1e-3, 1, build_factorization("tree", 1000).sensitivity, "zcdp")
    assert out["std"] == pytest.approx(expected.std)
    assert out["method"] == "zcdp"


def test_calibrate_rejects_impossible_budget() -> None:
    proc = run_cli(
        "calibrate", "--epsilon", "0", "--delta", "1e-3", "--clip", "1",
        "--mechanism", "tree", "--steps", "10",
    )
    assert proc.returncode == 2
    assert "ε must be a finite number > 0" in proc.stderr
    assert proc.stdout == ""


def test_human_readable_output(capsys) -> None:
    assert main(["mechanism", "--name", "tree", "--steps", "16"]) == 0
    assert "sensitivity" in capsys.readouterr().out


def test_mechanism_blt_reports_its_parameters(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    assert main(["mechanism", "--name", "blt", "--steps", "500", "--buffers", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["buffers"] == 3 and len(out["theta"]) == len(out["omega"]) == 3
    assert out["lower_bound_rmse"] < out["rmse"] < build_factorization("toeplitz", 500).rmse


def test_mechanism_optimized_loose_gap_is_certified_within_it(capsys, tmp_path,
                                                               monkeypatch) -> None:
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    assert main(["mechanism", "--name", "optimized", "--steps", "300", "--gap", "0.02",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1e-4 < out["optimality_gap"] <= 0.02  # stopped early, within the asked gap
    # the certificate is honest: the RMSE is within √1.02 of the best possible
    exact = build_factorization("optimized", 300).rmse
    assert exact <= out["rmse"] <= exact * (1.02**0.5)
