"""simulations/chen_wang_cnn.py at toy size on tiny IDX files the test writes."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from flwr_corrnoise.data.idx import FILES, write_idx
from simulations import chen_wang_cnn as sim


def _write(directory: Path, n_train: int = 300, n_test: int = 60) -> None:
    rng = np.random.default_rng(0)
    directory.mkdir()
    for part, n in (("train", n_train), ("test", n_test)):
        y = np.arange(n, dtype=np.uint8) % 10
        x = rng.integers(0, 40, (n, 28, 28), dtype=np.uint8)
        x[np.arange(n), 2 * y, :] = 255  # a learnable stripe per class
        write_idx(directory / FILES[f"{part}_x"], x)
        write_idx(directory / FILES[f"{part}_y"], y)


def test_partition_like_the_paper() -> None:
    labels = np.repeat(np.arange(10), 50)
    parts = sim.partition(labels)
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    for i in range(5):  # learner i holds 40 % of class i (20 of 50) and 7 or 8 of the others'
        assert np.sum(labels[parts[i]] == i) == 20
        assert 7 <= np.sum(labels[parts[(i + 1) % 5]] == i) <= 8


@pytest.mark.slow
def test_toy_cnn_run(tmp_path: Path) -> None:
    _write(tmp_path / "idx")
    out = tmp_path / "out"
    assert sim.main(["--dataset", "mnist", "--data-root", str(tmp_path / "idx"), "--steps", "6",
                     "--evals", "2", "--test-size", "50", "--train-eval-size", "50",
                     "--out", str(out)]) == 0
    with open(out / "cnn.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["algorithm"] for r in rows} == {"chen-wang", "dsgd", "dola", "pdop"}
    assert all(r["data"] == "MNIST" for r in rows)
    assert all(0.0 <= float(r["test_accuracy"]) <= 1.0 for r in rows)
    assert (out / "cnn.png").exists()


def test_cnn_task_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(1)
    images = rng.random((40, 28, 28)).astype(np.float32)
    labels = np.arange(40) % 10
    task = sim.CNNTask(images, labels, [np.arange(40)] * 5, horizon=3, batch=2, seed=0)
    theta = task.initial()[None].astype(np.float64)
    X, y = task.history(np.array([0]), 2)
    g = task.grad(theta, X, y)[0]
    for j in rng.choice(task.dim, 5, replace=False):
        e = np.zeros_like(theta)
        e[0, j] = 1e-2
        fd = (task.loss(theta + e, X, y)[0] - task.loss(theta - e, X, y)[0]) / 2e-2
        assert fd == pytest.approx(g[j], abs=2e-3)
