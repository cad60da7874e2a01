"""The optimized factorization's ``C`` and ``C⁻¹`` cached under its dual's digest (issue 22):
read back bit for bit without an eigendecomposition, and a damaged, foreign or forged file
refused and replaced, never used."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.mechanisms import cache
from flwr_corrnoise.mechanisms import optimized as opt
from flwr_corrnoise.mechanisms.optimized import (
    Optimized,
    check_factors,
    evaluate_dual,
    factors_key,
    load_factors,
    pack_lower,
    primal_and_scale,
    unpack_lower,
    workload_gram,
    workload_matvec,
)

N = 40


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    return tmp_path


def no_eigendecomposition(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("an eigendecomposition ran although the factors are cached")

    monkeypatch.setattr(opt, "evaluate_dual", refuse)


def factors_path(f: Optimized):
    return cache.path_for(factors_key(f.n, f.digest))


def test_the_factors_are_read_back_bit_for_bit_without_an_eigendecomposition(
        private_cache, monkeypatch) -> None:
    first = Optimized(N)
    assert factors_path(first).exists()
    # the cached pair is the one the dual gives (a second computation: evaluate_dual)
    point = evaluate_dual(workload_gram(N), first.dual)
    np.testing.assert_array_equal(first.C, primal_and_scale(point.X)[0])
    no_eigendecomposition(monkeypatch)
    second = Optimized(N)
    assert second.digest == first.digest
    np.testing.assert_array_equal(second.C, first.C)
    np.testing.assert_array_equal(second.Cinv, first.Cinv)
    np.testing.assert_allclose(second.Cinv @ second.C, np.eye(N), atol=1e-12)
    assert second.lower_bound == pytest.approx(point.lower_bound, rel=1e-12)
    assert second.sensitivity == pytest.approx(1.0, abs=1e-12)
    # a stream restoring this factorization by its digest reads the same cache
    restored = opt._restore(N, first.digest)
    assert restored is not None and restored.digest == first.digest
    np.testing.assert_array_equal(restored.Cinv, first.Cinv)


def damage(path, at: int) -> None:
    """Flip 8 bytes of the file at offset ``at``."""
    data = bytearray(path.read_bytes())
    data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
    path.write_bytes(bytes(data))


def forge(path, **arrays) -> None:
    """Rewrite the factors file with some arrays replaced (a well-formed file)."""
    with np.load(path, allow_pickle=False) as f:
        stored = {k: np.array(f[k]) for k in f.files}
    stored.update(arrays)
    np.savez(path, **stored)


@pytest.mark.parametrize("how", ["damaged-header", "damaged-data", "truncated", "foreign",
                                 "other-dual", "bad-inverse", "scaled-column", "bad-scale"])
def test_a_bad_factors_file_is_refused_rebuilt_and_replaced(private_cache, how: str,
                                                            caplog) -> None:
    good = Optimized(N)
    path = factors_path(good)
    other = Optimized(N, gap=0.5, use_cache=False)  # another dual point of the same N
    other_scale = primal_and_scale(evaluate_dual(workload_gram(N), other.dual).X)[1]
    if how == "damaged-header":
        damage(path, path.stat().st_size // 2)
    elif how == "damaged-data":  # one number of C⁻¹ (the zip member's CRC-32 fails)
        damage(path, path.read_bytes().index(pack_lower(good.Cinv)[N + 3].tobytes()))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "foreign":  # another factorization's file copied under this name
        store_other = Optimized(N + 1)
        path.write_bytes(factors_path(store_other).read_bytes())
    elif how == "other-dual":  # names the right digest, holds another dual's factors
        forge(path, C=pack_lower(other.C), Cinv=pack_lower(other.Cinv), scale=other_scale)
    elif how == "bad-inverse":
        bad = good.Cinv.copy()
        bad[N - 1, 0] += 1e-3
        forge(path, Cinv=pack_lower(bad))
    elif how == "scaled-column":  # a column norm ≠ 1: another sensitivity
        bad = good.C.copy()
        bad[:, 3] *= 1.01
        forge(path, C=pack_lower(bad), Cinv=pack_lower(np.linalg.inv(bad)))
    elif how == "bad-scale":
        with np.load(path) as f:
            scale = np.array(f["scale"])
        forge(path, scale=scale * 1.01)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert load_factors(good.dual, good.digest) is None
    assert any("ignoring" in r.getMessage() for r in caplog.records)
    rebuilt = Optimized(N)  # rebuilds from the dual, replaces the file
    np.testing.assert_array_equal(rebuilt.C, good.C)
    np.testing.assert_array_equal(rebuilt.Cinv, good.Cinv)
    loaded = load_factors(good.dual, good.digest)
    assert loaded is not None
    np.testing.assert_array_equal(loaded[0], good.C)


def test_check_factors_accepts_the_pair_and_rejects_others() -> None:
    f = Optimized(N, use_cache=False)
    C, scale = primal_and_scale(evaluate_dual(workload_gram(N), f.dual).X)
    assert check_factors(f.dual, C, f.Cinv, scale) is None
    assert "unit norm" in check_factors(f.dual, 2 * C, f.Cinv / 2, scale)
    assert "square-root" in check_factors(f.dual * 1.001, C, f.Cinv, scale)
    assert "inverse" in check_factors(f.dual, C, f.Cinv * (1 + 1e-6), scale)
    assert "shapes" in check_factors(f.dual, C[:-1, :-1], f.Cinv, scale)
    nan = C.copy()
    nan[5, 2] = np.nan
    assert "non-finite" in check_factors(f.dual, nan, f.Cinv, scale)


def test_the_helpers_against_dense_computations() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 33):
        x = rng.normal(size=n)
        np.testing.assert_allclose(workload_matvec(x), workload_gram(n) @ x, rtol=1e-13,
                                   atol=1e-12)
        m = np.tril(rng.normal(size=(n, n)))
        packed = pack_lower(m)
        assert packed.shape == (n * (n + 1) // 2,)
        np.testing.assert_array_equal(unpack_lower(packed, n), m)
    with pytest.raises(ValueError, match="order"):
        unpack_lower(np.zeros(5), 3)
