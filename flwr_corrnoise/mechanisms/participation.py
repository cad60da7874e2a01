"""Sensitivity when one datum is used more than once: participation patterns.

Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning With
Correlated Noise") guarantee assumes each datum enters the stream once (a one-pass stream). Flower
apps train epochs over a fixed local dataset, so a datum enters the stream at several steps ``π =
{t_1 < t_2 < …}``. Replacing it changes the gradient of every step in ``π`` (each change has norm
``≤ 2·B_g``), so the release ``C·G + ξ`` moves by ``Σ_{t∈π} c_t u_tᵀ`` with ``‖u_t‖ ≤ 2·B_g`` —
chosen adaptively, one per step. In units of ``2·B_g`` the squared sensitivity is

    sens²(π) = max over unit u_t of Σ_{s,t∈π} X_st·⟨u_s, u_t⟩,     X = CᵀC,

maximized over every pattern ``π`` the loop can produce. Two facts carry everything here:

* ``sens²(π) ≤ Σ_{s,t∈π} |X_st|`` (Cauchy–Schwarz on each term), with **equality when
  ``X_π ≥ 0``** (take every ``u_t`` equal). This is the absolute-value bound of
  Choquette-Choo et al. 2023 ("(Amplified) banded matrix factorization", eq. (5)).
* **Toeplitz encoders** (``toeplitz``, ``blt``): if ``C``'s coefficients ``c(0) ≥ c(1) ≥ … ≥
  0``, the worst ``b``-min-sep pattern is ``{0, b, 2b, …}`` (Kalinin & Lampert 2024,
  arXiv:2405.13763, Thm. 2), so ``sens² = ‖Σ_{e<k} shift_{e·b}(c)‖²`` — exact, in O(N).
  Coefficients that are not non-increasing and non-negative are replaced by their
  non-increasing non-negative majorant (``|c|`` with a reverse running maximum), which only
  grows every ``|X_st|``: an upper bound.

Two participation schemes (both as in jax_privacy's ``sensitivity.py``):

* **min-sep** ``(b, k)``: at most ``k`` uses, any two at least ``b`` steps apart (``b = 1``:
  any steps). Generic factorizations get the certified upper bound of Choquette-Choo et al.
  2023 (Alg. 4): the best ``k`` entries of every row of ``|X|`` under the separation
  (a dynamic program), then the best ``k`` of those row maxima — a maximum over a larger
  set than the true one.
* **fixed-epoch** ``(b, k)``: a cyclic order fixed once, ``b`` steps per epoch, ``k`` epochs:
  the datum in slot ``i`` is used exactly at ``i, i+b, …, i+(k−1)·b``. There are only ``b``
  patterns; each is summed directly.

Every result says whether it is exact (a pattern achieves it: the lower bound found equals
the upper bound) and which method produced it. Anything not covered by a structure falls
back to the triangle inequality ``sens ≤ k·max_j‖c_j‖``, valid for every factorization at
any horizon. ``tests/mechanisms/test_participation.py`` checks all of it against brute force over
every pattern at small ``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .base import Factorization

#: the generic (dense ``X = CᵀC``) computation is used up to this horizon
DENSE_LIMIT = 4096
#: relative slack under which the best pattern found "achieves" the upper bound
EXACT_RTOL = 1e-9


class ParticipationError(ValueError):
    """A participation pattern that cannot exist (non-positive counts, wrong horizon)."""


@dataclass(frozen=True)
class Participation:
    """How often, and how far apart, one datum enters a learner's stream.

    ``max_participations`` (``k``): the most uses of one datum. ``min_sep`` (``b``): the
    fewest steps between two uses (``1``: consecutive steps allowed). ``fixed_epoch``: the
    uses are exactly ``b`` apart (one fixed cyclic order, ``b`` steps per epoch), a subset of
    the min-sep patterns with a smaller (never larger) sensitivity. The default is the
    paper's one-pass stream: each datum once.
    """

    max_participations: int = 1
    min_sep: int = 1
    fixed_epoch: bool = False

    def __post_init__(self) -> None:
        for name in ("max_participations", "min_sep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ParticipationError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.max_participations == 1:  # one use: separation and order are irrelevant
            object.__setattr__(self, "min_sep", 1)
            object.__setattr__(self, "fixed_epoch", False)

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def once(cls) -> Participation:
        """Each datum used once (Zhang et al.'s online stream)."""
        return cls()

    @classmethod
    def epochs(cls, epochs: int, steps_per_epoch: int) -> Participation:
        """``epochs`` passes over the data in one order fixed once (a shuffled-once cyclic
        loader), ``steps_per_epoch`` steps each."""
        return cls(max_participations=epochs, min_sep=steps_per_epoch, fixed_epoch=True)

    @classmethod
    def min_separation(cls, min_sep: int, max_participations: int) -> Participation:
        """At most ``max_participations`` uses, at least ``min_sep`` steps apart (any
        order: e.g. data reshuffled between rounds)."""
        return cls(max_participations=max_participations, min_sep=min_sep)

    @classmethod
    def from_options(cls, horizon: int, *, epochs: int | None = None,
                     min_sep: int | None = None,
                     max_participations: int | None = None) -> Participation:
        """The participation the user's options describe over ``horizon`` steps — the one
        reading of ``epochs`` / ``min-sep`` / ``max-participations`` that the learner's
        config and the CLI share. ``epochs = k > 1``: ``k`` passes in one fixed cyclic
        order (``k`` must divide the horizon); ``min_sep``/``max_participations``: at most
        that many uses (default: as many as fit), that far apart (default 1); none: once.

        Zero, negative or fractional values are errors (``epochs = 0`` once returned the
        one-pass noise: std 6.65 instead of 11.87)."""
        for name, value in (("epochs", epochs), ("min-sep", min_sep),
                            ("max-participations", max_participations)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer) \
                    or int(value) != value or value < 1:
                raise ParticipationError(f"{name} must be a positive integer, got {value!r}")
        if epochs is not None and int(epochs) > 1:
            if min_sep is not None or max_participations is not None:
                raise ParticipationError("set either epochs or min-sep/max-participations, "
                                         "not both")
            if int(horizon) % int(epochs):
                raise ParticipationError(
                    f"epochs = {epochs} must divide the horizon {horizon}: every epoch has "
                    "the same number of steps in a fixed cyclic order")
            return cls.epochs(int(epochs), int(horizon) // int(epochs))
        if min_sep is not None or max_participations is not None:
            b = int(min_sep or 1)
            return cls.min_separation(b, int(max_participations or -(-int(horizon) // b)))
        return cls()

    @classmethod
    def every_step(cls, horizon: int) -> Participation:
        """The datum may be used at every one of ``horizon`` steps (a per-round update that
        reuses the learner's whole dataset every round)."""
        return cls(max_participations=horizon, min_sep=1)

    # -- reading ------------------------------------------------------------------------
    @property
    def single(self) -> bool:
        return self.max_participations == 1

    def participations(self, n: int) -> int:
        """The most uses possible within ``n`` steps: ``min(k, ⌈n/b⌉)``."""
        return min(self.max_participations, -(-int(n) // self.min_sep))

    def patterns(self, n: int) -> list[np.ndarray]:
        """The fixed-epoch patterns within ``n`` steps (one per slot ``i < b``)."""
        if not self.fixed_epoch:
            raise ParticipationError("only a fixed-epoch participation has a short list of "
                                     "patterns")
        b, k = self.min_sep, self.max_participations
        return [np.arange(i, min(n, i + k * b), b) for i in range(min(b, n))]

    def describe(self) -> str:
        if self.single:
            return "each datum once"
        if self.fixed_epoch:
            return (f"{self.max_participations} epochs of {self.min_sep} steps (fixed cyclic "
                    "order)")
        return (f"≤ {self.max_participations} uses, ≥ {self.min_sep} steps apart")

    def as_dict(self) -> dict[str, Any]:
        """The binding form: stored with a learner's state, compared on every restore."""
        return {"max-participations": self.max_participations, "min-sep": self.min_sep,
                "fixed-epoch": self.fixed_epoch}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Participation:
        if "sampling-rate" in d:  # a sampled participation's binding
            return SampledParticipation(
                int(d.get("max-participations", 1)), int(d.get("min-sep", 1)),
                bool(d.get("fixed-epoch", False)), float(d["sampling-rate"]),
                int(d["bands"]), float(d["expected-batch-size"]),
                str(d.get("relation", "replace-one")))
        return cls(int(d.get("max-participations", 1)), int(d.get("min-sep", 1)),
                   bool(d.get("fixed-epoch", False)))


ONCE = Participation()


#: the neighbouring relations a sampled participation's amplified ε can be stated for
SAMPLED_RELATIONS = ("replace-one", "add-remove")


@dataclass(frozen=True)
class SampledParticipation(Participation):
    """Cyclic Poisson sampling (Choquette-Choo et al., "(Amplified) Banded Matrix
    Factorization", Algorithm 2): the examples split once into ``bands`` groups, step ``i``
    draws each member of group ``i mod bands`` independently with probability
    ``sampling_rate``; ``bands = 1`` is Poisson sampling (DP-SGD).

    Why a subclass: its base fields are the **un-amplified** bound of the same loop (at most
    ``⌈N/bands⌉`` uses, exactly ``bands`` steps apart, a fixed-epoch pattern), so any code
    that does not know about sampling still computes a sensitivity that holds whatever was
    drawn; the calibration (:func:`~flwr_corrnoise.privacy.calibrate_factorization`) reads
    the sampling and calibrates the amplified mechanism instead
    (:mod:`flwr_corrnoise.amplification`). ``expected_batch_size`` (public: ``n/s``) is what
    a step's noised sum is divided by, whatever the step drew, so the update never reveals
    a drawn batch size (Opacus does the same). ``relation``: the neighbouring relation the
    ε is stated for. Build it with :meth:`cyclic_poisson`."""

    sampling_rate: float = 1.0
    bands: int = 1
    expected_batch_size: float = 1.0
    relation: str = "replace-one"

    def __post_init__(self) -> None:
        super().__post_init__()
        q = float(self.sampling_rate)
        if not 0.0 < q <= 1.0:
            raise ParticipationError(f"sampling rate must lie in (0, 1], got "
                                     f"{self.sampling_rate!r}")
        object.__setattr__(self, "sampling_rate", q)
        if isinstance(self.bands, bool) or not isinstance(self.bands, int | np.integer) \
                or self.bands < 1:
            raise ParticipationError(f"bands must be a positive integer, got {self.bands!r}")
        object.__setattr__(self, "bands", int(self.bands))
        m = float(self.expected_batch_size)
        if not (math.isfinite(m) and m > 0):
            raise ParticipationError(f"expected batch size must be finite and > 0, got "
                                     f"{self.expected_batch_size!r}")
        object.__setattr__(self, "expected_batch_size", m)
        if self.relation not in SAMPLED_RELATIONS:
            raise ParticipationError(f"relation must be one of {SAMPLED_RELATIONS}, got "
                                     f"{self.relation!r}")

    @classmethod
    def cyclic_poisson(cls, sampling_rate: float, bands: int, horizon: int,
                       expected_batch_size: float,
                       relation: str = "replace-one") -> SampledParticipation:
        """The participation of a cyclic Poisson sampler over ``horizon`` steps."""
        if isinstance(horizon, bool) or int(horizon) != horizon or horizon < 1:
            raise ParticipationError(f"horizon must be a positive integer, got {horizon!r}")
        b = int(bands)
        return cls(max_participations=max(1, -(-int(horizon) // max(b, 1))), min_sep=b,
                   fixed_epoch=True, sampling_rate=sampling_rate, bands=b,
                   expected_batch_size=expected_batch_size, relation=relation)

    def describe(self) -> str:
        kind = "Poisson sampling" if self.bands == 1 else \
            f"cyclic Poisson sampling over {self.bands} groups"
        return (f"{kind} at rate {self.sampling_rate:.6g} (expected batch "
                f"{self.expected_batch_size:.6g}, {self.relation}), ≤ "
                f"{self.max_participations} uses")

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "sampling-rate": self.sampling_rate,
                "bands": self.bands, "expected-batch-size": self.expected_batch_size,
                "relation": self.relation}


@dataclass(frozen=True)
class Sensitivity:
    """``max_π sens(π)`` in units of the per-step change (``2·B_g``), as certified.

    ``value`` is what the noise is calibrated to (an upper bound, or exact);
    ``lower`` a value some pattern provably reaches (``value`` when exact); ``method``
    names the computation.
    """

    value: float
    lower: float
    exact: bool
    method: str

    def __float__(self) -> float:
        return self.value


def _achieved(value2: float, lower2: float, method: str) -> Sensitivity:
    value, lower = math.sqrt(max(value2, 0.0)), math.sqrt(max(lower2, 0.0))
    exact = value - lower <= EXACT_RTOL * value
    return Sensitivity(value=value, lower=value if exact else lower, exact=exact,
                       method=method)


# -- min-sep: the one-dimensional dynamic program ----------------------------------------
def best_separated_sum(x: np.ndarray, min_sep: int, k: int) -> np.ndarray:
    """``max Σ_{j∈π} x_j`` over index sets ``π`` of ≤ ``k`` indices pairwise ≥ ``min_sep``
    apart, for every row of ``x`` at once (Choquette-Choo et al. 2023, Alg. 3).

    ``f[i]`` holds the best value using indices ``≥ i`` with the participations allowed so
    far; each round adds one participation: take ``x_i`` plus the best from ``i + b`` on,
    then a reverse running maximum (skip ``i``). Entries must be ≥ 0 for the empty set to
    be dominated (they are: callers pass ``|X|``).
    """
    x = np.atleast_2d(np.asarray(x, dtype=float))
    rows, n = x.shape
    b = int(min_sep)
    f = np.zeros((rows, n + b))
    for _ in range(min(k, -(-n // b))):
        g = np.zeros_like(f)
        g[:, :n] = x + f[:, b:n + b]
        f = np.maximum.accumulate(g[:, ::-1], axis=1)[:, ::-1]
    return f[:, 0]


def _dense_min_sep(X: np.ndarray, p: Participation) -> Sensitivity:
    n = X.shape[0]
    k = p.participations(n)
    absx = np.abs(X)
    rows = best_separated_sum(absx, p.min_sep, k)
    upper2 = float(best_separated_sum(rows[None, :], p.min_sep, k)[0])
    # a pattern that reaches a value: the evenly spaced ones from every start, and the
    # greedy pattern built on the row maxima
    lower2 = 0.0
    for start in range(min(p.min_sep, n)):
        idx = np.arange(start, n, p.min_sep)[:k]
        lower2 = max(lower2, _pattern_value(X, idx))
    return _achieved(upper2, lower2, "min-sep bound (|X| row DP, then DP over rows)")


def _pattern_value(X: np.ndarray, idx: np.ndarray) -> float:
    """A value the adversary reaches on pattern ``idx``: ``max(1ᵀX_π1, Σ|X_π|)`` when
    ``X_π ≥ 0`` (then both agree), else ``1ᵀX_π1`` with the best sign flips of a greedy
    pass — a lower bound on ``sens²(π)`` whatever the signs."""
    sub = X[np.ix_(idx, idx)]
    if np.all(sub >= 0):
        return float(sub.sum())
    s = np.ones(len(idx))
    for _ in range(3):  # local search over signs: each flip may only raise sᵀX s
        for i in range(len(idx)):
            gain = -4.0 * s[i] * (sub[i] @ s - sub[i, i] * s[i])
            if gain > 0:
                s[i] = -s[i]
    return float(s @ sub @ s)


def _dense_fixed_epoch(X: np.ndarray, p: Participation) -> Sensitivity:
    n = X.shape[0]
    upper2, lower2 = 0.0, 0.0
    for idx in p.patterns(n):
        sub = X[np.ix_(idx, idx)]
        upper2 = max(upper2, float(np.abs(sub).sum()))
        lower2 = max(lower2, _pattern_value(X, idx))
    return _achieved(upper2, lower2, "fixed-epoch (Σ|X| over each of the b patterns)")


def dense_sensitivity(C: np.ndarray, participation: Participation) -> Sensitivity:
    """The multi-participation sensitivity of a materialized encoder ``C`` (``W×N``)."""
    C = np.asarray(C, dtype=float)
    return gram_sensitivity(C.T @ C, participation)


def gram_sensitivity(X: np.ndarray, participation: Participation) -> Sensitivity:
    """The multi-participation sensitivity of an encoder given by its Gram ``X = CᵀC``."""
    X = np.asarray(X, dtype=float)
    if participation.single:
        value = math.sqrt(float(np.max(np.diag(X))))
        return Sensitivity(value, value, True, "max column norm")
    if participation.fixed_epoch:
        return _dense_fixed_epoch(X, participation)
    return _dense_min_sep(X, participation)


# -- Toeplitz encoders: the closed form --------------------------------------------------
def toeplitz_sensitivity(coef: np.ndarray, n: int, participation: Participation) -> Sensitivity:
    """Sensitivity of the ``n×n`` lower-triangular Toeplitz ``C`` with column 0 ``coef``.

    With non-negative non-increasing ``coef`` the pattern ``{0, b, …, (k−1)b}`` is the worst
    (Kalinin & Lampert 2024, Thm. 2): ``sens² = ‖v‖²``, ``v = Σ_{e<k} shift_{e·b}(coef)``,
    computed by a cumulative sum over blocks of ``b``. For fixed epochs the same pattern is
    one of the ``b`` patterns and a later start only truncates ``v``, so the value is the
    same. Otherwise ``coef`` is replaced by its non-increasing non-negative majorant first
    (an upper bound), and the evenly spaced pattern on the true coefficients is the lower
    bound.
    """
    n = int(n)
    c = np.zeros(n)
    m = min(n, len(coef))
    c[:m] = np.asarray(coef, dtype=float)[:m]
    k = participation.participations(n)
    b = participation.min_sep
    upper2 = majorant_norm2(c, n, participation)
    lower2 = spaced_norm2(c, n, b, k)
    monotone = bool(np.all(c >= 0) and np.all(np.diff(c) <= 0))
    if monotone:
        return Sensitivity(math.sqrt(upper2), math.sqrt(upper2), True,
                           "Toeplitz, non-increasing c ≥ 0: pattern {0, b, 2b, …}")
    return _achieved(upper2, lower2, "Toeplitz majorant (non-increasing |c|)")


def majorant_norm2(c: np.ndarray, n: int, participation: Participation) -> float:
    """The certified ``sens²`` of the ``n×n`` lower-triangular Toeplitz encoder with column
    0 ``c`` (length ``≥ n``) under ``participation``: the evenly spaced pattern on the
    non-increasing non-negative majorant of ``c`` (``|c|`` with a reverse running maximum;
    equal to ``c`` when ``c`` already is one, then exact)."""
    majorant = np.maximum.accumulate(np.abs(c[:n])[::-1])[::-1]
    return spaced_norm2(majorant, n, participation.min_sep, participation.participations(n))


def spaced_norm2(c: np.ndarray, n: int, b: int, k: int) -> float:
    """``‖Σ_{e<k} shift_{e·b}(c)‖²`` over ``n`` entries, in O(n)."""
    pad = (-n) % b
    blocks = np.concatenate((c[:n], np.zeros(pad))).reshape(-1, b)
    v = np.cumsum(blocks, axis=0)
    if k < v.shape[0]:
        v[k:] -= v[:-k].copy()
    v = v.ravel()[:n]
    return float(v @ v)


def triangle_sensitivity(single: float, participation: Participation, n: int) -> Sensitivity:
    """``‖Σ_{t∈π} c_t u_t‖ ≤ Σ_{t∈π} ‖c_t‖ ≤ k·max_j‖c_j‖``: valid for every factorization
    at any horizon (the fallback where no structure and no dense ``X`` is available)."""
    k = participation.participations(n)
    return Sensitivity(k * single, single, k == 1, "triangle inequality k·max‖c_j‖")


def participation_sensitivity(
    factorization: Factorization, participation: Participation | None = None,
    steps: int | None = None,
) -> Sensitivity:
    """The factorization's sensitivity under ``participation`` for what it has released
    after ``steps`` steps (all ``N`` by default): what the noise is calibrated to."""
    return factorization.participation_sensitivity(participation or ONCE, steps)
