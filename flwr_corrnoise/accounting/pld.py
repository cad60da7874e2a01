"""Privacy loss distributions (PLDs): tight ε of composed Poisson-subsampled Gaussians.

Why this module exists (issue 35): DP-SGD with Poisson sampling, and the banded
matrix-factorization mechanism under cyclic Poisson sampling (Choquette-Choo, Ganesh,
McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training", NeurIPS 2023), release a *composition of
Poisson-subsampled Gaussian mechanisms*. Neither a single Gaussian release
(:mod:`.gaussian`) nor zCDP describes that without giving up the amplification; a PLD
accountant computes it to within a discretization error that is always on the safe side.
Pure NumPy/SciPy: ``dp_accounting`` is the independent check in the tests only.

**The events.** :class:`PoissonSubsampledGaussian` ``(q, σ)``: every example enters the
step with probability ``q`` independently, its clipped contribution has norm ≤ 1, and the
sum receives ``N(0, σ²I)``. The neighbouring relation is the accountant's (as in
``dp_accounting``), and every result carries its label:

* ``"add-remove"`` (what Opacus reports): one example is added or removed. The dominating
  pairs (Zhu, Dong & Wang 2022, "Optimal Accounting of Differential Privacy via
  Characteristic Function", their result on Poisson subsampling) are, with
  ``N(m) = N(m, σ²)``,
  *remove*: ``P = (1−q)·N(0) + q·N(−1)`` vs ``Q = N(0)``;
  *add*: ``P = N(0)`` vs ``Q = (1−q)·N(0) + q·N(1)``.
  The relation is not symmetric, so both are composed separately and the ε reported is the
  larger (the same example is added, or removed, in every step of one pair of datasets).
  Koskela, Jälkö & Honkela 2020, "Computing Tight Differential Privacy Guarantees Using
  FFT", account it the same way.
* ``"replace-one"`` (what this library uses everywhere else): one example's value is
  replaced. Couple the two worlds' samples (Balle, Barthe & Gaboardi 2018, "Privacy
  Amplification by Subsampling: Tight Analyses via Couplings and Divergences"): the other
  examples are drawn alike, and the replaced one is absent in both worlds with probability
  ``1 − q`` and present, with value ``g`` or ``g'`` (``‖g‖, ‖g'‖ ≤ 1``), otherwise. The
  worst case is ``g' = −g`` (Zhu, Dong & Wang 2022, Poisson subsampling under the
  replace-one relation; it is ``dp_accounting``'s ``AdjacencyType.REPLACE``):
  ``P = (1−q)·N(0) + q·N(−1)`` vs ``Q = (1−q)·N(0) + q·N(1)``.
  It is symmetric (``Q`` is ``P`` mirrored), so one PLD describes both directions. Why
  this pair and not add/remove's: a replacement is a removal and an addition, and bounding
  it by both (group privacy of two add/remove steps) gives up the common ``(1 − q)·N(0)``
  of the two worlds; this pair keeps it and is tight. At ``q = 1`` it is
  exactly the Gaussian mechanism of sensitivity 2 that :mod:`flwr_corrnoise.privacy`
  calibrates (``Δ = 2·B_g``).

A :class:`~.events.GaussianRelease` (sensitivity Δ, std) is read as the pair
``N(0, std²)`` vs ``N(Δ, std²)`` whatever the relation: its sensitivity is already that of
the relation its builder used.

**Discretization: connect the dots** (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022,
"Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions"). The
privacy loss ``L(x) = ln(P(x)/Q(x))`` of every pair above is decreasing in ``x`` and has a
closed-form inverse, so the masses ``P_i, Q_i`` of each loss interval ``(iη, (i+1)η]`` come
from Gaussian CDFs at the two breakpoints. Each interval's mass is split between two atoms
at its endpoints, keeping *both* its P-mass and its Q-mass: the right atom gets the P-mass
``(P_i − e^{iη}Q_i)/(1 − e^{−η})``. Every point of the interval has a likelihood ratio
between the endpoints' and is a mixture of the two atoms, so the original pair is a
post-processing of the discrete one: the discrete pair *dominates* it, its hockey-stick
curve ``δ(ε)`` is the chord interpolation of the true convex curve in ``e^ε``, above it
everywhere. Unlike rounding every loss up to the grid (Meiser & Mohammadi 2018, "Tight on
Budget? Tight Bounds for r-Fold Approximate Differential Privacy"; Koskela et al. 2020),
which adds up to ``η`` to every one of ``k`` losses, the split keeps each atom's mean loss,
so the error does not grow linearly with ``k``. Tails beyond ``|x| ≈ 10σ`` of every mixture
component (mass ``e^{−50}``) go pessimistically to ``+∞`` (large losses) or to the lowest
atom that bounds them (small losses).

**Composition** (the PLD of a composition is the convolution of the PLDs; dominating pairs
compose adaptively, Zhu, Dong & Wang 2022, their composition theorem for dominating
pairs): ``k``-fold by one FFT raised to the
power ``k``. The FFT covers only the range that a Chernoff bound on the PLD's moment
generating function certifies to hold all but ``τ = 10⁻¹⁵`` of the composed mass; ``τ`` is
added to the mass at ``+∞`` (the wrap-around of the circular convolution can only misplace
that much). Negative rounding residues of the inverse FFT are set to zero (adding mass
only raises δ).

**Reading it.** ``δ(ε) = p_∞ + Σ_{ℓ_i > ε} p_i·(1 − e^{ε − ℓ_i})``; ``ε(δ)`` is the
smallest ε with ``δ(ε) ≤ δ``, solved exactly between two atoms. Both are upper bounds on
the true values, up to floating-point rounding (relative ~10⁻⁹ in δ).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import fft as sfft
from scipy.special import logsumexp, ndtr, ndtri

from .base import Accountant, PrivacyBudgetError, Release, UnsupportedEventError, check_budget
from .events import Composed, GaussianRelease, NoRelease, SelfComposed, WorstCase

__all__ = [
    "ADD_REMOVE",
    "DEFAULT_GRID",
    "RELATIONS",
    "REPLACE_ONE",
    "DiscretePLD",
    "PLDAccountant",
    "PoissonSubsampledGaussian",
    "PrivacyLoss",
    "Relation",
    "calibrate_noise_multiplier",
    "check_relation",
    "gaussian_pld",
    "subsampled_gaussian_pld",
]

Relation = Literal["replace-one", "add-remove"]
#: one example's value replaced (the library's relation everywhere)
REPLACE_ONE: Relation = "replace-one"
#: one example added or removed (what Opacus and ``dp_accounting`` report by default)
ADD_REMOVE: Relation = "add-remove"
RELATIONS: tuple[str, ...] = (REPLACE_ONE, ADD_REMOVE)

#: the loss grid η (``dp_accounting``'s ``value_discretization_interval`` default)
DEFAULT_GRID = 1e-4
#: ln of the mass of each mixture component cut off in x (``dp_accounting``'s default)
LOG_TAIL_MASS = -50.0
#: the mass a k-fold composition may leave outside its FFT window (added to p_∞)
COMPOSE_TAIL_MASS = 1e-15


def check_relation(relation: str) -> Relation:
    """``relation`` if it is one of :data:`RELATIONS`; the error names them."""
    if relation not in RELATIONS:
        raise PrivacyBudgetError(f"unknown neighbouring relation {relation!r}; use one of "
                                 f"{RELATIONS}")
    return relation  # type: ignore[return-value]


# -- the events -------------------------------------------------------------------------
@dataclass(frozen=True)
class PoissonSubsampledGaussian(Release):
    """One step of DP-SGD: each example is included with probability ``sampling_rate``
    (Poisson sampling), the sum of the included examples' contributions (each of norm ≤ 1,
    the clip norm as unit) receives Gaussian noise of std ``noise_multiplier``.
    ``sampling_rate = 1`` is the plain Gaussian mechanism. The neighbouring relation is
    the accountant's (:class:`PLDAccountant`)."""

    sampling_rate: float
    noise_multiplier: float

    def __post_init__(self) -> None:
        try:
            q, s = float(self.sampling_rate), float(self.noise_multiplier)
        except (TypeError, ValueError) as err:
            raise PrivacyBudgetError("sampling rate and noise multiplier must be numbers") \
                from err
        if not (0.0 < q <= 1.0):
            raise PrivacyBudgetError(f"sampling rate must lie in (0, 1], got "
                                     f"{self.sampling_rate!r}")
        if not (math.isfinite(s) and s > 0):
            raise PrivacyBudgetError(f"noise multiplier must be finite and > 0, got "
                                     f"{self.noise_multiplier!r}")
        object.__setattr__(self, "sampling_rate", q)
        object.__setattr__(self, "noise_multiplier", s)


