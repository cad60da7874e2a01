"""LIBSVM reader on tiny files the test writes."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from flwr_corrnoise.data.libsvm import LibsvmFormatError, read_libsvm, write_libsvm


def test_roundtrip_and_sparse_parsing(tmp_path) -> None:
    p = tmp_path / "a.txt"
    p.write_text("1 1:0.5 3:-2\n# comment\n\n-1 2:1e-3  # trailing\n2\n")
    X, y = read_libsvm(p)
    assert np.array_equal(y, [1, -1, 2])
    assert np.array_equal(X, [[0.5, 0, -2], [0, 1e-3, 0], [0, 0, 0]])
    X5, _ = read_libsvm(p, num_features=5)
    assert X5.shape == (3, 5)
    rng = np.random.default_rng(0)
    Xr = rng.normal(size=(6, 4)) * (rng.random((6, 4)) < 0.5)
    yr = rng.integers(0, 3, 6).astype(float)
    write_libsvm(tmp_path / "b.txt", Xr, yr)
    Xb, yb = read_libsvm(tmp_path / "b.txt", num_features=4)
    assert np.array_equal(Xb, Xr) and np.array_equal(yb, yr)
    gz = tmp_path / "c.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert np.array_equal(read_libsvm(gz)[0], X)


def test_zero_based_and_errors(tmp_path) -> None:
    p = tmp_path / "z.txt"
    p.write_text("0 0:1 2:3\n")
    X, _ = read_libsvm(p)
    assert np.array_equal(X, [[1, 0, 3]])
    for bad, msg in [("1 a:2\n", "malformed"), ("1 1:nan\n", "non-finite"),
                     ("1 1:2 1:3\n", "repeated"), ("", "no data")]:
        q = tmp_path / "bad.txt"
        q.write_text(bad)
        with pytest.raises(LibsvmFormatError, match=msg):
            read_libsvm(q)
    p.write_text("1 9:1\n")
    with pytest.raises(LibsvmFormatError, match="exceeds"):
        read_libsvm(p, num_features=3)
