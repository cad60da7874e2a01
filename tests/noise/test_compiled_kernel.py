"""The compiled transform (flwr_corrnoise/compiled_kernel.py, noise_kernel.c): the same rows
as the NumPy path bit for bit, in every layout the kernel draws; built where a compiler is;
and a build that fuses multiply-adds (the fault the build flags guard against) is caught."""

from __future__ import annotations

import ctypes.util
from collections.abc import Iterator

import numpy as np
import pytest

from flwr_corrnoise import cipher_noise as cn
from flwr_corrnoise import compiled_kernel as ck
from flwr_corrnoise.cipher_noise import CipherGaussian

K = cn.CHUNK_PAIRS
HAVE_CC = ck._compiler() is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _restore_the_choice() -> Iterator[None]:
    yield
    ck.select(None)


def draws(path: str, dtype: type) -> list[np.ndarray]:
    """Every way the kernel draws, under one path."""
    ck.select(path)
    g = CipherGaussian.from_seed(42)
    out = [g.row(t, d, dtype) for t, d in ((0, 1), (1, 2), (2, 3), (3, 33), (4, 1000),
                                           (5, 2 * K - 1), (6, 2 * K + 3),
                                           (7, 5 * K + 4097), (2**50, 10**5 + 1))]
    out.append(g.rows(9, 7, 129, dtype))
    gens = [CipherGaussian.from_seed(s) for s in (1, 2, 3)]
    out.append(cn.next_rows_of(gens, np.empty((3, 4, 501), dtype=dtype)))
    out.append(g.standard_normal(3 * K + 17, dtype=dtype))
    cursor = CipherGaussian.from_seed(5)
    out.append(np.stack([cursor.next_row(40, dtype, ahead=30) for _ in range(30)]))
    assert ck.status().startswith("compiled" if path == "compiled" else "NumPy")
    return out


@needs_cc
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_and_numpy_paths_draw_the_same_rows(dtype: type) -> None:
    for a, b in zip(draws("numpy", dtype), draws("compiled", dtype), strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(a, b)


@needs_cc
def test_the_compiled_kernel_is_built_where_a_compiler_is() -> None:
    """Where a C compiler is (CI, this machine), the kernel does not fall back quietly: the
    library is built, with the whole-row function where OpenSSL's libcrypto links."""
    ck.select("auto")
    CipherGaussian.from_seed(1).row(0, 10)
    assert ck.status().startswith("compiled"), ck.status()
    if ctypes.util.find_library("crypto"):
        assert ck.HAS_ROW, ck.status()


def test_the_numpy_path_when_turned_off_or_not_buildable(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path, caplog) -> None:
    """No compiler: the NumPy path, said by status() and a warning, the same rows;
    ``compiled`` asked for explicitly then fails loudly; a bad choice is an error."""
    expect = CipherGaussian.from_seed(3).row(1, 999)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(ck.shutil, "which", lambda name: None)
    monkeypatch.setenv(ck.ENV_CACHE, str(tmp_path))
    ck.select("auto")
    np.testing.assert_array_equal(CipherGaussian.from_seed(3).row(1, 999), expect)
    assert ck.status().startswith("NumPy path: not built"), ck.status()
    assert "not compiled" in caplog.text and "the same noise" in caplog.text
    ck.select("compiled")
    with pytest.raises(RuntimeError, match="could not be built"):
        CipherGaussian.from_seed(3).row(1, 999)
    ck.select("sometimes")
    with pytest.raises(ValueError, match="auto, numpy or compiled"):
        CipherGaussian.from_seed(3).row(1, 999)


@needs_cc
def test_a_build_that_fuses_multiply_adds_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path) -> None:
    """The fault the flags guard against: with FMA contraction the compiled rows are no
    longer the NumPy path's — the comparison above would fail (so it can)."""
    expect = CipherGaussian.from_seed(4).row(0, 10**5, np.float64)
    fused = (*(f for f in ck.FLAGS if f != "-ffp-contract=off"), "-ffp-contract=fast", "-mfma")
    monkeypatch.setattr(ck, "FLAGS", fused)
    monkeypatch.setenv(ck.ENV_CACHE, str(tmp_path))
    ck.select("compiled")
    got = CipherGaussian.from_seed(4).row(0, 10**5, np.float64)
    assert not np.array_equal(got, expect)
    np.testing.assert_allclose(got, expect, rtol=1e-12, atol=1e-14)  # only the last bits