# -- one direction's privacy loss -------------------------------------------------------
Direction = Literal["remove", "add", "replace"]


@dataclass(frozen=True)
class PrivacyLoss:
    """The pair ``(P, Q)`` of one direction of a subsampled Gaussian (module docstring),
    noise ``sigma``, shift 1, sampling rate ``q``: its mixture components, its privacy loss
    ``L(x) = ln P(x)/Q(x)`` (decreasing in ``x``) and the inverse of ``L``."""

    direction: Direction
    q: float
    sigma: float

    @property
    def p_components(self) -> tuple[tuple[float, float], ...]:
        """``(weight, mean)`` of P's mixture components."""
        if self.direction == "add":
            return ((1.0, 0.0),)
        return _mixture(self.q, -1.0)

    @property
    def q_components(self) -> tuple[tuple[float, float], ...]:
        """``(weight, mean)`` of Q's mixture components."""
        if self.direction == "remove":
            return ((1.0, 0.0),)
        return _mixture(self.q, 1.0)

    def loss(self, x: np.ndarray | float) -> np.ndarray:
        """``L(x)``, in log space (no overflow at any ``x``)."""
        x = np.asarray(x, dtype=float)
        s2 = self.sigma * self.sigma
        lo_p = -(2.0 * x + 1.0) / (2.0 * s2)  # ln N(−1)(x)/N(0)(x)
        lo_q = (2.0 * x - 1.0) / (2.0 * s2)  # ln N(1)(x)/N(0)(x)
        up = _log_mix(self.q, lo_p) if self.direction != "add" else np.zeros_like(x)
        down = _log_mix(self.q, lo_q) if self.direction != "remove" else np.zeros_like(x)
        return up - down

    def inverse(self, losses: np.ndarray) -> np.ndarray:
        """The ``x`` with ``L(x) = ℓ`` for each ℓ (``+∞`` below the loss's range, ``−∞``
        above it: add's loss is < ``−ln(1−q)``, remove's > ``ln(1−q)``)."""
        ell = np.asarray(losses, dtype=float)
        q, s2 = self.q, self.sigma * self.sigma
        out = np.empty_like(ell)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if self.direction == "remove":
                # e^ℓ = 1 − q + q·e^{−(2x+1)/(2σ²)}
                ok = ell > math.log1p(-q) if q < 1 else np.ones_like(ell, dtype=bool)
                out[~ok] = np.inf
                e = ell[ok]
                log_term = np.where(e > 0, e + np.log1p(-(1.0 - q) * np.exp(-e)),
                                    np.log(np.expm1(np.minimum(e, 0.0)) + q))
                out[ok] = -0.5 - s2 * (log_term - math.log(q))
            elif self.direction == "add":
                # e^{−ℓ} = 1 − q + q·e^{(2x−1)/(2σ²)}
                ok = ell < -math.log1p(-q) if q < 1 else np.ones_like(ell, dtype=bool)
                out[~ok] = -np.inf
                e = -ell[ok]
                log_term = np.where(e > 0, e + np.log1p(-(1.0 - q) * np.exp(-e)),
                                    np.log(np.expm1(np.minimum(e, 0.0)) + q))
                out[ok] = 0.5 + s2 * (log_term - math.log(q))
            else:
                # x = −σ²·(ℓ/2 + asinh(α·sinh(ℓ/2))), α = (1−q)/q·e^{1/(2σ²)}
                if q == 1.0:
                    out[:] = -s2 * ell / 2.0
                else:
                    log_alpha = math.log1p(-q) - math.log(q) + 1.0 / (2.0 * s2)
                    a = np.abs(ell) / 2.0
                    log_y = log_alpha + _log_sinh(a)
                    asinh = np.where(log_y < 30.0, np.arcsinh(np.exp(np.minimum(log_y, 30.0))),
                                     log_y + math.log(2.0))
                    out[:] = -s2 * (ell / 2.0 + np.sign(ell) * asinh)
        return out


