"""Pure-ε accounting for Chen & Wang, "Locally Differentially Private Distributed Online Learning
with Guaranteed Optimality" and its baselines (DSGD, DOLA, PDOP).

Adjacency: one datum ``ξ_k`` of learner ``i``'s stream replaced. The learner's releases are
``y_t = θ_t + Lap(ϱ_t)^d``, and — LDP as Chen & Wang's paper defines it — everything it *receives*
is held fixed (a neighbour's message is external information). Lemma 2: the cumulative budget after
releasing steps ``0..T−1`` is at most ``Σ_t Δ_t / ϱ_t``, ``Δ_t`` the ℓ1 sensitivity of ``θ_t``
(basic composition of Laplace releases; ``Δ_0 = 0``: ``θ_0`` does not depend on data).

Two bounds on ``Δ_t = √d Φ_t`` (``Φ_t = ‖θ_t − θ'_t‖₂``), both labelled wherever reported:

* ``tight (eq. 22)`` — the recursion the paper uses to prove a finite budget as ``T → ∞``:
  ``Φ_0 = 0``, ``Φ_{t+1} = (|1 − |w_ii| γ_t| + L λ_t) Φ_t + λ_t C / (t+1)``: the replaced
  datum is one of ``t+1`` in the all-history gradient, so its weight decays like ``1/(t+1)``.
  Worst case is ``k = 0`` (a later ``k`` only drops non-negative terms). The learner's own
  ``|w_ii|`` is used (the derivation, eq. (17), only involves learner ``i``'s row).
* ``Theorem 5(i)`` — the bound the paper states for finite ``T``:
  ``Δ_t ≤ √d C τ_t``, ``τ_t = Σ_{p=1}^{t−1} λ_{p−1} Π_{q=p}^{t−1}(1 − w̄γ_q + Lλ_q) + λ_{t−1}``,
  ``w̄ = min_i |w_ii|`` — it drops the ``1/(t+1)`` and grows without bound in ``T``; with the
  paper's own settings it is orders of magnitude above the tight value.

* ``contractive (convex, unclipped)`` — ours, not in the paper: for an *unclipped* loss that
  is convex, ``L``-smooth and ``μ``-strongly convex in θ (the regularized logistic loss), the
  gradient step is a contraction, ``‖δ − η(∇F(θ) − ∇F(θ'))‖ ≤ max(|1 − ημ|, |1 − ηL|)‖δ‖``
  (co-coercivity), so with ``η_t = λ_t / (1 − |w_ii|γ_t)``
  ``Φ_{t+1} = (1 − |w_ii|γ_t) max(|1 − η_t μ|, |1 − η_t L|) Φ_t + λ_t C/(t+1)`` — never larger
  than eq. (22)'s factor ``|1 − |w_ii|γ_t| + Lλ_t``, and below 1 whenever ``η_t ≤ 2/L``, which
  lets Algorithm 1 use larger steps at a finite budget. (Per-sample clipping breaks the
  convexity argument, so an algorithm with ``clip`` set does not report it; steps with
  ``|w_ii|γ_t ≥ 1`` fall back to eq. (22)'s factor.)

``C`` bounds ``‖∇l(θ, ξ) − ∇l(θ, ξ')‖₂`` (Assumption 5) and ``L`` is the per-sample
gradient's Lipschitz constant. Both must hold for *every* pair of neighbouring streams, so both
come from the task's **declared** bounds (:func:`gradient_constants`): ``C = 2·min(clip, G)``
with ``G`` the task's declared per-sample gradient bound (logistic regression: the feature
bound ``B``, which the task enforces by projecting every row onto ``{‖a‖ ≤ B}``), and
``L = B²/4 + r``. A maximum over the data at hand would under-bound a neighbour whose replaced
row is larger, and would make the reported ε itself a function of the data.

The bound and the clip are the **node's own settings**, like its noise (:data:`BOUND_FIELDS`,
``privacy_fields`` of Chen & Wang's algorithms): its state records them at its first step, a
run-config value larger than its own is a refused proposal, and later settings may only be
smaller. The accountant charges the larger of what the state records and what the algorithm
enforces now (:func:`node_constants`), so a node restarted with a smaller bound is never
charged less than it spent under the first.

Baselines, two accountants each (labelled):

* ``per-step summation`` — what the baselines' papers (and Chen & Wang's Fig. 1(c)) do: every
  release is charged the one-step sensitivity ``√d · step_{t−1} · C`` and the charges are summed
  over all ``T`` releases, so the budget grows without bound;
* ``per-datum`` — rigorous for the same adjacency: datum ``ξ_k`` enters the update of step
  ``k`` only; afterwards the difference propagates through the learner's *own* state with
  factor ``a_t`` (DSGD: ``A_ii + L λ_t``; DOLA and PDOP mix only *released* values, so
  ``a_t = 0`` and a datum affects exactly one release). ``ε = max_k Σ_{t>k} √d Φ_t^{(k)}/ϱ_t``.

**Descriptions and the accountant.** Each label is a *description* of the releases: a
:class:`~flwr_corrnoise.accounting.LaplaceSeries` of per-step sensitivities, or a
:class:`~flwr_corrnoise.accounting.PerDatumLaplace` for the per-datum relation. One
accountant composes them all: :class:`~flwr_corrnoise.accounting.BasicComposition`
(Lemma 2). An algorithm builds its descriptions from its settings and its nodes' states
(:class:`NodeRelease`; ``node_releases`` of Chen & Wang's algorithms). Nothing here reads an
algorithm's update rule or imports an algorithm module. The bound helpers
(:func:`gradient_constants`, :func:`node_constants`, …) read only the algorithm's task and
``clip``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from flwr_corrnoise.accounting import BasicComposition, LaplaceSeries, PerDatumLaplace
from flwr_corrnoise.decentralized.protocol import State

__all__ = [
    "BOUND_FIELDS",
    "CONTRACTIVE",
    "PER_DATUM",
    "PER_STEP",
    "THM5",
    "TIGHT",
    "NodeRelease",
    "StepRule",
    "baseline_epsilon_per_datum",
    "baseline_epsilon_per_step",
    "baseline_per_datum_release",
    "baseline_per_step_release",
    "chen_wang_epsilon",
    "chen_wang_epsilons",
    "contractive_sensitivity",
    "cumulative_epsilon",
    "enforced_bounds",
    "node_constants",
    "node_epsilons",
    "noise_scale_for_epsilon",
    "record_bounds",
    "thm5_sensitivity",
    "tight_sensitivity",
]

#: the one composition every label here uses (Lemma 2: pure ε adds up)
ACCOUNTANT = BasicComposition()


class StepRule(Protocol):
    """The step sizes a node uses, as the accountant reads them: ``λ_t`` (gradient step) and
    ``γ_t`` (coupling) at 0-based steps ``t`` (:class:`~.chen_wang.StepSizes` is one)."""

    def lam(self, t: int | np.ndarray) -> np.ndarray | float: ...

    def gamma(self, t: int | np.ndarray) -> np.ndarray | float: ...

TIGHT = "tight (eq. 22)"
THM5 = "Theorem 5(i)"
CONTRACTIVE = "contractive (convex, unclipped)"
PER_STEP = "per-step summation (papers)"
PER_DATUM = "per-datum (rigorous)"

#: the declared data bounds that enter Chen & Wang's ε, as privacy fields: the task's feature
#: bound ``B`` (config ``feature-bound``) and the per-sample clip (``clip``; ``inf`` when off)
#: — for both a *smaller* value is more private
BOUND_FIELDS: dict[str, int] = {"feature-bound": -1, "clip": -1}


def _check(T: int, C: float, L: float, dim: int) -> None:
    if int(T) != T or T < 0:
        raise ValueError(f"T must be an integer ≥ 0, got {T!r}")
    if not (math.isfinite(C) and C >= 0 and math.isfinite(L) and L >= 0):
        raise ValueError(f"C and L must be finite and ≥ 0, got C={C!r}, L={L!r}")
    if int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")


def tight_sensitivity(T: int, steps: StepRule, w_self: float, L: float, C: float,
                      dim: int) -> np.ndarray:
    """ℓ1 sensitivities ``Δ_0..Δ_{T−1}`` of the released ``θ_t`` by eq. (22)."""
    _check(T, C, L, dim)
    t = np.arange(T, dtype=float)
    a = np.abs(1.0 - abs(w_self) * steps.gamma(t)) + L * steps.lam(t)
    inject = steps.lam(t) * C / (t + 1.0)
    phi = np.zeros(T)
    for s in range(T - 1):
        phi[s + 1] = a[s] * phi[s] + inject[s]
    return math.sqrt(dim) * phi


def contractive_sensitivity(T: int, steps: StepRule, w_self: float, L: float, mu: float,
                            C: float, dim: int) -> np.ndarray:
    """ℓ1 sensitivities by the co-coercivity recursion (see the module docstring)."""
    _check(T, C, L, dim)
    if not (math.isfinite(mu) and 0 <= mu <= L):
        raise ValueError(f"need 0 ≤ μ ≤ L, got μ={mu!r}, L={L!r}")
    t = np.arange(T, dtype=float)
    lam, keep = steps.lam(t), 1.0 - abs(w_self) * steps.gamma(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        eta = lam / keep
        a = np.where(keep > 0, keep * np.maximum(np.abs(1 - eta * mu), np.abs(1 - eta * L)),
                     np.abs(keep) + L * lam)
    inject = lam * C / (t + 1.0)
    phi = np.zeros(T)
    for s in range(T - 1):
        phi[s + 1] = a[s] * phi[s] + inject[s]
    return math.sqrt(dim) * phi


def thm5_sensitivity(T: int, steps: StepRule, w_bar: float, L: float, C: float,
                     dim: int) -> np.ndarray:
    """ℓ1 sensitivities ``√d C τ_t`` of Theorem 5(i) for ``t = 0..T−1`` (``τ_0 = 0``)."""
    _check(T, C, L, dim)
    t = np.arange(T, dtype=float)
    a = 1.0 - abs(w_bar) * steps.gamma(t) + L * steps.lam(t)
    lam = steps.lam(t)
    tau = np.zeros(T)
    for s in range(T - 1):  # τ_{s+1} = a_s τ_s + λ_s reproduces the printed double sum
        tau[s + 1] = a[s] * tau[s] + lam[s]
    return math.sqrt(dim) * C * tau


def cumulative_epsilon(sensitivity: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Lemma 2: ``ε(T') = Σ_{t<T'} Δ_t / ϱ_t`` for ``T' = 1..T`` (``inf`` where ϱ_t = 0 < Δ_t):
    basic composition of the :class:`~flwr_corrnoise.accounting.LaplaceSeries`."""
    return ACCOUNTANT.epsilon_curve(LaplaceSeries(sensitivity, scales))


