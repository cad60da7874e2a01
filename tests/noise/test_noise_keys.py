"""Noise keys (issue 20, attack 1): no learner's noise can be regenerated from a small seed.

The attack this guards against: torch's CPU generator kept 32 bits of a learner's seed, so
its seed was found from one release by search and the noise subtracted. Every stream
(NumPy and torch) draws under a 128-bit key: the AES-128-CTR kernel (cipher_noise.py) since
noise-state format 3, Philox4x64-10 (noise_keys.py) in the format-2 streams it continues.
"""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.noise_keys import (
    KEY_BITS,
    PHILOX_TAG,
    generator_key,
    key_from_seed,
    noise_generator,
    pack_generator,
    unpack_generator,
)
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.streams import NoiseStream


def test_os_entropy_keys_have_128_bits() -> None:
    """Fresh keys fill both 64-bit words (a 32- or 64-bit key would leave the high word
    constant); 64 keys are pairwise distinct and about half their bits are set."""
    keys = [generator_key(NoiseStream.create("blt", 8, 4, 1.0)._rng) for _ in range(64)]
    assert KEY_BITS == 128 and len(set(keys)) == 64
    assert len({k >> 64 for k in keys}) == 64 and len({k >> 96 for k in keys}) > 1
    ones = sum(bin(k).count("1") for k in keys) / (64 * 128)
    assert 0.4 < ones < 0.6


@pytest.mark.parametrize("shift", [32, 64, 96, 127])
def test_seeds_with_equal_low_bits_give_unrelated_streams(shift: int) -> None:
    """Two seeds that share every bit below ``shift`` give different keys and noise."""
    a, b = 12345, 12345 + (1 << shift)
    assert (a - b) % (1 << shift) == 0
    ka, kb = key_from_seed(a), key_from_seed(b)
    assert not np.array_equal(ka, kb)
    ea = NoiseStream.create("independent", 4, 50, 1.0, seed=a).next()
    eb = NoiseStream.create("independent", 4, 50, 1.0, seed=b).next()
    assert not np.allclose(ea, eb)


def test_keys_that_share_either_word_give_unrelated_noise() -> None:
    """Every key bit matters to the draw: flip one bit in either 64-bit word."""
    key = np.array([0x0123456789ABCDEF, 0xFEDCBA9876543210], dtype=np.uint64)
    base = np.random.Generator(np.random.Philox(key=key)).standard_normal(64)
    for word, bit in ((0, 0), (0, 63), (1, 0), (1, 63)):
        k = key.copy()
        k[word] ^= np.uint64(1 << bit)
        other = np.random.Generator(np.random.Philox(key=k)).standard_normal(64)
        assert np.corrcoef(base, other)[0, 1] < 0.5


def test_deployed_learner_state_holds_a_128_bit_key() -> None:
    """A learner with no seed (every learner outside simulation) keys its stream from OS
    entropy: two learners of identical settings draw unrelated noise."""
    settings = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0,
                               horizon=8)
    a = LearnerState.create(settings, [(5,)], None)
    b = LearnerState.create(settings, [(5,)], None)
    assert a.noise is not None and b.noise is not None
    assert generator_key(a.noise._rng) != generator_key(b.noise._rng)
    assert not np.allclose(a.noise.next(), b.noise.next())


def test_generator_state_round_trip_continues_bit_for_bit() -> None:
    gen = noise_generator(7)
    gen.standard_normal(3)
    gen.integers(0, 2**32, 1, dtype=np.uint32)  # leave a half-used 64-bit word behind
    words = pack_generator(gen)
    again = unpack_generator(words)
    np.testing.assert_array_equal(gen.standard_normal(17), again.standard_normal(17))
    assert generator_key(again) == generator_key(gen)


def test_a_format_2_philox_stream_continues_bit_for_bit() -> None:
    """A NumPy stream written before the AES kernel (format 2: its keyed Philox state,
    tagged PHILOX_TAG) still loads and continues exactly as a Philox stream does."""
    from flwr_corrnoise.streams import normalize_shapes

    for dtype in (np.float64, np.float32):
        old = NoiseStream("blt", 8, normalize_shapes(6), 1.5, noise_generator(42), dtype=dtype)
        old.next()
        state = old.state_dict()
        state["format"] = np.array(2, dtype=np.int64)
        assert int(state["rng"][0]) == PHILOX_TAG and state["rng"].size == 14
        restored = NoiseStream.from_bytes(NoiseStream.from_state_dict(state).to_bytes())
        assert isinstance(restored._rng, np.random.Generator)
        for _ in range(7):
            np.testing.assert_array_equal(restored.next(), old.next())


def test_legacy_pcg64_state_is_rekeyed_not_continued() -> None:
    """A noise state of format 1 (PCG64) loads, but continues under a fresh OS-entropy key:
    whoever knew its PCG64 seed cannot predict what comes next."""
    stream = NoiseStream.create("independent", 6, 20, 1.0, seed=3)
    state = stream.state_dict()
    pcg = np.random.Generator(np.random.PCG64(3))
    st = pcg.bit_generator.state
    s, inc = st["state"]["state"], st["state"]["inc"]
    mask = (1 << 64) - 1
    state["rng"] = np.array([s >> 64, s & mask, inc >> 64, inc & mask, 0, 0], dtype=np.uint64)
    state["format"] = np.array(1, dtype=np.int64)
    restored = NoiseStream.from_state_dict(state)
    predicted = np.random.Generator(np.random.PCG64(3)).standard_normal(20)
    got = restored.next()
    assert not np.allclose(got, predicted)
    assert restored.step == 1 and generator_key(restored._rng) >> 64 != 0


def test_torch_stream_draws_the_keyed_generator_not_torchs() -> None:
    """The torch stream's float64 ξ equals the NumPy stream's bit for bit (same key, same
    AES-128-CTR row), whatever torch's own generators are seeded with."""
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import TorchNoiseStream

    seed = (1 << 100) + 5
    for name, tol in (("independent", 0.0), ("blt", 1e-12)):  # blt: kernel float order
        ref = NoiseStream.create(name, 6, 9, 1.3, seed=seed)
        torch.manual_seed(0)
        dev = TorchNoiseStream.create(name, 6, 9, 1.3, seed=seed, dtype=torch.float64)
        torch.manual_seed(1)
        for _ in range(6):
            np.testing.assert_allclose(dev.next().numpy(), ref.next(), rtol=0, atol=tol)
    low = TorchNoiseStream.create("blt", 6, 9, 1.3, seed=seed - (1 << 100))
    assert not np.allclose(low.next().double().numpy(),
                           TorchNoiseStream.create("blt", 6, 9, 1.3, seed=seed).next()
                           .double().numpy())
