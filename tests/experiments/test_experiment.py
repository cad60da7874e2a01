"""The experiment script and the main job, at toy sizes."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flwr_corrnoise.apps.logreg_task import LogRegEvaluator, LogRegSetup
from simulations import logreg
from tests.flower_helpers import RAY, ray_head

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_logreg_script_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "lr"
    code = logreg.main([
        "--learners", "4", "--dim", "8", "--rounds", "6", "--seeds", "2", "--tune-seeds", "1",
        "--eta-grid", "0.05", "0.2", "--methods", "none", "independent", "toeplitz",
        "--workers", "1", "--test-size", "200", "--out", str(out),
    ])
    assert code == 0
    for name in ("runs.csv", "tuning.csv", "curves.csv", "accuracy.png", "loss.png",
                 "regret.png", "table.md"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "runs.csv") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["method", "epsilon", "delta", "seed", "eta", "final_accuracy",
                       "avg_online_loss", "dynamic_regret"]
    body = rows[1:]
    assert len(body) == 2 + 2 * 2 * 2  # noiseless once; 2 methods × 2 budgets; 2 seeds each
    noiseless = [r for r in body if r[0] == "noiseless"]
    assert noiseless and all(r[1] == "" and r[2] == "" for r in noiseless)
    assert {r[1] for r in body if r[0] == "toeplitz"} == {"2.0", "0.5"}
    # the chosen η is one of the grid and marked in tuning.csv
    with open(out / "tuning.csv") as fh:
        tuning = list(csv.DictReader(fh))
    assert sum(int(t["chosen"]) for t in tuning) == 5
    # --replot redraws the figures from curves.csv alone
    for name in ("accuracy.png", "loss.png", "regret.png"):
        (out / name).unlink()
    assert logreg.main(["--out", str(out), "--replot"]) == 0
    assert all((out / n).stat().st_size > 0 for n in ("accuracy.png", "loss.png", "regret.png"))
    curves = logreg.read_curves(out / "curves.csv")
    assert ("toeplitz", 2.0, 0.001) in curves
    assert len(curves[("none", None, None)]["accuracy"][0]) == 7  # rounds 0..6


def test_evaluator_regret_matches_definition() -> None:
    """Regret = τ·Σ_r (f^r(x^r) − (f^r)*), recomputed from the evaluator's own rows."""
    setup = LogRegSetup(num_learners=3, dim=5, rounds=4, tau=2, test_size=50)
    ev = LogRegEvaluator(setup)
    rng = np.random.default_rng(0)
    for r in range(5):
        ev(r, [rng.normal(size=5)])
    rows = [row for row in ev.rows if "online-loss" in row]
    expected = 2 * sum(row["online-loss"] - row["round-optimum"] for row in rows)
    assert ev.summary()["dynamic_regret"] == pytest.approx(expected)
    assert len(rows) == 4  # no online loss after the last round