@dataclass(frozen=True)
class NodeRelease:
    """What Chen & Wang's accountants read of one node's releases ``y_t = θ_t + Lap(ϱ_t)^d``:
    its step sizes, its own mixing weight ``|w_ii|`` (and the network's smallest, ``w̄``, for
    Theorem 5(i)), the declared constants ``C`` and ``L`` (and the strong convexity ``μ``
    for the contractive bound), the dimension and its noise ``ϱ_t = ϱ₀ (t+1)^ς``.

    The algorithm builds it from its settings and the node's state (never from data:
    :meth:`~.chen_wang.ChenWang.node_releases`); :meth:`event` turns it into the Laplace
    series a label's sensitivity bound gives, which the accountant composes.
    """

    steps: StepRule
    w_self: float
    L: float
    C: float
    dim: int
    noise_scale: float
    exponent: float
    w_bar: float | None = None
    mu: float = 0.0

    def scales(self, T: int) -> np.ndarray:
        """``ϱ_t = ϱ₀ (t+1)^ς`` for ``t = 0..T−1``."""
        t = np.arange(T, dtype=float)
        return self.noise_scale * (t + 1.0) ** self.exponent

    def sensitivities(self, T: int, accountant: str = TIGHT) -> np.ndarray:
        """ℓ1 sensitivities ``Δ_0..Δ_{T−1}`` by the bound ``accountant`` names."""
        if accountant == TIGHT:
            return tight_sensitivity(T, self.steps, self.w_self, self.L, self.C, self.dim)
        if accountant == THM5:
            w_bar = self.w_self if self.w_bar is None else self.w_bar
            return thm5_sensitivity(T, self.steps, w_bar, self.L, self.C, self.dim)
        if accountant == CONTRACTIVE:
            return contractive_sensitivity(T, self.steps, self.w_self, self.L, self.mu,
                                           self.C, self.dim)
        raise ValueError(f"unknown accountant {accountant!r}; use {TIGHT!r}, {THM5!r} or "
                         f"{CONTRACTIVE!r}")

    def event(self, T: int, accountant: str = TIGHT) -> LaplaceSeries:
        """The node's first ``T`` releases as the labelled bound describes them."""
        scales = self.scales(T)
        return LaplaceSeries(self.sensitivities(T, accountant), scales)


