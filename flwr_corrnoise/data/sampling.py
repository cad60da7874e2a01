"""Cyclic Poisson sampling: minibatches whose randomness the accountant can amplify.

Why (issue 35): :class:`~flwr_corrnoise.data.loader.CyclicLoader` uses every example in one
fixed order, which the accounting can bound but not amplify. Here each step *samples*
(Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023, Algorithm 2): the
examples are split once into ``bands`` groups by a fixed order (``order_seed``, public, as
the cyclic loader's); at step ``i`` only group ``i mod bands`` is eligible, and each of its
members is included independently with probability ``q``. ``bands = 1`` is plain Poisson
sampling (DP-SGD, Opacus's ``poisson_sampling``). The accounting
(:mod:`flwr_corrnoise.amplification`) reads :attr:`CyclicPoissonLoader.sampling`.

**The rate.** Like Opacus (``sample_rate = 1/len(data_loader)``), a loader of
``num_examples`` examples and ``batch_size`` takes ``s = ⌈n/batch_size⌉`` steps per epoch
and samples at ``q = bands/s`` (≤ 1: at most ``s`` bands), so every step draws
``q·n/bands = n/s`` examples in expectation whatever ``bands`` is; ``bands = s`` gives
``q = 1``, one fixed batch per group (the cyclic loader's participation). Steps are
``local_epochs·s`` per round, ``rounds`` rounds. A variable batch is normalized by
:attr:`~CyclicPoissonLoader.expected_batch_size` (the sum of clipped per-example gradients
divided by it, as Opacus does), never by its own size.

**The randomness is a secret, addressable by step.** Amplification holds only if whoever
reads the releases cannot tell which examples a step drew, so the draws come from the
learner's key (its noise key: bytes, an integer simulation seed, or Philox key words) and
are never released — the number drawn included. A 128-bit sampling key is derived once
with keyed BLAKE2b (RFC 7693) under a personalization of its own, so the sampling bits are
independent of any noise the same key makes; step ``i``'s inclusion bits are the AES-128-CTR
keystream (NIST SP 800-38A, through ``cryptography``) of that key at counter block
``i·2⁶⁴``, one 64-bit word per group member, and member ``j`` is in the batch iff its word is
below ``⌊q·2⁶⁴⌋`` (probability ``≤ q``, exactly ``q`` for every rate ≥ 2⁻¹¹). So step
``i``'s batch is a function of ``(key, i)`` alone: a rebuilt loader (a Flower ``ClientApp`` is
rebuilt every round) gives the same batch, and no state needs saving.

Pure NumPy (and the AES of ``cryptography``); :attr:`CyclicPoissonLoader.participation`
gives the deterministic fallback bound for a learner that does not use the amplification.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..amplification import CyclicPoissonSampling
from ..mechanisms.participation import SampledParticipation
from .loader import CyclicLoader, EpochLoop

__all__ = ["CyclicPoissonLoader", "Loader", "sampling_key"]

#: BLAKE2b personalization of the sampling key (16 bytes): no other use of a learner's key
#: derives the same bits
_PERSON = b"flwr-cn/cyc-pois"
_MAX_STEP = 1 << 64


def sampling_key(key: bytes | int | np.ndarray) -> bytes:
    """The 128-bit AES key of the sampler, derived from the learner's ``key``: bytes (16
    to 64 of them, e.g. a cipher noise key), an integer simulation seed (hashed from every
    bit, :func:`flwr_corrnoise.cipher_noise.key_from_seed`) or Philox key words (uint64)."""
    if isinstance(key, bool):
        raise TypeError("a sampling key is bytes, an integer seed or uint64 key words")
    if isinstance(key, int | np.integer):
        from ..cipher_noise import key_from_seed

        material = key_from_seed(int(key))
    elif isinstance(key, np.ndarray):
        material = np.ascontiguousarray(key, dtype="<u8").tobytes()
    elif isinstance(key, bytes | bytearray | memoryview):
        material = bytes(key)
    else:
        raise TypeError("a sampling key is bytes, an integer seed or uint64 key words, got "
                        f"{type(key).__name__}")
    if not 16 <= len(material) <= 64:
        raise ValueError(f"a sampling key holds 16 to 64 bytes (128 bits or more), got "
                         f"{len(material)}")
    return hashlib.blake2b(b"cyclic-poisson-sampling/v1", key=material, digest_size=16,
                           person=_PERSON).digest()


@dataclass(frozen=True)
class CyclicPoissonLoader(EpochLoop):
    """Batches of example indices by cyclic Poisson sampling (module docstring):
    ``bands`` groups, rate ``bands/⌈num_examples/batch_size⌉``, ``local_epochs`` expected
    passes per round, ``rounds`` rounds, randomness from ``key``."""

    num_examples: int
    batch_size: int
    rounds: int
    #: the learner's noise key; ``None``: the Flower front ends key it with the learner's
    #: own (:meth:`keyed`) once its state is open, and no batch is drawn before
    key: bytes | int | np.ndarray | None = field(repr=False, compare=False)
    local_epochs: int = 1
    bands: int = 1
    order_seed: int = 0
    order: np.ndarray = field(init=False, repr=False, compare=False)
    _aes_key: bytes = field(init=False, repr=False, compare=False)
    _groups: tuple[np.ndarray, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_sizes(("num_examples", "batch_size", "rounds", "local_epochs", "bands"))
        if self.bands > self.steps_per_epoch:
            raise ValueError(
                f"CyclicPoissonLoader: {self.bands} bands need a rate of bands/steps per "
                f"epoch = {self.bands}/{self.steps_per_epoch} > 1; at most "
                f"{self.steps_per_epoch} bands (one fixed batch per group)")
        object.__setattr__(self, "_aes_key",
                           b"" if self.key is None else sampling_key(self.key))
        object.__setattr__(self, "_groups",
                           tuple(self.order[g::self.bands] for g in range(self.bands)))

    # -- what the accounting needs --------------------------------------------------------
    @property
    def sampling_rate(self) -> float:
        """``q = bands/s``: each eligible example's inclusion probability."""
        return self.bands / self.steps_per_epoch

    @property
    def expected_batch_size(self) -> float:
        """``q·n/bands = n/s``: what a step's sum of clipped gradients is divided by (the
        same at every step, and public; a step's drawn size is neither)."""
        return self.sampling_rate * self.num_examples / self.bands

    @property
    def sampling(self) -> CyclicPoissonSampling:
        """What the amplified accounting reads (:mod:`flwr_corrnoise.amplification`)."""
        return CyclicPoissonSampling(self.sampling_rate, self.bands, self.horizon)

    @property
    def participation(self) -> SampledParticipation:
        """What the learner's settings calibrate to: the sampling (rate, cycle, the expected
        batch size every step's sum is divided by); its base fields are the un-amplified
        bound of the same loop (an example is used at most at its group's steps
        ``g, g + b, …``, ``⌈N/b⌉`` of them), which holds whatever was drawn, for any code
        that reads a participation without the sampling."""
        return SampledParticipation.cyclic_poisson(self.sampling_rate, self.bands,
                                                   self.horizon, self.expected_batch_size)

    def config(self) -> dict[str, Any]:
        """The learner's config keys this loop implies (as :meth:`CyclicLoader.config`)."""
        return {"horizon": self.horizon, "local-steps": self.local_steps,
                "num-server-rounds": self.rounds, "sampling-rate": self.sampling_rate,
                "sampling-cycle": self.bands,
                "expected-batch-size": self.expected_batch_size}

    @property
    def order_digest(self) -> str:
        """SHA-256 of the groups' order and the sizes and rate: what a learner's state
        records to refuse a changed loader (never a function of the key)."""
        h = hashlib.sha256(np.asarray(self.order, dtype="<i8").tobytes())
        h.update(f"/cyclic-poisson/{self.batch_size}/{self.local_epochs}/{self.bands}".encode())
        return h.hexdigest()

    # -- the batches ----------------------------------------------------------------------
    def group(self, step: int) -> np.ndarray:
        """The examples eligible at ``step``: group ``step mod bands`` (public)."""
        return self._groups[self._check_step(step) % self.bands]

    def indices(self, step: int) -> np.ndarray:
        """The example indices drawn at global step ``step`` (``0 ≤ step < horizon``): a
        function of the key and the step only. Its length is secret."""
        members = self.group(step)
        mask = self.inclusion(step)
        return members[mask]

    def keyed(self, key: bytes | int | np.ndarray) -> CyclicPoissonLoader:
        """This loader with the learner's noise ``key`` (the sampler derives its own
        sub-key from it)."""
        from dataclasses import replace

        return replace(self, key=key)

    def inclusion(self, step: int) -> np.ndarray:
        """Whether each member of :meth:`group` ``(step)`` is drawn (booleans, group
        order): word ``j`` of the step's AES-CTR keystream below ``⌊q·2⁶⁴⌋``."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        step = self._check_step(step)
        if not self._aes_key:
            raise ValueError("this CyclicPoissonLoader has no key: the draws come from the "
                             "learner's noise key (PrivateSteps keys it; elsewhere pass key=)")
        size = self._groups[step % self.bands].size
        q = self.sampling_rate
        if q >= 1.0:
            return np.ones(size, dtype=bool)
        counter = (step << 64).to_bytes(16, "big")
        enc = Cipher(algorithms.AES(self._aes_key), modes.CTR(counter)).encryptor()
        words = np.frombuffer(enc.update(bytes(8 * size)), dtype="<u8")
        return words < np.uint64(int(q * 2.0**64))

    def eligible_steps(self, example: int) -> np.ndarray:
        """The global steps at which ``example`` may be drawn (its group's; public)."""
        slot = int(np.flatnonzero(self.order == int(example))[0])
        return np.arange(slot % self.bands, self.horizon, self.bands)

    def _check_step(self, step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int | np.integer) \
                or not 0 <= int(step) < min(self.horizon, _MAX_STEP):
            raise IndexError(f"step {step!r} is outside the loader's horizon {self.horizon}")
        return int(step)


#: a loop whose participation the library knows: one fixed order, or cyclic Poisson sampling
Loader = CyclicLoader | CyclicPoissonLoader
