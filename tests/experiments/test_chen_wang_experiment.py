"""simulations/chen_wang.py at toy size: every part runs and writes consistent outputs."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from flwr_corrnoise.decentralized.chen_wang import StepSizes
from flwr_corrnoise.decentralized.chen_wang_privacy import TIGHT, chen_wang_epsilon
from simulations import chen_wang as sim
from simulations.chen_wang_tables import render_blocks
from simulations.marked import marked_blocks


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_toy_run_writes_consistent_outputs(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "cw"
    monkeypatch.setattr(sim, "ROOT", tmp_path)  # --docs writes tmp_path/docs, not the repo's
    assert sim.main(["--steps", "40", "--seeds", "1", "--tune-doublings", "2", "--synthetic",
                     "--small-standin", "--table-multipliers", "1", "4", "--equal-budget",
                     "--rate-fit-from", "10", "--out", str(out), "--docs"]) == 0
    for name in ("fig1.csv", "epsilon.csv", "table1.csv", "rate.csv", "fig1.png",
                 "table1.png", "rate.png"):
        assert (out / name).exists(), name
    fig = _rows(out / "fig1.csv")
    assert {r["algorithm"] for r in fig} == {"chen-wang", "chen-wang-tuned", "dsgd", "dola",
                                             "pdop"}
    assert all("stand-in" in r["data"] for r in fig)  # the stand-in is named on every row
    eps = [r for r in _rows(out / "epsilon.csv")
           if r["algorithm"] == "chen-wang" and r["accountant"] == TIGHT and r["T"] == "40"]
    assert len(eps) == 1
    dim = 20  # the small stand-in
    for i in range(5):
        ref = chen_wang_epsilon(40, StepSizes(1.0, 0.77, 1.0, 0.65), w_self=0.6,
                                L=0.25 + 0.01, C=2.0, dim=dim, noise_scale=1.0,
                                exponent=0.1 + 0.01 * (i + 1))[-1]
        assert float(eps[0][f"learner{i + 1}"]) == pytest.approx(ref, rel=1e-5)
    table = _rows(out / "table1.csv")
    assert [float(r["multiplier"]) for r in table] == [1.0, 4.0]
    # more noise → smaller budget (ε ∝ 1/ϱ₀)
    assert float(table[1]["epsilon_tight_mean"]) == pytest.approx(
        float(table[0]["epsilon_tight_mean"]) / 4, rel=1e-5)
    rate = _rows(out / "rate.csv")
    assert all(np.isfinite(float(r["tracking_error"])) for r in rate)
    # the page's tables are the copied CSVs rendered (issue 36), between their markers
    page = (tmp_path / "docs" / "results-chen-wang.md").read_text()
    blocks = marked_blocks(page)
    assert set(blocks) == {"table:fig1", "table:epsilon", "table:table1"}
    assert blocks == render_blocks("results-chen-wang.md", tmp_path / "docs")
    assert "| 1 | " in blocks["table:table1"] and "| 23.34 | 8 |" in blocks["table:table1"]
