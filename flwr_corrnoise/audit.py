"""An empirical privacy auditor: run the real private step on neighbouring streams and
measure how well the best possible attacker tells them apart.

The calibration (:mod:`flwr_corrnoise.privacy`) *proves* ``(ε, δ)`` from the mechanism's
column norms. A proof covers the code it describes; this module checks the code that runs.
It executes the library's own private step many times, each execution with a fresh,
independent noise key, on two neighbouring data streams ``D`` and ``D'`` that differ in one
datum, and turns the success of a hypothesis test between them into a lower bound on ε that
holds with confidence ``1 − α`` (Jagielski et al. 2020; Nasr et al. 2021; the canary
auditor of jax_privacy). If the lower bound exceeds the claimed ε, the claim is
**falsified**: some released quantity carries more information than the calibration paid
for (too little noise, noise that does not vary between runs, a datum that moves the release
by more than the clip norm, …).

What runs (never a re-implementation of the noise, never a shortcut):

* ``variant="step"`` (paper 000): :class:`~flwr_corrnoise.learner.LearnerState` and
  :func:`~flwr_corrnoise.learner.local_round`, the one learner round every front end calls,
  for ``N/τ`` rounds with the server step :func:`~flwr_corrnoise.learner.aggregate` between
  them. The auditor observes what leaves the learner: every round's update ``ĝ``.
* ``variant="round"`` (paper 001, :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`): a
  learner state over ``R`` rounds and :func:`~flwr_corrnoise.variants.round_release`.
* ``variant="central"`` (paper 002, :class:`~flwr_corrnoise.flower.CorrNoiseCentralDPStrategy`):
  :func:`~flwr_corrnoise.variants.central_calibration`,
  :func:`~flwr_corrnoise.variants.central_noise_std`, one
  :class:`~flwr_corrnoise.streams.NoiseStream` on the server and the released average of
  ``n`` clipped round updates, as the wrapper's ``aggregate_train`` computes it.

The neighbouring pair is the **gradient canary** (the worst case of the Gaussian
mechanism): every datum of the stream has a zero gradient except the canary at step ``j``,
whose gradient is ``+10·B·u`` in ``D`` and ``−10·B·u`` in ``D'`` (``u`` a unit vector over
all coordinates); clipping makes them ``±B·u``, the largest change one datum can make.
Step ``j`` is by default the step whose change the release reveals most.

The distinguisher is the **optimal** one (Neyman–Pearson): the release is Gaussian with a
covariance the auditor knows from the factorization, ``σ²·P·M·Mᵀ·Pᵀ`` (``M = A⁻¹B`` the
increments, ``P`` the averaging of steps into rounds), so the log-likelihood ratio is a
threshold on the whitened projection ``S = yᵀΣ⁻¹a / (σ·√(aᵀΣ⁻¹a))`` of the releases'
component ``y`` along ``u`` onto the canary's footprint ``a``; ``S ~ N(±μ/2, 1)`` under the
claimed noise, with ``μ = 2h·√(aᵀΣ⁻¹a)/σ``.

From the scores of the runs:

* **threshold** chosen on one half of the runs (the selection half), applied to the other
  half (the evaluation half) only, so the bound needs no correction for the choice;
* **Clopper–Pearson** one-sided upper bounds ``FPR⁺``, ``FNR⁺`` at ``α/2`` each, so both
  hold together with probability ``≥ 1 − α``, and (ε, δ)-DP implies
  ``ε ≥ max(ln((1 − δ − FNR⁺)/FPR⁺), ln((1 − δ − FPR⁺)/FNR⁺))`` — the **empirical lower
  bound** ``epsilon_lower_bound``;
* **a second, analytic check**: ``μ`` of the release (from ``B`` and the noise std, not from
  ``C``'s column norms as the calibration computes it) gives the exact ε of a Gaussian
  mechanism at δ (``epsilon_analytic``); for the exact calibration it equals the claimed ε
  whenever the release carries all of ``C·G + ξ``'s information (every mechanism here but
  the efficient tree, whose online estimator discards some, so its release's ε is lower);
* **a fit**: the scores' empirical mean shift and spread give ``μ̂`` and its ε
  (``epsilon_gaussian_fit``, an estimate, not a bound); a spread far from 1 means the noise
  is not what the factorization says.

The auditor runs at a small size (``N`` = 8 … 64, ``d`` = 2): it checks that the code
adds the noise it claims for the budget it claims; the calibration's scaling to large ``N``
is checked by the tests of :mod:`~flwr_corrnoise.privacy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr
from scipy.stats import beta as beta_dist

from ._deprecation import renamed_keywords
from .learner import (
    LearnerState,
    PrivacySettings,
    aggregate,
    clip_by_global_norm,
    derive_seed,
    local_round,
)
from .mechanisms import Factorization, check_mechanism
from .mechanisms.participation import Participation
from .privacy import METHODS, check_budget
from .streams import NoiseStream, new_seed
from .variants import central_calibration, central_noise_std, round_release

#: where the noise is added: every local step (paper 000), every round on the learner
#: (paper 001), once per round on the server (paper 002)
VARIANTS = ("step", "round", "central")

#: the canary's raw gradient norm in units of the clip norm: > 1, so the audit runs the
#: clipping too (a canary inside the clip ball would audit a smaller change)
CANARY_NORM = 10.0

#: exit status of ``flwr-corrnoise audit`` when the lower bound exceeds the claimed ε
FALSIFIED_EXIT = 4


@dataclass(frozen=True)
class AuditResult:
    """What an audit found. ``epsilon_lower_bound > epsilon`` falsifies the claim."""

    mechanism: str
    variant: str
    steps: int  # N: local steps (step variant) or rounds (round, central)
    tau: int  # local steps per round (step variant; 1 otherwise)
    dim: int
    epsilon: float  # claimed
    delta: float
    method: str
    runs: int  # executions on each of D and D' (independent noise keys)
    alpha: float  # the lower bound holds with probability >= 1 - alpha
    canary_step: int  # the (first) step (round) whose datum differs
    noise_std: float  # σ the calibration sets for the noise on the released quantity
    noise_std_run: float  # σ of the noise streams that ran (smallest over the executions)
    noise_scale: float  # 1 unless a fault was injected on purpose
    reused_seed: bool  # True only for the deliberate fault "every run, one seed"
    mu: float  # the release's whitened mean shift, from B and noise_std_run
    epsilon_analytic: float  # exact Gaussian ε of mu at delta: equals epsilon if exact
    epsilon_lower_bound: float  # empirical, confidence 1 - alpha
    threshold: float  # chosen on the selection half
    false_positives: int  # on the evaluation half, of evaluation_runs D' runs
    false_negatives: int  # on the evaluation half, of evaluation_runs D runs
    evaluation_runs: int
    mu_empirical: float  # mean shift of the scores over their spread, all runs
    score_std: float  # the scores' spread: 1 under the claimed noise
    epsilon_gaussian_fit: float  # exact Gaussian ε of mu_empirical (an estimate)
    seconds: float
    #: passes over the data: the canary is used at canary_step + e·(steps/epochs), e < epochs
    epochs: int = 1

    @property
    def falsified(self) -> bool:
        """Whether the runs prove, at confidence ``1 − α``, that ε exceeds the claim."""
        return self.epsilon_lower_bound > self.epsilon

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "falsified": self.falsified}


# -- statistics -------------------------------------------------------------------------------
def clopper_pearson_upper(k: np.ndarray | int, n: int, significance: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper bound on a binomial rate from ``k`` of ``n``: the
    ``p`` with ``P[Bin(n, p) ≤ k] = significance`` (1 when ``k = n``)."""
    k = np.asarray(k, dtype=np.float64)
    safe = np.maximum(n - k, 1.0)
    upper = beta_dist.ppf(1.0 - significance, k + 1.0, safe)
    return np.where(k >= n, 1.0, upper)


