"""simulations/plan_check.py at toy size: every run's plan is the plan of its own settings,
the measured accuracies are finite, and the table and lever ranking are written."""

from __future__ import annotations

import csv
from pathlib import Path

from flwr_corrnoise.plan import make_plan
from simulations import plan_check


def test_plan_check_toy(tmp_path: Path) -> None:
    assert plan_check.main(["--rounds", "6", "--learners", "3", "--dim", "5", "--seeds", "1",
                            "--test-size", "200", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "plan-check.csv").open()))
    names = [r["name"] for r in rows]
    assert names[:5] == ["plain", "clip only (ε = 10⁴)", "per-step", "per-round", "central"]
    assert all(0.0 <= float(r["accuracy_mean"]) <= 1.0 for r in rows)
    parsed = {"rounds": 6, "learners": 3, "dim": 5, "tau": 4, "eta": 0.05, "epsilon": 2.0,
              "delta": 1e-5, "clip": 1.0, "test_size": 200}
    import argparse

    for (name, setup, adaptive), row in zip(plan_check.runs(argparse.Namespace(**parsed)),
                                            rows, strict=True):
        assert row["name"] == name
        if setup.mechanism == "none":
            assert row["nsr_final"] == ""
            continue
        plan = make_plan(plan_check.plan_for(setup, adaptive), levers=False)
        assert float(row["nsr_final"]) == float(f"{plan.nsr_final:.4g}")
    text = (tmp_path / "plan-check.md").read_text()
    assert "plan, best first:" in text and "measured, best first:" in text
