"""Noise keys: where every learner's Gaussian (and Laplace) noise comes from.

Why this module exists: the noise is the only thing between a learner's data and whoever
reads its releases. If an observer can regenerate the noise, it subtracts it and reads the
clipped gradient exactly (ε = ∞). Two ways that happens, both seen in this project's own
audit (issue 20): a **small key** (torch's CPU generator keeps 32 bits of its seed, so one
release was enough to find the seed by search in about 61 core-hours), and a generator
whose **outputs reveal its state** (Mersenne Twister after 624 words; PCG64's 128-bit state
from a few hundred bytes, Bouillaguet et al. 2020).

**Since issue 34 every noise of the library is drawn from AES-128-CTR**
(:mod:`~flwr_corrnoise.cipher_noise`: a standard cipher, rows addressable by counter) under
the same keys — :func:`key_from_seed` hashes a simulation's seed, OS entropy keys every other
learner: the NumPy and torch Gaussian streams and the decentralized algorithms' Laplace
noise (in process and through the Flower relay). What follows describes the keyed Philox
that streams of noise-state format 2 keep (they continue bit for bit, as they began).

The rule here was: every noise generator of the library is NumPy's **Philox4x64-10**, a
counter-based generator (Salmon et al., SC 2011: a 10-round Feistel-like bijection of a
256-bit counter under a **128-bit key**) with

* the key from **OS entropy** (:func:`secrets.token_bytes`, 128 bits) for every learner
  that is not in a reproducible simulation, or derived from a simulation's integer seed by
  NumPy's ``SeedSequence`` hash, which reads *every* bit of the seed (two seeds that share
  their low 64 bits give unrelated keys — a test checks it);
* outputs that are a keyed bijection of a public counter: no state to recover beyond the key
  itself, and no known attack recovers a Philox key from its outputs short of searching
  2¹²⁸ keys. (Where a cryptographic guarantee and exact float addition are wanted, a
  learner opts in to :mod:`~flwr_corrnoise.secure_noise`: ChaCha20 with a 256-bit key, on a
  grid.)

Why Philox and not ChaCha20 for every stream: NumPy's ziggurat draws normals from Philox at
the speed of PCG64 (``benchmarks/noise_keys.py``: 0.8–1.5× at d ≥ 10⁴), while a ChaCha20
Box–Muller sampler in NumPy costs 2.4–3.8× a PCG64 draw at the sizes that matter
(d = 3·10⁵–10⁶). The torch streams draw from the same Philox on the host
(:mod:`~flwr_corrnoise.torch.streams`): torch's own generators cannot hold a 128-bit key.

The generator's whole state (counter, key, the 4-word output buffer and its position)
packs into 14 uint64 words (:func:`pack_generator`), and a generator restored from them
continues bit for bit.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

#: bits of every noise key the library draws from OS entropy
KEY_BITS = 128
#: first word of a packed Philox state (format 2 of the noise state)
PHILOX_TAG = 0x9B11_0C4E_0000_0002
_MASK64 = (1 << 64) - 1


def os_entropy_key() -> np.ndarray:
    """A fresh 128-bit Philox key (two uint64 words) from OS entropy."""
    return np.frombuffer(secrets.token_bytes(KEY_BITS // 8), dtype="<u8").astype(np.uint64)


def key_from_seed(seed: int | Sequence[int]) -> np.ndarray:
    """The 128-bit key of a simulation's integer seed (or seed words).

    ``SeedSequence`` hashes *all* bits of an arbitrarily large non-negative integer, so
    seeds that agree in their low bits still give unrelated keys — unlike torch's CPU
    generator, whose ``manual_seed`` keeps the low 32 bits only.
    """
    if isinstance(seed, int | np.integer) and not isinstance(seed, bool) and int(seed) < 0:
        raise ValueError("the seed must be a non-negative integer")
    return np.random.SeedSequence(seed).generate_state(KEY_BITS // 64, dtype=np.uint64)


def noise_generator(seed: int | Sequence[int] | None = None) -> np.random.Generator:
    """The noise generator: Philox4x64-10 keyed by :func:`os_entropy_key` (``seed=None``)
    or by :func:`key_from_seed` (reproducible simulations and tests)."""
    key = os_entropy_key() if seed is None else key_from_seed(seed)
    return np.random.Generator(np.random.Philox(key=key))


def generator_key(gen: np.random.Generator) -> int:
    """The generator's key as one integer (tests and audits: it must have 128 bits): a
    keyed Philox's, or the key of an AES-128 :class:`~flwr_corrnoise.cipher_noise.
    CipherGaussian` (the streams' generator since noise-state format 3)."""
    key = getattr(gen, "key", None)
    if isinstance(key, int) and not hasattr(gen, "bit_generator"):
        return key
    state = gen.bit_generator.state
    if state["bit_generator"] != "Philox":
        raise ValueError(f"not a noise generator (Philox), but {state['bit_generator']}")
    k = [int(x) for x in state["state"]["key"]]
    return k[0] | (k[1] << 64)


def pack_generator(gen: np.random.Generator) -> np.ndarray:
    """14 uint64 words: tag, counter (4), key (2), buffer (4), buffer position,
    ``has_uint32``, ``uinteger`` — everything to continue bit for bit."""
    st = gen.bit_generator.state
    if st["bit_generator"] != "Philox":
        raise ValueError(f"only Philox noise generators are stored, not {st['bit_generator']}")
    return np.array(
        [PHILOX_TAG, *(int(x) for x in st["state"]["counter"]),
         *(int(x) for x in st["state"]["key"]), *(int(x) for x in st["buffer"]),
         st["buffer_pos"], st["has_uint32"], st["uinteger"]],
        dtype=np.uint64,
    )


def unpack_generator(words: np.ndarray) -> np.random.Generator:
    """Inverse of :func:`pack_generator`.

    A 6-word PCG64 state (noise-state format 1, written before keyed generators) is
    **re-keyed**: its stream continues from a fresh OS-entropy Philox key. Why not continue
    it: whoever knew or recovered that PCG64 seed would predict every later row; the rows
    the stream already combined stay in its buffers, and fresh independent rows from a new
    key keep the law of the noise, so the privacy calibration still holds.
    """
    w = [int(x) for x in np.asarray(words, dtype=np.uint64).reshape(-1)]
    if len(w) == 6:
        log.warning("a noise state written with a PCG64 generator (format 1) continues with "
                    "a fresh 128-bit Philox key from OS entropy: its noise is no longer "
                    "predictable from the old seed (and no longer reproducible from it)")
        return noise_generator(None)
    if len(w) != 14 or w[0] != PHILOX_TAG:
        raise ValueError(f"not a noise-generator state ({len(w)} words)")
    bitgen = np.random.Philox(key=np.array(w[5:7], dtype=np.uint64))
    bitgen.state = {
        "bit_generator": "Philox",
        "state": {"counter": np.array(w[1:5], dtype=np.uint64),
                  "key": np.array(w[5:7], dtype=np.uint64)},
        "buffer": np.array(w[7:11], dtype=np.uint64),
        "buffer_pos": w[11],
        "has_uint32": w[12],
        "uinteger": w[13],
    }
    return np.random.Generator(bitgen)
