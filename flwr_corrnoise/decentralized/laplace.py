"""Pure (ε, 0) differential privacy with Laplace noise: sampler, scale schedules, a
serializable per-learner noise stream and the accounting helpers both papers need.

Why Laplace and not the project's Gaussian streams: Chen & Wang, "Locally Differentially Private
Distributed Online Learning with Guaranteed Optimality" and Wang, Yang, Yao, Song & Wan, "Revisiting
Differentially Private Algorithms for Decentralized Online Learning" give pure ε-DP guarantees,
which need Laplace noise calibrated to an ℓ1 sensitivity: releasing ``x + Lap(b)^d`` where ``x``
changes by at most ``Δ₁`` in ℓ1 between adjacent data is ``Δ₁ / b``-DP, and releases compose by
adding their ε (basic composition, tight for pure DP in the worst case).

Schedules, one per paper/baseline:

* ``power``: ``b_t = b₀ (t+1)^s`` — Chen & Wang's *growing* scale ``ϱ_t = σ (t+1)^ς / √2``
  (``b₀ = σ/√2``, ``s = ς``);
* ``geometric``: ``b_t = b₀ q^t`` — PDOP (Huang et al. 2015), ``0.5 · 0.98^t`` in Chen & Wang's
  runs;
* ``inverse``: ``b_t = b₀ / (t+1)`` — DOLA's decaying scale in Chen & Wang's runs
  (``0.07/(0.2(t+1))``);
* ``constant``: ``b_t = b₀``.

``b₀ = 0`` turns the noise off (ε = ∞): the stream still consumes its random numbers, so a run
with noise off sees exactly the same data order and the same draws (times zero) as a private
one — what the "ε → ∞ equals the non-private algorithm" tests rely on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flwr_corrnoise import arraypack
from flwr_corrnoise.cipher_noise import CipherGaussian

__all__ = [
    "SCHEDULES",
    "LaplaceStream",
    "ScaleSchedule",
    "basic_composition",
    "epsilon_of_laplace",
    "laplace",
    "scale_for_epsilon",
]

SCHEDULES = ("constant", "power", "geometric", "inverse")


def laplace(
    rng: CipherGaussian, scale: float | np.ndarray, shape: int | Sequence[int]
) -> np.ndarray:
    """Draw ``Lap(0, scale)`` noise of ``shape``; ``scale`` is a scalar or broadcasts to shape
    (per-coordinate scales). Density ``exp(−|x|/b)/(2b)``, variance ``2 b²``.

    The unit draws are the generator's next Laplace row (AES-128-CTR keystream, inversion:
    :func:`~flwr_corrnoise.cipher_noise.laplace_from_keystream`; the tail is cut at
    ``73.5·b``, a mass of ``2⁻¹⁰⁶`` per draw that docs/privacy.md adds to δ), so a restored
    generator continues bit for bit. The draw is ``scale × Lap(0, 1)``: a zero scale gives
    zeros while consuming the same row as any other scale (noise on and off runs stay
    aligned).
    """
    b = np.asarray(scale, dtype=float)
    if not np.all(np.isfinite(b)) or np.any(b < 0):
        raise ValueError(f"Laplace scale must be finite and ≥ 0, got {scale!r}")
    shape_t = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
    try:
        np.broadcast_shapes(b.shape, shape_t)
    except ValueError as err:
        raise ValueError(f"scale of shape {b.shape} does not broadcast to {shape_t}") from err
    if not isinstance(rng, CipherGaussian):
        raise TypeError(f"Laplace noise comes from a CipherGaussian, not {type(rng).__name__}")
    unit = rng.next_laplace(math.prod(shape_t)).reshape(shape_t)
    return unit * b


def epsilon_of_laplace(l1_sensitivity: float, scale: float) -> float:
    """ε of one Laplace release: ``Δ₁ / b`` (``inf`` if ``b = 0`` and ``Δ₁ > 0``)."""
    if not (math.isfinite(l1_sensitivity) and l1_sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and ≥ 0, got {l1_sensitivity!r}")
    if not (scale >= 0) or math.isnan(scale):
        raise ValueError(f"Laplace scale must be ≥ 0, got {scale!r}")
    if l1_sensitivity == 0:
        return 0.0
    return math.inf if scale == 0 else l1_sensitivity / scale


def scale_for_epsilon(l1_sensitivity: float, epsilon: float) -> float:
    """The Laplace scale ``b = Δ₁ / ε`` that makes one release ε-DP."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"ε must be finite and > 0, got {epsilon!r}")
    if not (math.isfinite(l1_sensitivity) and l1_sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and ≥ 0, got {l1_sensitivity!r}")
    return l1_sensitivity / epsilon


def basic_composition(epsilons: Sequence[float] | np.ndarray) -> float:
    """ε of a sequence of pure-DP releases on the same data: their sum."""
    eps = np.asarray(epsilons, dtype=float)
    if np.any(np.isnan(eps)) or np.any(eps < 0):
        raise ValueError("ε values must be ≥ 0")
    return float(eps.sum())


@dataclass(frozen=True)
class ScaleSchedule:
    """Laplace scale per step ``t = 0, 1, …`` (see the module docstring for the kinds)."""

    kind: str = "constant"
    base: float = 1.0
    rate: float = 0.0  # exponent s for "power", ratio q for "geometric", unused otherwise

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown scale schedule {self.kind!r}; use one of {SCHEDULES}")
        if not (math.isfinite(self.base) and self.base >= 0):
            raise ValueError(f"base scale must be finite and ≥ 0, got {self.base!r}")
        if not math.isfinite(self.rate):
            raise ValueError(f"schedule rate must be finite, got {self.rate!r}")
        if self.kind == "geometric" and not 0 < self.rate <= 1:
            raise ValueError(f"geometric ratio must be in (0, 1], got {self.rate!r}")

    @classmethod
    def chen_wang(cls, sigma: float, varsigma: float) -> ScaleSchedule:
        """Chen & Wang's Assumption 4: ``ϱ_t = σ (t+1)^ς / √2``."""
        return cls("power", float(sigma) / math.sqrt(2.0), float(varsigma))

    @property
    def noiseless(self) -> bool:
        return self.base == 0.0

    def scale(self, t: int | np.ndarray) -> np.ndarray | float:
        """``b_t`` at step(s) ``t`` (0-based)."""
        tt = np.asarray(t, dtype=float)
        if np.any(tt < 0):
            raise ValueError("steps are 0-based and ≥ 0")
        if self.kind == "constant":
            out = np.full_like(tt, self.base)
        elif self.kind == "power":
            out = self.base * (tt + 1.0) ** self.rate
        elif self.kind == "geometric":
            out = self.base * self.rate**tt
        else:
            out = self.base / (tt + 1.0)
        return float(out) if out.ndim == 0 else out

    def to_arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        return {
            f"{prefix}kind": np.array(self.kind),
            f"{prefix}base": np.array(self.base),
            f"{prefix}rate": np.array(self.rate),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str = "") -> ScaleSchedule:
        return cls(
            str(arrays[f"{prefix}kind"]),
            float(arrays[f"{prefix}base"]),
            float(arrays[f"{prefix}rate"]),
        )


class LaplaceStream:
    """One learner's Laplace noise, step by step, with its state as bytes.

    State is the AES-128-CTR generator's five words (:class:`~flwr_corrnoise.cipher_noise.
    CipherGaussian`: key and row counter) and the step counter: a
    learner whose state lives in Flower's ``context.state`` (or on disk) restores it and
    draws exactly the next step's noise — never
    the same noise twice, never skipping. ``scales`` optionally multiplies the schedule per
    coordinate (heterogeneous per-coordinate scales).

    ``seed=None`` (the default) keys the generator with 128 bits of OS entropy
    (:meth:`~flwr_corrnoise.cipher_noise.CipherGaussian.from_seed`); an integer seed is for
    reproducible simulations and tests. Why no default seed: a default of ``0`` gave every
    stream made without one the same noise, known to anyone, which a release then does not
    hide at all.
    """

    def __init__(
        self,
        dim: int,
        schedule: ScaleSchedule,
        seed: int | Sequence[int] | None = None,
        *,
        coordinate_scales: np.ndarray | None = None,
        _rng: CipherGaussian | None = None,
        _step: int = 0,
    ) -> None:
        if int(dim) != dim or dim < 1:
            raise ValueError(f"dimension must be a positive integer, got {dim!r}")
        self.dim = int(dim)
        self.schedule = schedule
        cs = np.ones(self.dim) if coordinate_scales is None else np.asarray(
            coordinate_scales, dtype=float
        )
        if cs.shape != (self.dim,) or not np.all(np.isfinite(cs)) or np.any(cs < 0):
            raise ValueError("coordinate scales must be a finite, ≥ 0 vector of length dim")
        self.coordinate_scales = cs
        # the library's noise kernel: AES-128-CTR under a 128-bit key
        self.rng = _rng if _rng is not None else CipherGaussian.from_seed(seed)
        self.step = int(_step)

    def current_scale(self) -> np.ndarray:
        """Per-coordinate scale of the *next* draw."""
        return self.schedule.scale(self.step) * self.coordinate_scales

    def next(self) -> np.ndarray:
        """The noise of the current step; advances the step."""
        out = laplace(self.rng, self.current_scale(), self.dim)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        return {
            "rng": self.rng.pack(),
            "step": np.array(self.step, dtype=np.int64),
            "dim": np.array(self.dim, dtype=np.int64),
            "coordinate_scales": self.coordinate_scales,
            **self.schedule.to_arrays("schedule_"),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, np.ndarray]) -> LaplaceStream:
        try:
            return cls(
                int(state["dim"]),
                ScaleSchedule.from_arrays(state, "schedule_"),
                coordinate_scales=state["coordinate_scales"],
                _rng=CipherGaussian.unpack(state["rng"]),
                _step=int(state["step"]),
            )
        except KeyError as err:
            raise ValueError(f"Laplace stream state lacks {err}") from err

    def to_bytes(self) -> bytes:
        return arraypack.pack(self.state_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> LaplaceStream:
        return cls.from_state_dict(arraypack.unpack(data))