def epsilon_from_counts(
    false_pos: np.ndarray | int, false_neg: np.ndarray | int, n_neg: int, n_pos: int,
    delta: float, alpha: float,
) -> np.ndarray:
    """The ε that (ε, δ)-DP needs to allow a test with these error counts, from
    Clopper–Pearson upper bounds on both rates at ``α/2`` each (so the pair holds with
    probability ``≥ 1 − α``): ``max(ln((1−δ−FNR⁺)/FPR⁺), ln((1−δ−FPR⁺)/FNR⁺))``, ``−∞``
    where neither numerator is positive."""
    fpr = clopper_pearson_upper(false_pos, n_neg, alpha / 2)
    fnr = clopper_pearson_upper(false_neg, n_pos, alpha / 2)

    def side(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(num > 0, np.log(np.maximum(num, 1e-300)) - np.log(den), -np.inf)

    return np.maximum(side(1.0 - delta - fnr, fpr), side(1.0 - delta - fpr, fnr))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε of a Gaussian mechanism with whitened mean shift ``μ`` at ``δ``: the root of
    ``Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) = δ`` (the exact trade-off curve; Dong, Roth & Su
    2019, Cor. 2.13). Written here, not imported from :mod:`~flwr_corrnoise.privacy`, so
    the audit's check of the calibration is a second computation."""
    if not mu > 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf

    def excess(eps: float) -> float:
        a = float(log_ndtr(-eps / mu + mu / 2))
        b = eps + float(log_ndtr(-eps / mu - mu / 2))
        return math.exp(a) - math.exp(min(b, 0.0)) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(brentq(excess, 0.0, hi, xtol=1e-13, rtol=1e-12))


