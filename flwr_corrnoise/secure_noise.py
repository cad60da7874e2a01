"""Secure noise: a cryptographically secure Gaussian source and a floating-point defence.

Opt-in (``NoiseStream.create(..., secure=True)``), in the spirit of Opacus' ``secure_mode``
and Google's differential-privacy library. Two threats, two parts:

**A predictable generator.** NumPy's PCG64 is a statistical generator: 128 bits of state,
recoverable from a few hundred bytes of output (Bouillaguet et al., 2020), so whoever sees
(or guesses) enough of the noise can predict the rest. Secure noise comes from the
**ChaCha20** keystream (the ``cryptography`` package, which Flower already depends on) under
a 256-bit key drawn from OS entropy (:func:`secrets.token_bytes`); the key can never be
chosen by a caller (a secure stream refuses a seed). The generator's whole state is the key
and a 96-bit block counter, so it serializes to seven 64-bit words and a restored stream
continues bit for bit: the keystream at block ``b`` is a pure function of ``(key, b)``
(ChaCha20 is seekable).

**Floating-point attacks on Gaussian sampling.** Mironov (CCS 2012) showed that a
floating-point Laplace sample added to a value leaves holes and value-dependent rounding in
the set of floats the release can take, so the release can reveal the value exactly;
Jin et al. ("Are we there yet?", S&P 2022) did the same for Gaussian samplers (Box–Muller,
polar, ziggurat) in the DP libraries of the day. The two published defences:

* Opacus / Holohan & Braghin (2021): sum several (4) Gaussians and rescale, which makes the
  float support denser. It acts on each ``ξ`` draw, but our noise is the *correlated
  increment* ``e[k] = V·(b_k − b_{k−1})·ξ``, a floating-point linear combination of up to
  ``N`` rows of ``ξ``: whatever the sampler's float support looked like, that combination
  and the final ``value + e`` rounding re-create value-dependent rounding. It also costs 4×
  the random bits.
* Google's library (Secure Noise Generation, 2020): put the noise on a grid ``g·ℤ`` whose
  granularity ``g`` is a **power of two** at or above the noise's resolution, and round the
  value to the same grid. Then ``value + noise`` is a sum of two integer multiples of ``g``
  and float addition is **exact** (for ``|sum| ≤ 2⁵³·g``): the release is exactly
  ``value + noise`` in real arithmetic, with no float rounding left to read.

We use the **grid** defence, applied where it survives: on the final increment. A secure
stream returns ``round_g(e[k])`` with ``g = granularity(V)``, the smallest power of two
``≥ V·2⁻³²``; :func:`add_on_grid` is the matching addition for the caller (it truncates the
value toward zero onto the grid, so a clipped gradient's norm never grows, and checks that
the sum is exact). Why ``2⁻³²`` and not Google's ``2⁻⁵⁷``: Google samples a binomial in
exact integer arithmetic, we sample in float64 (Box–Muller, below) and combine rows in
float64; the grid must be much coarser than those float errors (≈ ``2⁻⁵⁰·V`` for a few
rows, ``≈ N·2⁻⁵³·V`` for the dense mechanisms) so that rounding, not float error, decides
which grid point is released, and much finer than the noise (``2⁻³²·V``: a shift of
≤ ``2⁻³³·V``, invisible to learning and to the law — the tests check mean, variance and a
KS test against N(0, 1)). ``|value + noise| ≤ 2⁵³·g`` leaves room for values up to
``2²¹·V``.

The sampler is the library's noise transform (:mod:`~flwr_corrnoise.cipher_noise`,
transform 2; since secure format 2, 2026-11-28) on the ChaCha20 keystream: Box–Muller with a
fixed 16 bytes a pair (no rejection, so the keystream position is a function of the number
of draws and restore is exact), the radius from a 64-bit word — and, below 2³², a second
word from block ``2⁹⁵ + w`` (no draw reaches it) — so ``u ≥ 2⁻¹²⁹`` and ``|ξ| ≤ 13.37``,
a tail of mass ``2⁻¹²⁸`` a pair, below any δ by twenty orders of magnitude (format 1 used
53-bit uniforms: a cut at 8.57σ, ``1.1·10⁻¹⁶`` a pair, which at 10¹⁰ draws would have added
``2·10⁻⁶`` to δ at ε = 1 — unaccounted). Its float outputs are dense at ``≈ 2⁻⁴⁷`` in the
bulk, so every grid cell of width ``2⁻³²·V`` is reachable (a test checks the coverage on a
coarse grid), and they are the same floats on every machine, compiled or not.
What this does not cover: timing side channels, and the other end of the computation (the
gradient itself is float arithmetic on private data — the released ``trunc_g(g) + noise``
is exact, what produced ``g`` is not this module's concern).
"""