@needs_cc
def test_a_cache_folder_others_can_write_is_not_loaded_from(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path) -> None:
    """Loading a library runs its code beside the noise key: a folder another user could
    have written the library into is refused (the NumPy path runs; ``compiled`` fails)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(ck.ENV_CACHE, str(shared))
    expect = CipherGaussian.from_seed(6).row(0, 50)
    ck.select("auto")
    np.testing.assert_array_equal(CipherGaussian.from_seed(6).row(0, 50), expect)
    assert "writable by another user" in ck.status(), ck.status()
    shared.chmod(0o755)
    ck.select("compiled")
    np.testing.assert_array_equal(CipherGaussian.from_seed(6).row(0, 50), expect)
    assert ck.status().startswith("compiled")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_radius_words_at_the_edges_agree_in_both_paths_and_the_reference(dtype: type) -> None:
    """Words whose uniform is 1 (R = +0), just below 1 (where ln u is tiny), on either side
    of ½ (float64's two table halves), and the smallest main-path words: the compiled loop,
    the NumPy path and the scalar reference give the same floats, none NaN or negative."""
    from tests.noise.test_cipher_noise import ref_pair

    edges = [2**64 - 1, 2**64 - 4, 2**64 - 2**11, 2**64 - 2**40, 2**63, 2**63 + 4,
             2**63 - 4, 2**62, 2**32, 2**32 + 3, 2**33 - 1]
    rng = np.random.default_rng(7)
    words = np.array(edges + [int(x) for x in rng.integers(2**32, 2**63, 53, dtype=np.uint64)],
                     dtype=np.uint64)
    m = words.size
    asize = 4 if dtype is np.float32 else 8
    ks = np.empty((8 + asize) * m, dtype=np.uint8)
    ks[: 8 * m] = words.view(np.uint8)
    ks[8 * m :] = rng.integers(0, 256, asize * m, dtype=np.uint8)
    dt = np.dtype(dtype)
    outs = []
    for path in ("compiled", "numpy"):
        ck.select(path if HAVE_CC else "numpy")
        out = np.empty(2 * m, dtype=dt)
        cn.pairs_from_keystream(ks, m, dt, lambda i, j: 0, out[:m], out[m:])
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    for j in range(m):
        a = int.from_bytes(ks[8 * m + asize * j : 8 * m + asize * (j + 1)].tobytes(), "little")
        assert (outs[0][j], outs[0][m + j]) == ref_pair(int(words[j]), a, 0, dtype)
    radius = np.hypot(outs[0][:m].astype(np.float64), outs[0][m:].astype(np.float64))
    assert np.all(np.isfinite(radius)) and radius[0] == 0.0  # u = 1
    assert 0 < radius[3] < 1e-3  # u = 1 − 2⁻²⁴ in float32, closer in float64


def blt_reference(r: np.ndarray, theta: np.ndarray, omega: np.ndarray,
                  e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BLT's step one column at a time in the dtype's scalars, the order NumpyOps.blt_step
    defines: s = ω₀r₀ + ω₁r₁ + … left to right, e − s, then θᵢrᵢ + e."""
    e = e.copy()
    out = np.empty_like(r)
    k, d = r.shape
    for j in range(d):
        if k:
            s = omega[0] * r[0, j]
            for i in range(1, k):
                s = s + omega[i] * r[i, j]
            e[j] = e[j] - s
        for i in range(k):
            out[i, j] = theta[i, 0] * r[i, j] + e[j]
    return e, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("k", "d", "strided"), [(1, 1, False), (2, 513, False),
                                                 (4, 1100, True), (5, 700, False),
                                                 (0, 9, False)])