def _choose_threshold(pos: np.ndarray, neg: np.ndarray, delta: float, alpha: float) -> float:
    """The threshold ("D" iff score ≥ t) whose Clopper–Pearson ε is largest on these runs
    (the selection half; the bound itself is computed on the other half)."""
    candidates = np.concatenate([np.unique(np.concatenate([pos, neg])), [np.inf]])
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    false_neg = np.searchsorted(pos_sorted, candidates, side="left")
    false_pos = neg.size - np.searchsorted(neg_sorted, candidates, side="left")
    eps = epsilon_from_counts(false_pos, false_neg, neg.size, pos.size, delta, alpha)
    return float(candidates[int(np.argmax(eps))])


# -- the release model the distinguisher whitens with ---------------------------------------
@dataclass(frozen=True)
class _Plan:
    rounds: int
    tau: int
    canary: int  # step (round) index of the differing datum's first use
    uses: frozenset[int]  # every step (round) at which the differing datum is used
    footprint: np.ndarray  # a: the canary's unit change of each release, length R
    weights: np.ndarray  # Σ⁻¹a, Σ the releases' noise covariance at unit std
    info: float  # aᵀΣ⁻¹a


def _plan(fact: Factorization, steps: int, tau: int, canary_step: int | None,
          epochs: int = 1) -> _Plan:
    """Whitening for ``R = steps/τ`` releases, each the mean of ``τ`` noisy steps.

    The covariance comes from the factorization's ``B`` (``noising_matrix() = A⁻¹B``), the
    auditor's public knowledge of the mechanism. With ``epochs > 1`` the canary is used at
    ``j, j + b, …`` (``b = steps/epochs``, one fixed cyclic order) and moves every one of
    those steps the same way; its footprint is the sum of theirs. The default first use
    ``j`` maximizes the release's information about the canary, ``aᵀΣ⁻¹a``."""
    rounds = steps // tau
    inc = fact.noising_matrix()  # N × W: the per-step increments at unit std
    avg = np.kron(np.eye(rounds), np.full((1, tau), 1.0 / tau))  # R × N
    cov = avg @ inc @ inc.T @ avg.T
    sep = steps // epochs
    starts = range(sep) if canary_step is None else [canary_step]
    if canary_step is not None and not 0 <= canary_step < sep:
        raise ValueError(f"canary step must be in [0, {sep}), got {canary_step}")
    best: tuple[float, int, np.ndarray, np.ndarray] | None = None
    for j in starts:
        footprint = avg[:, j::sep][:, :epochs].sum(axis=1)
        weights = np.linalg.solve(cov, footprint)
        info = float(footprint @ weights)
        if best is None or info > best[0]:
            best = (info, j, footprint, weights)
    assert best is not None
    info, j, footprint, weights = best
    uses = frozenset(range(j, steps, sep)) if epochs > 1 else frozenset({j})
    return _Plan(rounds, tau, j, uses, footprint, weights, info)


