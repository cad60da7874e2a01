"""Adaptive clipping in the local-DP setting: the quantile method of Andrew, Thakkar,
McMahan and Ramaswamy, "Differentially Private Learning with Adaptive Clipping"
(NeurIPS 2021), run by each learner on its own data, its cost composed into the learner's ε.

Pure math (NumPy, the library's accountants and its AES-CTR normals): no Flower, no torch.

**The method.** A fixed clip norm ``B_g`` must be guessed before training, and a bad guess
either discards most of the signal (too small) or pays noise for norms that never occur
(too large). Andrew et al. track a quantile ``γ`` of the norms instead: at each step the
learner counts the examples whose norm is at most the current clip norm ``C_t``,
privatizes that count, and moves the clip norm geometrically::

    b_t  = #{examples of step t : ‖g‖ ≤ C_t}             (0 … m, m examples a step)
    b̃_t  = (b_t + σ_b·ζ_t) / m                             ζ_t ~ N(0, 1), fresh each step
    C_{t+1} = C_t · exp(−η_C · (b̃_t − γ))

so ``C`` shrinks while more than a ``γ`` fraction of the norms fit under it and grows
while fewer do. Flower's ``DifferentialPrivacyClientSideAdaptiveClipping`` and Opacus'
``AdaClipDPOptimizer`` run the same update across *clients* per round (central DP); here
the unit is one learner's step (local DP), ``m`` the examples of the step (1 for the
NumPy step and the per-round mod, the batch for the torch optimizer).

**Why the count is a Gaussian mechanism of sensitivity 1 per use.** Under replace-one
(the neighbouring relation of every learner guarantee here) two neighbouring datasets
differ in one example ``x`` ↔ ``x′``. At a step that does not use it, the two counts are
computed on the same examples; at a step that uses it, exactly one term of the sum
``b_t = Σ_i 1[‖g_i‖ ≤ C_t]`` changes, from one indicator in ``{0, 1}`` to another, so
``|b_t − b′_t| ≤ 1``. (A zero gradient — a datum whose gradient cannot be computed — has
norm 0 and is one more indicator; the rule does not depend on what the datum is.) An
example that the declared participation lets enter ``k`` steps changes the vector
``(b_t)_t`` in at most ``k`` coordinates by at most 1 each: ``‖b − b′‖₂ ≤ √k``. With
independent noise ``σ_b`` per step the counts are one Gaussian release of ℓ2 sensitivity
``√k`` and std ``σ_b``, i.e. ``μ_b = √k/σ_b`` (Dong, Roth & Su, "Gaussian Differential
Privacy", 2019).

**Why the gradient noise needs no new calibration: unit sensitivity, then rescale.** The
learner's gradient noise is the matrix mechanism's ``C·G + V·ξ``, whose sensitivity is
``2·B·max_j‖c_j‖`` when every row of ``G`` has norm ≤ ``B``. With a clip norm that moves,
the step clips to ``C_t``, **divides by** ``C_t`` (so the row has norm ≤ 1), adds the
stream's increment calibrated at ``B = 1``, and multiplies the sum by ``C_t``::

    release_t = C_t · ( clip(g_t, C_t)/C_t + e_t )

The rows ``clip(g_t, C_t)/C_t`` have norm ≤ 1 whatever ``C_t`` is, so the inner mechanism
has ℓ2 sensitivity ``2·max_j‖c_j‖`` (under the participation, as everywhere else), and the
factor ``C_t`` is a function of the earlier noised counts only: the whole view of an
adversary is post-processing of the joint release ``(C·G′ + V·ξ, b + σ_b·ζ)``, and ``C_t``
itself is never released (learner state, like the noise generator; the released metadata
stays a function of settings and counters — ``noise-std`` is then in units of the clip
norm). The rows of ``G′`` are chosen adaptively from earlier outputs of both parts; the
joint noise is a Gaussian with a lower-triangular factor in time order, so the adaptive
continual-release argument (Denisov, McMahan, Rush, Smith and Thakurta, "Improved
Differential Privacy for SGD via Optimal Private Linear Operators on Adaptive Streams",
NeurIPS 2022, Thm 2.1) reduces it to the non-adaptive Gaussian mechanism whose whitened
sensitivity is at most ``√(μ_g² + μ_b²)``, ``μ_g = 2·max_j‖c_j‖/V``: **μ² adds** (exactly the
composition of Gaussian mechanisms in μ-GDP, and of ρ = μ²/2 in zCDP). The library's
accountants read a :class:`~flwr_corrnoise.accounting.Composed` event this way, and
``tests/accounting/test_adaptive_clipping.py`` holds the result against ``dp_accounting``'s PLD and
RDP accountants on the same composed events.

**Calibration.** The budget ``(ε, δ)`` fixes the largest total ``μ``; the counts take
``μ_b² = k/σ_b²`` of it (by default ``σ_b`` is chosen so that they take
:data:`DEFAULT_COUNT_SHARE` of ``μ²``: the gradient noise grows by ``1/√(1 − share)``,
5.4 %), and the gradient noise is calibrated to the rest, then checked — and rounded up —
in exact arithmetic on the composed event, like every calibration here.

**The count noise** comes from the library's AES-128-CTR normals (:mod:`~flwr_corrnoise.
cipher_noise`) under a key of its own (128 bits of OS entropy for a deployed learner; a
hash of the simulation seed otherwise): the normal of step ``t`` is row ``t`` of that key,
drawn once, for the step the learner's counter says (element ``t mod 256`` of row
``t // 256``) — so a round that is rolled back and run again draws nothing new, exactly
like the gradient stream.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .accounting import Composed, GaussianRelease, PrivacyBudgetError, check_budget
from .cipher_noise import CipherGaussian, key_from_seed, os_entropy_key
from .mechanisms.base import Factorization
from .mechanisms.participation import ONCE, Participation
from .privacy import Calibration, accountant

__all__ = [
    "CLIP_STATE",
    "COUNT_KEY_STATE",
    "DEFAULT_COUNT_SHARE",
    "AdaptiveClipState",
    "AdaptiveClipping",
    "adaptive_release",
    "calibrate_adaptive",
    "count_release",
    "epsilon_spent_adaptive",
]

#: the share of the total ``μ²`` the privatized counts take when ``noise`` is not given
DEFAULT_COUNT_SHARE = 0.1

#: the clip norm stays within this factor of its initial value either way (a clamp on a
#: function of noised counts: post-processing; it keeps ``C_t`` a finite positive float)
CLIP_RANGE = 1e6

#: the learner-state payload entries (:attr:`~flwr_corrnoise.learner.LearnerState.payload`)
CLIP_STATE = "adaptive-clip"
COUNT_KEY_STATE = "adaptive-clip-key"

#: the domain word of a simulation's count-noise key (the gradient stream hashes the seed
#: alone: the two keys differ)
_COUNT_DOMAIN = 0xADAC11

#: steps whose count normals are one row of the count key (row ``t // K``, element ``t mod K``)
_BLOCK = 256
#: blocks of count normals kept in this process, by (key, block): a pure function of both,
#: not state (never stored, never released); bounded, oldest dropped first
_BLOCKS: dict[tuple[int, int], np.ndarray] = {}
_BLOCKS_MAX = 1024
#: count-noise generators by their packed words (only ``row``/``rows`` are used: stateless)
_GENERATORS: dict[tuple[int, ...], CipherGaussian] = {}


@dataclass(frozen=True)
class AdaptiveClipping:
    """The settings of the quantile clip-norm update (Andrew et al. 2021).

    ``quantile`` (``γ``): the fraction of norms the clip norm tracks (0.5: the median).
    ``lr`` (``η_C``): the geometric step **per local step** (a round of ``τ`` steps moves
    ``ln C`` by about ``η_C·τ·(b̄ − γ)``; Andrew et al.'s per-round 0.2 over ``τ`` steps is
    ``0.2/τ``). ``noise`` (``σ_b``): the std of the Gaussian noise on each step's count;
    ``None``: chosen so that the counts take :data:`DEFAULT_COUNT_SHARE` of the budget.
    """

    quantile: float = 0.5
    lr: float = 0.01
    noise: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.quantile, int | float) and 0.0 < self.quantile < 1.0):
            raise PrivacyBudgetError(
                f"adaptive-clip-quantile must be in (0, 1), got {self.quantile!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise PrivacyBudgetError(f"adaptive-clip-lr must be finite and > 0, got {self.lr!r}")
        if self.noise is not None and not (isinstance(self.noise, int | float)
                                           and math.isfinite(self.noise) and self.noise > 0):
            raise PrivacyBudgetError(
                f"adaptive-clip-noise must be finite and > 0 (or unset), got {self.noise!r}")
        object.__setattr__(self, "quantile", float(self.quantile))
        object.__setattr__(self, "lr", float(self.lr))
        if self.noise is not None:
            object.__setattr__(self, "noise", float(self.noise))

    def as_dict(self) -> dict[str, Any]:
        """The binding form (stored with a learner state, compared on every restore)."""
        return {"quantile": self.quantile, "lr": self.lr, "noise": self.noise}

    @classmethod
    def from_config(cls, quantile: Any, lr: Any, noise: Any) -> AdaptiveClipping | None:
        """From the config keys' values (``quantile`` ``None``: adaptive clipping off; an
        ``lr`` or ``noise`` without a quantile is an error, not silently ignored)."""
        if quantile is None:
            if lr is not None or noise is not None:
                raise PrivacyBudgetError(
                    "adaptive-clip-lr / adaptive-clip-noise are set but adaptive-clip-quantile "
                    "is not: set the quantile to turn adaptive clipping on")
            return None
        return cls(float(quantile), 0.01 if lr is None else float(lr),
                   None if noise is None else float(noise))


def count_release(noise: float, participation: Participation, steps: int) -> GaussianRelease:
    """The privatized counts of ``steps`` steps as an accountant reads them: ℓ2
    sensitivity ``√k`` (``k``: the most uses of one datum within ``steps`` steps under
    ``participation``; each use moves one count by at most 1, see the module docstring)
    and std ``noise``."""
    uses = participation.participations(int(steps))
    return GaussianRelease(math.sqrt(uses), noise)


def count_noise(total_mu: float, uses: int, share: float = DEFAULT_COUNT_SHARE) -> float:
    """``σ_b`` that makes the counts take ``share`` of ``μ²``: ``√k/σ_b = √share·μ``."""
    return math.sqrt(uses) / (math.sqrt(share) * total_mu)


def calibrate_adaptive(
    fact: Factorization, epsilon: float, delta: float, adaptive: AdaptiveClipping,
    method: str = "exact", participation: Participation = ONCE,
) -> tuple[Calibration, float]:
    """The unit-clip gradient noise ``V`` and the count noise ``σ_b`` that make the
    learner's whole release — the matrix mechanism on rows of norm ≤ 1 and its ``N``
    privatized counts — ``(ε, δ)``-DP under ``participation``.

    Returns ``(calibration, σ_b)``: the calibration has ``clip_norm = 1`` (the stream adds
    ``V·e_t`` to the normalized row, the step multiplies by ``C_t``: module docstring).
    Raises :class:`PrivacyBudgetError` when a given ``σ_b`` alone spends the budget."""
    eps, dlt = check_budget(epsilon, delta)
    if getattr(participation, "expected_batch_size", None) is not None:
        raise PrivacyBudgetError(
            "adaptive clipping is accounted for a declared participation, not under "
            "amplification by sampling (its counts would need the sampled accountant): use "
            "a fixed clip-norm with a sampled loader")
    acc = accountant(method)
    sens = fact.participation_sensitivity(participation)
    grad_l2 = 2.0 * sens.value
    counts = count_release(1.0, participation, fact.n)  # the sensitivity √k
    total_mu = 1.0 / acc.noise_std(1.0, eps, dlt)  # the largest μ the budget allows
    sigma_b = (adaptive.noise if adaptive.noise is not None
               else count_noise(total_mu, round(counts.l2_sensitivity ** 2)))
    mu_b = counts.l2_sensitivity / sigma_b
    rest = total_mu * total_mu - mu_b * mu_b
    if rest <= 0:
        raise PrivacyBudgetError(
            f"adaptive-clip-noise {sigma_b:g} spends the whole budget on the clip counts "
            f"(μ = {mu_b:.4g} ≥ {total_mu:.4g}, the budget's): raise it or unset it")
    std = grad_l2 / math.sqrt(rest)
    count_event = GaussianRelease(counts.l2_sensitivity, sigma_b)
    for attempt in range(10_000):  # the float root is a hair off: up until it provably holds
        if acc.satisfies(Composed((GaussianRelease(grad_l2, std), count_event)), eps, dlt):
            break
        std = math.nextafter(std, math.inf) if attempt < 64 else std * (1 + 1e-12)
    else:  # pragma: no cover - the root is within ulps
        raise PrivacyBudgetError("could not find a noise std that provably meets the budget")
    cal = Calibration(std=std, epsilon=eps, delta=dlt, clip_norm=1.0,
                      sensitivity=sens.value, l2_sensitivity=grad_l2, method=method,
                      mechanism=fact.name, steps=fact.n,
                      participation=participation.describe(), sensitivity_exact=sens.exact)
    return cal, sigma_b


def adaptive_release(fact: Factorization, std: float, sigma_b: float,
                     participation: Participation, steps: int | None = None) -> Composed:
    """What an adaptively clipping learner has released after ``steps`` steps (all ``N``
    by default): the matrix mechanism's prefix at unit clip, composed with the counts of
    those steps."""
    n = fact.n if steps is None else int(steps)
    return Composed((fact.release(1.0, std, steps=steps, participation=participation),
                     count_release(sigma_b, participation, n)))


def epsilon_spent_adaptive(fact: Factorization, std: float, sigma_b: float, delta: float,
                           method: str, participation: Participation, steps: int) -> float:
    """ε of :func:`adaptive_release` after ``steps`` steps (0 before the first)."""
    if steps <= 0:
        return 0.0
    steps = min(int(steps), fact.n)
    return accountant(method).epsilon(
        adaptive_release(fact, std, sigma_b, participation,
                         None if steps == fact.n else steps), delta)


@dataclass
class AdaptiveClipState:
    """A learner's clip norm and the key of its count noise: learner state, never
    released. Stored as two payload arrays of the learner state
    (:meth:`to_payload`); every update *replaces* them (no array is written in place), so
    a shallow copy of the payload is a checkpoint."""

    log_clip: float
    log_initial: float
    generator: CipherGaussian
    #: normals of one block of steps, computed together (a pure function of the key and the
    #: block: not state, never stored; one AES call a step cost ≈ 0.5 ms)
    _block: tuple[int, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, initial_clip: float, seed: int | None) -> AdaptiveClipState:
        """A fresh state at ``initial_clip``; ``seed=None``: the count noise is keyed with
        128 bits of OS entropy, else with a hash of ``seed`` in a domain of its own
        (simulations)."""
        key = os_entropy_key() if seed is None else key_from_seed([int(seed) % (1 << 128),
                                                                   _COUNT_DOMAIN])
        lc = math.log(float(initial_clip))
        return cls(lc, lc, CipherGaussian(key))

    @property
    def clip_norm(self) -> float:
        """``C_t``."""
        return math.exp(self.log_clip)

    def count_normal(self, step: int) -> float:
        """``ζ_t``: element ``t mod K`` of row ``t // K`` (``K`` = :data:`_BLOCK`) of the
        count-noise key — one normal per step, for the step the learner's counter names,
        so a rolled-back step draws the same. The row is kept per key in this process (a
        pure function of key and row): the learner restores its state from the payload
        every step."""
        block, at = divmod(int(step), _BLOCK)
        if self._block is None or self._block[0] != block:
            cache_key = (self.generator.key, block)
            rows = _BLOCKS.get(cache_key)
            if rows is None:
                rows = self.generator.row(block, _BLOCK)  # one AES-CTR row a block
                rows.flags.writeable = False
                if len(_BLOCKS) >= _BLOCKS_MAX:
                    _BLOCKS.pop(next(iter(_BLOCKS)))
                _BLOCKS[cache_key] = rows
            self._block = (block, rows)
        return float(self._block[1][at])

    def update(self, unclipped: float, examples: int, step: int,
               adaptive: AdaptiveClipping, sigma_b: float) -> float:
        """``C_{t+1} = C_t·exp(−η_C·((b_t + σ_b·ζ_t)/m − γ))`` for step ``step``'s count
        ``b_t = unclipped`` of ``m = examples``; returns the new clip norm."""
        noisy = (float(unclipped) + sigma_b * self.count_normal(step)) / max(int(examples), 1)
        lc = self.log_clip - adaptive.lr * (noisy - adaptive.quantile)
        bound = math.log(CLIP_RANGE)
        self.log_clip = min(max(lc, self.log_initial - bound), self.log_initial + bound)
        return self.clip_norm

    # -- the learner-state payload ----------------------------------------------------------
    def to_payload(self) -> dict[str, np.ndarray]:
        return {CLIP_STATE: np.array([self.log_clip, self.log_initial], dtype=np.float64),
                COUNT_KEY_STATE: self.generator.pack()}

    @classmethod
    def from_payload(cls, payload: Mapping[str, np.ndarray] | None) -> AdaptiveClipState:
        if not payload or CLIP_STATE not in payload or COUNT_KEY_STATE not in payload:
            raise ValueError("the learner state has no adaptive-clipping state (it was made "
                             "without adaptive clipping)")
        lc, li = (float(x) for x in np.asarray(payload[CLIP_STATE]).reshape(-1)[:2])
        if not (math.isfinite(lc) and math.isfinite(li)):
            raise ValueError("the stored clip norm is not finite")
        words = tuple(int(w) for w in np.asarray(payload[COUNT_KEY_STATE]).reshape(-1))
        gen = _GENERATORS.get(words)
        if gen is None:  # the key schedule once per key and process (≈ 150 µs a restore)
            gen = CipherGaussian.unpack(np.array(words, dtype=np.uint64))
            if len(_GENERATORS) >= _BLOCKS_MAX:
                _GENERATORS.pop(next(iter(_GENERATORS)))
            _GENERATORS[words] = gen
        return cls(lc, li, gen)
