"""Device noise: a ChaCha20 keystream and Box–Muller normals computed in torch integer and
float ops, so on a GPU the noise is made where the model is and never crosses the bus.

Why this module exists (issue 34, item 3): a torch stream that draws its normals on the host
(:mod:`~flwr_corrnoise.cipher_noise`, AES-128-CTR through OpenSSL) copies ``d`` floats to
the device every step. :class:`~flwr_corrnoise.torch.streams.TorchNoiseStream` draws from
:class:`DeviceGaussian` instead on a CUDA device (by default) or wherever
``device_noise=True`` asks for it. AES-NI is a CPU instruction; a GPU has none, but ChaCha20
(Bernstein, "ChaCha, a variant of Salsa20", 2008; RFC 8439) is built from 32-bit additions,
rotations and XORs only, which any tensor library has. Here every ChaCha20 block of a row is
computed side by side: the state is a ``16 × blocks`` int64 tensor of 32-bit words (int64 so
that an addition never overflows and a right shift never drags a sign bit; ``& 0xFFFFFFFF``
after each addition), the four column quarter-rounds run as one op on four rows, the
diagonal ones after rolling rows 4–15 — ten double rounds, then the input is added back. The
same code runs on CPU tensors, where ``tests/noise/test_device_noise.py`` checks the
keystream **bit for bit** against ``cryptography``'s ChaCha20 (OpenSSL) and the normals
against a NumPy transform of the same words.

**Key policy: the library's.** A 256-bit ChaCha20 key, from OS entropy
(:func:`secrets.token_bytes`) for every learner outside a reproducible simulation, or a
hash of *every* bit of a simulation's seed (NumPy's ``SeedSequence``, as
:func:`flwr_corrnoise.noise_keys.key_from_seed`, four words instead of two). Never from
torch's generators (32- or 64-bit seeds).

**Row ``t`` by counter.** ChaCha20's 128-bit input after the key is a 32-bit block counter
and a 96-bit nonce (RFC 8439 § 2.3); row ``t`` of domain ``D`` is the keystream of nonce
``D ‖ t`` (32 + 64 bits, little-endian) from block 0, so ``row(t, d)`` is a pure function
of ``(key, t, d, dtype)`` and a mechanism may regenerate a row instead of storing it. The
generator's whole state is the key and the next row: six uint64 words.

**The transform**: Box–Muller as the host kernel's (:mod:`~flwr_corrnoise.cipher_noise`),
on one whole row (a GPU wants one launch per op, not cache-sized chunks). With
``m = ⌈d/2⌉`` pairs, the row's 32-bit words are ``m`` radius words ``(lo, hi)`` (64 bits
each), then ``m`` angle words (one 32-bit word for float32, two for float64);
``z[:m] = R·cos θ``, ``z[m:] = R·sin θ`` (an odd ``d`` drops the last sine).

* radius, main path (``w ≥ 2³²``): ``u = fl(w >> 1)·2⁻⁶³`` in the output dtype,
  ``R = √(−2 ln u)``;
* radius, refill (``w < 2³²``, probability 2⁻³² a pair): the first 64-bit word ``v`` of
  block ``j`` (the pair's index) of the refill nonce, ``u = w·2⁻⁶⁴ + (2·fl(v) + 1)·2⁻¹²⁹``
  in float64 (a 128-bit uniform to float64 precision, smallest ``2⁻¹²⁹``): the host
  kernel's tail, **13.37σ**, a
  total variation of ``2⁻¹²⁸`` a pair from Gaussian pairs (docs/privacy.md, "Noise
  generation and δ": the same ``(1 + e^ε)·⌈n/2⌉·2⁻¹²⁸`` in δ);
* angle: float32 ``θ = fl(a)·fl(2π·2⁻³²)``; float64 ``θ = fl(a >> 11)·2π·2⁻⁵³`` from a
  64-bit word; ``cos``/``sin`` are torch's (CUDA's on a GPU).

What is bit-identical where: the keystream, everywhere (integer ops). The normals use the
device's ``log``/``cos``/``sin``, whose last bit may differ between CPU and GPU; a row is
bit-reproducible on one device type. The floating-point attack (Mironov 2012) is the host
kernel's question too; the grid defence applies to the final increment whatever produced it.

**On CUDA** the keystream is one fused Triton kernel (:mod:`.chacha_triton`, where Triton
imports): the same words as the torch ops below, bit for bit, without their ≈ 600 launches a
row. Both, and the rows, ran on an H200 (``benchmarks/device_check.sh``; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: bytes of a ChaCha20 key (256 bits)
KEY_BYTES = 32
#: first word of a packed :class:`DeviceGaussian` state
STATE_TAG = 0xC4AC_4A20_0000_0001
#: nonce domains (the nonce's first 32-bit word): float32 rows, float64 rows, refill words
DOMAIN_FLOAT32 = 1
DOMAIN_FLOAT64 = 2
DOMAIN_REFILL = 0x100
_MASK = 0xFFFF_FFFF
_MAX_T = 1 << 64
_MAX_BLOCKS = 1 << 32  # the 32-bit block counter of one nonce
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"
_WORDS_PER_PAIR = {torch.float32: 3, torch.float64: 4}


def key_from_seed(seed: int | Sequence[int]) -> bytes:
    """The 256-bit key of a reproducible simulation's seed: ``SeedSequence`` of every bit
    of it (seeds sharing their low bits give unrelated keys). Never for a deployed learner."""
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool) and int(seed) < 0:
        raise ValueError("the seed must be a non-negative integer")
    words = np.random.SeedSequence(seed).generate_state(4, dtype=np.uint64)
    return np.asarray(words, dtype="<u8").tobytes()


def _key_words(key: bytes) -> list[int]:
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"a ChaCha20 noise key is {KEY_BYTES} bytes, got {len(key)}")
    return [int.from_bytes(key[4 * i : 4 * i + 4], "little") for i in range(8)]


# -- the keystream ---------------------------------------------------------------------------
def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) & _MASK) | (x >> (32 - n))


def _quarter_rounds(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RFC 8439 § 2.1 on four quarter-rounds at once (rows of ``a, b, c, d``)."""
    a = (a + b) & _MASK
    d = _rotl(d ^ a, 16)
    c = (c + d) & _MASK
    b = _rotl(b ^ c, 12)
    a = (a + b) & _MASK
    d = _rotl(d ^ a, 8)
    c = (c + d) & _MASK
    b = _rotl(b ^ c, 7)
    return a, b, c, d


