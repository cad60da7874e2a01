"""Amplification by sampling for banded matrix factorization: noise for a banded encoder
under cyclic Poisson sampling, and the choice of its bands.

Why (issue 35): a learner that trains epochs over its data in a fixed order gets no
amplification by subsampling, and DP-SGD with Poisson sampling (Opacus) then needs
1.4–2.5× less noise in the prefix sums than our fixed-order mechanisms. Choquette-Choo,
Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A
unified approach to private training" (NeurIPS 2023) combine both:

**Cyclic Poisson sampling** (their Algorithm 2; :class:`~flwr_corrnoise.data.sampling.
CyclicPoissonLoader`): the examples are split once into ``b`` groups; at step ``i`` only
group ``i mod b`` is eligible, each member included independently with probability ``q``.

**What is proven and used here** (their Theorem 4, restated for the replace-one relation as
well): let ``C`` be lower-triangular with ``w ≤ b`` bands (``C[r, s] = 0`` for
``r − s ≥ w``) and largest column norm ``ζ = max_s ‖c_s‖``. An example of group ``g`` is
eligible at ``t_j = g + j·b`` only; column ``t_j`` of ``C`` is supported on rows
``[t_j, t_j + w) ⊂ [t_j, t_{j+1})``, and the rows ``[t_j, t_{j+1})`` read the columns
``[t_j − w + 1, t_{j+1})``, of which only ``t_j`` is one of the example's. So the release,
cut into those row blocks, is a sequence of mechanisms in which block ``j`` depends on the
example only through its (sampled or not) gradient at ``t_j``; the other columns a block
reads are computed from earlier released rows and other examples, which post-processing
removes (the adaptive argument of Denisov et al. 2022, Thm. 2.1). Each block is therefore
a Poisson-subsampled Gaussian mechanism with rate ``q``, sensitivity
``‖c_{t_j}‖·B_g ≤ ζ·B_g`` and noise std ``V``, and the blocks compose adaptively: the
learner's whole release is at least as private as DP-SGD run for
``k = ⌈N/b⌉`` steps (:meth:`CyclicPoissonSampling.cycles`) at rate ``q`` with noise
multiplier ``σ = V/(ζ·B_g)``, under either neighbouring relation (the subsampled
Gaussian's dominating pair of that relation, :mod:`flwr_corrnoise.accounting.pld`). With
``b = w = 1`` it *is* DP-SGD; with ``q = 1`` it is the un-amplified banded mechanism with
``k`` participations ``b`` apart (sensitivity ``√k·ζ``, what
:mod:`~flwr_corrnoise.mechanisms.participation` computes for that fixed-epoch pattern).
``tests/mechanisms/test_amplified_banded.py`` checks the block structure by brute force over
sampled participation patterns.

**Choosing the bands.** At a fixed expected batch size (``n/s`` examples per step for a
learner with ``n`` examples and ``s`` steps per epoch), ``b`` bands mean rate ``q = b/s``:
more bands give the encoder more room (a smaller RMSE at unit sensitivity, ``‖c‖·‖B‖_F/√N``)
but less amplification (a larger ``σ``). Choquette-Choo et al. choose ``b`` by calibrating
``σ_b`` with the amplified accountant for every candidate and comparing the error of the
prefix-sum workload, ``σ_b·ζ_b·‖B_b‖_F/√N`` (their Sec. 5; jax_privacy's
``optimize_coefs_for_amplifications``): the noise in the model iterates of one SGD run.
:func:`choose_bands` keeps that rule with two changes, both because it picked a loser
(docs/results-multi-epoch.md: 2 bands at ε = 8 and 16 steps per epoch, a predicted 3 %
gain, trained 0.08 below DP-SGD):

- **the error is the noise in the iterate each gradient is taken at, in the loop the
  learner runs** (:func:`iterate_rmse`): under FedAvg a learner restarts every round from
  the average of ``M`` learners' models, so the noise at its step ``t`` of a round that
  began at ``u`` is its own noise since ``u`` (a window of the stream; one step long at
  the round's first step) plus ``1/M`` of every learner's prefix sum up to ``u``. A banded
  encoder's increments ``C⁻¹ξ`` are anti-correlated, their std 2.8–5× DP-SGD's at equal
  ε; the prefix sums over the whole run hide that, the short windows do not. With one
  learner (or one round) this *is* the paper's prefix-sum RMSE;
- **a margin** (:data:`MIN_GAIN`, 10 %): ``b > 1`` only where its error is at least that
  much below DP-SGD's (``b = 1``); otherwise DP-SGD, the baseline the paper's mechanism
  must never lose to. Both errors are proxies (they leave out the batch-size variance of
  sampling and the model's curvature); in the one trained case where they disagree they
  differ by 6 %, so a smaller predicted gain is not evidence. The margin is a stated
  choice, not fitted.

Every candidate's figures are returned, so a caller sees what the choice weighed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .accounting import PrivacyBudgetError, SelfComposed, check_budget
from .accounting.base import check_positive
from .accounting.calibration import Calibration
from .accounting.pld import (
    DEFAULT_GRID,
    REPLACE_ONE,
    PLDAccountant,
    PoissonSubsampledGaussian,
    calibrate_noise_multiplier,
    check_relation,
)

__all__ = [
    "AmplifiedCalibration",
    "BandChoice",
    "CyclicPoissonSampling",
    "amplified_event",
    "calibrate_amplified",
    "choose_bands",
    "encoder_bands",
    "epsilon_spent_amplified",
    "iterate_rmse",
]

#: :func:`choose_bands` takes ``b > 1`` only where its error is at least this fraction
#: below DP-SGD's (module docstring)
MIN_GAIN = 0.10


@dataclass(frozen=True)
class CyclicPoissonSampling:
    """What a cyclic Poisson sampler promises the accountant: ``bands`` groups (the
    cycle), step ``i`` samples only group ``i mod bands``, each member independently with
    probability ``sampling_rate``, over ``horizon`` steps. ``bands = 1`` is Poisson
    sampling (DP-SGD). Public: it says nothing about which example is in which batch."""

    sampling_rate: float
    bands: int
    horizon: int

    def __post_init__(self) -> None:
        q = float(self.sampling_rate)
        if not 0.0 < q <= 1.0:
            raise PrivacyBudgetError(f"sampling rate must lie in (0, 1], got "
                                     f"{self.sampling_rate!r}")
        for name in ("bands", "horizon"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise PrivacyBudgetError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        object.__setattr__(self, "sampling_rate", q)

    @classmethod
    def of(cls, participation: Any, horizon: int) -> CyclicPoissonSampling:
        """What a sampled participation (``Participation.sampled``) promises over ``horizon``
        steps. Here, not a method of the participation: the math below the accountant
        (:mod:`~flwr_corrnoise.mechanisms`) does not import the accountant."""
        return cls(participation.sampling_rate, participation.bands, int(horizon))

    def cycles(self, steps: int | None = None) -> int:
        """``⌈steps/b⌉``: the most steps at which one example is eligible within the first
        ``steps`` (all ``N`` by default); group 0's count, the largest."""
        steps = self.horizon if steps is None else int(steps)
        if not 0 <= steps <= self.horizon:
            raise ValueError(f"steps must lie in [0, {self.horizon}], got {steps}")
        return -(-steps // self.bands)

    def describe(self) -> str:
        kind = "Poisson sampling" if self.bands == 1 else \
            f"cyclic Poisson sampling over {self.bands} groups"
        return (f"{kind}, rate {self.sampling_rate:.6g}, ≤ {self.cycles()} uses of one "
                f"example in {self.horizon} steps")

    def as_dict(self) -> dict[str, Any]:
        return {"sampling-rate": self.sampling_rate, "bands": self.bands,
                "horizon": self.horizon}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CyclicPoissonSampling:
        return cls(float(d["sampling-rate"]), int(d["bands"]), int(d["horizon"]))


def encoder_bands(factorization: Any) -> int:
    """``w``: the number of nonzero diagonals of the factorization's encoder ``C``
    (``C[r, s] = 0`` for ``r − s ≥ w``), read from its structure (BandMF, ``C = I``) or
    from the materialized ``C`` up to the dense limit; ``ValueError`` where ``C`` is not
    square and lower-triangular or cannot be checked."""
    from .mechanisms.bandmf import BandedToeplitz
    from .mechanisms.independent import Independent
    from .mechanisms.participation import DENSE_LIMIT

    if isinstance(factorization, BandedToeplitz):
        return factorization.bands
    if isinstance(factorization, Independent):
        return 1
    if factorization.n > DENSE_LIMIT:
        raise ValueError(f"cannot check the bands of {factorization.name!r} at N = "
                         f"{factorization.n} (beyond the dense limit {DENSE_LIMIT})")
    _, C = factorization.matrices()
    if C.shape != (factorization.n, factorization.n) or np.any(np.triu(C, 1) != 0):
        raise ValueError(f"the encoder of {factorization.name!r} is not square "
                         "lower-triangular: amplification by cyclic sampling does not apply")
    rows, cols = np.nonzero(C)
    return int(np.max(rows - cols)) + 1 if rows.size else 1


def amplified_event(sampling: CyclicPoissonSampling, noise_multiplier: float,
                    steps: int | None = None) -> SelfComposed:
    """What a banded mechanism under ``sampling`` has released after ``steps`` steps (all
    by default), as the PLD accountant reads it: ``⌈steps/b⌉`` Poisson-subsampled Gaussian
    steps at the sampler's rate with noise multiplier ``V/(ζ·B_g)`` (module docstring)."""
    return SelfComposed(PoissonSubsampledGaussian(sampling.sampling_rate, noise_multiplier),
                        sampling.cycles(steps))


@dataclass(frozen=True)
class AmplifiedCalibration(Calibration):
    """The noise std of a banded mechanism under cyclic Poisson sampling, with everything
    needed to audit it: a :class:`~flwr_corrnoise.privacy.Calibration` (so a learner's
    settings hand it to every front end like any other) whose ``sensitivity`` is the
    encoder's largest column norm ``ζ``, ``l2_sensitivity`` one block's change (``2·ζ·B_g``
    under replace-one, ``ζ·B_g`` under add/remove) and :attr:`release` the amplified event
    — a Gaussian accountant cannot read it and refuses, the safe answer. ``relation``
    labels the guarantee; ``accountant`` the computation."""

    sampling_rate: float = 1.0  # q
    bands: int = 1  # the sampler's cycle b
    encoder_bands: int = 1  # w ≤ b
    cycles: int = 1  # ⌈N/b⌉ compositions
    relation: str = REPLACE_ONE
    accountant: str = "pld"
    grid: float = DEFAULT_GRID

    @property
    def column_norm(self) -> float:
        """``ζ = max_s ‖c_s‖``."""
        return self.sensitivity

    @property
    def noise_multiplier(self) -> float:
        """``σ = V/(ζ·B_g)``: DP-SGD's noise multiplier (std over clip norm) for the same
        ε — the convention of Opacus and ``dp_accounting``, not ``V/Δ``."""
        return self.std / (self.sensitivity * self.clip_norm)

    @property
    def sampling(self) -> CyclicPoissonSampling:
        return CyclicPoissonSampling(self.sampling_rate, self.bands, self.steps)

    @property
    def event(self) -> SelfComposed:
        """The calibrated release, as the PLD accountant reads it."""
        return amplified_event(self.sampling, self.noise_multiplier)

    @property
    def release(self) -> SelfComposed:  # type: ignore[override]
        return self.event


def calibrate_amplified(
    epsilon: float, delta: float, clip_norm: float, sampling: CyclicPoissonSampling,
    factorization: Any = None, *, mechanism: str = "bandmf",
    params: Mapping[str, Any] | None = None, relation: str = REPLACE_ONE,
    grid: float = DEFAULT_GRID, rtol: float = 1e-5,
) -> AmplifiedCalibration:
    """The noise std ``V`` making a banded mechanism under ``sampling`` ``(ε, δ)``-DP under
    ``relation``: ``V = σ·ζ·B_g`` with ``σ`` the smallest noise multiplier for which
    ``⌈N/b⌉`` Poisson-subsampled Gaussian steps at rate ``q`` meet the budget by the PLD
    (:func:`~flwr_corrnoise.accounting.pld.calibrate_noise_multiplier`).

    ``factorization`` (else ``mechanism`` with ``params``, built for the sampler's horizon;
    BandMF with ``bands = b`` by default) must have an encoder of at most ``b`` bands;
    anything else is refused, as the theorem does not cover it. With ``b = 1`` this is
    exactly DP-SGD's calibration.
    """
    eps, dlt = check_budget(epsilon, delta)
    clip = check_positive("clip norm", clip_norm)
    relation = check_relation(relation)
    if factorization is None:
        from .mechanisms import build_factorization

        given = dict(params or {})
        if mechanism == "bandmf":
            given.setdefault("bands", min(sampling.bands, sampling.horizon))
        factorization = build_factorization(mechanism, sampling.horizon, **given)
    if factorization.n != sampling.horizon:
        raise ValueError(f"the factorization's horizon {factorization.n} is not the "
                         f"sampler's {sampling.horizon}")
    w = encoder_bands(factorization)
    if w > sampling.bands:
        raise ValueError(
            f"the encoder of {factorization.name!r} has {w} bands but the sampler cycles "
            f"over {sampling.bands} groups: one example's uses would share rows of C·G, "
            "and the amplified accounting would not hold (use bands ≤ the cycle)")
    zeta = float(factorization.sensitivity)
    cycles = sampling.cycles()
    sigma = calibrate_noise_multiplier(eps, dlt, sampling.sampling_rate, cycles, relation,
                                       grid, rtol)
    unit = 2.0 if relation == REPLACE_ONE else 1.0  # one block's change, in ζ·B_g
    return AmplifiedCalibration(
        std=sigma * zeta * clip, epsilon=eps, delta=dlt, clip_norm=clip, sensitivity=zeta,
        l2_sensitivity=unit * zeta * clip, method="pld", mechanism=factorization.name,
        steps=sampling.horizon,
        participation=f"{sampling.describe()} ({relation})", sampling_rate=sampling.sampling_rate,
        bands=sampling.bands, encoder_bands=w, cycles=cycles, relation=relation,
        accountant=f"pld ({relation})", grid=grid)


def epsilon_spent_amplified(
    std: float, delta: float, clip_norm: float, sampling: CyclicPoissonSampling,
    column_norm: float, steps_done: int, relation: str = REPLACE_ONE,
    grid: float = DEFAULT_GRID,
) -> float:
    """ε of what a learner has released after ``steps_done`` steps (ε spent per round):
    the ``⌈steps_done/b⌉`` blocks released so far, each a Poisson-subsampled Gaussian of
    noise multiplier ``V/(ζ·B_g)``."""
    if steps_done <= 0:
        return 0.0
    std = check_positive("noise std", std)
    _, dlt = check_budget(1.0, delta)
    sigma = std / (check_positive("column norm", column_norm)
                   * check_positive("clip norm", clip_norm))
    event = amplified_event(sampling, sigma, min(int(steps_done), sampling.horizon))
    return PLDAccountant(relation, grid).epsilon(event, dlt)


@dataclass(frozen=True)
class BandChoice:
    """One candidate of :func:`choose_bands`: ``bands`` (sampler cycle = encoder bands),
    its rate, compositions and calibrated noise multiplier, the encoder's unit-sensitivity
    RMSE ``ζ·‖B‖_F/√N``, the prefix-sum noise RMSE ``σ·ζ·‖B‖_F/√N`` (clip norm 1; the
    paper's criterion) and ``error``, the iterate noise RMSE the choice compares
    (:func:`iterate_rmse` × ``σ``; ``= rmse`` for one learner or one round)."""

    bands: int
    sampling_rate: float
    cycles: int
    noise_multiplier: float
    column_norm: float
    unit_rmse: float
    rmse: float
    error: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def iterate_rmse(band: np.ndarray, horizon: int, steps_per_round: int | None = None,
                 learners: int = 1) -> float:
    """The RMSE (per coordinate, over the ``horizon`` steps, unit noise multiplier and clip
    norm) of the noise in a learner's model after each of its steps, for a banded Toeplitz
    encoder with first column ``band`` (``c(0) = 1``) under FedAvg: ``learners`` learners
    (``M``) with independent noise streams, each restarting every ``steps_per_round``
    steps (``P``; default the horizon: one round) from the average of their models.

    With ``β = cumsum(1/c)`` (column 0 of ``B = A·C⁻¹``), the noise after step ``t`` of the
    round that began at ``u`` (``L = t − u + 1`` own steps) is
    ``ζ·[Σ_{j≤t} B[t, j] z_j − (1 − 1/M)·Σ_{j<u} B[u−1, j] z_j] + (1/M)·Σ_{other learners}
    ζ·B[u−1]·z'``, whose variance is ``ζ²·(Σ_{m<u} (β(m+L) − a·β(m))² + Σ_{k<L} β(k)² +
    (M−1)/M²·Σ_{m<u} β(m)²)`` with ``a = 1 − 1/M``. ``M = 1`` or ``P ≥ N``: the prefix-sum
    RMSE ``ζ·‖B‖_F/√N``. O(N·P)."""
    from .mechanisms.bandmf import decoder_column

    n = int(horizon)
    c = np.asarray(band, dtype=float)
    per = n if steps_per_round is None else int(steps_per_round)
    m = int(learners)
    if n < 1 or per < 1 or m < 1:
        raise ValueError("horizon, steps per round and learners must be positive")
    beta = decoder_column(c, n)
    zeta2 = float(c[:n] @ c[:n])
    b2 = beta * beta
    total = np.cumsum(b2)  # Σ_{k<L} β(k)² at index L − 1
    if m == 1 or per >= n:
        return math.sqrt(zeta2 * float(np.sum(total)) / n)
    a = 1.0 - 1.0 / m
    var = 0.0
    starts = np.arange(0, n, per)
    for length in range(1, per + 1):
        u = starts[starts + length - 1 < n]  # rounds long enough for this step
        d = (beta[length:] - a * beta[:n - length]) ** 2  # m in [0, n − L)
        cross = np.concatenate(([0.0], np.cumsum(d)))[u]  # Σ_{m<u}
        before = np.concatenate(([0.0], total))[u]  # Σ_{m<u} β(m)²
        var += float(np.sum(cross + total[length - 1] + (m - 1) / m**2 * before))
    return math.sqrt(zeta2 * var / n)


def default_band_candidates(horizon: int, steps_per_epoch: int) -> list[int]:
    """Powers of two up to the steps per epoch (rate 1) and the horizon, and the steps per
    epoch itself (one fixed batch per group: the un-amplified banded mechanism)."""
    top = min(int(steps_per_epoch), int(horizon))
    out = {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    out.add(top)
    return sorted(out)


def choose_bands(
    epsilon: float, delta: float, horizon: int, steps_per_epoch: int,
    relation: str = REPLACE_ONE, candidates: Iterable[int] | None = None,
    grid: float = DEFAULT_GRID, rtol: float = 1e-5, *, steps_per_round: int | None = None,
    learners: int = 1, min_gain: float = MIN_GAIN,
) -> tuple[BandChoice, list[BandChoice]]:
    """The bands for a learner that takes ``steps_per_epoch`` steps per expected pass over
    its data (rate ``b/steps_per_epoch`` for ``b`` bands, the
    :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader` rule), over ``horizon``
    steps, at ``(ε, δ)`` under ``relation``, in a FedAvg loop of ``learners`` learners
    restarting every ``steps_per_round`` steps (default: one round, the paper's setting);
    and every candidate's figures (module docstring). The candidate ``b > 1`` with the
    smallest iterate error wins only where that error is at least ``min_gain`` below
    DP-SGD's (``b = 1``, always a candidate); otherwise ``b = 1``. ``b = steps_per_epoch``
    is the un-amplified banded mechanism over a fixed partition."""
    from .mechanisms import build_factorization

    s, n = int(steps_per_epoch), int(horizon)
    if s < 1 or n < 1:
        raise ValueError("steps per epoch and horizon must be positive")
    if not 0.0 <= float(min_gain) < 1.0:
        raise ValueError(f"min_gain must lie in [0, 1), got {min_gain!r}")
    bands = sorted(set(candidates) | {1}) if candidates is not None else \
        default_band_candidates(n, s)
    if bands[0] < 1 or bands[-1] > min(s, n):
        raise ValueError(f"bands must lie in [1, {min(s, n)}] (at most the steps per "
                         "epoch, where the rate reaches 1, and the horizon)")
    table = []
    for b in bands:
        q = min(1.0, b / s)
        sampling = CyclicPoissonSampling(q, b, n)
        fact = build_factorization("bandmf", n, bands=b)
        sigma = calibrate_noise_multiplier(epsilon, delta, q, sampling.cycles(), relation,
                                           grid, rtol)
        unit = iterate_rmse(fact.band, n, steps_per_round, learners)
        table.append(BandChoice(bands=b, sampling_rate=q, cycles=sampling.cycles(),
                                noise_multiplier=sigma, column_norm=fact.sensitivity,
                                unit_rmse=fact.rmse, rmse=sigma * fact.rmse,
                                error=sigma * unit))
    dpsgd = table[0]
    wide = [c for c in table if c.bands > 1]
    best = min(wide, key=lambda c: (c.error, c.bands)) if wide else dpsgd
    if best.error > (1.0 - float(min_gain)) * dpsgd.error:
        best = dpsgd
    return best, table
