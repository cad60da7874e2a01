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
        "calibrate", "--epsilon", "2", "--delta", "1e-3", "--clip-norm", "1",
        "--mechanism", "tree", "--steps", "1000", "--method", "zcdp", "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = calibrate(2, 1e-3, 1, build_factorization("tree", 1000).sensitivity, "zcdp")
    assert out["std"] == pytest.approx(expected.std)
    assert out["method"] == "zcdp"


def test_calibrate_rejects_impossible_budget() -> None:
    proc = run_cli(
        "calibrate", "--epsilon", "0", "--delta", "1e-3", "--clip-norm", "1",
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


@pytest.mark.slow
def test_report_on_a_real_tiny_flower_run(tmp_path, capsys) -> None:
    """`report` on the results of a real (tiny) Flower simulation: ε per learner as the
    run's summary has it, the final accuracy, and a PNG."""
    from flwr_corrnoise.apps.logreg import logreg_apps
    from flwr_corrnoise.apps.logreg_task import LogRegSetup

    from ..flower_helpers import simulate

    setup = LogRegSetup(num_learners=2, dim=4, rounds=2, tau=2, mechanism="toeplitz",
                        test_size=100, seed=1, data_seed=2)
    out = tmp_path / "run"
    simulate(*logreg_apps(setup, str(out), progress=False), setup.num_learners)
    summary = json.loads((out / "summary.json").read_text())
    png = tmp_path / "plot.png"
    capsys.readouterr()  # the run's own output
    assert main(["report", str(out), "--plot", str(png), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    learners = {k: v for k, v in printed.items() if k.startswith("learner ")}
    assert sorted(learners) == ["learner 0", "learner 1"]  # keyed by partition id
    for who, rec in summary["learners"].items():
        assert f"ε spent {rec['epsilon-spent']:.4g} of 2 " in learners[f"learner {who}"]
        assert f"{setup.rounds * setup.tau}/{setup.rounds * setup.tau} steps" in \
            learners[f"learner {who}"]
    assert printed["final accuracy"] == pytest.approx(summary["final_accuracy"])
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed["plot"] == str(png.resolve())
    # ε per learner per round, increasing to the budget
    rows = (out / "privacy.csv").read_text().splitlines()[1:]
    assert len(rows) == setup.rounds * setup.num_learners
    assert float(rows[-1].split(",")[-1]) == pytest.approx(2.0)


def test_report_refuses_a_directory_without_results(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err


def test_a_failed_run_exits_3_with_its_reason(monkeypatch, capsys) -> None:
    from flwr_corrnoise import cli
    from flwr_corrnoise.flower import RunFailedError

    def failed(args):
        raise RunFailedError("nothing was released for 3 consecutive round(s)")

    monkeypatch.setattr(cli, "_report", failed)
    assert main(["report", "anywhere"]) == 3
    assert "run failed: nothing was released" in capsys.readouterr().err


def test_calibrate_takes_the_build_options_of_mechanism(capsys, tmp_path, monkeypatch) -> None:
    """`calibrate --buffers 2` calibrates the 2-buffer BLT (not the default 4), as
    `mechanism --buffers 2` builds it: the std is the one for that factorization's
    sensitivity."""
    from flwr_corrnoise.mechanisms.blt import BufferedToeplitz

    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    args = ["calibrate", "--epsilon", "2", "--delta", "1e-3", "--clip-norm", "1",
            "--mechanism", "blt", "--steps", "300", "--json"]
    assert main([*args, "--buffers", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    four = json.loads(capsys.readouterr().out)
    for out, k in ((two, 2), (four, 4)):
        fact = BufferedToeplitz(300, buffers=k, use_cache=False)
        assert out["std"] == pytest.approx(calibrate(2, 1e-3, 1, fact.sensitivity).std,
                                           rel=1e-6)
    assert two["std"] != pytest.approx(four["std"], rel=1e-6)
    assert main([*args[:-4], "optimized", "--steps", "200", "--gap", "0.02", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["std"] == pytest.approx(
        calibrate(2, 1e-3, 1, 1.0).std)  # the optimized C has unit sensitivity


@pytest.mark.parametrize(("raised", "code", "says"), [
    (None, 0, ""),
    (ValueError("no summary.json in x"), 2, "flwr-corrnoise: error: no summary.json in x"),
    (FileNotFoundError(2, "No such file or directory", "x/summary.json"), 2,
     "flwr-corrnoise: error: [Errno 2] No such file or directory: 'x/summary.json'"),
    ("run-failed", 3, "flwr-corrnoise: run failed: nothing was released"),
    ("wrapped-run-failed", 3, "flwr-corrnoise: run failed: nothing was released"),
    (KeyError("a bug"), 1, "flwr-corrnoise: failed: KeyError: 'a bug'"),
    (KeyboardInterrupt(), 130, "flwr-corrnoise: interrupted"),
])
def test_every_error_exits_non_zero(monkeypatch, capsys, raised, code, says) -> None:
    """0 only on success: a configuration error 2 (one line), a failed run 3 — also when
    Flower wraps it (`run_simulation`'s "An error was encountered") —, a bug 1 (with its
    traceback), an interrupt 130."""
    from flwr_corrnoise import cli
    from flwr_corrnoise.flower import RunFailedError

    def report(args):
        if raised is None:
            return {"plot": "p.png"}
        if raised == "run-failed":
            raise RunFailedError("nothing was released for 3 consecutive round(s)")
        if raised == "wrapped-run-failed":
            try:
                raise RunFailedError("nothing was released at all")
            except RunFailedError as err:
                raise RuntimeError("An error was encountered. Ending simulation.") from err
        raise raised

    monkeypatch.setattr(cli, "_report", report)
    assert main(["report", "anywhere"]) == code
    err = capsys.readouterr().err
    assert says in err
    if code == 2:
        assert err.count("\n") == 1  # one line, no traceback
    if code == 1:
        assert "Traceback" in err


def test_usage_errors_exit_2() -> None:
    assert run_cli().returncode == 2  # no subcommand
    proc = run_cli("calibrate", "--epsilon", "2")  # required options missing
    assert proc.returncode == 2 and "required" in proc.stderr
    proc = run_cli("report", "/nonexistent/results")
    assert proc.returncode == 2 and proc.stderr.startswith("flwr-corrnoise: error: no summary")
