"""An empirical privacy auditor: run the real private step on neighbouring streams and
measure how well an attacker tells them apart — an auditor that can fail.

The calibration (:mod:`flwr_corrnoise.privacy`) *proves* ``(ε, δ)`` from the mechanism's
column norms. A proof covers the code it describes; this module checks the code that runs.
It executes the library's own private step many times, each execution with a fresh,
independent noise key, on two neighbouring data streams ``D`` and ``D'`` that differ in one
datum, and turns the success of a hypothesis test between them into a lower bound on ε that
holds with high confidence (Jagielski, Ullman & Oprea 2020, "Auditing Differentially
Private Machine Learning: How Private is Private SGD?"; Nasr, Song, Thakurta, Papernot &
Carlini 2021, "Adversary Instantiation: Lower Bounds for Differentially Private Machine
Learning"). If the lower bound exceeds the claimed ε, or the noise that ran is not the law
the proof assumes, the claim is **falsified**.

Why the test statistic comes from the releases that run. An earlier version whitened the
releases with the noise covariance the mechanism *claims* (``σ²·P·M·Mᵀ·Pᵀ`` from the
factorization). That is the optimal test only if the claim is true — exactly what an
audit may not assume: with the noise of one step zeroed (true ε = ∞) it spread its weight
over all releases, drowned the one exact release in the others' noise and passed with a
bound of 0.4–0.6, while the sign of that release alone proves ε ≥ 5.6 on the same runs.
The attacker of Nasr et al. knows the implementation; the auditor cannot, so it *learns*
it first, from executions that are independent of the ones the bound is computed on:

1. **Phase 1 (the noise that runs).** ``noise_runs`` executions of the real private step
   on the all-zero data set, with fresh keys. Their releases (the component ``y`` along
   the canary direction ``u``, one number per release) give the noise covariance ``Σ̂``
   of what actually ran, regularized by a ridge of ``10⁻⁶·tr(Σ̂)/R``, so that a
   direction without noise gets a huge but finite weight.
2. **The canary and the weights,** fixed before any of the runs below exist: the use
   pattern ``π*`` (first use ``j*``, then every use the participation allows,
   separated by exactly its minimum) maximizing ``a_πᵀ Σ̂⁻¹ a_π`` (``a_π``: the canary's
   footprint on the releases), and the weights ``w = Σ̂⁻¹ a_π*`` — the Neyman–Pearson
   test for the *estimated* law.
3. **Phase 2 (the bound).** ``runs`` executions on ``D`` and on ``D'``, with new
   independent keys, the canary used at ``π*``. Every candidate test scores them: the
   estimated-law statistic ``wᵀy``; the claimed-law likelihood ratio
   ``yᵀΣ⁻¹a / (σ·√(aᵀΣ⁻¹a))`` (optimal when the claim holds; ``N(±μ/2, 1)`` then); and
   each release alone (the canary's sign in one release, which catches a step whose noise
   is missing even when ``Σ̂`` were poor). On the first half of the runs (the selection
   half) the auditor chooses the test *and* its threshold with the largest
   Clopper–Pearson ε; on the other half (the evaluation half) it applies only that one.
   Why one chosen test instead of a Bonferroni split of α over all of them: the choice
   is made on runs independent of the evaluation half, so the bound needs no correction
   for it and keeps its full α; a Bonferroni split would pay ``ln(#tests)`` of
   confidence for every audit.

Weights fixed before phase 2 make the bound valid whatever the weights are: an estimate
of ``Σ̂`` that is off costs power, never validity (the bound only counts errors of a fixed
test on fresh runs).

From the chosen test's errors on the evaluation half:

* **Clopper–Pearson** one-sided upper bounds ``FPR⁺``, ``FNR⁺`` at ``α/4`` each, so both
  hold together with probability ``≥ 1 − α/2``, and (ε, δ)-DP implies
  ``ε ≥ max(ln((1 − δ − FNR⁺)/FPR⁺), ln((1 − δ − FPR⁺)/FNR⁺))`` — the **empirical lower
  bound** ``epsilon_lower_bound``;
* **the law check** (the other ``α/2``): phase 1's releases (every coordinate, ``R·d``
  numbers an execution), whitened with the *claimed* covariance, have a sample
  covariance ``W`` whose eigenvalues under the claim lie in
  ``[(1 − √(p/n) − t/√n)², (1 + √(p/n) + t/√n)²]`` (``p = R·d``, ``n`` executions,
  ``t = √(2 ln(4/α))``) with probability ``≥ 1 − α/2`` — the Davidson–Szarek bound on the
  extreme singular values of a Gaussian matrix (Vershynin 2012, "Introduction to the
  non-asymptotic analysis of random matrices", Cor. 5.35). An eigenvalue outside rejects
  the claimed law: below, some direction carries less noise than claimed (a zeroed step,
  a smaller std, a key reused); above, more. Either way the code does not run what the
  proof describes. ``falsified`` is true when the bound exceeds the claim **or** the law
  is rejected; the two checks together err with probability ``≤ α``.
* **an analytic check**: ``μ`` of the release (from ``B`` and the std the streams report,
  not from ``C``'s column norms as the calibration computes it), for the worst use
  pattern, gives the exact ε of a Gaussian mechanism at δ (``epsilon_analytic``); it
  equals the claimed ε whenever the release carries all of ``C·G + ξ``'s information
  (every mechanism here but the efficient tree, whose online estimator discards some).
  It sees the parameters of the stream, not the noise drawn: a zeroed step leaves it
  unchanged — which is why the runs decide.
* **a fit**: the claimed-law scores' mean shift and spread give ``μ̂`` and its ε
  (``epsilon_gaussian_fit``, an estimate, not a bound); a spread far from 1 means the
  noise is not what the factorization says.

What runs (never a re-implementation of the noise, never a shortcut):

* ``variant="step"`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated
  Learning With Correlated Noise"), by ``front_end``: ``"local-round"``:
  :class:`~flwr_corrnoise.learner_state.LearnerState` and
  :func:`~flwr_corrnoise.learner.local_round`,
  the learner round of the ``NumPyClient``, the ``ClientApp`` helper and the in-process
  engine, ``N/τ`` rounds with the server step :func:`~flwr_corrnoise.aggregation.aggregate`
  between them; ``"private-step"``: :func:`~flwr_corrnoise.learner.private_step` one step
  at a time, what :class:`~flwr_corrnoise.flower.PrivateSteps` calls in the user's loop;
  ``"torch"``: :class:`~flwr_corrnoise.torch.PrivateOptimizer` on a bias-free linear model
  (per-example gradients, clipping and the torch noise stream on the CPU). The auditor
  observes what leaves the learner: every round's update ``ĝ``.
* ``variant="round"`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated
  Learning With Correlated Noise" (arXiv version),
  :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`): a learner state over ``R`` rounds and
  :func:`~flwr_corrnoise.variants.round_release`.
* ``variant="central"`` (Zhang, Zhu & Johansson, "Differentially Private Online Federated Learning
  with Correlated Noise", :class:`~flwr_corrnoise.flower.CorrNoiseCentralDPStrategy`):
  :func:`~flwr_corrnoise.variants.central_calibration`,
  :func:`~flwr_corrnoise.variants.central_noise_std`, one
  :class:`~flwr_corrnoise.streams.NoiseStream` on the server and the released average of
  ``n`` clipped round updates, as the wrapper's ``aggregate_train`` computes it.

``dtype="float32"`` audits a float32 stream (``LearnerState.create(dtype=…)``; step and
round variants, and the torch front end's model).

The neighbouring pair is the **gradient canary** (the worst case of the Gaussian
mechanism): every datum of the stream has a zero gradient except the canary, whose
gradient is ``+10·B·u`` in ``D`` and ``−10·B·u`` in ``D'`` at each of its uses (``u`` a
unit vector over all coordinates); clipping makes them ``±B·u``, the largest change one
datum can make. Its uses: once (the default), once per epoch in a fixed cyclic order
(``epochs``), or as many times as a min-sep participation allows (``min_sep``,
``max_participations``), exactly ``min_sep`` apart — the worst pattern for the Toeplitz
mechanisms (Kalinin & Lampert 2024) and the one the participation module reaches.

**Fault injection** (deliberate faults, to show that the auditor fails them): a stream at
``noise_scale`` times the calibrated std; one key for every execution (``reuse_seed``);
the increment of one step zeroed (``zero_noise_step``: the learner's real stream, its
recurrence run as always, with that step's increment replaced by zeros where it is
released); and one-pass accounting on a multi-epoch loop (``accounted_epochs``: the
learner's settings declare ``accounted_epochs`` passes while the canary is used
``epochs`` times).

The auditor runs at a small size (``N`` = 8 … 64, ``d`` = 2): it checks that the code
adds the noise it claims for the budget it claims; the calibration's scaling to large ``N``
is checked by the tests of :mod:`~flwr_corrnoise.privacy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr
from scipy.stats import beta as beta_dist

from .aggregation import aggregate
from .learner import StepCounts, clip_by_global_norm, local_round, private_step
from .learner_state import LearnerState
from .mechanisms import Factorization, check_mechanism
from .mechanisms.participation import Participation, SampledParticipation
from .privacy import METHODS, check_budget
from .settings import PrivacySettings, derive_seed
from .streams import NoiseStream, new_seed
from .variants import central_calibration, central_noise_std, round_release

#: where the noise is added: every local step (Zhang et al.), every round on the learner
#: (Zhang et al., arXiv), once per round on the server (Zhang, Zhu & Johansson)
VARIANTS = ("step", "round", "central")

#: the step variant's code paths: the learner round (NumPyClient, ClientApp helper,
#: engine), the one private step of PrivateSteps, the torch PrivateOptimizer
FRONT_ENDS = ("local-round", "private-step", "torch")

#: the noise streams' float types
DTYPES = ("float64", "float32")

#: the canary's raw gradient norm in units of the clip norm: > 1, so the audit runs the
#: clipping too (a canary inside the clip ball would audit a smaller change)
CANARY_NORM = 10.0

#: the ridge added to the estimated covariance, relative to its mean diagonal: a direction
#: without noise gets weight ~10⁶ times an ordinary one's, huge but finite
RIDGE = 1e-6

#: exit status of ``flwr-corrnoise audit`` when the claim is falsified
FALSIFIED_EXIT = 4

#: the candidate tests' names (each release alone is ``"release <r>"``)
ESTIMATED_LAW, CLAIMED_LAW = "estimated-law", "claimed-law"


@dataclass(frozen=True)
class AuditResult:
    """What an audit found. ``falsified``: the lower bound exceeds the claimed ε, or the
    noise that ran is not the claimed law."""

    mechanism: str
    variant: str
    steps: int  # N: local steps (step variant) or rounds (round, central)
    tau: int  # local steps per round (step variant; 1 otherwise)
    dim: int
    epsilon: float  # claimed
    delta: float
    method: str
    runs: int  # phase-2 executions on each of D and D' (independent noise keys)
    alpha: float  # the verdict errs with probability <= alpha (alpha/2 each check)
    canary_step: int  # the (first) step (round) whose datum differs
    noise_std: float  # σ the calibration sets for the noise on the released quantity
    noise_std_run: float  # σ of the noise streams that ran (smallest over the executions)
    noise_scale: float  # 1 unless a fault was injected on purpose
    reused_seed: bool  # True only for the deliberate fault "every run, one seed"
    mu: float  # the release's whitened mean shift, worst use pattern, from B and the std run
    epsilon_analytic: float  # exact Gaussian ε of mu at delta: equals epsilon if exact
    epsilon_lower_bound: float  # empirical, confidence 1 - alpha/2
    threshold: float  # of the chosen test, chosen on the selection half
    false_positives: int  # on the evaluation half, of evaluation_runs D' runs
    false_negatives: int  # on the evaluation half, of evaluation_runs D runs
    evaluation_runs: int
    mu_empirical: float  # claimed-law scores: mean shift over spread, all phase-2 runs
    score_std: float  # the claimed-law scores' spread: 1 under the claimed noise
    epsilon_gaussian_fit: float  # exact Gaussian ε of mu_empirical (an estimate)
    seconds: float
    #: passes over the data: the canary is used at canary_step + e·(steps/epochs), e < epochs
    epochs: int = 1
    #: the passes the learner's settings declare (= epochs unless the fault is injected)
    accounted_epochs: int = 1
    #: min-sep participation (None: fixed epochs or once)
    min_sep: int | None = None
    max_participations: int | None = None
    #: the participation the learner's settings declare, in words
    participation: str = "each datum once"
    #: every step (round) at which the canary is used
    canary_uses: tuple[int, ...] = ()
    #: the step (round) whose noise increment was zeroed on purpose (a fault), or None
    zero_noise_step: int | None = None
    dtype: str = "float64"
    front_end: str = "local-round"
    noise_runs: int = 0  # phase-1 executions on the all-zero data set
    #: the test the selection half chose: "estimated-law", "claimed-law" or "release <r>"
    test: str = ESTIMATED_LAW
    #: μ of the canary under the phase-1 estimated law, and its ε (estimates, not bounds)
    mu_estimated: float = 0.0
    epsilon_estimated: float = 0.0
    mu_canary: float = 0.0  # the claimed-law μ of the canary's pattern (std that ran)
    #: the law check: extreme eigenvalues of the whitened phase-1 sample covariance,
    #: against the bounds that hold under the claim with probability >= 1 - alpha/2
    law_min_eigenvalue: float = 1.0
    law_max_eigenvalue: float = 1.0
    law_lower_edge: float = 0.0
    law_upper_edge: float = math.inf
    law_rejected: bool = False

    @property
    def exceeds_claim(self) -> bool:
        """Whether the runs prove, at confidence ``1 − α/2``, that ε exceeds the claim."""
        return self.epsilon_lower_bound > self.epsilon

    @property
    def falsified(self) -> bool:
        """The lower bound exceeds the claim, or the claimed noise law is rejected (the two
        together err with probability ``≤ α``)."""
        return self.exceeds_claim or self.law_rejected

    @property
    def verdict(self) -> str:
        law = (f"whitened noise covariance eigenvalues in [{self.law_min_eigenvalue:.3g}, "
               f"{self.law_max_eigenvalue:.3g}]")
        if not self.falsified:
            return (f"consistent: lower bound {self.epsilon_lower_bound:.3f} <= claimed "
                    f"{self.epsilon:g}; the noise law is consistent with the claim ({law} "
                    f"within [{self.law_lower_edge:.3g}, {self.law_upper_edge:.3g}])")
        reasons = []
        if self.exceeds_claim:
            reasons.append(f"the runs prove epsilon >= {self.epsilon_lower_bound:.3f} > the "
                           f"claimed {self.epsilon:g} (confidence {1 - self.alpha / 2:g}, "
                           f"test {self.test})")
        if self.law_rejected:
            side = ("less noise than claimed in some direction"
                    if self.law_min_eigenvalue < self.law_lower_edge else
                    "more noise than claimed in some direction")
            reasons.append(f"the noise that ran is not the claimed law: {side} ({law}, "
                           f"outside [{self.law_lower_edge:.3g}, {self.law_upper_edge:.3g}], "
                           f"confidence {1 - self.alpha / 2:g})")
        return "FALSIFIED: " + "; ".join(reasons)

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


def _choose_threshold(pos: np.ndarray, neg: np.ndarray, delta: float,
                      alpha: float) -> tuple[float, float]:
    """The threshold ("D" iff score ≥ t) whose Clopper–Pearson ε is largest on these runs
    (the selection half; the bound itself is computed on the other half), and that ε.

    The candidates are the midpoints between consecutive distinct scores (and ±∞): a
    threshold *at* a score would put the evaluation half's ties and near-ties on one side
    by chance; the midpoint of the widest gap a perfect separation leaves is the robust
    choice."""
    values = np.unique(np.concatenate([pos, neg]))
    values = values[np.isfinite(values)]
    mids = values[:-1] + (values[1:] - values[:-1]) / 2
    candidates = np.concatenate([[-np.inf], mids, [np.inf]])
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    false_neg = np.searchsorted(pos_sorted, candidates, side="left")
    false_pos = neg.size - np.searchsorted(neg_sorted, candidates, side="left")
    eps = epsilon_from_counts(false_pos, false_neg, neg.size, pos.size, delta, alpha)
    best = int(np.argmax(eps))
    return float(candidates[best]), float(eps[best])


def law_check(releases: np.ndarray, cov: np.ndarray,
              alpha: float) -> tuple[float, float, float, float]:
    """Whether ``n`` executions' releases (``n × R × d``, zero data) follow the claimed law
    ``N(0, cov ⊗ I_d)``: the extreme eigenvalues of their whitened sample covariance and
    the edges they lie within with probability ``≥ 1 − α`` under the claim.

    Under the claim the whitened releases form an ``n × p`` matrix ``G`` of independent
    standard normals (``p = R·d``), and with probability ``≥ 1 − 2·exp(−t²/2)``
    ``√n − √p − t ≤ s_min(G) ≤ s_max(G) ≤ √n + √p + t`` (Davidson & Szarek 2001;
    Vershynin 2012, Cor. 5.35), so the eigenvalues of ``GᵀG/n`` lie in
    ``[(1 − √(p/n) − t/√n)₊², (1 + √(p/n) + t/√n)²]`` for ``t = √(2 ln(2/α))``. A
    non-asymptotic bound (valid at every ``n``, conservative by the Tracy–Widom
    fluctuations it does not use). Returns ``(λ_min, λ_max, lower, upper)``; with
    ``p ≥ n`` the lower edge is 0 (no check below)."""
    n, rounds, dim = releases.shape
    vals, vecs = np.linalg.eigh(cov)
    floor = max(float(vals.max()), 1e-300) * 1e-14
    whiten = vecs / np.sqrt(np.maximum(vals, floor))  # cov^(-1/2) up to a rotation
    z = np.einsum("nrd,rk->nkd", releases, whiten).reshape(n, rounds * dim)
    eig = np.linalg.eigvalsh(z.T @ z / n)
    p = rounds * dim
    t = math.sqrt(2.0 * math.log(2.0 / alpha))
    spread = math.sqrt(p / n) + t / math.sqrt(n)
    lower = max(0.0, 1.0 - spread) ** 2
    return float(eig[0]), float(eig[-1]), lower, (1.0 + spread) ** 2


# -- the release model ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Releases:
    """What the auditor observes: ``R = steps/τ`` releases, each the mean of ``τ`` steps."""

    rounds: int
    tau: int
    avg: np.ndarray  # R × N: steps (rounds) → releases
    cov: np.ndarray  # R × R: the claimed noise covariance at unit std


def _release_model(fact: Factorization, steps: int, tau: int) -> _Releases:
    """The claimed covariance comes from the factorization's ``B``
    (``noising_matrix() = A⁻¹B``, the increments at unit std): the mechanism's public
    description, which the law check and the claimed-law test compare the runs with."""
    rounds = steps // tau
    inc = fact.noising_matrix()  # N × W
    avg = np.kron(np.eye(rounds), np.full((1, tau), 1.0 / tau))  # R × N
    return _Releases(rounds, tau, avg, avg @ inc @ inc.T @ avg.T)


def _use_patterns(steps: int, uses: int, sep: int,
                  canary_step: int | None) -> list[tuple[int, ...]]:
    """Every pattern of ``uses`` uses exactly ``sep`` steps apart that fits the horizon (one
    per first use), or the one starting at ``canary_step``."""
    firsts = steps - (uses - 1) * sep
    if canary_step is not None:
        if not 0 <= canary_step < firsts:
            raise ValueError(f"canary step must be in [0, {firsts}), got {canary_step}")
        return [tuple(range(canary_step, canary_step + uses * sep, sep))]
    return [tuple(range(j, j + uses * sep, sep)) for j in range(firsts)]


# -- executions of the real private step -----------------------------------------------------
#: one execution on D (+1), D' (−1) or the all-zero data set (0), with a noise key and the
#: canary's uses: the releases (R × d) and the std of the noise stream the code ran with
Execution = Callable[[int, int | None, frozenset[int]], tuple[np.ndarray, float]]


def _run_seeds(runs: int, seed: int | None, reuse_seed: bool,
               first: int = 0) -> list[int | None]:
    """Independent noise keys for ``runs`` executions: derived from ``seed`` (indices
    ``first …``) for a reproducible audit, else fresh OS entropy per execution.
    ``reuse_seed`` is the deliberate fault of a learner whose seed is a constant."""
    if reuse_seed:
        one = new_seed() if seed is None else derive_seed(seed, 0)
        return [one] * runs
    if seed is None:
        return [None] * runs  # each learner draws its own key from the OS
    return [derive_seed(seed, first + r) for r in range(runs)]


def _without_noise_at(stream: Any, step: int | None) -> None:
    """The deliberate fault "no noise at one step": the stream that runs, with the
    increment of ``step`` replaced by zeros where it is handed out (its recurrence and
    generator advance as always). Wraps the stream object's own ``next`` and
    ``next_block``, through which every release of it passes (``add_next`` calls
    ``next``; a one-learner group calls the stream's own ``add_next``; a BLT round draws
    its steps as one block, :class:`~flwr_corrnoise.learner.BlockNoise`), so the release
    is formed by the real code."""
    if step is None:
        return
    real_next, real_block = stream.next, getattr(stream, "next_block", None)

    def next_without_noise_at_one_step() -> Any:
        at = stream.step
        increment = real_next()
        return increment * 0 if at == step else increment

    def block_without_noise_at_one_step(count: int) -> Any:
        at = stream.step
        block = real_block(count)  # type: ignore[misc]
        if at <= step < at + count:
            block[step - at] = 0
        return block

    stream.next = next_without_noise_at_one_step
    if real_block is not None:
        stream.next_block = block_without_noise_at_one_step


@dataclass(frozen=True)
class _CanarySampler:
    """Cyclic Poisson sampling of the canary (``sampling_rate`` mode of :func:`audit`):
    the library's :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader` over ``b/q``
    examples in batches of one (rate ``q``, ``b`` groups), keyed by each execution's noise
    key, the canary its example at the first slot of group 0. ``drawn`` ≠ ``rate`` is the
    deliberate fault of a loop that draws more often than the settings claim."""

    rate: float
    cycle: int
    drawn: float
    steps: int

    def loader(self, key: int) -> Any:
        from .data.sampling import CyclicPoissonLoader

        per_epoch = round(self.cycle / self.drawn)
        if abs(per_epoch * self.drawn - self.cycle) > 1e-9 * self.cycle:
            raise ValueError(f"the audit's sampler needs cycle/rate = {self.cycle}/"
                             f"{self.drawn:g} to be an integer (steps per epoch)")
        return CyclicPoissonLoader(per_epoch, 1, rounds=-(-self.steps // per_epoch),
                                   key=key, bands=self.cycle)

    def wrap(self, execute: Execution) -> Execution:
        def sampled(sign: int, seed: int | None, uses: frozenset[int]
                    ) -> tuple[np.ndarray, float]:
            key = new_seed() if seed is None else seed  # the learner's own key
            if not uses:  # phase 1: the all-zero data set, nothing to draw
                return execute(sign, key, uses)
            ld = self.loader(key)
            canary = int(ld.group(min(uses))[0])
            drawn = frozenset(t for t in uses if canary in ld.indices(t))
            return execute(sign, key, drawn)
        return sampled


@dataclass(frozen=True)
class _Run:
    """What every execution shares."""

    settings: PrivacySettings
    releases: _Releases
    u: np.ndarray
    eta: float
    noise_scale: float
    secure: bool
    dtype: str
    zero_noise_step: int | None

    def scaled_stream(self, shapes: list[tuple[int, ...]], seed: int | None,
                      dtype: Any) -> NoiseStream:
        """The deliberate fault: the learner's stream at ``noise_scale`` × the calibrated
        std (the same mechanism, factorization and key)."""
        s = self.settings
        return NoiseStream.create(s.mechanism, s.horizon, shapes,
                                  s.calibration().std * self.noise_scale,  # type: ignore[union-attr]
                                  seed, secure=self.secure, factorization=s.factorization(),
                                  dtype=dtype)

    @property
    def np_dtype(self) -> Any:
        return np.float32 if self.dtype == "float32" else None

    def canary(self, sign: int) -> np.ndarray:
        return sign * CANARY_NORM * self.settings.clip_norm * self.u


def _step_execution(run: _Run, front_end: str) -> Execution:
    if front_end == "torch":
        return _torch_execution(run)
    dim, rel = run.u.size, run.releases
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None, uses: frozenset[int]) -> tuple[np.ndarray, float]:
        canary = run.canary(sign)
        state = LearnerState.create(run.settings, [(dim,)], seed, secure=run.secure,
                                    dtype=run.np_dtype)
        if run.noise_scale != 1.0:
            state.noise = run.scaled_stream([(dim,)], state.seed, run.np_dtype)
        _without_noise_at(state.noise, run.zero_noise_step)
        out = np.empty((rel.rounds, dim))
        if front_end == "private-step":  # PrivateSteps' step, one call per datum
            counts = StepCounts()
            for r in range(rel.rounds):
                total = np.zeros(dim)
                for _ in range(rel.tau):
                    g = canary if state.position in uses else zero
                    total += private_step(state, run.settings, lambda g=g: g, dim, counts)
                out[r] = total / rel.tau  # what the round's model difference reveals
            return out, state.noise.std  # type: ignore[union-attr]

        def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
            return [canary if position in uses else zero]

        x = [np.zeros(dim)]
        for r in range(rel.rounds):
            res = local_round(x, gradient, state, run.settings, rel.tau, run.eta)
            out[r] = res.update[0]  # what leaves the learner: the round's ĝ
            x = aggregate(x, [res.update], run.eta, 1.0, rel.tau)
        return out, state.noise.std  # type: ignore[union-attr]

    return execute


def _torch_execution(run: _Run) -> Execution:
    """The torch front end: :class:`~flwr_corrnoise.torch.PrivateOptimizer` on a bias-free
    ``Linear(d, 1)`` whose per-example loss is ``y·(w·x)``, so the gradient of datum
    ``(x, 1)`` is ``x``: the canary's ``±10·B·u``, or zero. Per-example clipping, the
    device stream's increment and the SGD step are the optimizer's; the release is
    :meth:`~flwr_corrnoise.torch.PrivateOptimizer.round_update`."""
    import torch

    from .plan import safe_learning_rate
    from .torch.optimizer import PrivateOptimizer
    from .torch.streams import TorchNoiseStream

    dim, rel, settings = run.u.size, run.releases, run.settings
    tdtype = torch.float32 if run.dtype == "float32" else torch.float64
    # the release ĝ does not depend on the step size; one the optimizer deems safe keeps
    # its (correct) warning about noise that swamps the model out of the audit's output
    lr = min(run.eta, safe_learning_rate(settings, 1))
    target = torch.ones(1, dtype=tdtype)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out * y).sum()

    def execute(sign: int, seed: int | None, uses: frozenset[int]) -> tuple[np.ndarray, float]:
        canary = torch.tensor(run.canary(sign), dtype=tdtype)[None, :]
        zero = torch.zeros((1, dim), dtype=tdtype)
        model = torch.nn.Linear(dim, 1, bias=False).to(tdtype)
        with torch.no_grad():
            model.weight.zero_()
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        if run.noise_scale != 1.0:
            stream = TorchNoiseStream.create(
                settings.mechanism, settings.horizon, [(1, dim)],
                settings.calibration().std * run.noise_scale, seed,  # type: ignore[union-attr]
                factorization=settings.factorization(), dtype=tdtype)
            private = PrivateOptimizer(sgd, model, settings, stream=stream, loss_fn=loss)
        else:
            private = PrivateOptimizer(sgd, model, settings, seed=seed, loss_fn=loss,
                                       noise_dtype=tdtype)
        _without_noise_at(private.noise, run.zero_noise_step)
        out = np.empty((rel.rounds, dim))
        step = 0
        for r in range(rel.rounds):
            for _ in range(rel.tau):
                private.zero_grad()
                private.backward(canary if step in uses else zero, target)
                private.step()
                step += 1
            out[r] = private.round_update()[0].reshape(-1)
        return out, float(private.noise.std)  # type: ignore[union-attr]

    return execute


def _round_execution(run: _Run) -> Execution:
    dim, clip_norm, rel = run.u.size, run.settings.clip_norm, run.releases
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None, uses: frozenset[int]) -> tuple[np.ndarray, float]:
        canary = run.canary(sign)
        state = LearnerState.create(run.settings, [(dim,)], seed, secure=run.secure,
                                    dtype=run.np_dtype)
        noise = state.noise
        if run.noise_scale != 1.0:
            noise = run.scaled_stream([(dim,)], state.seed, run.np_dtype)
        _without_noise_at(noise, run.zero_noise_step)
        out = np.empty((rel.rounds, dim))
        for r in range(rel.rounds):
            noisy, _ = round_release(canary if r in uses else zero, clip_norm, noise)  # type: ignore[arg-type]
            state.step += 1
            out[r] = noisy
        return out, noise.std  # type: ignore[union-attr]

    return execute


def _central_execution(run: _Run, learners: int, std: float) -> Execution:
    dim, settings, rel = run.u.size, run.settings, run.releases
    zero = np.zeros(dim)

    def execute(sign: int, seed: int | None, uses: frozenset[int]) -> tuple[np.ndarray, float]:
        canary = run.canary(sign)
        stream = NoiseStream.create(settings.mechanism, rel.rounds, [(dim,)], std, seed,
                                    factorization=settings.factorization())
        _without_noise_at(stream, run.zero_noise_step)
        x = np.zeros(dim)
        out = np.empty((rel.rounds, dim))
        for r in range(rel.rounds):
            total = np.zeros(dim)
            for i in range(learners):  # learner 0 holds the canary, the others send zero
                delta = canary if (i == 0 and r in uses) else zero
                total += clip_by_global_norm(delta, settings.clip_norm)[0]
            released = x + total / learners + stream.next()
            out[r] = released - x
            x = released
        return out, stream.std

    return execute


def _execute_all(execute: Execution, sign: int, seeds: list[int | None],
                 uses: frozenset[int]) -> tuple[np.ndarray, float]:
    out = []
    ran_with = math.inf
    for seed in seeds:
        releases, std = execute(sign, seed, uses)
        out.append(releases)
        ran_with = min(ran_with, std)
    return np.stack(out), ran_with


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# -- the audit --------------------------------------------------------------------------------
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
    min_sep: int | None = None,
    max_participations: int | None = None,
    front_end: str = "local-round",
    dtype: str = "float64",
    noise_runs: int | None = None,
    zero_noise_step: int | None = None,
    accounted_epochs: int | None = None,
    sampling_rate: float | None = None,
    sampling_cycle: int | None = None,
    drawn_rate: float | None = None,
) -> AuditResult:
    """Audit one configuration: ``noise_runs`` executions on the all-zero data set
    (default ``runs``), then ``runs`` executions on each of ``D`` and ``D'``.

    ``steps`` is the horizon ``N`` in local steps (``variant="step"``, ``τ`` steps per
    round) or in rounds (``"round"``, ``"central"``, where ``τ`` must be 1). ``learners``
    is the central variant's ``min_learners``. ``seed`` makes the audit reproducible (each
    execution's key is derived from it); ``None`` keys every execution from OS entropy.
    ``secure`` audits the learner's opt-in secure noise (step and round variants).
    ``clip_norm`` is the clip norm ``B``.
    ``front_end`` (step variant): ``"local-round"``, ``"private-step"`` or ``"torch"``;
    ``dtype``: the stream's ``"float64"`` or ``"float32"`` (not central).

    Participation (how often the canary is used; the learner is calibrated for it):
    ``epochs`` (> 1): once per epoch in a fixed cyclic order, ``steps/epochs`` apart;
    ``min_sep``/``max_participations``: as many uses as the min-sep participation allows
    (:meth:`~flwr_corrnoise.mechanisms.participation.Participation.from_options`), exactly
    ``min_sep`` apart. ``epsilon_analytic`` then checks the multi-participation
    sensitivity from ``B`` and the canary's footprint, a second method.

    Deliberate faults, to show that the auditor catches them: ``noise_scale`` (≠ 1: noise
    of the wrong std), ``reuse_seed`` (one key for every execution), ``zero_noise_step``
    (no noise increment at that step, or round), ``accounted_epochs`` (the settings
    declare that many passes while the canary is used ``epochs`` times: one-pass
    accounting on a multi-epoch loop with ``accounted_epochs=1``).

    Sampling (``sampling_rate = q``; issue 35): the learner's settings declare cyclic
    Poisson sampling (:class:`~flwr_corrnoise.mechanisms.participation.SampledParticipation`,
    ``sampling_cycle = b`` groups, default 4 for ``bandmf``, else 1) and are calibrated to
    the amplified guarantee; the canary is eligible at every ``b``-th step and each
    execution's sampler (:class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`, keyed
    by that execution's noise key through its own sub-key) decides at which of them it is
    drawn. The lower bound and the law check stay valid (any fixed test on fresh
    executions); the analytic ε is that of the canary used at every eligible step (no
    amplification), an upper reference, not a check. The fault ``drawn_rate`` (> ``q``)
    draws at that rate while the settings claim ``q`` — ``drawn_rate = 1`` is a loop that
    ignores the sampler.
    """
    started = time.perf_counter()
    check_mechanism(mechanism)
    check_budget(epsilon, delta)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if method not in METHODS:
        raise ValueError(f"calibration method must be one of {METHODS}, got {method!r}")
    noise_runs = runs if noise_runs is None else noise_runs
    for name, value, low in (("steps", steps, 1), ("tau", tau, 1), ("dim", dim, 1),
                             ("learners", learners, 1), ("runs", runs, 20),
                             ("noise_runs", noise_runs, 10), ("epochs", epochs, 1)):
        _check_int(name, value, low)
    steps, tau, dim, runs, noise_runs = int(steps), int(tau), int(dim), int(runs), int(noise_runs)
    if variant != "step" and tau != 1:
        raise ValueError(f"the {variant} variant releases once per round: tau must be 1")
    if variant != "step" and front_end != "local-round":
        raise ValueError(f"front_end {front_end!r} is one of the step variant's")
    if steps % tau:
        raise ValueError(f"steps ({steps}) must be a multiple of tau ({tau})")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if not (math.isfinite(noise_scale) and noise_scale > 0):
        raise ValueError(f"noise_scale must be finite and > 0, got {noise_scale!r}")
    if secure and (variant == "central" or seed is not None or reuse_seed
                   or front_end == "torch" or dtype != "float64"):
        raise ValueError("secure noise is the learners' (step and round variants, NumPy) and "
                         "is keyed from OS entropy only, float64: no seed, no reused seed")
    if variant == "central" and dtype != "float64":
        raise ValueError("the central variant's server stream is float64")
    if zero_noise_step is not None and not 0 <= int(zero_noise_step) < steps:
        raise ValueError(f"zero_noise_step must be in [0, {steps}), got {zero_noise_step!r}")

    # the participation the canary's uses follow, and the one the settings declare
    sampler = None
    if sampling_rate is not None:
        if epochs != 1 or accounted_epochs is not None or min_sep is not None \
                or max_participations is not None or variant != "step":
            raise ValueError("sampling is a participation of its own (step variant): no "
                             "epochs, accounted_epochs, min_sep or max_participations")
        cycle = int(sampling_cycle if sampling_cycle is not None else
                    (4 if mechanism == "bandmf" else 1))
        declared = SampledParticipation.cyclic_poisson(sampling_rate, cycle, steps, 1.0)
        sampler = _CanarySampler(declared.sampling_rate, cycle,
                                 declared.sampling_rate if drawn_rate is None
                                 else float(drawn_rate), steps)
        sep, uses_count = cycle, -(-steps // cycle)
        if canary_step is None:
            canary_step = 0  # group 0: the most eligible steps
    elif sampling_cycle is not None or drawn_rate is not None:
        raise ValueError("sampling_cycle and drawn_rate need sampling_rate")
    elif min_sep is not None or max_participations is not None:
        if epochs != 1 or accounted_epochs is not None:
            raise ValueError("set either epochs (and accounted_epochs) or "
                             "min_sep/max_participations, not both")
        declared = Participation.from_options(steps, min_sep=min_sep,
                                              max_participations=max_participations)
        sep, uses_count = declared.min_sep, declared.participations(steps)
    else:
        if steps % epochs:
            raise ValueError(f"epochs ({epochs}) must divide steps ({steps})")
        accounted = epochs if accounted_epochs is None else accounted_epochs
        _check_int("accounted_epochs", accounted, 1)
        declared = Participation.from_options(steps, epochs=int(accounted))
        sep, uses_count = steps // epochs, int(epochs)
    settings = PrivacySettings(mechanism=mechanism, epsilon=epsilon, delta=delta,
                               clip_norm=clip_norm, horizon=steps, method=method,
                               participation=declared)
    rel = _release_model(settings.factorization(), steps, tau)
    patterns = _use_patterns(steps, uses_count, sep, canary_step)
    footprints = np.stack([rel.avg[:, list(p)].sum(axis=1) for p in patterns])  # P × R
    u = np.full(dim, 1.0 / math.sqrt(dim))  # every coordinate carries the canary
    run = _Run(settings, rel, u, float(eta), float(noise_scale), bool(secure), dtype,
               None if zero_noise_step is None else int(zero_noise_step))
    # σ the calibration claims for the released quantity, and h, the canary's clipped
    # change of one step's (round's) contribution: ±h in D and D'
    if variant == "central":
        cal = central_calibration(mechanism, epsilon, delta, clip_norm, steps, method,  # type: ignore[arg-type]
                                  declared, settings.mechanism_params())
        claimed_std = central_noise_std(cal, learners)
        shift = clip_norm / learners  # one learner's clipped update, in the average of n
        execute = _central_execution(run, learners, claimed_std * noise_scale)
    else:
        claimed_std = settings.calibration().std  # type: ignore[union-attr]
        shift = clip_norm  # ±B on its step; ±B/τ on its round's mean (the 1/τ is in avg)
        execute = (_step_execution(run, front_end) if variant == "step" else
                   _round_execution(run))
        if sampler is not None:
            execute = sampler.wrap(execute)

    # phase 1: the noise that runs, on the all-zero data set, keys of its own
    phase1, std1 = _execute_all(execute, 0, _run_seeds(noise_runs, seed, reuse_seed,
                                                       2 * runs), frozenset())
    y1 = phase1 @ u  # n × R: the releases along the canary's direction
    est = y1.T @ y1 / noise_runs  # the mean is 0 on the zero data set
    scale = float(np.trace(est)) / rel.rounds
    if not scale > 0:  # no variation at all (a reused key): the claim's scale
        scale = claimed_std ** 2 * float(np.trace(rel.cov)) / rel.rounds
    est_inv = np.linalg.inv(est + RIDGE * scale * np.eye(rel.rounds))
    info_est = np.einsum("pr,rs,ps->p", footprints, est_inv, footprints)
    best = int(np.argmax(info_est))  # the canary's pattern, fixed before phase 2
    pattern, a = patterns[best], footprints[best]

    # phase 2: D and D' with new independent keys, the canary at its pattern
    seeds = _run_seeds(2 * runs, seed, reuse_seed)
    uses = frozenset(pattern)
    pos_rel, std_pos = _execute_all(execute, +1, seeds[0::2], uses)
    neg_rel, std_neg = _execute_all(execute, -1, seeds[1::2], uses)
    ran_with = min(std1, std_pos, std_neg)
    y = np.stack([pos_rel @ u, neg_rel @ u])  # 2 × runs × R

    # the candidate tests: weights fixed before phase 2
    cov_inv = np.linalg.inv(rel.cov)
    info_claim = float(a @ cov_inv @ a)
    names = [ESTIMATED_LAW, CLAIMED_LAW]
    weights = [est_inv @ a, cov_inv @ a / (claimed_std * math.sqrt(info_claim))]
    for r in np.flatnonzero(a):
        names.append(f"release {int(r)}")
        weights.append(np.sign(a[r]) * np.eye(rel.rounds)[r])
    scores = y @ np.stack(weights, axis=1)  # 2 × runs × tests
    half = runs // 2
    alpha_bound = alpha / 2  # the other half of α is the law check's
    chosen = [_choose_threshold(scores[0, :half, k], scores[1, :half, k], delta, alpha_bound)
              for k in range(len(names))]
    k = int(np.argmax([eps for _, eps in chosen]))
    threshold = chosen[k][0]
    pos_eval, neg_eval = scores[0, half:, k], scores[1, half:, k]
    false_pos = int(np.sum(neg_eval >= threshold))
    false_neg = int(np.sum(pos_eval < threshold))
    bound = float(epsilon_from_counts(false_pos, false_neg, neg_eval.size, pos_eval.size,
                                      delta, alpha_bound))

    # the law check on phase 1, every coordinate, against the claimed covariance
    lam_min, lam_max, lower, upper = law_check(phase1, claimed_std ** 2 * rel.cov, alpha / 2)
    rejected = (lower > 0 and lam_min < lower) or lam_max > upper

    # the analytic check: the worst pattern's μ from B and the std the streams report
    info_worst = float(np.max(np.einsum("pr,rs,ps->p", footprints, cov_inv, footprints)))
    mu = 2.0 * shift * math.sqrt(info_worst) / ran_with if ran_with > 0 else math.inf
    mu_canary = 2.0 * shift * math.sqrt(info_claim) / ran_with if ran_with > 0 else math.inf
    mu_est = 2.0 * shift * math.sqrt(float(info_est[best]))  # h²·aᵀΣ̂⁻¹a under the estimate
    # the claimed-law scores' fit (N(±μ/2, 1) under the claim)
    claimed = scores[:, :, 1]
    spread = float(math.sqrt((np.var(claimed[0], ddof=1) + np.var(claimed[1], ddof=1)) / 2))
    shift_hat = float(np.mean(claimed[0]) - np.mean(claimed[1]))
    mu_hat = shift_hat / spread if spread > 0 else (math.inf if shift_hat > 0 else 0.0)
    return AuditResult(
        mechanism=mechanism, variant=variant, steps=steps, tau=tau, dim=dim,
        epsilon=float(epsilon), delta=float(delta), method=method, runs=runs,
        alpha=float(alpha), canary_step=pattern[0], noise_std=float(claimed_std),
        noise_std_run=float(ran_with),
        noise_scale=float(noise_scale), reused_seed=bool(reuse_seed), mu=mu,
        epsilon_analytic=gaussian_epsilon(mu, delta),
        epsilon_lower_bound=max(0.0, bound), threshold=threshold,
        false_positives=false_pos, false_negatives=false_neg,
        evaluation_runs=int(pos_eval.size), mu_empirical=mu_hat, score_std=spread,
        epsilon_gaussian_fit=gaussian_epsilon(mu_hat, delta),
        seconds=time.perf_counter() - started, epochs=int(epochs),
        accounted_epochs=declared.max_participations if declared.fixed_epoch else 1,
        min_sep=None if min_sep is None and max_participations is None else sep,
        max_participations=None if min_sep is None and max_participations is None
        else uses_count,
        participation=declared.describe(), canary_uses=tuple(int(s) for s in pattern),
        zero_noise_step=run.zero_noise_step, dtype=dtype, front_end=front_end,
        noise_runs=noise_runs, test=names[k], mu_estimated=mu_est,
        epsilon_estimated=gaussian_epsilon(mu_est, delta), mu_canary=mu_canary,
        law_min_eigenvalue=lam_min, law_max_eigenvalue=lam_max, law_lower_edge=lower,
        law_upper_edge=upper, law_rejected=bool(rejected),
    )