def _mixture(q: float, mean: float) -> tuple[tuple[float, float], ...]:
    return ((q, mean),) if q == 1.0 else ((1.0 - q, 0.0), (q, mean))


def _log_mix(q: float, log_ratio: np.ndarray) -> np.ndarray:
    """``ln(1 − q + q·e^{log_ratio})``."""
    if q == 1.0:
        return log_ratio
    return np.logaddexp(math.log1p(-q), math.log(q) + log_ratio)


def _log_sinh(a: np.ndarray) -> np.ndarray:
    """``ln sinh(a)`` for ``a ≥ 0`` (``−∞`` at 0), stable at both ends."""
    with np.errstate(divide="ignore"):
        return a + np.log(-np.expm1(-2.0 * a)) - math.log(2.0)


def _interval_mass(components: tuple[tuple[float, float], ...], sigma: float,
                   upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Mass of the mixture in ``[lower_i, upper_i)`` for every ``i`` (``lower ≤ upper``),
    each component's as a difference of whichever tail keeps relative precision."""
    total = np.zeros_like(upper)
    for weight, mean in components:
        a, b = (lower - mean) / sigma, (upper - mean) / sigma
        right = a > 0  # both in the right half: difference of survival functions
        with np.errstate(invalid="ignore"):
            mass = np.where(right, ndtr(-a) - ndtr(-b), ndtr(b) - ndtr(a))
        total += weight * np.maximum(np.nan_to_num(mass, nan=0.0), 0.0)
    return total


def _tail_mass(components: tuple[tuple[float, float], ...], sigma: float, x: float,
               below: bool) -> float:
    """``P(X < x)`` (``below``) or ``P(X ≥ x)`` of the mixture."""
    if x == (math.inf if below else -math.inf):
        return 1.0
    if x == (-math.inf if below else math.inf):
        return 0.0
    return float(sum(w * ndtr(((x - m) if below else (m - x)) / sigma)
                     for w, m in components))


# -- the discrete PLD -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class DiscretePLD:
    """The P-side distribution of the privacy loss of one pair, on the grid ``η·ℤ``:
    ``probs[j]`` is the mass at loss ``(offset + j)·η``, ``infinity_mass`` the mass at
    ``+∞``. The Q-side is implied (``Q = e^{−ℓ}·P`` at every finite atom; any rest of Q
    sits where P has no mass and changes no hockey-stick divergence of order ``e^ε``)."""

    grid: float
    offset: int
    probs: np.ndarray
    infinity_mass: float

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.probs.size)) * self.grid

    def compose(self, other: DiscretePLD) -> DiscretePLD:
        """The PLD of both releases (a convolution)."""
        if other.grid != self.grid:
            raise ValueError("PLDs on different grids cannot be composed")
        length = self.probs.size + other.probs.size - 1
        size = sfft.next_fast_len(length, real=True)
        probs = sfft.irfft(sfft.rfft(self.probs, size) * sfft.rfft(other.probs, size), size)
        probs = np.maximum(probs[:length], 0.0)
        inf = 1.0 - (1.0 - self.infinity_mass) * (1.0 - other.infinity_mass)
        return DiscretePLD(self.grid, self.offset + other.offset, probs, inf)

    def self_compose(self, count: int, tail_mass: float = COMPOSE_TAIL_MASS) -> DiscretePLD:
        """The PLD of ``count`` releases of this one (module docstring: one FFT to the
        power ``count`` over the Chernoff window, ``tail_mass`` added to ``+∞``)."""
        count = int(count)
        if count < 0:
            raise ValueError(f"a release is composed a non-negative number of times, got "
                             f"{count}")
        if count == 0:
            return DiscretePLD(self.grid, 0, np.ones(1), 0.0)
        if count == 1:
            return self
        p = self.probs
        lower, upper = _chernoff_window(p, count, tail_mass)
        length = upper - lower + 1
        size = sfft.next_fast_len(max(length, p.size), real=True)
        spectrum = sfft.rfft(p, size) ** count
        full = sfft.irfft(spectrum, size)
        out = np.maximum(np.roll(full, -lower)[:length], 0.0)
        inf = -math.expm1(count * math.log1p(-self.infinity_mass)) if self.infinity_mass \
            else 0.0
        return DiscretePLD(self.grid, count * self.offset + lower, out,
                           min(1.0, inf + tail_mass))

    def delta(self, epsilon: float) -> float:
        """``δ(ε) = p_∞ + Σ_{ℓ > ε} p·(1 − e^{ε−ℓ})``: the hockey-stick divergence."""
        return min(1.0, self.infinity_mass + math.fsum(self._terms(epsilon)))

    def _terms(self, epsilon: float) -> np.ndarray:
        first = max(0, math.floor(epsilon / self.grid) - self.offset + 1)  # ℓ > ε from here
        ell = (self.offset + np.arange(first, self.probs.size)) * self.grid
        above = ell > epsilon
        return self.probs[first:][above] * -np.expm1(epsilon - ell[above])

    def _delta_sum(self, epsilon: float) -> float:
        """:meth:`delta` with NumPy's pairwise sum (for the search; not the answer)."""
        return self.infinity_mass + float(np.sum(self._terms(epsilon)))

    def epsilon(self, delta: float) -> float:
        """The smallest ``ε ≥ 0`` with ``δ(ε) ≤ delta`` (``inf`` if the mass at ``+∞``
        alone exceeds it). ``δ`` is decreasing in ε: a binary search over the atoms finds
        the ``j`` with ``δ(ℓ_j) > delta ≥ δ(ℓ_{j+1})``, and on ``[ℓ_j, ℓ_{j+1}]``
        ``δ(ε) = p_∞ + A − e^{ε−ℓ_j}·T`` (``A = Σ_{i>j} p_i``, ``T = Σ_{i>j} p_i e^{ℓ_j−ℓ_i}``)
        is solved for ε in closed form."""
        if self.infinity_mass > delta:
            return math.inf
        p, h, n = self.probs, self.grid, self.probs.size
        if self.delta(self.offset * h) <= delta:
            # ε < ℓ_0: every atom counts, δ(ε) = p_∞ + Σp − e^{ε}·Σ p·e^{−ℓ}
            total = self.infinity_mass + float(p.sum())
            if total <= delta:
                return 0.0
            with np.errstate(divide="ignore"):
                log_q = float(logsumexp(np.log(p) - self.losses))
            eps = math.log(total - delta) - log_q
            return max(0.0, min(eps, self.offset * h))
        lo, hi = 0, n - 1  # δ(ℓ_lo) > delta ≥ δ(ℓ_hi) = p_∞
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._delta_sum((self.offset + mid) * h) > delta:
                lo = mid
            else:
                hi = mid
        tail = p[lo + 1:]
        A = math.fsum(tail)
        T = math.fsum(tail * np.exp(-h * np.arange(1, tail.size + 1)))
        left = (self.offset + lo) * h
        ratio = (self.infinity_mass + A - delta) / T if T > 0 else math.inf
        eps = left + math.log(ratio) if 0 < ratio < math.inf else left + h
        return max(0.0, min(max(eps, left), left + h))