def test_the_blt_step_is_one_order_of_ieee_operations_on_both_paths(
        dtype: type, k: int, d: int, strided: bool) -> None:
    """BLT's recurrence (`NumpyOps.blt_step`, `cn_blt_steps32/64` at one step): the
    compiled pass and the NumPy path give the same floats as a scalar reference of the
    defined order, on rows that are a view of wider ones too. Why it matters: the noise a
    learner adds is then the same on every machine, with or without a compiler (a BLAS
    `ω @ r` sums in its own order)."""
    from flwr_corrnoise.mechanisms.streaming import numpy_ops

    rng = np.random.default_rng(k * 1000 + d)
    wide = rng.standard_normal((k, d + 37 if strided else d)).astype(dtype)
    r = wide[:, 5:5 + d] if strided else wide
    theta = rng.uniform(0.5, 1.0, (k, 1)).astype(dtype)
    omega = rng.standard_normal(k).astype(dtype)
    e0 = rng.standard_normal(d).astype(dtype)
    want_e, want_out = blt_reference(r, theta, omega, e0)
    ops = numpy_ops(dtype)
    for path in (["numpy", "compiled"] if HAVE_CC else ["numpy"]):
        ck.select(path)
        e, out = e0.copy(), np.empty((k, d), dtype=dtype)
        ops.blt_step(r, theta, omega, e, out)
        assert ck.status().startswith("compiled" if path == "compiled" else "NumPy")
        # the compiled pass takes this layout (it is not the NumPy path under another name)
        assert ops._compiled_steps(r, theta, omega, e0.copy()[None, :],
                                   np.empty((k, d), dtype=dtype), k, d) is (
            path == "compiled" and k > 0)
        np.testing.assert_array_equal(e, want_e, err_msg=path)
        np.testing.assert_array_equal(out, want_out, err_msg=path)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 3, 5, 6, 7])
@pytest.mark.parametrize("tau", [1, 2, 3, 5])
def test_the_compiled_blt_steps_are_the_steps_one_by_one(dtype: type, k: int, tau: int
                                                          ) -> None:
    """``cn_blt_steps32/64`` over τ steps — a block of columns stepped τ times while in
    cache: k ≤ 5 buffers kept in registers with two scratch blocks between steps, more
    buffers row by row in place — equal the scalar reference step after step, on buffers
    that are a view of wider ones, at a d that ends mid-block (the blocks are 128
    columns)."""
    from flwr_corrnoise.mechanisms.streaming import numpy_ops

    d = 300
    rng = np.random.default_rng(10 * k + tau)
    wide = rng.standard_normal((k, d + 11)).astype(dtype)
    r = wide[:, 3:3 + d]
    theta = rng.uniform(0.5, 1.0, (k, 1)).astype(dtype)
    omega = rng.standard_normal(k).astype(dtype)
    rows0 = rng.standard_normal((tau, d)).astype(dtype)
    want_rows, cur = [], r
    for t in range(tau):
        e, cur = blt_reference(cur, theta, omega, rows0[t])
        want_rows.append(e)
    ck.select("compiled")
    try:
        rows, out = rows0.copy(), np.empty((k, d), dtype=dtype)
        assert numpy_ops(dtype)._compiled_steps(r, theta, omega, rows, out, k, d)
    finally:
        ck.select(None)
    np.testing.assert_array_equal(rows, np.stack(want_rows))
    np.testing.assert_array_equal(out, cur)


