"""Mushrooms loader on tiny files the test writes (no Debian package needed)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.data.mushrooms import load_mushrooms, one_hot, split_by_class
from flwr_corrnoise.data.libsvm import write_libsvm


def test_one_hot_with_missing_values() -> None:
    X = one_hot([["a", "x"], ["b", None], ["a", "y"]])
    # columns: attr0 = a, b; attr1 = x, y, missing
    assert np.array_equal(X, [[1, 0, 1, 0, 0], [0, 1, 0, 0, 1], [1, 0, 0, 1, 0]])
    assert np.all(X.sum(axis=1) == 2)


def test_libsvm_mushrooms_labels_and_normalization(tmp_path) -> None:
    rng = np.random.default_rng(0)
    X = (rng.random((12, 9)) < 0.4).astype(float)
    X[:, 0] = 1.0
    y = np.array([1, 2] * 6, dtype=float)
    write_libsvm(tmp_path / "mushrooms", X, y)
    Xl, yl, source = load_mushrooms(tmp_path / "mushrooms")
    assert "LIBSVM" in source
    assert np.array_equal(yl, (y == 2).astype(float))
    assert np.allclose(np.linalg.norm(Xl, axis=1), 1.0)
    assert np.allclose(Xl * np.linalg.norm(X, axis=1, keepdims=True), X)
    raw, _, _ = load_mushrooms(tmp_path / "mushrooms", normalize=False)
    assert np.array_equal(raw, X)
    write_libsvm(tmp_path / "three", X, np.arange(12) % 3)
    with pytest.raises(ValueError, match="two classes"):
        load_mushrooms(tmp_path / "three")
    with pytest.raises(FileNotFoundError):
        load_mushrooms(tmp_path / "missing")


def test_split_by_class_like_the_paper() -> None:
    y = np.array([0] * 9 + [1] * 4, dtype=float)
    X = np.arange(13, dtype=float)[:, None]
    shards = split_by_class(X, y, 5)
    assert [s[1].tolist() for s in shards[:3]] == [[0.0] * 3] * 3
    assert all(np.all(s[1] == 1) for s in shards[3:])
    assert sorted(np.concatenate([s[0][:, 0] for s in shards]).tolist()) == list(range(13))
    with pytest.raises(ValueError):
        split_by_class(X, y, 1)
