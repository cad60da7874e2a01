"""The AES-128-CTR noise kernel (flwr_corrnoise/cipher_noise.py): a scalar reference bit for
bit, rows by counter, state that continues bit for bit, keys, the law and its tail."""

from __future__ import annotations

import functools
import math
import struct

import mpmath
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from flwr_corrnoise import cipher_noise as cn
from flwr_corrnoise.cipher_noise import CipherGaussian

K = cn.CHUNK_PAIRS
DTYPES = [np.float32, np.float64]


# -- a straightforward scalar reference: the same cipher and counter, pure-Python bits -------
def f32_of_int(x: int) -> np.float32:
    """``x`` rounded to the nearest float32 (ties to even), in integer arithmetic."""
    e = x.bit_length()
    if e > 24:
        shift = e - 24
        q, rem = divmod(x, 1 << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and q & 1):
            q += 1
        x = q << shift
    return np.float32(float(x))  # exact: x has at most 24 significant bits


def ref_uniform(w: int, dtype: type) -> np.floating:
    """Transform 2's uniform of a main-path radius word: ``hi = w >> 33`` and the next 31
    bits ``lo``, each an exact integer rounded to the dtype, ``hi·2⁻³¹ + (lo·2⁻⁶² + 2⁻⁶³)``
    in the dtype's arithmetic."""
    hi, lo = w >> 33, (w >> 2) & 0x7FFF_FFFF
    if dtype is np.float32:
        return (f32_of_int(hi) * np.float32(2.0**-31)
                + (f32_of_int(lo) * np.float32(2.0**-62) + np.float32(2.0**-63)))
    return np.float64(float(hi) * 2.0**-31 + (float(lo) * 2.0**-62 + 2.0**-63))


@functools.cache
def exact_ln(x: float) -> float:
    """``ln x`` correctly rounded to float64 (mpmath at 200 bits)."""
    with mpmath.workprec(200):
        return float(mpmath.log(mpmath.mpf(x)))


def ref_ln(u: np.floating) -> np.floating:
    """``ln u`` as the kernel defines it, from the bits (``struct``), one scalar IEEE step at
    a time in ``u``'s dtype. float32: ``u = 2^e·x``, ``x`` in ``(fl(√½), fl(√2)]``,
    ``s = (x − 1)/(x + 1)``, ``ln x = s·Σ_{j<5} 2s^{2j}/(2j + 1)``. float64: ``x ∈ [1, 2)``,
    ``c = 1 + i/128`` from its top 7 mantissa bits, ``r = (x − c)·fl(1/c)``,
    ``ln u = (e·ln 2 + ln c) + Σ_{k≤8} (−1)^{k+1} r^k/k``, and for ``u ∈ [½, 1)`` ``e = 0``
    with ``ln(c/2)`` in place of ``ln c``."""
    if isinstance(u, np.float32):
        bits = struct.unpack("<I", struct.pack("<f", u))[0]
        e = (bits >> 23) - 127
        xbits = (bits & ((1 << 23) - 1)) | (127 << 23)
        if xbits > struct.unpack("<I", struct.pack("<f", np.float32(math.sqrt(2.0))))[0]:
            xbits -= 1 << 23
            e += 1
        x = np.float32(struct.unpack("<f", struct.pack("<I", xbits))[0])
        s = (x - np.float32(1)) / (x + np.float32(1))
        z = s * s
        p = np.float32(2.0 / 9)
        for j in (3, 2, 1, 0):
            p = p * z + np.float32(2.0 / (2 * j + 1))
        return np.float32(e) * np.float32(math.log(2.0)) + p * s
    bits = struct.unpack("<Q", struct.pack("<d", float(u)))[0]
    e = (bits >> 52) - 1023
    i = (bits >> 45) & 127
    x = struct.unpack("<d", struct.pack("<Q", (bits & ((1 << 52) - 1)) | (1023 << 52)))[0]
    c = 1.0 + i / 128
    r = (x - c) * (1.0 / c)
    p = -1.0 / 8
    for k in (7, 6, 5, 4, 3, 2, 1):
        p = p * r + (-1.0) ** (k + 1) / k
    lnc = exact_ln(c / 2) if e == -1 else exact_ln(c)
    return np.float64((float(0 if e == -1 else e) * math.log(2.0) + lnc) + p * r)