@pytest.mark.slow
def test_main_job_runs_the_demo(tmp_path: Path) -> None:
    """README command 1 at toy size, as a user runs it: three methods on three seeds in
    process (bands), BLT's first seed on Flower's simulation engine too — the same final
    model as in process —, the figure, the CSVs, and a results directory `report` reads.
    Its Flower run joins this test worker's Ray head (``RAY_ADDRESS``, which the demo and
    ``ray.init`` honour) instead of starting a local Ray (≈ 15 s of CPU): a fresh local Ray
    under Flower is what tests/flower/test_flwr_run.py runs, twice."""
    env = dict(os.environ)
    if RAY.exists():
        env["RAY_ADDRESS"] = ray_head().address
    proc = subprocess.run(
        [sys.executable, "-m", "flwr_corrnoise.cli", "simulate", "--rounds", "3",
         "--learners", "2", "--local-steps", "4", "--seeds", "3", "--out", str(tmp_path),
         "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert set(out) == {"noiseless", "independent", "blt", "flower run", "plot"}
    assert "3 seeds" in out["blt"]
    diff = float(re.search(r"to ([\d.e+-]+) ->", out["flower run"]).group(1))
    assert diff < 1e-9  # the engines share every step
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    with open(tmp_path / "curves.csv") as fh:
        curves = list(csv.DictReader(fh))
    assert len(curves) == 3 * 3 * 4  # methods × seeds × rounds 0..3
    with open(tmp_path / "summary.csv") as fh:
        summary = {row["method"]: row for row in csv.DictReader(fh)}
    assert summary["noiseless"]["epsilon"] == "" and summary["blt"]["epsilon"] == "2.0"
    flower = json.loads((tmp_path / "blt" / "summary.json").read_text())
    assert flower["setup"]["mechanism"] == "blt" and flower["setup"]["rounds"] == 3
    assert "[in process 9/9]" in proc.stderr and "[Flower] done" in proc.stderr
    rep = subprocess.run([sys.executable, "-m", "flwr_corrnoise.cli", "report",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert rep.returncode == 0 and "ε spent 2 of 2" in rep.stdout


@pytest.mark.slow
def test_the_demo_setting_tells_the_story() -> None:
    """The demo's claims, on its own setting and tuned step sizes, at one seed each on the
    in-process engine (the figure's engine): no noise learns well (≥ 0.85), correlated
    noise stays close to it and independent noise falls far behind at the same budget."""
    from experiments.demo import DEMO, run_inprocess, setup_for

    final = {m: run_inprocess(setup_for(m, 1))[0][-1]["test-accuracy"]
             for m in ("none", "independent", "blt")}
    assert final["none"] >= 0.85
    assert final["none"] - final["blt"] < 0.06
    assert final["blt"] - final["independent"] > 0.05
    assert DEMO.rounds * DEMO.tau == 1000 and DEMO.epsilon == 2.0


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = [line for b in blocks for line in b.splitlines() if line and line[0] != "#"]
    test_cmd = next(c for c in commands if "pytest" in c)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_label_rules_select_the_generator_variant() -> None:
    """``labels`` picks the data: 'fedprox' is the paper's naive rule (labels almost
    constant per learner), 'centred' our balanced adaptation; anything else is an error."""
    from flwr_corrnoise.apps.logreg_task import federation

    small = LogRegSetup(num_learners=10, dim=100)
    positives = {}
    for rule in ("centred", "fedprox"):
        fed = federation(small.with_(labels=rule))
        assert fed.config.centered is (rule == "centred")
        positives[rule] = np.array(
            [np.mean(fed.learner_batch(i, 0, 256)[1] > 0) for i in range(10)]
        )
    extreme = lambda p: np.mean((p < 0.1) | (p > 0.9))  # noqa: E731
    assert extreme(positives["fedprox"]) >= 0.6
    assert extreme(positives["centred"]) <= 0.2
    assert LogRegSetup.from_run_config({"labels": "fedprox"}).labels == "fedprox"
    with pytest.raises(ValueError, match="labels must be one of"):
        LogRegSetup(labels="naive")


def test_docs_table_section_is_replaced_not_duplicated(tmp_path: Path) -> None:
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\nintro\n")
    logreg.update_marked_section(doc, "table:centred", "| a |\n|---|\n| 1 |")
    logreg.update_marked_section(doc, "table:centred", "| a |\n|---|\n| 2 |")
    text = doc.read_text()
    assert text.count("<!-- BEGIN table:centred -->") == 1
    assert "| 2 |" in text and "| 1 |" not in text and text.startswith("# Results\n\nintro")
    doc.write_text(text + "\nafter\n")
    logreg.update_marked_section(doc, "table:centred", "| 3 |")
    assert doc.read_text().endswith("| 3 |\n<!-- END table:centred -->\n\nafter\n")


def test_moving_average_keeps_the_ends_level() -> None:
    flat = np.full(200, 0.7)
    np.testing.assert_allclose(logreg.moving_average(flat, 9), flat)
    ramp = np.arange(100.0)
    smooth = logreg.moving_average(ramp, 5)
    np.testing.assert_allclose(smooth[2:-2], ramp[2:-2])  # linear data is kept inside
    assert smooth[0] == pytest.approx(1.0)  # mean of 0, 1, 2: not pulled towards zero


def test_round_and_server_variants_follow_their_definitions() -> None:
    """noise-at round/server: plain τ local steps, the round update clipped to η·τ·B_g, then
    Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning With
    Correlated Noise", arXiv version) per-learner or Zhang, Zhu & Johansson's ("Differentially
    Private Online Federated Learning with Correlated Noise") server noise; replayed by hand
    here."""
    from experiments.logreg import run_logreg_inprocess
    from flwr_corrnoise.apps.logreg_task import logistic_gradient
    from flwr_corrnoise.learner import clip_by_global_norm
    from flwr_corrnoise.settings import PrivacySettings, derive_seed
    from flwr_corrnoise.streams import NoiseStream
    from flwr_corrnoise.variants import central_calibration

    base = LogRegSetup(num_learners=3, dim=4, rounds=5, tau=2, eta=0.2, clip=0.5,
                       mechanism="toeplitz", test_size=20, seed=3, data_seed=1)
    bound = 0.2 * 2 * 0.5
    for where in ("round", "server"):
        setup = base.with_(noise_at=where)
        got = run_logreg_inprocess(setup).params[0]
        if where == "round":
            std = PrivacySettings("toeplitz", 2.0, 1e-3, bound, 5).calibration().std
            streams = [NoiseStream.create("toeplitz", 5, 4, std, derive_seed(3, i))
                       for i in range(3)]
        else:
            std = central_calibration("toeplitz", 2.0, 1e-3, bound, 5).std / 3
            server = NoiseStream.create("toeplitz", 5, 4, std, derive_seed(3, 10**6))
        x = np.zeros(4)
        for r in range(5):
            deltas = []
            for i in range(3):
                z, grad = x.copy(), logistic_gradient(setup, i)
                for t in range(2):
                    z = z - 0.2 * grad([z], r * 2 + t)[0]
                deltas.append(clip_by_global_norm(z - x, bound)[0])
            if where == "round":
                x = x + np.mean([d + streams[i].next() for i, d in enumerate(deltas)], axis=0)
            else:
                x = x + np.mean(deltas, axis=0) + server.next()
        np.testing.assert_allclose(got, x, atol=1e-12)
    with pytest.raises(ValueError, match="noise_at must be one of"):
        LogRegSetup(noise_at="client")


def test_script_runs_the_variants(tmp_path: Path) -> None:
    out = tmp_path / "v"
    assert logreg.main([
        "--learners", "3", "--dim", "4", "--rounds", "4", "--seeds", "1", "--eta-grid", "0.1",
        "--methods", "none", "toeplitz", "toeplitz@round", "blt@server", "--budgets",
        "2:0.001", "--workers", "1", "--test-size", "50", "--out", str(out),
    ]) == 0
    with open(out / "runs.csv") as fh:
        methods = [row["method"] for row in csv.DictReader(fh)]
    assert sorted(methods) == ["blt@server", "noiseless", "toeplitz", "toeplitz@round"]
    table = (out / "table.md").read_text()
    assert "Toeplitz (MF iii), per round (Zhang et al., arXiv)" in table
    assert "BLT, 4 buffers (ours), central (Zhang, Zhu & Johansson)" in table
