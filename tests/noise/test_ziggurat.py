"""The ziggurat candidate that benchmarks/cipher_noise.py measures beside the kernel
(benchmarks/ziggurat_candidate.py; not the kernel, docs/benchmarks.md "Issue 34, third
pass"): a speed figure means something only for a correct sampler, so its tables against
mpmath, rows against a scalar reference bit for bit (the same cipher and counters, the
algorithm written out one normal at a time), the fallback's own counters, adversarial
words, the tail cut and the law."""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import mpmath
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from flwr_corrnoise import cipher_noise as cn

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ziggurat_candidate.py"
_SPEC = importlib.util.spec_from_file_location("ziggurat_candidate", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
zg = importlib.util.module_from_spec(_SPEC)
sys.modules["ziggurat_candidate"] = zg  # its dataclass looks itself up there
_SPEC.loader.exec_module(zg)

KEY = bytes(range(16))


# -- an independent table at 200 bits ---------------------------------------------------------
@functools.cache
def exact_layers() -> tuple[list, mpmath.mpf]:
    """``X_0 … X_256`` and ``v`` at 200 bits from the stated ``r``."""
    with mpmath.workprec(200):
        r = mpmath.mpf(zg.R_TEXT)
        f = lambda x: mpmath.exp(-x * x / 2)  # noqa: E731
        v = r * f(r) + mpmath.quad(f, [r, mpmath.inf])
        xs = [v / f(r), r]
        for _ in range(254):
            xs.append(mpmath.sqrt(-2 * mpmath.log(v / xs[-1] + f(xs[-1]))))
        xs.append(mpmath.mpf(0))
        return xs, v


@functools.cache
def ref_table() -> tuple[list[float], list[float], list[int]]:
    """Per layer: ``X_i·2⁻⁵²`` and ``f(X_i)`` rounded once, and ``K_i = ⌈2⁵²·X_{i+1}/X_i⌉``."""
    xs, _ = exact_layers()
    with mpmath.workprec(200):
        scale = [float(x * mpmath.mpf(2) ** -52) for x in xs[:256]]
        dens = [float(mpmath.exp(-x * x / 2)) for x in xs]
        limit = [int(mpmath.ceil(xs[i + 1] / xs[i] * mpmath.mpf(2) ** 52)) for i in range(256)]
    return scale, dens, limit


def aes_blocks(key: bytes, first: int, count: int) -> bytes:
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return enc.update(b"".join((first + i).to_bytes(16, "big") for i in range(count)))


def u128(hi: int, lo: int) -> float:
    return (float(hi) + (float(lo) + 0.5) * 2.0**-64) * 2.0**-64


def ref_normal(word: int, step_words, r: float = zg.R) -> float:
    """One float64 normal from its main word and its fallback steps' words, the algorithm
    of the module docstring written out with Python floats (NumPy only for log/exp)."""
    scale, dens, limit = ref_table()
    log = lambda x: float(np.log(np.float64(x)))  # noqa: E731
    exp = lambda x: float(np.exp(np.float64(x)))  # noqa: E731

    def candidate(w: int) -> tuple[int, int, int, float]:
        i, s, mant = w & 0xFF, (w >> 8) & 1, w >> 12
        return i, s, mant, float(mant) * (-scale[i] if s else scale[i])

    i, s, mant, value = candidate(word)
    if mant < limit[i]:
        return value
    k = 0
    while True:
        a, b, c, e = step_words(k)
        if i == 0:  # the tail
            xi = -log(u128(a, b)) / r
            y = -log(u128(c, e))
            if y + y > xi * xi:
                return -(r + xi) if s else r + xi
        else:  # the wedge, then a restart on b
            x = abs(value)
            if dens[i] + float(a >> 11) * 2.0**-53 * (dens[i + 1] - dens[i]) < exp(-0.5 * x * x):
                return value
            i, s, mant, value = candidate(b)
            if mant < limit[i]:
                return value
        k += 1


def ref_row(key: bytes, t: int, d: int, domain: int = 0) -> np.ndarray:
    """Row ``t``: word ``j`` of the CTR keystream at ``domain ‖ t ‖ 0`` is normal ``j``; its
    fallback step ``k`` is AES of ``(domain | 2) ‖ t ‖ j·2¹⁶ + 2k`` and the next block."""
    ks = aes_blocks(key, (domain << 120) | (t << 64), -(-8 * d // 16))
    out = np.empty(d)
    for j in range(d):
        w = int.from_bytes(ks[8 * j : 8 * j + 8], "little")
        base = ((domain | 2) << 120) | (t << 64) | (j << 16)

        def step(k: int, base: int = base) -> list[int]:
            b = aes_blocks(key, base + 2 * k, 2)
            return [int.from_bytes(b[8 * q : 8 * q + 8], "little") for q in range(4)]

        out[j] = ref_normal(w, step)
    return out


# -- the tables ----------------------------------------------------------------------------------
def test_the_tables_close_the_ziggurat_and_match_mpmath() -> None:
    """256 layers of area v: the base strip X_0·f(r) = v, each layer X_i·(f(X_{i+1}) − f(X_i))
    = v, and the top layer reaches the peak (X_255·(1 − f(X_255)) = v, so r is the closure's
    root); the module's float tables are these values rounded once, K exact."""
    xs, v = exact_layers()
    with mpmath.workprec(200):
        f = lambda x: mpmath.exp(-x * x / 2)  # noqa: E731
        assert abs(xs[0] * f(xs[1]) - v) < mpmath.mpf(2) ** -150
        for i in range(1, 255):
            assert abs(xs[i] * (f(xs[i + 1]) - f(xs[i])) - v) < mpmath.mpf(2) ** -150
        assert abs(xs[255] * (1 - f(xs[255])) - v) < mpmath.mpf(10) ** -40
    t = zg.tables()
    scale, dens, limit = ref_table()
    f64 = np.dtype(np.float64)
    assert list(t.scale[f64][:256]) == scale and list(t.scale[f64][256:]) == [-x for x in scale]
    assert list(t.f) == dens and list(t.accept[f64][:256]) == limit
    assert t.x[1] == zg.R == pytest.approx(3.6541528853610088, rel=1e-16)  # NumPy's r
    # the fast path accepts 98.5 % of words (Marsaglia & Tsang: ≈ 99 % with 256 layers)
    assert 0.984 < np.mean(np.array(limit, dtype=float)) * 2.0**-52 < 0.986


# -- rows against the reference ----------------------------------------------------------------
def rows(key: bytes, t: int, d: int, dtype: type = np.float64) -> np.ndarray:
    return zg.Rows(key).row(t, np.empty(d, dtype=dtype))


@pytest.mark.parametrize("d", [1, 2, 7, 1000, zg.CHUNK + 77])
def test_rows_equal_the_scalar_reference_bit_for_bit(d: int) -> None:
    """Short rows, the ≈ 15 fallbacks a row of 1000 has, and a row of two chunks whose
    fallbacks are batched at the end, against the reference."""
    for t in (0, 12345) if d < 1000 else (3,):
        np.testing.assert_array_equal(rows(KEY, t, d), ref_row(KEY, t, d))


def test_float32_rows_read_4_bytes_a_normal_and_round_the_same_values() -> None:
    """float32 rows: 32-bit words (23 mantissa bits) of their own domain; a word accepted
    at once is ``fl32(fl32(mantissa)·fl32(X_i·2⁻²³))``, checked against mpmath."""
    got = rows(KEY, 5, 3000, np.float32)
    ks = aes_blocks(KEY, (1 << 120) | (5 << 64), 3000 * 4 // 16)
    xs, _ = exact_layers()
    checked = 0
    with mpmath.workprec(200):
        for j in range(3000):
            w = int.from_bytes(ks[4 * j : 4 * j + 4], "little")
            i, s, mant = w & 0xFF, (w >> 8) & 1, w >> 9
            if mant < int(mpmath.ceil(xs[i + 1] / xs[i] * 2**23)):
                scale = np.float32(float(xs[i] * mpmath.mpf(2) ** -23))
                want = np.float32(mant) * scale
                assert got[j] == (-want if s else want)
                checked += 1
    assert 2900 < checked < 3000  # ≈ 1.5 % took the fallback
    assert 0.9 < float(np.var(got.astype(np.float64))) < 1.1


# -- adversarial words and the tail ---------------------------------------------------------------
def test_adversarial_words_every_branch_and_the_tail_cut() -> None:
    """Words that force each branch — the top layer (always a wedge), the base layer beyond
    r (the tail), a candidate just at its K — with fallback words that reach the largest
    accepted tail: every value equals the reference, none exceeds MAX_ABS, one is within
    10⁻³ of it."""
    _, _, limit = ref_table()
    words = [255 | (5 << 12), 255 | 256 | ((1 << 52) - 1) << 12,  # top layer
             0 | ((1 << 52) - 1) << 12, 256 | ((1 << 52) - 1) << 12,  # base layer: the tail
             7 | (limit[7] << 12), 7 | ((limit[7] - 1) << 12)]  # just rejected / accepted
    xi = 13.3720  # just below √(2·129·ln 2) = 13.3727: accepted with U₂ = 2⁻¹²⁹
    b = int(math.exp(-zg.R * xi) * 2.0**128)  # U₁ = (b + ½)·2⁻¹²⁸ ≈ e^{−rξ}
    rng = np.random.default_rng(5)
    script = {2: [[0, b, 0, 0]], 3: [[0, 0, 0, 0], [0, b, 0, 0]]}  # 3: one rejected try

    def step_words(j: int, k: int) -> list[int]:
        if j in script and k < len(script[j]):
            return script[j][k]
        return [int(x) for x in rng.integers(0, 2**63, 4, dtype=np.uint64) * np.uint64(2)]

    table = {(j, k): step_words(j, k) for j in range(len(words)) for k in range(4)}
    arr = np.array(words, dtype=np.uint64)[None]
    out = np.empty((1, len(words)))
    pending = zg.main_path(arr, out, zg.Workspace(8))
    assert pending is not None and list(pending) == [0, 1, 2, 3, 4]  # word 5: accepted
    out[0, pending] = zg.finish(arr[0, pending], np.dtype(np.float64), lambda p, k: np.array(
        [table[int(pending[j]), k] for j in p], dtype=np.uint64))
    want = [ref_normal(w, lambda k, j=j: table[j, k]) for j, w in enumerate(words)]
    assert list(out[0]) == want
    assert np.abs(out).max() <= zg.MAX_ABS
    assert abs(out[0, 2]) == pytest.approx(zg.MAX_ABS, abs=1e-3) and out[0, 3] < -zg.R
    assert pytest.approx(zg.R + math.sqrt(2 * 129 * math.log(2)), rel=1e-15) == zg.MAX_ABS


def test_a_fallback_that_never_accepts_fails_the_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keystream of zeros (the tail's U₁ = U₂ = 2⁻¹²⁹, always rejected): after MAX_STEPS
    steps the draw raises — no value is made up."""
    monkeypatch.setattr(zg, "MAX_STEPS", 16)
    with pytest.raises(RuntimeError, match="did not finish"):
        zg.finish(np.array([(1 << 52) - 1 << 12], dtype=np.uint64), np.dtype(np.float64),
                  lambda pend, k: np.zeros((len(pend), 4), dtype=np.uint64))


def test_fallback_blocks_are_their_own_counters() -> None:
    ecb = Cipher(algorithms.AES(KEY), modes.ECB()).encryptor()
    got = zg.fallback_blocks(ecb, 4, np.array([7, 2**55]), np.array([0, 12345]), 3)
    for (t, j), row in zip([(7, 0), (2**55, 12345)], got, strict=True):
        b = aes_blocks(KEY, (6 << 120) | (t << 64) | (j << 16) | 6, 2)
        assert [int(x) for x in row] == [int.from_bytes(b[8 * q : 8 * q + 8], "little")
                                         for q in range(4)]


def test_the_tail_eta_against_an_independent_computation() -> None:
    """η per draw 2⁻¹²⁷ covers what the grid cannot follow: a tail iteration with U₁ or U₂
    in its lowest cell (2·2⁻¹²⁸), times the expected tail iterations per draw — below one
    (mpmath: P(base layer beyond r) / P(the tail loop accepts) ≈ 2.8·10⁻⁴)."""
    xs, _ = exact_layers()
    with mpmath.workdps(40):
        r = xs[1]
        visit = (1 - r / xs[0]) / 256  # a first try lands in the tail
        accept = r * mpmath.sqrt(2 * mpmath.pi) * mpmath.exp(r * r / 2) * mpmath.ncdf(-r)
        per_draw = visit / accept / 0.98  # ≤ 1/0.98 tries a draw (every try rejects < 2 %)
    assert 2e-4 < float(per_draw) < 3e-4
    assert 2 * 2.0**-128 * float(per_draw) <= zg.TAIL_TV_PER_DRAW == 2.0**-127
    assert (1 + math.exp(8)) * cn.tail_tv(10**10, per_pair=2 * zg.TAIL_TV_PER_DRAW) < 1e-24


def test_moments_ks_and_tails_of_float64_rows() -> None:
    """10⁶ float64 draws: moments within 5 standard errors, KS against N(0, 1), the
    tail frequencies beyond 3, r and 4."""
    z = rows(cn.key_from_seed(99), 0, 10**6)
    n = z.size
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
    assert abs(stats.skew(z)) < 5 * math.sqrt(6) * se
    assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24) * se
    assert stats.kstest(z, "norm").pvalue > 1e-3
    for x in (3.0, 3.6541, 4.0):  # 3.6541: the base layer's edge r, where the tail begins
        p = 2 * stats.norm.sf(x)
        assert abs(np.mean(np.abs(z) > x) - p) < 5 * math.sqrt(p / n) + 1e-7