def chen_wang_epsilon(T: int, steps: StepRule, *, w_self: float, L: float, C: float,
                      dim: int, noise_scale: float, exponent: float,
                      accountant: str = TIGHT, w_bar: float | None = None,
                      mu: float = 0.0) -> np.ndarray:
    """Cumulative ε of one learner after ``1..T`` releases, ``ϱ_t = noise_scale (t+1)^exponent``
    (``mu``: strong convexity, used by the contractive accountant only)."""
    release = NodeRelease(steps, w_self, L, C, dim, noise_scale, exponent, w_bar, mu)
    sens = release.sensitivities(T, accountant)
    bad = np.flatnonzero(~np.isfinite(sens))
    if bad.size == 0:
        return ACCOUNTANT.epsilon_curve(release.event(T, accountant))
    # the bound's recursion overflowed float64 (a factor > 1 for many steps, e.g. raw rows
    # with a large λ₀): no finite bound from that release on — ε = inf there, as it should
    # read, instead of the accountant's refusal of a non-finite sensitivity
    k = int(bad[0])
    head = (ACCOUNTANT.epsilon_curve(LaplaceSeries(sens[:k], release.scales(T)[:k])) if k
            else np.zeros(0))
    return np.concatenate([np.asarray(head, dtype=float), np.full(T - k, math.inf)])