def ref_radius(w: int, v: int, dtype: type, below: int = 1 << 32) -> np.floating:
    if w >= below:  # R = √(−2·ln u), in the dtype (+ 0: a −0 becomes +0)
        u = ref_uniform(w, dtype)
        return np.sqrt(max(ref_ln(u) * u.dtype.type(-2) + u.dtype.type(0), u.dtype.type(0)))
    u = math.ldexp(float(2 * (w * 2**64 + v) + 1), -129)  # the 128-bit refill uniform
    r = np.sqrt(max(ref_ln(np.float64(u)) * -2.0 + 0.0, 0.0))
    return np.float32(r) if dtype is np.float32 else r


@functools.cache
def exact_table(i: int) -> tuple[float, float]:
    """``(cos, sin)(2πi/2048)`` at 200 bits, directly (no symmetry), correctly rounded."""
    with mpmath.workprec(200):
        x = 2 * mpmath.pi * i / (1 << cn.TABLE_BITS)
        c, s = mpmath.cos(x), mpmath.sin(x)
        # π is rounded at 200 bits: a value within 2⁻¹⁹⁰ of 0 is the exact zero
        return (0.0 if abs(c) < 2**-190 else float(c)), (0.0 if abs(s) < 2**-190 else float(s))


def ref_pair(radius_word: int, angle_word: int, refill_word: int, dtype: type,
             below: int = 1 << 32) -> tuple[np.floating, np.floating]:
    """The top 11 bits of the angle word pick a sector of ``2π/2048`` (the correctly rounded
    table, rounded again to float32 for float32 rows), the low bits (21 of a float32 word,
    52 of a float64 one) the offset ``φ`` in it; ``sin φ``, ``cos φ − 1`` by their Taylor
    polynomials, then the rotation."""
    r = ref_radius(radius_word, refill_word, dtype, below)
    if dtype is np.float32:
        i, f = angle_word >> 21, angle_word & ((1 << 21) - 1)
        phi = np.float32(f) * np.float32(2 * math.pi * 2.0**-32)
        t = phi * phi
        sn = (t * np.float32(-1.0 / 6.0)) * phi + phi
        cm = t * np.float32(-0.5)
        c, s = (np.float32(v) for v in exact_table(i))
        rc, rs = c * r, s * r
        return rc + (rc * cm - rs * sn), rs + (rs * cm + rc * sn)
    i, f = angle_word >> 53, angle_word & ((1 << 52) - 1)
    phi = float(f) * (2 * math.pi * 2.0**-63)
    t = phi * phi
    sn = (t * (1.0 / 120.0) - 1.0 / 6.0) * t * phi + phi
    cm = (t * (1.0 / 24.0) - 0.5) * t
    c, s = exact_table(i)
    rc, rs = c * float(r), s * float(r)
    return np.float64(rc + (rc * cm - rs * sn)), np.float64(rs + (rs * cm + rc * sn))


def aes_block(key: bytes, block: int, count: int = 1) -> bytes:
    """AES of the counter blocks ``block … block + count − 1`` (128-bit integers), one
    after the other: ECB, no CTR code."""
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return enc.update(b"".join((block + i).to_bytes(16, "big") for i in range(count)))


