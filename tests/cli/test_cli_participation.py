"""The CLI takes the participation (issue 21): ``calibrate``/``mechanism`` with
``--epochs``/``--min-sep``/``--max-participations``, ``plan``, and ``audit --epochs``."""

from __future__ import annotations

import json

import pytest

from flwr_corrnoise import Participation, PrivacySettings
from flwr_corrnoise.cli import main
from flwr_corrnoise.mechanisms import build_factorization


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def test_calibrate_uses_the_participation_and_the_blt_optimized_for_it(capsys) -> None:
    code, out = run(capsys, "calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm",
                    "1", "--mechanism", "blt", "--steps", "120", "--epochs", "4", "--json")
    assert code == 0
    got = json.loads(out)
    want = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-5, horizon=120,
                           participation=Participation.epochs(4, 30)).calibration()
    assert got["std"] == want.std and got["sensitivity"] == want.sensitivity
    assert got["participation"] == "4 epochs of 30 steps (fixed cyclic order)"
    assert got["sensitivity_exact"] is True
    once = json.loads(run(capsys, "calibrate", "--epsilon", "2", "--delta", "1e-5",
                          "--clip-norm", "1", "--mechanism", "blt", "--steps", "120",
                          "--json")[1])
    assert once["std"] < got["std"] / 1.5  # one pass would have under-noised by far


def test_mechanism_reports_the_sensitivity_under_min_sep(capsys) -> None:
    code, out = run(capsys, "mechanism", "--name", "toeplitz", "--steps", "60", "--min-sep",
                    "10", "--max-participations", "3", "--json")
    assert code == 0
    got = json.loads(out)
    want = build_factorization("toeplitz", 60).participation_sensitivity(
        Participation.min_separation(10, 3))
    assert got["participation_sensitivity"] == want.value
    assert got["participation_sensitivity_exact"] is True


@pytest.mark.parametrize("args, message", [
    (["--epochs", "7"], "must divide"),
    (["--epochs", "2", "--min-sep", "3"], "not both"),
])
def test_bad_participations_exit_2(capsys, args: list[str], message: str) -> None:
    code = main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
                 "--mechanism", "toeplitz", "--steps", "60", *args])
    assert code == 2 and message in capsys.readouterr().err


def test_plan_prints_a_verdict_and_its_json_matches_the_library(capsys) -> None:
    from flwr_corrnoise.plan import PlanInput, make_plan

    args = ["plan", "--model-size", "500", "--examples", "100", "--batch-size", "10",
            "--epochs", "2", "--rounds", "2", "--learners", "3", "--mechanism", "toeplitz",
            "--no-levers"]
    code, out = run(capsys, *args)
    assert code == 0 and "verdict:" in out and "noise-to-signal" in out
    got = json.loads(run(capsys, *args, "--json")[1])
    want = make_plan(PlanInput(model_size=500, examples=100, batch_size=10, epochs=2,
                               rounds=2, learners=3, mechanism="toeplitz"), levers=False)
    assert got["nsr_final"] == want.nsr_final and got["verdict"] == want.verdict


def test_audit_takes_epochs(capsys) -> None:
    code, out = run(capsys, "audit", "--mechanism", "toeplitz", "--steps", "8", "--epochs",
                    "2", "--runs", "40", "--seed", "1", "--json")
    got = json.loads(out)
    assert code == 0 and got["epochs"] == 2 and not got["falsified"]


def test_a_mistyped_option_is_named_with_its_nearest(capsys) -> None:
    """Issue 32: ``--epsilom`` used to say "--epsilon is required"."""
    with pytest.raises(SystemExit) as stop:
        main(["calibrate", "--epsilom", "2", "--delta", "1e-5", "--clip-norm", "1",
              "--mechanism", "blt", "--steps", "10"])
    assert stop.value.code == 2
    assert "unknown option --epsilom (did you mean --epsilon?)" in capsys.readouterr().err