# -- executions of the real private step -----------------------------------------------------
#: one execution on D (+1) or D' (−1) with a noise key: the releases' components along
#: ``u`` (length R) and the std of the noise stream the code actually ran with
Execution = Callable[[int, int | None], tuple[np.ndarray, float]]


def _run_seeds(
    runs: int, seed: int | None, reuse_seed: bool
) -> list[tuple[int | None, int | None]]:
    """Independent noise keys for each (D, D') execution: derived from ``seed`` for a
    reproducible audit, else fresh OS entropy per execution. ``reuse_seed`` is the
    deliberate fault of a learner whose seed is a constant."""
    if reuse_seed:
        one = new_seed() if seed is None else derive_seed(seed, 0)
        return [(one, one)] * runs
    if seed is None:
        return [(None, None)] * runs  # each learner draws its own key from the OS
    return [(derive_seed(seed, 2 * r), derive_seed(seed, 2 * r + 1)) for r in range(runs)]


def _step_execution(settings: PrivacySettings, plan: _Plan, u: np.ndarray, eta: float,
                    noise_scale: float, secure: bool) -> Execution:
    dim, clip_norm = u.size, settings.clip_norm
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None) -> tuple[np.ndarray, float]:
        canary = sign * CANARY_NORM * clip_norm * u

        def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
            return [canary if position in plan.uses else zero]

        state = LearnerState.create(settings, [(dim,)], seed, secure=secure)
        if noise_scale != 1.0:  # the deliberate fault: a stream with the wrong std
            cal = settings.calibration()
            state.noise = NoiseStream.create(settings.mechanism, settings.horizon, [(dim,)],
                                             cal.std * noise_scale, state.seed, secure=secure,
                                             factorization=settings.factorization())
        x = [np.zeros(dim)]
        out = np.empty(plan.rounds)
        for r in range(plan.rounds):
            res = local_round(x, gradient, state, settings, plan.tau, eta)
            out[r] = res.update[0] @ u  # what leaves the learner: the round's ĝ
            x = aggregate(x, [res.update], eta, 1.0, plan.tau)
        return out, state.noise.std  # type: ignore[union-attr]

    return execute


def _round_execution(settings: PrivacySettings, plan: _Plan, u: np.ndarray,
                     noise_scale: float, secure: bool) -> Execution:
    dim, clip_norm = u.size, settings.clip_norm
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None) -> tuple[np.ndarray, float]:
        canary = sign * CANARY_NORM * clip_norm * u
        state = LearnerState.create(settings, [(dim,)], seed, secure=secure)
        noise = state.noise
        if noise_scale != 1.0:
            noise = NoiseStream.create(settings.mechanism, settings.horizon, [(dim,)],
                                       settings.calibration().std * noise_scale, state.seed,
                                       secure=secure, factorization=settings.factorization())
        out = np.empty(plan.rounds)
        for r in range(plan.rounds):
            noisy, _ = round_release(canary if r in plan.uses else zero, clip_norm, noise)
            state.step += 1
            out[r] = noisy @ u
        return out, noise.std  # type: ignore[union-attr]

    return execute