def ref_row(key: bytes, t: int, d: int, dtype: type, below: int = 1 << 32,
            refills: list[tuple[int, int]] | None = None) -> np.ndarray:
    """Row ``t`` by the scalar reference; ``refills`` (if given) collects ``(t, pair)`` of
    every refill word it reads."""
    dom = 1 if dtype is np.float32 else 0
    size = 12 if dtype is np.float32 else 16
    pairs = (d + 1) // 2
    start = (dom << 120) | (t << 64)
    nblocks = -(-size * pairs // 16)
    ks = aes_block(key, start, nblocks)
    z = np.empty(d, dtype=dtype)
    pos = 0
    for first in range(0, pairs, K):
        m = min(K, pairs - first)
        chunk, pos = ks[pos : pos + size * m], pos + size * m
        asize = size - 8
        for j in range(m):
            w = int.from_bytes(chunk[8 * j : 8 * j + 8], "little")
            a = int.from_bytes(chunk[8 * m + asize * j : 8 * m + asize * (j + 1)], "little")
            v = 0
            if w < below:
                if refills is not None:
                    refills.append((t, first + j))
                refill = ((dom | 2) << 120) | (t << 64) | (first + j)
                v = int.from_bytes(aes_block(key, refill)[:8], "little")
            c, s = ref_pair(w, a, v, dtype, below)
            z[2 * first + j] = c
            if 2 * first + m + j < d:
                z[2 * first + m + j] = s
    return z


KEY = bytes(range(16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 2, 7, 10])
def test_small_rows_equal_the_scalar_reference_bit_for_bit(dtype: type, d: int) -> None:
    gen = CipherGaussian(KEY)
    for t in (0, 1, 12345):
        row = gen.row(t, d, dtype)
        assert row.dtype == dtype
        np.testing.assert_array_equal(row, ref_row(KEY, t, d, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_of_several_chunks_equals_the_reference(dtype: type) -> None:
    d = 2 * K + 2 * 37 + 1  # two whole chunks and an odd tail
    np.testing.assert_array_equal(CipherGaussian(KEY).row(3, d, dtype),
                                  ref_row(KEY, 3, d, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_short_rows_drawn_together_and_a_one_chunk_row_equal_the_reference(
        dtype: type) -> None:
    """Short rows come from one ECB context over counter blocks, several in one batch (and
    a row of a whole chunk alone): the CTR keystream, the reference's rows."""
    rows = CipherGaussian(KEY).rows(7, 5, 33, dtype)
    for i in range(5):
        np.testing.assert_array_equal(rows[i], ref_row(KEY, 7 + i, 33, dtype))
    d = 2 * K - 1
    np.testing.assert_array_equal(CipherGaussian(KEY).row(2, d, dtype), ref_row(KEY, 2, d, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [5, 3000, 2 * K + 4])
def test_rows_of_several_keys_at_once_are_each_keys_rows(dtype: type, d: int) -> None:
    """next_rows_of: L generators at different positions, count rows each, short rows of
    all keys in shared transforms (batches that straddle keys), long ones by CTR: each
    slice is that generator's own next rows, and every position moves on by count."""
    gens = [CipherGaussian.from_seed(s) for s in (1, 2, 3)]
    for g, p in zip(gens, (0, 7, 2**40), strict=True):
        g.position = p
    count = 3 if d < K else 1
    out = cn.next_rows_of(gens, np.empty((3, count, d), dtype=dtype))
    for g, p, block in zip(gens, (0, 7, 2**40), out, strict=True):
        np.testing.assert_array_equal(block, CipherGaussian.from_seed(
            [1, 2, 3][gens.index(g)]).rows(p, count, d, dtype))
        assert g.position == p + count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [41, 2 * K + 3])
def test_the_refill_path_end_to_end(dtype: type, d: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With the refill threshold raised to 2⁶³ about half the pairs take the refill path
    (its words from their own domain at the pair's index), in short rows (ECB, two in one
    transform) and a long one (CTR): the rows equal the reference with the same threshold,
    and the kernel asks for exactly the reference's refill words (a refill word's bits
    reach the float only below 2⁵², so the rows alone would not see a wrong pair index)."""
    monkeypatch.setattr(cn, "REFILL_BELOW", 1 << 63)
    asked: list[tuple[int, int]] = []
    real = cn._Keystream.refill_word

    def spy(self: cn._Keystream, domain: int, t: int, pair: int) -> int:
        asked.append((t, pair))
        return real(self, domain, t, pair)

    monkeypatch.setattr(cn._Keystream, "refill_word", spy)
    count = 2 if d < K else 1
    got = CipherGaussian(KEY).rows(9, count, d, dtype)
    want: list[tuple[int, int]] = []
    for i in range(count):
        np.testing.assert_array_equal(got[i], ref_row(KEY, 9 + i, d, dtype, below=1 << 63,
                                                      refills=want))
    assert want and sorted(asked) == sorted(want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_keystream_reaches_the_stated_maximum_radius(dtype: type) -> None:
    """All-zero radius words and refill words: u = 2⁻¹²⁹, the largest radius, exactly the
    stated cut; a chunk mixing extreme and random words equals the reference."""
    m = 64
    rng = np.random.default_rng(0)
    ks = rng.integers(0, 256, 16 * m, dtype=np.uint8)
    words = ks[: 8 * m].view("<u8")
    words[::2] = 0  # w = 0: the refill path
    words[1::4] = (1 << 32) - 1  # just below the threshold
    words[3::8] = 1 << 32  # the smallest main-path word
    refills = {j: (0 if j % 4 == 0 else int(rng.integers(0, 2**63)) * 2 + 1) for j in range(m)}
    dt = np.dtype(dtype)
    out = np.empty(2 * m, dtype=dt)
    cn.pairs_from_keystream(ks, m, dt, lambda i, j: refills[j], out[:m], out[m:])
    asize = 4 if dtype is np.float32 else 8
    for j in range(m):
        a = int.from_bytes(ks[8 * m + asize * j : 8 * m + asize * (j + 1)].tobytes(), "little")
        c, s = ref_pair(int(words[j]), a, refills[j], dtype)
        assert (out[j], out[m + j]) == (c, s)
    radius = np.hypot(out[:m].astype(np.float64), out[m:].astype(np.float64))
    extreme = radius[::4]  # w = 0 and v = 0: u = 2⁻¹²⁹
    rtol = 1e-6 if dtype is np.float32 else 1e-14
    np.testing.assert_allclose(extreme, cn.MAX_RADIUS, rtol=rtol)
    assert radius.max() <= cn.MAX_RADIUS * (1 + rtol)
    assert pytest.approx(13.37, abs=0.01) == cn.MAX_RADIUS


def test_refill_words_come_from_their_own_domain() -> None:
    for dom, t, p in [(0, 0, 0), (1, 5, 12345), (4, 2**55, 2**63)]:
        expect = int.from_bytes(aes_block(KEY, ((dom | 2) << 120) | (t << 64) | p)[:8], "little")
        assert cn._Keystream(KEY).refill_word(dom, t, p) == expect


def test_the_direction_table_is_correctly_rounded() -> None:
    cos_t, sin_t = cn.direction_table()
    assert cos_t.shape == (1 << cn.TABLE_BITS,) and not cos_t.flags.writeable
    for i in range(1 << cn.TABLE_BITS):
        assert (cos_t[i], sin_t[i]) == exact_table(i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_transform_is_accurate_to_a_few_ulps(dtype: type) -> None:
    """Given the uniform ``u`` the kernel forms from the bits (the format's discretization:
    ``hi·2⁻³¹ + (lo·2⁻⁶² + 2⁻⁶³)`` in the dtype) and the angle (a sector of ``2π/2048`` and
    the offset ``2π·f·2⁻³²`` (float32) or ``2π·f·2⁻⁶³`` (float64)), each normal is within 4
    ulps (of its radius) of Box–Muller in exact arithmetic (mpmath, 120 bits): the ``atanh``
    series, the table, the polynomials and the float steps lose nothing more."""
    d = 400
    row = CipherGaussian(KEY).row(4, d, dtype)
    size = 12 if dtype is np.float32 else 16
    start = ((1 if dtype is np.float32 else 0) << 120) | (4 << 64)
    ks = aes_block(KEY, start, -(-size * d // 2 // 16))
    m, asize = d // 2, size - 8
    worst = 0.0
    with mpmath.workprec(120):
        for j in range(m):
            w = int.from_bytes(ks[8 * j : 8 * j + 8], "little")
            a = int.from_bytes(ks[8 * m + asize * j : 8 * m + asize * (j + 1)], "little")
            u = mpmath.mpf(float(ref_uniform(w, dtype)))
            if dtype is np.float32:
                theta = 2 * mpmath.pi * (mpmath.mpf(a >> 21) / 2048
                                         + mpmath.mpf(a & ((1 << 21) - 1)) / 2**32)
            else:
                theta = 2 * mpmath.pi * (mpmath.mpf(a >> 53) / 2048
                                         + mpmath.mpf(a & ((1 << 52) - 1)) / 2**63)
            r = mpmath.sqrt(-2 * mpmath.log(u))
            ulp = float(np.spacing(np.asarray(float(r), dtype=dtype)))
            for got, exact in ((row[j], r * mpmath.cos(theta)),
                               (row[m + j], r * mpmath.sin(theta))):
                worst = max(worst, abs(float(got) - float(exact)) / ulp)
    assert worst <= 4.0


# -- rows by counter --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_t_is_the_same_whatever_was_drawn_before(dtype: type) -> None:
    fresh = CipherGaussian.from_seed(11).row(5, 1000, dtype)
    busy = CipherGaussian.from_seed(11)
    busy.rows(0, 5, 1000, dtype)
    busy.standard_normal(12345, dtype=dtype)
    busy.row(6, 77, np.float64)
    np.testing.assert_array_equal(busy.row(5, 1000, dtype), fresh)
    cursor = CipherGaussian.from_seed(11)
    drawn = [cursor.next_row(1000, dtype) for _ in range(6)]
    np.testing.assert_array_equal(drawn[5], fresh)
    assert cursor.position == 6
    np.testing.assert_array_equal(np.stack(drawn),
                                  CipherGaussian.from_seed(11).rows(0, 6, 1000, dtype))


def test_different_rows_keys_and_dtypes_differ() -> None:
    a, b = CipherGaussian.from_seed(1), CipherGaussian.from_seed(2)
    rows = [a.row(0, 64), a.row(1, 64), b.row(0, 64), a.row(0, 64, np.float32)]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not np.any(rows[i].astype(np.float64) == rows[j].astype(np.float64))
    # seeds that share their low 64 bits still give unrelated keys (every bit is hashed)
    assert cn.key_from_seed(5) != cn.key_from_seed(5 + 2**64)


def test_out_arguments_are_checked_and_written() -> None:
    gen = CipherGaussian(KEY)
    out = np.empty(10, dtype=np.float32)
    assert gen.row(2, 10, np.float32, out=out) is out
    np.testing.assert_array_equal(out, gen.row(2, 10, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        gen.row(2, 10, np.float64, out=out)
    with pytest.raises(ValueError, match="float32 or float64"):
        gen.row(2, 10, np.float16)
    with pytest.raises(ValueError, match="row index"):
        gen.row(2**56, 10)


# -- the sequential stream and the state ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_sequential_draws_do_not_depend_on_how_they_are_cut(dtype: type) -> None:
    n = 2 * (2 * K) + 999  # crosses two chunk boundaries
    whole = CipherGaussian.from_seed(3).standard_normal(n, dtype=dtype)
    gen = CipherGaussian.from_seed(3)
    cuts = [1, 2 * K - 1, 10, 2 * K + 500]
    parts = [gen.standard_normal(k, dtype=dtype) for k in [*cuts, n - sum(cuts)]]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert gen.sequential == n


def test_pack_unpack_continues_bit_for_bit() -> None:
    gen = CipherGaussian.from_seed(17)
    gen.next_row(100, np.float32)
    gen.standard_normal(12347)
    words = gen.pack()
    assert words.dtype == np.uint64 and words.shape == (5,) and cn.is_packed(words)
    again = CipherGaussian.unpack(words)
    assert again.state == gen.state
    after = [(g.next_row(300, np.float32), g.standard_normal(20000), g.next_row(9))
             for g in (gen, again)]
    for x, y in zip(*after, strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="cipher-noise"):
        CipherGaussian.unpack(words[:4])
    bad = words.copy()
    bad[0] += np.uint64(1)
    with pytest.raises(ValueError, match="cipher-noise"):
        CipherGaussian.unpack(bad)
    assert "key" not in repr(gen) and str(gen.key) not in repr(gen)
    import pickle

    clone = pickle.loads(pickle.dumps(gen))  # e.g. to a Ray worker: no OpenSSL context
    assert clone.state == gen.state
    np.testing.assert_array_equal(clone.next_row(50), gen.next_row(50))


def test_a_transform_1_state_is_refused_with_a_clear_error() -> None:
    """A generator saved before transform 2 (tag ``…0003``) would continue with other rows
    than it released: refused, saying why, never continued quietly."""
    words = CipherGaussian.from_seed(1).pack()
    assert int(words[0]) == cn.STATE_TAG != cn.TRANSFORM1_TAG
    words[0] = np.uint64(cn.TRANSFORM1_TAG)
    with pytest.raises(ValueError, match=r"transform 1.*start a new stream"):
        CipherGaussian.unpack(words)


def test_keys_have_128_bits_from_os_entropy_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    real = cn.secrets.token_bytes

    def spy(n: int) -> bytes:
        asked.append(n)
        return real(n)

    monkeypatch.setattr(cn.secrets, "token_bytes", spy)
    keys = {CipherGaussian.from_seed(None).key for _ in range(32)}
    keys |= {CipherGaussian.from_os_entropy().key for _ in range(32)}
    assert asked == [16] * 64 and len(keys) == 64
    assert max(k.bit_length() for k in keys) > 120  # 128-bit keys, not a 32/64-bit seed
    with pytest.raises(ValueError, match="16 bytes"):
        CipherGaussian(bytes(8))


# -- the law and its tail ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_and_ks_against_the_normal(dtype: type) -> None:
    """10⁶ draws (the suite's budget; ``benchmarks/cipher_noise.py --ks 10000000`` runs the
    issue's 10⁷ once): mean, variance, skewness, kurtosis within 5 standard errors, and a
    Kolmogorov–Smirnov test against N(0, 1), on rows and on the sequential stream."""
    gen = CipherGaussian.from_seed(2024)
    n = 10**6
    for z in (gen.rows(0, 4, n // 4, dtype).reshape(-1), gen.standard_normal(n, dtype=dtype)):
        z = z.astype(np.float64)
        se = 1 / math.sqrt(n)
        assert abs(z.mean()) < 5 * se
        assert abs(z.var() - 1) < 5 * math.sqrt(2) * se
        assert abs(stats.skew(z)) < 5 * math.sqrt(6) * se
        assert abs(stats.kurtosis(z)) < 5 * math.sqrt(24) * se
        assert stats.kstest(z, "norm").pvalue > 1e-3
        # the tails, too: P(|z| > 3) and P(|z| > 4) within 5 binomial standard errors
        for x in (3.0, 4.0):
            p = 2 * stats.norm.sf(x)
            assert abs(np.mean(np.abs(z) > x) - p) < 5 * math.sqrt(p / n) + 1e-7


def test_the_tail_cut_and_eta_against_independent_computations() -> None:
    # the stated figures: 24-bit uniforms cut at 5.8σ, 32-bit at 6.7σ, 53-bit at 8.6σ
    for bits, figure in [(24, 5.77), (32, 6.66), (53, 8.57), (129, 13.37)]:
        cut = cn.uniform_tail_cut(bits)
        assert cut == pytest.approx(figure, abs=0.005)
        assert cut == pytest.approx(math.sqrt(stats.chi2(2).isf(2.0**-bits)), rel=1e-9)
    assert pytest.approx(cn.uniform_tail_cut(129), rel=1e-15) == cn.MAX_RADIUS
    # η: the mass beyond the cut of a Gaussian pair's radius, by mpmath (2-D normal tail)
    with mpmath.workdps(50):
        r = mpmath.mpf(cn.MAX_RADIUS)
        beyond = mpmath.quad(lambda x: x * mpmath.exp(-x * x / 2), [r, mpmath.inf])
        assert float(beyond) == pytest.approx(2.0**-129, rel=1e-9)
        one_d = 2 * mpmath.ncdf(-r)  # a single coordinate's tail is smaller still
    assert float(beyond) <= cn.TAIL_TV_PER_PAIR and float(one_d) < float(beyond)
    assert cn.tail_tv_per_draw() == cn.TAIL_TV_PER_PAIR / 2
    assert cn.tail_tv(10**10) == pytest.approx(5e9 * 2.0**-128)
    assert cn.tail_tv(3) == 2 * cn.TAIL_TV_PER_PAIR  # an odd count uses ⌈n/2⌉ pairs
    # 10¹⁰ draws at ε = 8: (1 + e^ε)·η_total is negligible beside any δ in use
    assert (1 + math.exp(8)) * cn.tail_tv(10**10) < 1e-25
    # a 32-bit uniform would not be: 6.7σ gives η_total ≈ 1 at 10¹⁰ draws
    assert cn.tail_tv(10**10, per_pair=2.0**-32) > 1


# -- rows computed ahead (next_row's ahead=: a cache, not state) -------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 2, 33, 1000, cn.ROW_CACHE_FLOATS // 2 + 1])
def test_rows_computed_ahead_are_the_rows_one_at_a_time(dtype: type, d: int) -> None:
    n = 40
    want = CipherGaussian.from_seed(21).rows(3, n, d, dtype)
    gen = CipherGaussian(cn.key_from_seed(21), position=3)
    out = np.empty(d, dtype=dtype)
    got = []
    for i in range(n):
        if i % 3 == 2:  # into a given array, too
            got.append(gen.next_row(d, dtype, out=out, ahead=n - i).copy())
        else:
            got.append(gen.next_row(d, dtype, ahead=n - i))
        assert gen.position == 4 + i  # the counter moves one row a call, as without ahead
        cache = gen._cache
        assert cache is None or cache.size <= cn.ROW_CACHE_FLOATS  # bounded memory
        if 2 * d > cn.ROW_CACHE_FLOATS:
            assert cache is None  # a long row is never computed ahead
        else:  # never past what the caller said it may draw
            assert cache is None or cache.shape[0] - gen._cache_at <= n - i - 1
    np.testing.assert_array_equal(np.stack(got), want)  # bit for bit, each row once
    assert gen._cache is None  # the last row handed out: nothing kept


def test_rows_ahead_are_not_state_and_are_dropped_when_the_counter_moves() -> None:
    d, dtype = 5, np.float32
    want = CipherGaussian.from_seed(4).rows(0, 200, d, dtype)
    gen = CipherGaussian.from_seed(4)
    for _ in range(3):
        gen.next_row(d, dtype, ahead=200)
    assert gen._cache is not None  # rows 3… computed ahead
    plain = CipherGaussian.from_seed(4)
    plain.position = 3
    # the state, the packed words and a pickle are the counter, never the cached rows
    assert gen.state == plain.state
    np.testing.assert_array_equal(gen.pack(), plain.pack())
    import pickle

    clone = pickle.loads(pickle.dumps(gen))
    assert clone._cache is None and clone.position == 3
    # a rollback (the state set back) drops the cache: the same rows again, by design
    token = gen.state
    a = [gen.next_row(d, dtype, ahead=200) for _ in range(4)]
    gen.state = token
    assert gen._cache is None
    b = [gen.next_row(d, dtype, ahead=200) for _ in range(4)]
    np.testing.assert_array_equal(np.stack(a), want[3:7])
    np.testing.assert_array_equal(np.stack(b), want[3:7])
    # a seek (the counter moved from outside) drops it: the row at the new counter
    gen.position += 10
    assert gen._cache is None
    np.testing.assert_array_equal(gen.next_row(d, dtype, ahead=200), want[17])
    gen.position = 2
    np.testing.assert_array_equal(gen.next_row(d, dtype, ahead=200), want[2])
    # another d or dtype at the same counter: that row, not a cached one of the old shape
    np.testing.assert_array_equal(gen.next_row(d, np.float64, ahead=200),
                                  CipherGaussian.from_seed(4).row(3, d, np.float64))
    np.testing.assert_array_equal(gen.next_row(d + 1, dtype, ahead=200),
                                  CipherGaussian.from_seed(4).row(4, d + 1, dtype))
    # another key: dropped, the new key's rows
    gen.next_row(d, dtype, ahead=200)
    assert gen._cache is not None
    gen.state = (cn.key_from_seed(5), 0, 0)
    assert gen._cache is None
    np.testing.assert_array_equal(gen.next_row(d, dtype, ahead=200),
                                  CipherGaussian.from_seed(5).row(0, d, dtype))


# -- Laplace rows (the decentralized algorithms' noise) -----------------------------------------
def ref_laplace(key: bytes, t: int, n: int) -> np.ndarray:
    """Pure-Python bits: draw i reads AES(0x08 ‖ t ‖ i) (one block), sign from bit 0 of the
    first word, U = (k₁ + (k₂ + 1)·2⁻⁵³)·2⁻⁵³ in Python floats, x = ±(−ln U)."""
    blocks = aes_block(key, (0x08 << 120) | (t << 64), n)
    out = np.empty(n)
    for i in range(n):
        a = int.from_bytes(blocks[16 * i : 16 * i + 8], "little")
        b = int.from_bytes(blocks[16 * i + 8 : 16 * i + 16], "little")
        u = (float(a >> 11) + (float(b >> 11) + 1.0) * 2.0**-53) * 2.0**-53
        e = -np.log(np.float64(u))
        out[i] = -e if a & 1 else e
    return out


@pytest.mark.parametrize("n", [1, 5, 1000, 2 * K + 3])
def test_laplace_rows_equal_the_scalar_reference_bit_for_bit(n: int) -> None:
    gen = CipherGaussian(KEY, position=9)
    got = gen.next_laplace(n)
    np.testing.assert_array_equal(got, ref_laplace(KEY, 9, n))
    assert gen.position == 10
    np.testing.assert_array_equal(gen.laplace_row(9, n), got)  # addressable by counter
    # a Laplace row shares no keystream with the Gaussian rows of the same counter
    assert not np.array_equal(CipherGaussian(KEY).row(9, n)[:n], got)


def test_laplace_extremes_and_the_tail_cut() -> None:
    ks = np.zeros(16 * 4, dtype=np.uint8)
    words = ks.view("<u8")
    words[2] = 1  # draw 1: all-zero k₁, k₂ and sign bit 1
    words[4] = words[5] = (1 << 64) - 1  # draw 2: U = 1 → 0 (sign 1: −0.0)
    words[6] = 1 << 11  # draw 3: k₁ = 1
    out = cn.laplace_from_keystream(ks, np.empty(4))
    assert out[0] == pytest.approx(cn.LAPLACE_MAX, rel=1e-15) and out[1] == -out[0]
    assert out[2] == 0.0
    assert out[3] == pytest.approx(53 * math.log(2), rel=1e-12)  # U ≈ 2⁻⁵³
    assert pytest.approx(106 * math.log(2), rel=1e-15) == cn.LAPLACE_MAX
    # the cut's mass: P(|Lap(1)| > 73.5) = e^{−73.5} = 2⁻¹⁰⁶, by mpmath
    with mpmath.workdps(40):
        assert float(mpmath.exp(-mpmath.mpf(cn.LAPLACE_MAX))) == pytest.approx(
            cn.LAPLACE_TAIL_TV, rel=1e-12)
    with pytest.raises(ValueError, match="16 keystream bytes"):
        cn.laplace_from_keystream(ks[:40], np.empty(3))


def test_laplace_law_moments_and_ks() -> None:
    x = CipherGaussian.from_seed(77).next_laplace(10**6)
    n = x.size
    assert abs(x.mean()) < 5 * math.sqrt(2 / n)
    assert abs(x.var() - 2) < 5 * math.sqrt(20 / n)  # Var(X²) = E X⁴ − 4 = 24 − 4
    assert stats.kstest(x, stats.laplace.cdf).pvalue > 1e-3
    assert stats.kstest(np.abs(x), stats.expon.cdf).pvalue > 1e-3
    for c in (5.0, 8.0):  # the tails: P(|x| > c) = e^{−c}
        p = math.exp(-c)
        assert abs(np.mean(np.abs(x) > c) - p) < 5 * math.sqrt(p / n)