def _chernoff_window(p: np.ndarray, count: int, tail_mass: float) -> tuple[int, int]:
    """Indices ``[lower, upper]`` (relative to ``count × offset``) outside which the
    ``count``-fold convolution of ``p`` holds at most ``tail_mass``: for every order ``t``,
    ``P(S ≥ u) ≤ M(t)^count·e^{−t·u}`` (and the mirror for the lower tail), at orders on a
    log grid around ``1/(√count · spread)``, where the bound is tight for sums of many
    independent losses.

    The moment generating function ``M`` is bounded on blocks of ``m`` atoms, each block's
    mass at its last index for ``t > 0`` (at its first for ``t < 0``): an upper bound on
    ``M(t)`` at a fraction of the cost, which widens the window by at most ``count·m``
    atoms, with ``m`` kept below ``spread/√count`` (a fraction of the window's width)."""
    n = p.size
    upper, lower = count * (n - 1), 0
    if tail_mass <= 0 or n == 1:
        return lower, upper
    idx = np.arange(n, dtype=float)
    mass = float(p.sum())
    mean = float(p @ idx) / mass
    spread = math.sqrt(max(float(p @ (idx - mean) ** 2) / mass, 1e-12)) + 1.0
    base = 1.0 / (math.sqrt(count) * spread)
    m = max(1, min(-(-n // 2048), int(spread / (4.0 * math.sqrt(count)))))
    blocks = -(-n // m)
    block_mass = np.zeros(blocks * m)
    block_mass[:n] = p
    block_mass = block_mass.reshape(blocks, m).sum(axis=1)
    starts = np.arange(blocks, dtype=float) * m
    with np.errstate(divide="ignore"):
        log_w = np.log(block_mass)
    keep = np.isfinite(log_w)
    log_w, starts = log_w[keep], starts[keep]
    log_bound = math.log(2.0 / tail_mass)
    ts = base * np.geomspace(0.05, 40.0, 24)
    for sign, where in ((1.0, starts + (m - 1)), (-1.0, starts)):
        orders = sign * ts
        log_mgf = logsumexp(orders[:, None] * where[None, :] + log_w[None, :], axis=1)
        for order, value in zip(orders, (count * log_mgf + log_bound) / orders, strict=True):
            if not math.isfinite(value):
                continue
            if order > 0:
                upper = min(upper, math.ceil(value))
            else:
                lower = max(lower, math.floor(value))
    return max(0, min(lower, upper)), max(lower, upper)


def _discretize(loss: PrivacyLoss, grid: float) -> DiscretePLD:
    """Connect-the-dots PLD of ``loss`` on the grid ``grid·ℤ`` (module docstring)."""
    sigma = loss.sigma
    z = -float(ndtri(0.5 * math.exp(LOG_TAIL_MASS)))  # each component's cut, in σ
    means = [m for _, m in loss.p_components]
    x_lo, x_hi = min(means) - z * sigma, max(means) + z * sigma
    eps_hi, eps_lo = float(loss.loss(x_lo)), float(loss.loss(x_hi))
    i_a, i_b = math.floor(eps_lo / grid), math.ceil(eps_hi / grid)
    if i_b <= i_a:
        i_b = i_a + 1
    if i_b - i_a > 50_000_000:
        raise PrivacyBudgetError(
            f"the privacy loss spans {eps_hi - eps_lo:.3g} nats: too many grid points at η = "
            f"{grid} (noise multiplier {sigma:.3g} is far too small for any useful budget)")
    ell = np.arange(i_a, i_b + 1) * grid
    xs = loss.inverse(ell)  # decreasing in ℓ
    upper, lower = xs[:-1], xs[1:]  # interval i: x ∈ [x_{i+1}, x_i) ⇔ ℓ ∈ (ℓ_i, ℓ_{i+1}]
    P = _interval_mass(loss.p_components, sigma, upper, lower)
    Q = _interval_mass(loss.q_components, sigma, upper, lower)
    # the right atom's P-mass: (P_i − e^{ℓ_i}·Q_i)/(1 − e^{−η}), with e^{ℓ_i}Q_i in log space
    with np.errstate(divide="ignore", over="ignore"):
        scaled_q = np.exp(np.log(Q) + ell[:-1])
    right = np.clip((P - scaled_q) / -math.expm1(-grid), 0.0, P)
    probs = np.zeros(ell.size)
    probs[:-1] += P - right
    probs[1:] += right
    # losses ≤ ℓ_{i_a} (x ≥ x_{i_a}) at the atom ℓ_{i_a}; losses > ℓ_{i_b} at +∞
    probs[0] += _tail_mass(loss.p_components, sigma, float(xs[0]), below=False)
    inf = _tail_mass(loss.p_components, sigma, float(xs[-1]), below=True)
    first, last = _trim(probs)
    return DiscretePLD(grid, i_a + first, probs[first:last], inf)


def _trim(probs: np.ndarray) -> tuple[int, int]:
    nz = np.flatnonzero(probs > 0)
    if nz.size == 0:
        return 0, 1
    return int(nz[0]), int(nz[-1]) + 1


# -- PLDs of events ---------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PLD:
    """The PLD of a release under one relation: one :class:`DiscretePLD` per direction
    (one for replace-one and for a plain Gaussian release, remove and add for
    add/remove), each composed on its own; ε and δ are the worst direction's."""

    relation: str
    directions: tuple[DiscretePLD, ...]

    def compose(self, other: PLD) -> PLD:
        if len(other.directions) == 1 and len(self.directions) == 2:
            other = PLD(other.relation, other.directions * 2)
        elif len(self.directions) == 1 and len(other.directions) == 2:
            return PLD(self.relation, self.directions * 2).compose(other)
        return PLD(self.relation, tuple(a.compose(b) for a, b in
                                        zip(self.directions, other.directions, strict=True)))

    def self_compose(self, count: int) -> PLD:
        return PLD(self.relation, tuple(d.self_compose(count) for d in self.directions))

    def epsilon(self, delta: float) -> float:
        return max(d.epsilon(delta) for d in self.directions)

    def delta(self, epsilon: float) -> float:
        return max(d.delta(epsilon) for d in self.directions)


def subsampled_gaussian_pld(sampling_rate: float, noise_multiplier: float,
                            relation: str = REPLACE_ONE, grid: float = DEFAULT_GRID) -> PLD:
    """The PLD of one :class:`PoissonSubsampledGaussian` under ``relation``."""
    event = PoissonSubsampledGaussian(sampling_rate, noise_multiplier)
    relation = check_relation(relation)
    q, s = event.sampling_rate, event.noise_multiplier
    if relation == REPLACE_ONE:
        return PLD(relation, (_discretize(PrivacyLoss("replace", q, s), grid),))
    remove = _discretize(PrivacyLoss("remove", q, s), grid)
    if q == 1.0:  # both directions are the same Gaussian pair
        return PLD(relation, (remove,))
    return PLD(relation, (remove, _discretize(PrivacyLoss("add", q, s), grid)))


def gaussian_pld(mu: float, grid: float = DEFAULT_GRID, relation: str = REPLACE_ONE) -> PLD:
    """The PLD of ``N(0, 1)`` vs ``N(μ, 1)``: a Gaussian release of ``μ = Δ/std`` (its
    sensitivity already that of its relation; ``relation`` only labels the result)."""
    if not (math.isfinite(mu) and mu > 0):
        raise PrivacyBudgetError(f"μ must be finite and > 0, got {mu!r}")
    return PLD(check_relation(relation), (_discretize(PrivacyLoss("remove", 1.0, 1.0 / mu),
                                                      grid),))


# -- the accountant ---------------------------------------------------------------------
class PLDAccountant(Accountant):
    """ε and δ of compositions of Poisson-subsampled Gaussian (and Gaussian) releases
    under one neighbouring relation, by discretized PLDs (module docstring). Its ``name``
    carries the relation: every result it gives is for that relation only."""

    def __init__(self, relation: str = REPLACE_ONE, grid: float = DEFAULT_GRID) -> None:
        self.relation: Relation = check_relation(relation)
        if not (math.isfinite(grid) and 0 < grid <= 0.1):
            raise PrivacyBudgetError(f"the loss grid must lie in (0, 0.1], got {grid!r}")
        self.grid = float(grid)
        self.name = f"pld ({self.relation})"

    def supports(self, event: Release) -> bool:
        try:
            self._check(event)
        except UnsupportedEventError:
            return False
        return True

    def _check(self, event: Release) -> None:
        if isinstance(event, PoissonSubsampledGaussian | GaussianRelease | NoRelease):
            return
        if isinstance(event, SelfComposed):
            return self._check(event.event)
        if isinstance(event, Composed):
            for e in event.events:
                self._check(e)
            return
        if isinstance(event, WorstCase):
            for e in event.cases:
                self._check(e)
            return
        raise UnsupportedEventError(
            f"the PLD accountant cannot account {type(event).__name__}: only (Poisson-"
            "subsampled) Gaussian releases, their compositions and worst cases")

    def pld(self, event: Release) -> PLD | None:
        """The PLD of ``event`` (``None``: nothing released). A :class:`WorstCase` has no
        single PLD: :meth:`epsilon` and :meth:`delta` take the worst of its cases."""
        self._check(event)
        if isinstance(event, NoRelease):
            return None
        if isinstance(event, PoissonSubsampledGaussian):
            return subsampled_gaussian_pld(event.sampling_rate, event.noise_multiplier,
                                           self.relation, self.grid)
        if isinstance(event, GaussianRelease):
            if event.l2_sensitivity == 0:
                return None
            return gaussian_pld(event.mu, self.grid, self.relation)
        if isinstance(event, SelfComposed):
            inner = self.pld(event.event) if event.count else None
            return None if inner is None else inner.self_compose(event.count)
        if isinstance(event, Composed):
            out: PLD | None = None
            for e in event.events:
                part = self.pld(e)
                if part is not None:
                    out = part if out is None else out.compose(part)
            return out
        raise UnsupportedEventError("a worst case over releases has no single PLD")

    def epsilon(self, event: Release, delta: float) -> float:
        _, dlt = check_budget(1.0, delta)
        if isinstance(event, WorstCase):
            return max((self.epsilon(e, dlt) for e in event.cases), default=0.0)
        pld = self.pld(event)
        return 0.0 if pld is None else pld.epsilon(dlt)

    def delta(self, event: Release, epsilon: float) -> float:
        eps, _ = check_budget(epsilon, 0.5)
        if isinstance(event, WorstCase):
            return max((self.delta(e, eps) for e in event.cases), default=0.0)
        pld = self.pld(event)
        return 0.0 if pld is None else pld.delta(eps)


def dpsgd_event(sampling_rate: float, noise_multiplier: float, steps: int) -> SelfComposed:
    """``steps`` Poisson-subsampled Gaussian steps: DP-SGD's release."""
    return SelfComposed(PoissonSubsampledGaussian(sampling_rate, noise_multiplier), steps)


def calibrate_noise_multiplier(
    epsilon: float, delta: float, sampling_rate: float, steps: int,
    relation: str = REPLACE_ONE, grid: float = DEFAULT_GRID, rtol: float = 1e-5,
    event: Callable[[float], Release] | None = None,
) -> float:
    """The smallest noise multiplier σ (to relative ``rtol``, rounded up) for which
    ``steps`` Poisson-subsampled Gaussian steps at ``sampling_rate`` are ``(ε, δ)``-DP
    under ``relation``, on this module's PLD ε.

    ``event(σ)`` replaces the DP-SGD event when given (any release whose ε decreases in
    σ). The upper start is the un-amplified composition, ``steps`` Gaussian releases of
    sensitivity 2 (replace-one) or 1, calibrated exactly (Balle & Wang 2018): subsampling
    only lowers the hockey-stick divergence (joint convexity), so that σ meets the budget
    up to the grid's pessimism (doubled until it does). The bracket ``[lo, hi]`` (``hi``
    meets the budget, ``lo`` does not) then shrinks by safeguarded Newton steps on
    ``ln ε`` as a function of ``ln σ`` (nearly a straight line: ε falls like a power of
    σ), each aimed a quarter ``rtol`` past the root and followed by a probe ``rtol/2``
    back across it, whose pair of values also gives the next slope; a step that would
    leave the bracket bisects it instead. A dozen PLDs replace bisection's twenty-odd. The
    σ returned is the bracket's upper end, one that provably meets the budget on the
    accountant's pessimistic PLD.
    """
    eps, dlt = check_budget(epsilon, delta)
    relation = check_relation(relation)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise PrivacyBudgetError(f"steps must be a positive integer, got {steps!r}")
    if not (0 < rtol < 0.1):
        raise PrivacyBudgetError(f"rtol must lie in (0, 0.1), got {rtol!r}")
    acc = PLDAccountant(relation, grid)
    make = event or (lambda s: dpsgd_event(sampling_rate, s, int(steps)))

    def excess(u: float) -> float:  # ln(ε(e^u)/ε): ≤ 0 where the budget is met
        spent = acc.epsilon(make(math.exp(u)), dlt)
        return math.log(spent / eps) if spent > 0 else -50.0

    from .gaussian import solve_mu

    scale = 2.0 if relation == REPLACE_ONE else 1.0
    u_hi = math.log(scale * math.sqrt(int(steps)) / solve_mu(eps, dlt))
    g_hi = excess(u_hi)
    for _ in range(60):
        if g_hi <= 0:
            break
        u_hi += math.log(2.0)
        g_hi = excess(u_hi)
    else:
        raise PrivacyBudgetError("no noise multiplier meets the budget")
    q = float(sampling_rate) if event is None else 1.0
    u_lo = u_hi + math.log(max(q, 1e-3) / 2.0)
    g_lo = excess(u_lo)
    for _ in range(60):
        if g_lo > 0:
            break
        u_hi, g_hi = u_lo, g_lo
        u_lo -= math.log(2.0)
        g_lo = excess(u_lo)
    else:
        raise PrivacyBudgetError("the budget is met at every noise multiplier tried")
    span = math.log1p(rtol)
    slope = (g_hi - g_lo) / (u_hi - u_lo)
    u, g = u_hi, g_hi
    for _ in range(100):
        if u_hi - u_lo <= span:
            return math.exp(u_hi)
        # a Newton step aimed a quarter span past the root, on the side that meets the
        # budget, so that the probe below lands a quarter span short of it
        target = u - g / slope + span / 4 if slope < 0 else math.nan
        width = u_hi - u_lo
        if not (u_lo + span / 8 < target < u_hi - span / 8):
            target = u_lo + width / 2
        u, g = target, excess(target)
        if g <= 0:
            u_hi, g_hi = u, g
            probe = u - span / 2
        else:
            u_lo, g_lo = u, g
            probe = u + span / 2
        if u_lo < probe < u_hi:
            g_probe = excess(probe)
            if g_probe <= 0:
                u_hi, g_hi = probe, g_probe
            else:
                u_lo, g_lo = probe, g_probe
            if g_probe != g:
                slope = (g_probe - g) / (probe - u)
        elif u_hi > u_lo:
            slope = (g_hi - g_lo) / (u_hi - u_lo)
    raise PrivacyBudgetError("the noise multiplier search did not converge")