def sumsq_reference(row: np.ndarray) -> float:
    """A row's sum of squares in the order learner.row_sums_of_squares defines, in Python's
    float64 scalars: 64 lanes (element i into lane i mod 64, in order), then the lanes
    left to right."""
    acc = [0.0] * 64
    for i, v in enumerate(float(x) for x in row):
        acc[i % 64] = acc[i % 64] + v * v
    total = acc[0]
    for lane in acc[1:]:
        total = total + lane
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("n", [0, 1, 15, 64, 65, 200, 2113, 5003])
def test_row_norms_are_one_order_on_both_paths(dtype: type, rows: int, n: int) -> None:
    """learner.row_sums_of_squares (the clip's norms): the compiled ``cn_sumsq32/64`` and
    the NumPy path give the same doubles as the scalar reference of the defined order, on
    rows that are a view of wider ones, across the short-row, few-block and many-block
    NumPy ways — so a learner with a compiler and one without clip by the same floats."""
    from flwr_corrnoise.learner import row_norms, row_sums_of_squares

    rng = np.random.default_rng(rows * 10_000 + n)
    wide = rng.standard_normal((rows, n + 7)) * rng.uniform(0.01, 100.0, (rows, 1))
    g = wide.astype(dtype)[:, 3:3 + n]
    want = np.array([sumsq_reference(r) for r in g])
    paths = ["numpy", "compiled"] if HAVE_CC else ["numpy"]
    for path in paths:
        ck.select(path)
        try:
            got = row_sums_of_squares(g)
            ck.kernel()  # (a few short rows never ask for it)
            assert ck.status().startswith("compiled" if path == "compiled" else "NumPy")
        finally:
            ck.select(None)
        np.testing.assert_array_equal(got, want, err_msg=path)
    np.testing.assert_array_equal(row_norms(g), np.sqrt(want))


def test_row_norms_of_non_finite_rows_are_not_finite() -> None:
    """A NaN or an infinity anywhere in a row makes its norm non-finite on both paths (the
    private step zeroes such a row; a float32 row's squares cannot overflow float64)."""
    from flwr_corrnoise.learner import row_norms

    g = np.ones((4, 300), dtype=np.float32)
    g[1, 5], g[2, 299], g[3, 130] = np.nan, np.inf, -np.inf
    for path in (["numpy", "compiled"] if HAVE_CC else ["numpy"]):
        ck.select(path)
        try:
            norms = row_norms(g)
        finally:
            ck.select(None)
        assert norms[0] == np.sqrt(300) and not np.isfinite(norms[1:]).any(), path


def scale_reference(row: np.ndarray, factor: float) -> np.ndarray:
    """Each element of a row times ``factor`` in Python's float64, then rounded to the
    row's dtype (one rounding, to nearest): the clip's scaling written out element by
    element."""
    return np.array([float(x) * factor for x in row], dtype=np.float64).astype(row.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 15, 64, 2113])
def test_scale_rows_is_one_product_and_one_rounding_on_both_paths(dtype: type, n: int) -> None:
    """learner.scale_rows (the clip's scaling): the compiled ``cn_scale32/64`` and the NumPy
    path give, on rows that are a view of wider ones, the floats of the masked
    ``g[over] *= (target / norms)[:, None]`` the private step used before, and of a scalar
    reference; a factor of 1 leaves its row (and its neighbours' columns) untouched."""
    from flwr_corrnoise.learner import scale_rows

    rng = np.random.default_rng(n)
    wide = (rng.standard_normal((5, n + 7)) * 37.0).astype(dtype)
    factors = np.array([0.3, 1.0, 1.0 / 3.0, 0.999999999, 1.0])
    over = factors != 1.0
    masked = wide.copy()
    view = masked[:, 3:3 + n]
    view[over] *= factors[over][:, None]
    want = np.array([scale_reference(row, f)
                     for row, f in zip(wide[:, 3:3 + n], factors, strict=True)])
    np.testing.assert_array_equal(view, want)
    for path in (["numpy", "compiled"] if HAVE_CC else ["numpy"]):
        ck.select(path)
        try:
            got = wide.copy()
            assert scale_rows(got[:, 3:3 + n], factors) is not None
            if path == "compiled":
                assert ck.status().startswith("compiled")
        finally:
            ck.select(None)
        np.testing.assert_array_equal(got, masked, err_msg=path)
    with pytest.raises(ValueError, match="one factor per row"):
        scale_rows(wide, factors[:2])