from __future__ import annotations

import math
import secrets

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from .cipher_noise import row_from_chunks

GRID_BITS = 32  # the grid is 2⁻³² of the noise std (rounded up to a power of two)
_BLOCK = 64  # bytes per ChaCha20 block
_COUNTER_SPAN = 1 << 32  # OpenSSL's ChaCha20 counter is 32 bits: blocks per nonce
_MAX_BLOCK = 1 << 96  # 32-bit counter + 64 bits of the nonce used as the high part
_MASK64 = (1 << 64) - 1
STATE_TAG = 0x5EC0_C4A2_0000_0002  # first word of a packed secure state (format 2)
#: format 1's tag: Box–Muller on 53-bit uniforms (a tail cut at 8.57σ), refused on restore
FORMAT1_TAG = 0x5EC0_C4A2_0000_0001
_MAX_DRAW_BLOCK = 1 << 92  # draws stay below this block: the refill words live above 2⁹⁵
_REFILL_BASE = 1 << 95


class ChaCha20Gaussian:
    """Standard normals from a ChaCha20 keystream; the state is ``(key, block)``.

    >>> g = ChaCha20Gaussian(bytes(32))
    >>> a = g.standard_normal(5)
    >>> h = ChaCha20Gaussian.unpack(ChaCha20Gaussian(bytes(32)).pack())
    >>> bool(np.array_equal(a, h.standard_normal(5)))
    True
    """

    __slots__ = ("_block", "_key", "_scratch", "_zeros")

    def __init__(self, key: bytes, block: int = 0) -> None:
        key = bytes(key)
        if len(key) != 32:
            raise ValueError(f"a ChaCha20 key is 32 bytes, got {len(key)}")
        self._key = key
        self._block = _check_block(block)
        # reused buffers (not state): a fresh 8·d-byte output per draw costs more in page
        # faults than ChaCha20 itself at d = 10⁶
        self._scratch = np.empty(0, dtype=np.uint8)
        self._zeros = b""

    @classmethod
    def from_os_entropy(cls) -> ChaCha20Gaussian:
        """A fresh generator keyed with 256 bits from the OS (the only way a secure
        stream gets a key: never from a seed a caller or coordinator could choose)."""
        return cls(secrets.token_bytes(32))

    # -- state ------------------------------------------------------------------------
    @property
    def state(self) -> tuple[bytes, int]:
        """``(key, block)``: the keystream position; setting it rewinds or seeks."""
        return self._key, self._block

    @state.setter
    def state(self, value: tuple[bytes, int]) -> None:
        key, block = value
        if len(bytes(key)) != 32:
            raise ValueError("a ChaCha20 key is 32 bytes")
        self._key, self._block = bytes(key), _check_block(block)

    def pack(self) -> np.ndarray:
        """Seven uint64 words: tag, the key (4 words), block counter (high, low)."""
        words = [int.from_bytes(self._key[i : i + 8], "little") for i in range(0, 32, 8)]
        return np.array(
            [STATE_TAG, *words, self._block >> 64, self._block & _MASK64], dtype=np.uint64
        )

    @classmethod
    def unpack(cls, words: np.ndarray) -> ChaCha20Gaussian:
        """Inverse of :meth:`pack`; a PCG64 state or a wrong tag is an error."""
        w = [int(x) for x in np.asarray(words, dtype=np.uint64).reshape(-1)]
        if len(w) == 7 and w[0] == FORMAT1_TAG:
            raise ValueError(
                "a secure (ChaCha20) generator state of format 1 (53-bit Box–Muller, saved by "
                "an earlier flwr-corrnoise): this version draws the library's transform 2 and "
                "cannot continue that stream's rows: start a new stream")
        if len(w) != 7 or w[0] != STATE_TAG:
            raise ValueError("not a secure (ChaCha20) generator state")
        key = b"".join(x.to_bytes(8, "little") for x in w[1:5])
        return cls(key, (w[5] << 64) | w[6])

    # -- drawing ----------------------------------------------------------------------
    def keystream(self, blocks: int) -> bytes:
        """The next ``blocks`` 64-byte keystream blocks; advances the counter."""
        return self._fill(blocks).tobytes()

    def _fill(self, blocks: int) -> np.ndarray:
        """The next ``blocks`` keystream blocks as a uint8 view of the scratch buffer
        (valid until the next draw); advances the counter."""
        if blocks < 0:
            raise ValueError("blocks must be >= 0")
        end = _check_block(self._block + blocks)
        nbytes = blocks * _BLOCK
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
            self._zeros = bytes(nbytes)
        out, zeros = self._scratch[:nbytes], memoryview(self._zeros)
        pos, offset = self._block, 0
        while pos < end:
            # one nonce per 2³² blocks: OpenSSL refuses to let the 32-bit counter wrap
            take = min(end, (pos // _COUNTER_SPAN + 1) * _COUNTER_SPAN) - pos
            iv = (pos % _COUNTER_SPAN).to_bytes(4, "little") + (
                pos // _COUNTER_SPAN
            ).to_bytes(12, "little")
            enc = Cipher(algorithms.ChaCha20(self._key, iv), mode=None).encryptor()
            enc.update_into(zeros[: take * _BLOCK], out[offset:])
            pos += take
            offset += take * _BLOCK
        self._block = end
        return out

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` i.i.d. N(0, 1) float64 draws: the library's noise transform
        (:mod:`~flwr_corrnoise.cipher_noise`, transform 2 — compiled where a compiler is,
        the same floats in NumPy) on this keystream, in its row layout (chunks of
        ``CHUNK_PAIRS`` pairs, each its radius words then its angle words), so the radius
        reaches ``u = 2⁻¹²⁹`` through the refill words like every other stream's."""
        n = int(n)
        if n < 0:
            raise ValueError("n must be >= 0")
        m = (n + 1) // 2
        first = self._block
        if first + -(-16 * m // _BLOCK) > _MAX_DRAW_BLOCK:
            raise ValueError("the secure generator's keystream for draws is exhausted (2^92 "
                             "blocks)")
        ks = self._fill(-(-16 * m // _BLOCK))
        # radius word j of the chunk at pair `first_pair` is word 2·first_pair + j of ks
        return row_from_chunks(
            np.empty(n), lambda pair, nbytes: ks[16 * pair : 16 * pair + nbytes],
            lambda pair, j: self._refill_word(8 * first + 2 * pair + j))

    def _refill_word(self, word: int) -> int:
        """The refill word of the radius word at 64-bit index ``word`` of the keystream: the
        first 8 bytes of block ``2⁹⁵ + word`` (a range no draw reaches: draws stay below
        block 2⁹²), so no keystream byte is used twice."""
        block = _REFILL_BASE + int(word)
        iv = (block % _COUNTER_SPAN).to_bytes(4, "little") + (
            block // _COUNTER_SPAN).to_bytes(12, "little")
        enc = Cipher(algorithms.ChaCha20(self._key, iv), mode=None).encryptor()
        return int.from_bytes(enc.update(bytes(8)), "little")


def _check_block(block: int) -> int:
    block = int(block)
    if not 0 <= block < _MAX_BLOCK:
        raise ValueError(f"ChaCha20 block counter {block} outside [0, 2^96)")
    return block


def granularity(std: float) -> float:
    """The grid of a secure stream with noise std ``V``: the smallest power of two
    ``≥ V·2⁻³²`` (``0.0`` for ``V = 0``: no noise, nothing to round)."""
    std = float(std)
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
    if std == 0.0:
        return 0.0
    mant, exp = math.frexp(std)  # std = mant·2^exp, mant ∈ [0.5, 1)
    power = (exp - 1 if mant == 0.5 else exp) - GRID_BITS
    if power < -1000:  # x/g would overflow, g would be subnormal
        raise ValueError(f"noise std {std!r} is too small for the secure grid")
    return math.ldexp(1.0, power)


def round_to_grid(x: np.ndarray, g: float, out: np.ndarray | None = None) -> np.ndarray:
    """``x`` rounded to the nearest multiple of ``g`` (ties to even); exact for a power
    of two ``g``: ``x/g`` and ``·g`` only shift exponents. Elementwise, so a contiguous
    array is done in cache-sized chunks (:data:`GRID_CHUNK`): the same floats, each chunk's
    three passes in cache instead of three over memory (issue 34: the grid's cost at
    d = 10⁶)."""
    if g == 0.0:
        if out is None:
            return np.array(x, dtype=np.float64)
        out[...] = x
        return out
    _check_grid(g)
    x = np.asarray(x)
    res = np.empty(x.shape, dtype=np.result_type(x, g)) if out is None else out
    for src, part in _chunked(x, res):
        np.divide(src, g, out=part)
        np.rint(part, out=part)
        part *= g
    return res


#: elements a chunk of the grid's elementwise passes (256 KB of float64: stays in cache)
GRID_CHUNK = 1 << 15


def _chunked(*arrays: np.ndarray) -> list[tuple[np.ndarray, ...]]:
    """The arrays side by side in consecutive flat chunks of :data:`GRID_CHUNK` elements
    when they share one shape and are all C-contiguous; else one piece of the whole arrays
    (NumPy then broadcasts or strides as usual)."""
    shape = arrays[0].shape
    if (any(a.shape != shape or not a.flags.c_contiguous for a in arrays)
            or arrays[0].size <= GRID_CHUNK):
        return [arrays]
    flats = [a.reshape(-1) for a in arrays]
    return [tuple(f[lo : lo + GRID_CHUNK] for f in flats)
            for lo in range(0, flats[0].size, GRID_CHUNK)]


def truncate_to_grid(x: np.ndarray, g: float) -> np.ndarray:
    """``trunc_g(x)``: each entry toward zero to a multiple of ``g`` (a power of two: exact),
    in float64. Why: ``|trunc_g(x)_i| ≤ |x_i|``, so an example's gradient clipped to norm
    ``C`` stays within ``C`` — which truncating a *sum* of clipped gradients does not keep
    for one example's share (see :func:`add_on_grid`)."""
    out = np.array(x, dtype=np.float64)
    if g == 0.0:
        return out
    _check_grid(g)
    out /= g
    np.trunc(out, out=out)
    out *= g
    return out


def on_grid(x: np.ndarray, g: float) -> bool:
    """Whether every entry of ``x`` is an integer multiple of ``g``."""
    _check_grid(g)
    q = np.asarray(x, dtype=np.float64) / g
    return bool(np.all(q == np.rint(q)))


def add_on_grid(value: np.ndarray, noise: np.ndarray, g: float) -> np.ndarray:
    """``trunc_g(value) + noise``, computed exactly; ``noise`` must be on the grid.

    Truncation toward zero (not rounding) keeps ``|trunc_g(v)_i| ≤ |v_i|``, so a gradient
    clipped to norm ``C`` stays within ``C`` and the sensitivity the accounting used still
    holds. That argument is for ``value`` *one* clipped gradient: of a sum of several, one
    example's share can move ``trunc_g`` of the sum by up to ``g`` a coordinate beyond its
    own norm (the sum's fractional part crossing a multiple of ``g``), so a sum must be of
    examples each already on the grid (:func:`truncate_to_grid`; the sampled step does
    this), and then truncating it changes nothing. The float sum of two multiples of ``g``
    is exact while it stays within ``2⁵³·g``; a larger value is refused rather than rounded.
    """
    noise = np.asarray(noise, dtype=np.float64)
    if g == 0.0:
        return np.asarray(value, dtype=np.float64) + noise
    _check_grid(g)
    value = np.asarray(value, dtype=np.float64)  # float32 division could round up
    out = np.empty(np.broadcast_shapes(value.shape, noise.shape))
    # in cache-sized chunks (issue 34: ten passes over three d-buffers left the cache at
    # d = 10⁶); the same floats, every chunk checked (a NaN cannot hide in a min of chunks)
    for v, e, part in _chunked(value, noise, out):
        _check_units(*_units(v, e, g, part), g)
        part *= g
    return out


def _units(value: np.ndarray, noise: np.ndarray, g: float, out: np.ndarray
           ) -> tuple[float, float]:
    """``out ← trunc(value/g) + noise/g`` (units of g: dividing by a power of two is exact,
    so ``trunc(value/g)`` is ``trunc_g(value)/g`` and ``noise/g`` is an integer exactly when
    the noise is on the grid); raise if the noise is not on the grid; ``(min, max)`` of
    ``out`` (NaN and ±∞ propagate to both)."""
    np.divide(value, g, out=out)
    np.trunc(out, out=out)
    steps = np.divide(noise, g)
    out += steps  # exact while both are integers and the sum stays within 2⁵³
    frac = np.rint(steps)
    np.subtract(steps, frac, out=frac)
    if frac.any():  # a fraction of g, or NaN
        raise ValueError("the noise is not on the grid (not from a secure stream of this std?)")
    if out.size == 0:
        return math.inf, -math.inf
    return float(out.min()), float(out.max())


def _check_units(lo: float, hi: float, g: float) -> None:
    if lo == math.inf and hi == -math.inf:  # nothing was added (an empty release)
        return
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("the value to noise holds non-finite entries (or beyond 2^1000·g)")
    if max(-lo, hi) > 2.0**53:
        raise ValueError(
            f"|value + noise| exceeds 2^53·g = {2.0**53 * g:.3g}: the sum would not be exact"
        )


def _check_grid(g: float) -> None:
    mant, _ = math.frexp(g)
    if not (math.isfinite(g) and g > 0 and mant == 0.5):
        raise ValueError(f"the grid must be a positive power of two, got {g!r}")
