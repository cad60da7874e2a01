"""simulations/plan_check.py at toy size: every run's plan is the plan of its own settings,
the measured accuracies are finite, and the table and lever ranking are written."""

from __future__ import annotations

import csv
from pathlib import Path

from flwr_corrnoise.plan import make_plan, with_signal
from simulations import plan_check, plan_check_quickstart
from simulations.marked import marked_blocks

DOCS = Path(__file__).resolve().parents[2] / "docs"


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
        inputs = plan_check.plan_for(setup, adaptive)
        plan = make_plan(inputs, levers=False)
        assert float(row["nsr_final"]) == float(f"{plan.nsr_final:.4g}")
        est = plan_check.signal_sample(setup)
        measured = make_plan(with_signal(inputs, est), levers=False)
        assert float(row["signal"]) == float(f"{est.fraction:.4g}")
        assert float(row["nsr_final_measured"]) == float(f"{measured.nsr_final:.4g}")
        assert row["verdict_measured"] == measured.verdict
    text = (tmp_path / "plan-check.md").read_text()
    assert "plan, best first:" in text and "measured, best first:" in text
    # the docs page's table is a generated block: replaced, the text around it kept
    page = tmp_path / "page.md"
    page.write_text(f"before\n<!-- BEGIN {plan_check.BLOCK} -->\nold\n"
                    f"<!-- END {plan_check.BLOCK} -->\nafter\n")
    plan_check.write_docs_table(rows, page)
    out = page.read_text()
    assert out.startswith("before\n") and out.endswith("after\n") and "old" not in out
    assert plan_check.table(rows) in out


def test_the_pages_tables_are_the_committed_csvs_rendered() -> None:
    """docs/results-plan-check.md's two generated tables are its committed CSVs rendered
    by the scripts' own table code (no hand-edited or stale figure)."""
    blocks = marked_blocks((DOCS / "results-plan-check.md").read_text())
    assert blocks == plan_check.render_blocks(DOCS)
    assert set(blocks) == {plan_check.BLOCK, plan_check_quickstart.BLOCK}
