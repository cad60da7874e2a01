"""simulations/wang.py at toy size: every experiment writes its CSVs and plots, the regret
bounds of Corollaries 3.7/3.10 upper-bound the measured regret, the stand-in is named."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from simulations import wang


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_toy_experiments(tmp_path: Path) -> None:
    out = str(tmp_path / "w")
    common = ["--synthetic", "--out", out]
    wang.main(["main", "--steps", "120", "--tune", "grid", "--tune-steps", "40",
               "--clips", "0.1", "1", "--mults", "0.01", "1", *common])
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


def test_adaptive_tuning_widens_to_an_interior_optimum(tmp_path: Path) -> None:
    """The default tuning (issue 24): full-horizon runs on seed 1000, line searches that
    step ×10 until both neighbours of the best point are evaluated and worse."""
    out = tmp_path / "a"
    wang.main(["main", "--synthetic", "--algorithms", "pd-ftgl", "--steps", "80",
               "--tune-start", "1", "1000", "--out", str(out)])
    rows = _rows(out / "tuning.csv")
    assert all(r["rounds"] == "80" and r["seed"] == "1000" for r in rows)
    chosen = [r for r in rows if r["chosen"] == "True"]
    assert len(chosen) == 1
    best = min(float(r["final_AL"]) for r in rows)
    assert float(chosen[0]["final_AL"]) == best
    C, m = float(chosen[0]["clip"]), float(chosen[0]["multiplier"])
    evaluated = {(float(r["clip"]), float(r["multiplier"])): float(r["final_AL"]) for r in rows}
    if chosen[0]["optimum_interior"] == "True":  # both neighbours in each direction seen
        for nb in ((C, m * 10), (C, m / 10), (C * 10, m), (C / 10, m)):
            key = min(evaluated, key=lambda k: abs(np.log(k[0] / nb[0])) +
                      abs(np.log(k[1] / nb[1])))
            assert np.isclose(key[0], nb[0]) and np.isclose(key[1], nb[1])
            assert evaluated[key] >= best
    summary = _rows(out / "main-summary.csv")
    assert float(summary[0]["clip"]) == C and float(summary[0]["multiplier"]) == m


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



def test_tuning_rows_from_parallel_points(tmp_path: Path) -> None:
    """Grid points run as separate processes become tuning rows: the reported setting is
    'chosen', and it is interior only with a worse point on each side."""
    for m, al in ((0.1, 3.0), (1.0, 2.0), (10.0, 2.5)):
        d = tmp_path / f"p{m}"
        d.mkdir()
        wang.write_csv(d / "main-summary.csv", [{"dataset": "x", "algorithm": "PD-OCG",
                                                 "clip": 0.1, "multiplier": m, "rounds": 9,
                                                 "final_AL": al, "seed": 1000}])
    reported = [{"dataset": "x", "algorithm": "PD-OCG", "clip": "0.1", "multiplier": "1.0"}]
    rows = wang.tuning_rows([str(tmp_path / f"p{m}") for m in (0.1, 1.0, 10.0)], reported)
    assert [r["chosen"] for r in rows] == [False, True, False]
    assert [r["optimum_interior"] for r in rows] == [False, True, False]
    edge = wang.tuning_rows([str(tmp_path / f"p{m}") for m in (0.1, 1.0)], reported)
    assert not any(r["optimum_interior"] for r in edge)  # no larger multiplier evaluated