def _central_execution(settings: PrivacySettings, plan: _Plan, u: np.ndarray,
                       learners: int, std: float) -> Execution:
    dim, clip_norm = u.size, settings.clip_norm
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None) -> tuple[np.ndarray, float]:
        canary = sign * CANARY_NORM * clip_norm * u
        stream = NoiseStream.create(settings.mechanism, plan.rounds, [(dim,)], std, seed,
                                    factorization=settings.factorization())
        x = np.zeros(dim)
        out = np.empty(plan.rounds)
        for r in range(plan.rounds):
            total = np.zeros(dim)
            for i in range(learners):  # learner 0 holds the canary, the others send zero
                delta = canary if (i == 0 and r in plan.uses) else zero
                total += clip_by_global_norm(delta, clip_norm)[0]
            released = x + total / learners + stream.next()
            out[r] = (released - x) @ u
            x = released
        return out, stream.std

    return execute


# -- the audit --------------------------------------------------------------------------------
@renamed_keywords(clip="clip_norm")
def audit(
    mechanism: str,
    *,
    variant: str = "step",
    steps: int = 16,
    tau: int = 1,
    dim: int = 2,
    epsilon: float = 2.0,
    delta: float = 1e-3,
    clip_norm: float = 1.0,
    method: str = "exact",
    runs: int = 2000,
    alpha: float = 0.05,
    learners: int = 2,
    canary_step: int | None = None,
    seed: int | None = None,
    secure: bool = False,
    eta: float = 0.1,
    noise_scale: float = 1.0,
    reuse_seed: bool = False,
    epochs: int = 1,
) -> AuditResult:
    """Audit one configuration: ``runs`` executions on each of ``D`` and ``D'``.

    ``steps`` is the horizon ``N`` in local steps (``variant="step"``, ``τ`` steps per
    round) or in rounds (``"round"``, ``"central"``, where ``τ`` must be 1). ``learners``
    is the central variant's ``min_learners``. ``seed`` makes the audit reproducible (each
    execution's key is derived from it); ``None`` keys every execution from OS entropy.
    ``secure`` audits the learner's opt-in secure noise (step and round variants).
    ``clip_norm`` is the clip norm ``B`` (``clip=`` is its deprecated spelling).

    ``epochs`` (> 1): the data are reused — the canary is one datum used once per epoch in
    a fixed cyclic order (``steps/epochs`` steps, or rounds, apart), the learner's
    participation is that fixed-epoch one and the noise is calibrated for it
    (:mod:`flwr_corrnoise.mechanisms.participation`). ``epsilon_analytic`` then checks the
    multi-participation sensitivity from ``B`` and the canary's footprint, a second method.

    ``noise_scale`` (≠ 1) and ``reuse_seed`` inject faults on purpose — noise of the wrong
    std, or one noise key for every execution — to show that the auditor catches them.
    """
    started = time.perf_counter()
    check_mechanism(mechanism)
    check_budget(epsilon, delta)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    for name, value, low in (("steps", steps, 1), ("tau", tau, 1), ("dim", dim, 1),
                             ("learners", learners, 1), ("runs", runs, 20),
                             ("epochs", epochs, 1)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if variant != "step" and tau != 1:
        raise ValueError(f"the {variant} variant releases once per round: tau must be 1")
    if steps % tau:
        raise ValueError(f"steps ({steps}) must be a multiple of tau ({tau})")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if not (math.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale must be finite and > 0, got {noise_scale!r}")
    if secure and (variant == "central" or seed is not None or reuse_seed):
        raise ValueError("secure noise is the learners' (step and round variants) and is "
                         "keyed from OS entropy only: no seed, no reused seed")

    if steps % epochs:
        raise ValueError(f"epochs ({epochs}) must divide steps ({steps})")
    participation = (Participation.epochs(int(epochs), int(steps) // int(epochs))
                     if epochs > 1 else Participation.once())
    settings = PrivacySettings(mechanism=mechanism, epsilon=epsilon, delta=delta,
                               clip_norm=clip_norm, horizon=int(steps), method=method,
                               participation=participation)
    plan = _plan(settings.factorization(), int(steps), int(tau), canary_step, int(epochs))
    u = np.full(int(dim), 1.0 / math.sqrt(dim))  # every coordinate carries the canary
    # σ the calibration claims for the released quantity, and h, the canary's clipped
    # change of one step's (round's) contribution: ±h in D and D'
    if variant == "central":
        cal = central_calibration(mechanism, epsilon, delta, clip_norm, int(steps), method,  # type: ignore[arg-type]
                                  participation, settings.mechanism_params())
        claimed_std = central_noise_std(cal, learners)
        shift = clip_norm / learners  # one learner's clipped update, in the average of n
        execute = _central_execution(settings, plan, u, learners, claimed_std * noise_scale)
    else:
        claimed_std = settings.calibration().std  # type: ignore[union-attr]
        shift = clip_norm  # ±B on its step; ±B/τ on its round's mean (the 1/τ is in the plan)
        execute = (_step_execution(settings, plan, u, eta, noise_scale, secure)
                   if variant == "step" else
                   _round_execution(settings, plan, u, noise_scale, secure))

    releases = np.empty((2, int(runs), plan.rounds))
    ran_with = math.inf
    for r, (seed_pos, seed_neg) in enumerate(_run_seeds(int(runs), seed, reuse_seed)):
        releases[0, r], std_pos = execute(+1, seed_pos)
        releases[1, r], std_neg = execute(-1, seed_neg)
        ran_with = min(ran_with, std_pos, std_neg)

    # the likelihood-ratio statistic of every run at once: N(±μ/2, 1) under the claim
    scores = releases @ plan.weights / (claimed_std * math.sqrt(plan.info))
    # the release's μ from B and the std of the streams that ran (not C's column norms)
    mu = 2.0 * shift * math.sqrt(plan.info) / ran_with if ran_with > 0 else math.inf
    pos, neg = scores[0], scores[1]
    half = int(runs) // 2
    threshold = _choose_threshold(pos[:half], neg[:half], delta, alpha)
    pos_eval, neg_eval = pos[half:], neg[half:]
    false_pos = int(np.sum(neg_eval >= threshold))
    false_neg = int(np.sum(pos_eval < threshold))
    bound = float(epsilon_from_counts(false_pos, false_neg, neg_eval.size, pos_eval.size,
                                      delta, alpha))
    spread = float(math.sqrt((np.var(pos, ddof=1) + np.var(neg, ddof=1)) / 2))
    shift_hat = float(np.mean(pos) - np.mean(neg))
    mu_hat = shift_hat / spread if spread > 0 else (math.inf if shift_hat > 0 else 0.0)
    return AuditResult(
        mechanism=mechanism, variant=variant, steps=int(steps), tau=int(tau), dim=int(dim),
        epsilon=float(epsilon), delta=float(delta), method=method, runs=int(runs),
        alpha=float(alpha), canary_step=plan.canary, noise_std=float(claimed_std),
        noise_std_run=float(ran_with),
        noise_scale=float(noise_scale), reused_seed=bool(reuse_seed), mu=mu,
        epsilon_analytic=gaussian_epsilon(mu, delta),
        epsilon_lower_bound=max(0.0, bound), threshold=threshold,
        false_positives=false_pos, false_negatives=false_neg,
        evaluation_runs=int(pos_eval.size), mu_empirical=mu_hat, score_std=spread,
        epsilon_gaussian_fit=gaussian_epsilon(mu_hat, delta),
        seconds=time.perf_counter() - started, epochs=int(epochs),
    )