#: set when the fused kernel failed to build or run in this process: the torch ops from then on
_FUSED_FAILED = False


def _fused_failed(err: Exception) -> None:
    global _FUSED_FAILED
    _FUSED_FAILED = True
    logging.getLogger(__name__).warning(
        "flwr-corrnoise: the fused Triton ChaCha20 kernel failed (%s: %s); the device noise "
        "uses the torch ops from now on (the same words, slower)", type(err).__name__, err)


def fused_available(device: torch.device | str) -> bool:
    """Whether :func:`chacha20_blocks` runs the fused Triton kernel on ``device``: on a CUDA
    device where Triton imports (PyTorch's CUDA builds ship it); elsewhere the torch ops."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from . import chacha_triton  # noqa: F401
    except Exception:  # no Triton, or one that fails on import (a broken install)
        return False
    return True


def chacha20_blocks(key: bytes, nonce_words: Sequence[int], first: int, count: int,
                    device: torch.device | str = "cpu",
                    fused: bool | None = None) -> torch.Tensor:
    """Keystream blocks ``first … first + count − 1`` of ``(key, nonce)`` as a
    ``count × 16`` int64 tensor of 32-bit words (little-endian order of RFC 8439's
    serialization: word ``i`` of a block is bytes ``4i … 4i + 3``).

    ``fused``: ``None`` — the fused Triton kernel (:mod:`.chacha_triton`) where
    :func:`fused_available`, else the torch ops below; ``True``/``False`` force one (tests,
    benchmarks). The same words either way."""
    if not (first >= 0 and first + count <= _MAX_BLOCKS):
        raise ValueError(f"blocks {first}…{first + count - 1} outside the 32-bit counter")
    if len(nonce_words) != 3 or any(not 0 <= int(w) <= _MASK for w in nonce_words):
        raise ValueError("a ChaCha20 nonce is three 32-bit words")
    head = [*_CONSTANTS, *_key_words(key)]
    forced = fused is not None
    if fused is None:
        fused = fused_available(device) and not _FUSED_FAILED
    if fused:
        from . import chacha_triton

        try:
            return chacha_triton.chacha20_blocks(head, [int(w) for w in nonce_words], first,
                                                 count, torch.device(device))
        except Exception as err:  # Triton imports but cannot build here (no ptxas, …)
            if forced:
                raise
            _fused_failed(err)  # the torch ops below give the same words
    state = torch.empty((16, count), dtype=torch.int64, device=device)
    state[:12] = torch.tensor(head, dtype=torch.int64, device=device)[:, None]
    state[12] = torch.arange(first, first + count, dtype=torch.int64, device=device)
    state[13:] = torch.tensor([int(w) for w in nonce_words], dtype=torch.int64,
                              device=device)[:, None]
    a, b, c, d = state[0:4], state[4:8], state[8:12], state[12:16]
    for _ in range(10):  # a double round: columns, then diagonals
        a, b, c, d = _quarter_rounds(a, b, c, d)
        b, c, d = b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0)
        a, b, c, d = _quarter_rounds(a, b, c, d)
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    out = (torch.cat([a, b, c, d]) + state) & _MASK
    return out.T.contiguous()


def row_nonce(domain: int, t: int) -> tuple[int, int, int]:
    """The nonce of row ``t`` of ``domain``: ``domain ‖ t`` (32 + 64 bits)."""
    if not 0 <= t < _MAX_T:
        raise ValueError(f"row index {t} outside [0, 2^64)")
    return domain, t & _MASK, t >> 32


def row_words(key: bytes, domain: int, t: int, count: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The first ``count`` 32-bit keystream words of row ``t`` of ``domain`` (int64)."""
    blocks = -(-count // 16)
    return chacha20_blocks(key, row_nonce(domain, t), 0, blocks, device).reshape(-1)[:count]


# -- the transform ---------------------------------------------------------------------------
def normals_from_words(words: torch.Tensor, d: int, dtype: torch.dtype,
                       refill: Any) -> torch.Tensor:
    """Box–Muller on a row's words (see the module docstring): ``d`` normals of ``dtype``.

    ``refill(j)``: ``fl(v)``, the refill words of the pairs ``j`` (an index tensor) as
    float64 — only asked for radius words below 2³². Public for the tests, which feed it
    adversarial words."""
    m = (d + 1) // 2
    lo, hi = words[0 : 2 * m : 2], words[1 : 2 * m : 2]
    shifted = (hi << 31) | (lo >> 1)  # w >> 1 < 2⁶³: an int64
    r = shifted.to(dtype) * 2.0**-63
    low = torch.nonzero(hi == 0).reshape(-1)  # w < 2³²: the rare refill path
    if low.numel():
        r[low] = 1.0  # a placeholder: the refill radius replaces it
    r = torch.sqrt(torch.log(r) * -2.0)
    if low.numel():  # w = lo < 2³², exact in float64
        u = lo[low].to(torch.float64) * 2.0**-64 + (refill(low) * 2.0 + 1.0) * 2.0**-129
        r[low] = torch.sqrt(torch.log(u) * -2.0).to(dtype)
    if dtype == torch.float32:
        theta = words[2 * m : 3 * m].to(torch.float32) * torch.tensor(
            2.0 * math.pi * 2.0**-32, dtype=torch.float32, device=words.device)
    else:
        a_lo, a_hi = words[2 * m : 4 * m : 2], words[2 * m + 1 : 4 * m : 2]
        top = (a_hi << 21) | (a_lo >> 11)  # the 53 high bits of the angle word
        theta = top.to(torch.float64) * (2.0 * math.pi * 2.0**-53)
    out = torch.empty(2 * m, dtype=dtype, device=words.device)
    torch.mul(torch.cos(theta), r, out=out[:m])
    torch.mul(torch.sin(theta), r, out=out[m:])
    return out[:d]


# -- the generator ---------------------------------------------------------------------------
class DeviceGaussian:
    """Standard normals made on a torch device from ChaCha20: rows by counter, a row cursor.

    * :meth:`row` ``(t, d, dtype)``: row ``t``, a pure function of ``(key, t, d, dtype)``;
    * :meth:`next_row`: row :attr:`position`, then ``position += 1``.

    The state — key and next row — packs into six uint64 words (:meth:`pack`); a generator
    restored from them continues bit for bit.

    >>> g = DeviceGaussian.from_seed(7)
    >>> bool(torch.equal(g.row(3, 5), DeviceGaussian.from_seed(7).row(3, 5)))
    True
    """

    __slots__ = ("_key", "device", "position")
    #: :attr:`position` is the row counter (one row a :meth:`next_row`): a stream may go
    #: back rows by moving it (:meth:`flwr_corrnoise.streams.RowCursor.rows_back`)
    rows_by_counter = True

    def __init__(self, key: bytes, position: int = 0,
                 device: torch.device | str = "cpu") -> None:
        _key_words(key)
        self._key = bytes(key)
        if not 0 <= int(position) < _MAX_T:
            raise ValueError(f"row position {position} outside [0, 2^64)")
        self.position = int(position)
        self.device = torch.device(device)

    @classmethod
    def from_os_entropy(cls, device: torch.device | str = "cpu") -> DeviceGaussian:
        """A generator keyed with 256 bits of OS entropy (every deployed learner)."""
        return cls(secrets.token_bytes(KEY_BYTES), device=device)

    @classmethod
    def from_seed(cls, seed: int | Sequence[int] | None,
                  device: torch.device | str = "cpu") -> DeviceGaussian:
        """``None``: OS entropy; an integer seed: :func:`key_from_seed` (simulations)."""
        key = secrets.token_bytes(KEY_BYTES) if seed is None else key_from_seed(seed)
        return cls(key, device=device)

    @property
    def key(self) -> int:
        """The key as one integer (tests and audits: it has 256 bits)."""
        return int.from_bytes(self._key, "little")

    def row(self, t: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Row ``t``: ``d`` standard normals of ``dtype`` on :attr:`device`."""
        if dtype not in _WORDS_PER_PAIR:
            raise ValueError(f"device noise is float32 or float64, not {dtype}")
        if d < 0:
            raise ValueError("d must be >= 0")
        domain = DOMAIN_FLOAT32 if dtype == torch.float32 else DOMAIN_FLOAT64
        m = (d + 1) // 2
        words = row_words(self._key, domain, t, _WORDS_PER_PAIR[dtype] * m, self.device)

        def refill(pairs: torch.Tensor) -> torch.Tensor:
            return torch.stack([self.refill_word(domain, t, int(j)) for j in pairs.tolist()])

        return normals_from_words(words, d, dtype, refill)

    def refill_word(self, domain: int, t: int, pair: int) -> torch.Tensor:
        """``fl(v)``: the first 64-bit word of block ``pair`` of the refill nonce of row
        ``t``, correctly rounded to float64 (``hi·2³² + lo``: one rounding)."""
        w = chacha20_blocks(self._key, row_nonce(domain | DOMAIN_REFILL, t), pair, 1,
                            self.device)[0, :2].to(torch.float64)
        return w[1] * 2.0**32 + w[0]

    def next_row(self, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Row :attr:`position`, then move to the next row."""
        out = self.row(self.position, d, dtype)
        self.position += 1
        return out

    @property
    def state(self) -> tuple[bytes, int]:
        """``(key, position)``; setting it rewinds, seeks or re-keys (the device stays)."""
        return self._key, self.position

    @state.setter
    def state(self, value: tuple[bytes, int]) -> None:
        key, position = value
        _key_words(key)
        if not 0 <= int(position) < _MAX_T:
            raise ValueError(f"row position {position} outside [0, 2^64)")
        self._key, self.position = bytes(key), int(position)

    def __reduce__(self) -> tuple:
        """Pickle (e.g. to a Ray worker) as key, position and the device's name."""
        return (type(self), (self._key, self.position, str(self.device)))

    def pack(self) -> np.ndarray:
        """Six uint64 words: :data:`STATE_TAG`, the key (4 words, little-endian), the next
        row."""
        k = np.frombuffer(self._key, dtype="<u8")
        return np.array([STATE_TAG, *(int(x) for x in k), self.position], dtype=np.uint64)

    @classmethod
    def unpack(cls, words: np.ndarray, device: torch.device | str = "cpu") -> DeviceGaussian:
        """Inverse of :meth:`pack`; any other tag or length is an error."""
        w = [int(x) for x in np.asarray(words, dtype=np.uint64).reshape(-1)]
        if len(w) != 6 or w[0] != STATE_TAG:
            raise ValueError(f"not a device-noise generator state ({len(w)} words)")
        return cls(np.array(w[1:5], dtype="<u8").tobytes(), w[5], device)

    def __repr__(self) -> str:  # never the key
        return f"DeviceGaussian(position={self.position}, device={self.device})"
