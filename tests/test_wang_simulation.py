"""simulations/wang.py at toy size: every experiment writes its CSVs and plots, the regret
bounds of Corollaries 3.7/3.10 upper-bound the measured regret, the stand-in is named."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from simulations import wang


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_toy_experiments(tmp_path: Path) -> None:
    out = str(tmp_path / "w")
    common = ["--synthetic", "--out", out]
    wang.main(["main", "--steps", "120", "--tune-steps", "40", "--clips", "0.1", "1",
               "--mults", "0.01", "1", *common])
    summary = _rows(tmp_path / "w" / "main-summary.csv")
    assert {r["algorithm"] for r in summary} == {"PD-FTGL", "PD-OCG", "PD-OGD",
                                                 "PD-OGD (per-datum noise)"}
    assert all(r["dataset"].startswith("synthetic") for r in summary)
    for r in summary:
        assert np.isfinite(float(r["final_AL"])) and float(r["ms_per_round"]) > 0
        if r["algorithm"] in ("PD-FTGL", "PD-OCG"):
            assert float(r["eps paper-thm-3.6"]) == 10.0
            assert float(r["eps exact-gossip-sensitivity"]) < 10.0
    assert len(_rows(tmp_path / "w" / "tuning.csv")) == 4 * 4
    wang.main(["sweeps", "--steps", "60", "--sizes", "4", "9", *common])
    sweeps = _rows(tmp_path / "w" / "sweeps.csv")
    assert {r["sweep"] for r in sweeps} == {"privacy", "size", "topology"}
    assert {r["graph"] for r in sweeps} == {"complete", "cycle", "watts-strogatz"}
    wang.main(["rate", "--horizons", "60", "120", "--opt-iters", "30", "--rate-eps", "10",
               "--rate-mults", "1", *common])
    rate = _rows(tmp_path / "w" / "rate.csv")
    assert len(rate) == 4
    for r in rate:
        assert float(r["regret_max"]) <= float(r["bound"])
    assert set(wang.slopes(rate)) == {("PD-FTGL", "10.0", "1.0"), ("PD-OCG", "10.0", "1.0")}
    wang.main(["timing", "--steps", "200", "--timing-rounds", "60", *common])
    timing = _rows(tmp_path / "w" / "timing.csv")
    assert len(timing) == 4 and all(float(r["cpu_ms_per_round"]) > 0 for r in timing)
    assert "PD-FTGL" in wang.report(tmp_path / "w")
    for png in ("wang-main.png", "wang-sweeps.png", "wang-rate.png"):
        assert (tmp_path / "w" / png).stat().st_size > 1000


def test_comparator_is_the_minimum(tmp_path: Path) -> None:
    algo = wang.build(wang.config("synthetic", "pd-ftgl", 50, **{"num-nodes": 3}))
    task, K = algo.task, algo.K
    opt = wang.comparator_loss(task, K, 50, 300)
    idx = task.indices[:, :50].reshape(-1)
    E, lab = task.X[idx][None], task.y[idx][None]
    rng = np.random.default_rng(0)
    for _ in range(20):  # no feasible point is better
        x = K.project(rng.normal(scale=3, size=(1, task.dim)))
        assert task.loss(x, E, lab)[0] * 50 >= opt - 1e-6


def test_user_poker_file_reaches_the_task(tmp_path: Path) -> None:
    from experiments.data.poker import synthesize_poker
    from flwr_corrnoise.data.libsvm import write_libsvm

    X, y = synthesize_poker(200, seed=4)
    write_libsvm(tmp_path / "poker.t", X, y)
    out = tmp_path / "w"
    try:
        wang.main(["timing", "--datasets", "poker", "--poker-path", str(tmp_path / "poker.t"),
                   "--algorithms", "pd-ftgl", "--steps", "100", "--timing-rounds", "20",
                   "--out", str(out)])
    finally:
        wang.DATA_PATHS.clear()
    assert "LIBSVM file poker.t" in _rows(out / "timing.csv")[0]["dataset"]