def noise_scale_for_epsilon(epsilon: float, T: int, steps: StepRule, *, w_self: float,
                            L: float, C: float, dim: int, exponent: float,
                            accountant: str = TIGHT, w_bar: float | None = None,
                            mu: float = 0.0) -> float:
    """The ``ϱ₀`` (``= σ/√2``) that spends exactly ``epsilon`` over ``T`` releases: ε is
    ``∝ 1/ϱ₀``, so ``ϱ₀ = ε(T; ϱ₀ = 1) / epsilon`` (Chen & Wang's "σ^i = Σ_t …/ε_i")."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"ε must be finite and > 0, got {epsilon!r}")
    if T < 1:
        raise ValueError("need at least one release")
    unit = NodeRelease(steps, w_self, L, C, dim, 1.0, exponent, w_bar, mu)
    return ACCOUNTANT.scale_for(unit.event(T, accountant), epsilon)


def node_epsilons(releases: Sequence[NodeRelease], steps: int,
                  accountants: Sequence[str]) -> dict[str, np.ndarray]:
    """ε per node after ``steps`` releases under each labelled bound: 0 before any
    release, ``inf`` for a node without noise (``ϱ₀ = 0``)."""
    out: dict[str, list[float]] = {acc: [] for acc in accountants}
    for release in releases:
        for acc in accountants:
            if steps == 0:
                out[acc].append(0.0)
            elif release.noise_scale == 0:
                out[acc].append(math.inf)
            elif not np.all(np.isfinite(release.sensitivities(steps, acc))):
                out[acc].append(math.inf)  # the bound overflowed: no finite ε (see above)
            else:
                out[acc].append(ACCOUNTANT.epsilon(release.event(steps, acc)))
    return {k: np.asarray(v) for k, v in out.items()}


def chen_wang_epsilons(algo: Any, state: State, steps: int) -> dict[str, np.ndarray]:
    """ε per node (every applicable accountant) for the nodes in ``state`` after ``steps``
    releases — kept for callers of this name: ``algo.epsilon(state, steps)``, which builds
    the node descriptions (:meth:`~.chen_wang.ChenWang.node_releases`) and calls
    :func:`node_epsilons`."""
    return algo.epsilon(state, steps)


def gradient_constants(algo: object, feature_bound: float | None = None,
                       clip: float | None = None) -> tuple[float, float]:
    """``(C, L)`` from declared settings only: ``C = 2·min(clip, G)`` (``2G`` unclipped),
    ``G`` the task's declared per-sample gradient bound, ``L`` its declared smoothness —
    for the task's feature bound, or ``feature_bound`` where the task can say what its
    constants are for another one (``declared_constants``), and the algorithm's clip, or
    ``clip`` (``inf``: none).

    Why ``min``: the task's projection already bounds each data-term gradient by ``G``, and a
    clip can only shrink it further; either way two samples differ by at most ``2·min``.
    A task that declares no bounds is refused — there is no safe value to fall back on."""
    task = algo.task  # type: ignore[attr-defined]
    G = getattr(task, "gradient_bound", None)
    L = getattr(task, "smoothness", None)
    if G is None or L is None:
        raise ValueError(f"task {getattr(task, 'name', type(task).__name__)!r} declares no "
                         "gradient_bound/smoothness: Chen & Wang's accountants need both")
    if feature_bound is not None and hasattr(task, "declared_constants"):
        G, L = task.declared_constants(feature_bound)
    if clip is None:
        clip = getattr(algo, "clip", None)
    G = float(G)
    C = 2.0 * (min(float(clip), G) if clip is not None else G)
    return C, float(L)


def enforced_bounds(algo: object, size: int) -> dict[str, np.ndarray]:
    """What the algorithm enforces now, per node: the task's feature bound (``inf`` for a
    task that declares none) and the clip (``inf`` when off)."""
    bound = getattr(algo.task, "feature_bound", None)  # type: ignore[attr-defined]
    clip = getattr(algo, "clip", None)
    return {"feature-bound": np.full(size, math.inf if bound is None else float(bound)),
            "clip": np.full(size, math.inf if clip is None else float(clip))}


def record_bounds(algo: object, privacy: Mapping[str, Any], size: int
                  ) -> dict[str, np.ndarray]:
    """The bounds a node's new state records: the given ones (its own settings), else what
    the algorithm enforces. A record below what is enforced is refused: the accountant
    would then charge less than is spent."""
    enforced = enforced_bounds(algo, size)
    out = {}
    for name, now in enforced.items():
        raw = privacy.get(name)
        rec = now.copy() if raw is None else np.asarray(raw, dtype=float).reshape(size).copy()
        if np.any(np.isnan(rec)) or np.any(rec <= 0):
            raise ValueError(f"{name} must be > 0, got {rec}")
        if np.any(rec < now * (1 - 1e-12)):
            raise ValueError(f"{name} {rec.min():g} is below the {now[0]:g} this algorithm "
                             "enforces: its ε would be under-reported")
        out[f"privacy_{name}"] = rec
    return out


def node_constants(algo: object, state: State, k: int) -> tuple[float, float]:
    """``(C, L)`` for the node at position ``k`` of ``state``: the larger of the bound and
    clip its state records (those it started with) and those enforced now. (A state
    written before the bounds were recorded gets the enforced ones.)"""
    now = enforced_bounds(algo, 1)
    bound, clip = float(now["feature-bound"][0]), float(now["clip"][0])
    if "privacy_feature-bound" in state:
        bound = max(bound, float(state["privacy_feature-bound"][k]))
    if "privacy_clip" in state:
        clip = max(clip, float(state["privacy_clip"][k]))
    return gradient_constants(algo, None if math.isinf(bound) else bound,
                              None if math.isinf(clip) else clip)


def clipped(algo: object, state: State) -> bool:
    """Whether any node of ``state`` clips now or did when it started."""
    recorded = state.get("privacy_clip")
    return getattr(algo, "clip", None) is not None or (
        recorded is not None and bool(np.any(np.isfinite(recorded))))


# -- baselines ---------------------------------------------------------------------------
def baseline_per_step_release(step_sizes: np.ndarray, scales: np.ndarray, C: float,
                              dim: int) -> LaplaceSeries:
    """The papers' description: release ``t ≥ 1`` has sensitivity ``√d · step_{t−1} · C``
    (one step's worth), release 0 none (it is data-independent)."""
    step_sizes = np.asarray(step_sizes, dtype=float)
    scales = np.asarray(scales, dtype=float)
    sens = np.zeros_like(scales)
    sens[1:] = math.sqrt(dim) * step_sizes[:-1] * C
    return LaplaceSeries(sens, scales)


def baseline_epsilon_per_step(step_sizes: np.ndarray, scales: np.ndarray, C: float,
                              dim: int) -> np.ndarray:
    """The papers' accounting: release ``t ≥ 1`` is charged ``√d · step_{t−1} · C / ϱ_t``;
    cumulative over ``1..T`` releases (release 0 is data-independent)."""
    return ACCOUNTANT.epsilon_curve(baseline_per_step_release(step_sizes, scales, C, dim))


def baseline_per_datum_release(step_sizes: np.ndarray, contraction: np.ndarray,
                               scales: np.ndarray, C: float, dim: int) -> PerDatumLaplace:
    """The rigorous description: datum ``ξ_k`` enters the update of step ``k`` only, moving
    release ``k+1`` by ``√d · step_k · C``, and then the learner's own state with factor
    ``a_t`` (``contraction``; 0 for a node that mixes released values only)."""
    step_sizes = np.asarray(step_sizes, dtype=float)
    scales = np.asarray(scales, dtype=float)
    entry = np.zeros_like(scales)
    n = min(step_sizes.size, scales.size)
    entry[:n] = math.sqrt(dim) * step_sizes[:n] * C
    return PerDatumLaplace(entry, np.asarray(contraction, dtype=float)[: scales.size], scales)


def baseline_epsilon_per_datum(step_sizes: np.ndarray, contraction: np.ndarray,
                               scales: np.ndarray, C: float, dim: int) -> float:
    """Rigorous per-datum ε over releases ``0..T−1``: ``max_k C·step_k·H_{k+1}``,
    ``H_j = √d/ϱ_j + a_j H_{j+1}`` (``H_T = 0``), ``a_j`` the own-state propagation factor."""
    return ACCOUNTANT.epsilon(
        baseline_per_datum_release(step_sizes, contraction, scales, C, dim))
