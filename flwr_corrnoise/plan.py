"""A plan before the run: will these settings leave any signal?

Everything a user chooses (model size ``d``, examples per learner, batch size ``b``,
epochs, learners averaged per round ``m``, mechanism, ``(ε, δ)``, clip norm ``B_g``) fixes
the noise before a single gradient is computed, so the library can say *before* the run
whether the noise will drown the signal. The figures, for the per-step front ends
(:class:`~flwr_corrnoise.torch.PrivateOptimizer`: per-example clipping, the clipped sum plus
the increment divided by ``b``):

* ``N = epochs × ⌈examples / b⌉`` steps, the fixed-epoch participation of a cyclic loader
  (:class:`~flwr_corrnoise.data.loader.CyclicLoader`), and the calibrated std ``V``
  (:meth:`~flwr_corrnoise.settings.PrivacySettings.calibration`);
* the **noise** in the model after ``k`` steps, per unit learning rate: the prefix-sum noise
  ``V·‖b_k‖/b`` per coordinate (``b_k`` the row of ``B``), ``√d`` times that in norm, and
  ``1/√m`` of it once ``m`` learners' independent noises are averaged;
* the **signal** after ``k`` steps, per unit learning rate: at most ``k·B_g`` — every
  example's clipped gradient at the clip norm and all pointing the same way. This is an
  *upper bound* on the signal (real gradients disagree), so the ratio below is optimistic:
  when it says "noise dominates", it does. ``signal`` (the measured ratio of the mean
  clipped gradient's norm to ``B_g``, ``≤ 1``) scales it down to a realistic figure.
* the **noise-to-signal ratio** ``NSR(k) = V·‖b_k‖·√d / (b·√m·k·B_g)`` at the end of the
  first round and at the end of the run. ``B_g`` cancels (``V ∝ B_g``).

Two more terms (issue 32), each a closed form the tests check:

* **momentum** ``β`` (heavy ball, ``v ← β·v + u; x ← x − η·v``, torch's SGD): after ``k``
  steps the model holds ``Σ_t w_t·u_t`` with ``w_t = (1 − β^{k−t+1})/(1 − β)``. The signal
  bound becomes ``B_g·Σ_t w_t``, the noise ``V·‖Σ_t (w_t − w_{t+1})·b_t‖`` (the increments'
  noise is ``V·C⁻¹ξ = V·A⁻¹Bξ``, and ``A⁻¹`` takes differences), and the safe learning
  rate divides by the same weights: a momentum of 0.9 amplifies the accumulated noise up to
  ten-fold. ``β = 0`` is the sum above.
* **adaptive clipping** (``adaptive_quantile``, :mod:`~flwr_corrnoise.adaptive_clipping`):
  the calibration includes the noised clip counts (the gradient noise at unit clip grows
  by ``1/√(1 − share)``), and ``B_g`` still cancels (the noise moves with ``C_t``).

The verdict reads the end-of-run NSR: ``< 0.15`` signal dominates, ``< 1`` noisy, ``< 20``
noise dominates (little learning), else no learning — thresholds set against measured runs
with a *measured* signal (docs/results-plan-check.md). The signal term is either measured
(:func:`estimate_signal`: from a local, never-released sample of the learner's clipped
gradients before training, ``‖E clip(g)‖ / B_g``: what clipping leaves of the norms times
how well the directions agree) or, as the fallback, the upper bound ``1`` — a verdict the
plan labels optimistic. The levers (double the
batch, the learners or ε; halve the epochs; another mechanism) are ranked by the NSR each
would give, recomputed by the same code. ``safe_learning_rate`` is the step size at which
the model's accumulated noise has per-coordinate std ``0.1`` at its largest (a scale at
which weights of a usual network are already swamped): a larger step size blows the
model up, which is what the per-step helpers warn about.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .adaptive_clipping import AdaptiveClipping
from .mechanisms import build_factorization
from .mechanisms.participation import Participation
from .settings import PrivacySettings, check_delta_for

#: model-noise per-coordinate std above which training is swamped (safe_learning_rate)
SAFE_MODEL_NOISE = 0.1
#: the horizon up to which :func:`momentum_rows` materializes ``B`` (N × N floats)
MOMENTUM_EXACT_STEPS = 4096
#: where the noise is added (:attr:`PlanInput.mode`)
PLAN_MODES = ("step", "round", "central")
#: the end-of-run noise-to-signal from which a run is expected not to learn (the verdict
#: "noise dominates: expect no learning"; the servers warn before round 1)
NO_LEARNING_NSR = 20.0
#: the verdict's thresholds on the end-of-run noise-to-signal, recalibrated (issue 32)
#: against the measured runs of docs/results-plan-check.md with the *measured* signal term:
#: the runs at ≤ 0.12 lost ≤ 1 point beyond clipping's own cost, those at 0.16–0.36 lost
#: 3–11 points, the one at 1.7 was near chance; Flower's quickstart per-round and central
#: runs (no learning) are in the hundreds
SIGNAL_DOMINATES_NSR = 0.15
NOISY_NSR = 1.0
VERDICTS = ((SIGNAL_DOMINATES_NSR,
             "signal dominates: expect accuracy close to the noiseless run with clipping"),
            (NOISY_NSR, "noisy: expect clearly lower accuracy than without noise"),
            (NO_LEARNING_NSR,
             "noise dominates: expect little learning, tune the levers below"),
            (math.inf, "noise dominates: expect no learning"))


@dataclass(frozen=True)
class PlanInput:
    """What the user chooses (``epochs``: passes over each learner's data in the whole
    run, i.e. rounds × local epochs; ``learners``: replies averaged per round)."""

    model_size: int
    examples: int
    batch_size: int
    epochs: int
    learners: int = 1
    mechanism: str = "blt"
    epsilon: float = 2.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    method: str = "exact"
    rounds: int = 1
    learning_rate: float | None = None
    #: ‖mean clipped gradient‖ / clip norm, in (0, 1]: 1 (the default) counts every
    #: gradient at the clip norm, all aligned — an upper bound; measure it on a noiseless
    #: step of your model for a realistic figure
    signal: float = 1.0
    #: where ``signal`` came from, as the plan prints it (:attr:`SignalEstimate.basis`);
    #: ``None``: the upper bound (``signal = 1``) or a figure the caller stated
    signal_basis: str | None = None
    #: where the noise is added: ``step`` (every local step, per-example clipping),
    #: ``round`` (the learner's round update, :class:`~flwr_corrnoise.flower.
    #: CorrNoiseRoundMod`) or ``central`` (the server, on the average of the clipped round
    #: updates). For ``round`` and ``central`` the app trains on its local data every
    #: round (a datum is in every one of the ``rounds`` updates), the clip norm bounds a
    #: round update and ``examples``, ``batch_size`` and ``epochs`` do not enter the noise
    mode: str = "step"
    #: ``round``/``central``: the rounds a datum is in (default: every round)
    round_participation: Participation | None = None
    #: the local optimizer's (heavy-ball) momentum ``β`` in [0, 1): torch's
    #: ``SGD(momentum=β)``, Flower's quickstart 0.9
    momentum: float = 0.0
    #: adaptive clipping's quantile (``adaptive-clip-quantile``; ``None``: a fixed clip
    #: norm) and its count noise ``σ_b`` (``None``: the default share of the budget)
    adaptive_quantile: float | None = None
    adaptive_noise: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in PLAN_MODES:
            raise ValueError(f"plan: mode must be one of {PLAN_MODES}, got {self.mode!r}")
        if not 0.0 < float(self.signal) <= 1.0:
            raise ValueError(f"plan: signal must be in (0, 1], got {self.signal!r}")
        for name in ("model_size", "examples", "batch_size", "epochs", "learners", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"plan: {name} must be a positive integer, got {value!r}")
        if self.batch_size > self.examples:
            raise ValueError(f"plan: batch size {self.batch_size} exceeds the "
                             f"{self.examples} examples")
        if not 0.0 <= float(self.momentum) < 1.0:
            raise ValueError(f"plan: momentum must be in [0, 1), got {self.momentum!r}")
        if self.adaptive_quantile is not None and self.mode == "central":
            raise ValueError("plan: adaptive clipping is a learner's (local DP) setting; "
                             "central DP clips to a fixed norm")
        if self.mode == "step":  # round/central plans carry no data size (examples = 1)
            check_delta_for(self.delta, self.examples, " per learner")

    @property
    def signal_kind(self) -> str:
        """``"measured"`` (:class:`SignalEstimate`), ``"stated"`` (a figure given) or
        ``"upper-bound"`` (``signal = 1``, the fallback)."""
        if self.signal_basis is not None:
            return "measured"
        return "upper-bound" if self.signal == 1.0 else "stated"

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.examples // self.batch_size)

    @property
    def horizon(self) -> int:
        if self.mode != "step":
            return self.rounds
        return self.epochs * self.steps_per_epoch

    def settings(self) -> PrivacySettings:
        adaptive = (None if self.adaptive_quantile is None else
                    AdaptiveClipping(self.adaptive_quantile, noise=self.adaptive_noise))
        if self.mode != "step":  # the round update: every datum in every round's update
            return PrivacySettings(mechanism=self.mechanism, epsilon=self.epsilon,
                                   delta=self.delta, clip_norm=self.clip_norm,
                                   horizon=self.rounds, method=self.method,
                                   participation=self.round_participation
                                   or Participation.every_step(self.rounds),
                                   adaptive=adaptive)
        participation = (Participation.epochs(self.epochs, self.steps_per_epoch)
                         if self.epochs > 1 else Participation.once())
        return PrivacySettings(mechanism=self.mechanism, epsilon=self.epsilon,
                               delta=self.delta, clip_norm=self.clip_norm,
                               horizon=self.horizon, method=self.method,
                               participation=participation, adaptive=adaptive)


@dataclass(frozen=True)
class Plan:
    """The figures of :func:`make_plan` (see the module docstring)."""

    inputs: PlanInput
    horizon: int
    participation: str
    sensitivity: float
    sensitivity_exact: bool
    std: float
    noise_multiplier: float
    nsr_first_round: float
    nsr_final: float
    safe_learning_rate: float
    verdict: str
    levers: list[tuple[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["inputs"] = asdict(self.inputs)
        return out


def noise_to_signal(inputs: PlanInput) -> tuple[PrivacySettings, float, float, float]:
    """``(settings, NSR after the first round, NSR at the end, safe learning rate)``."""
    settings = inputs.settings()
    cal = settings.calibration()
    assert cal is not None
    n = settings.horizon
    first = max(1, min(n, n // inputs.rounds))
    beta = float(inputs.momentum)
    if beta == 0.0:
        rows = np.sqrt(settings.factorization().row_errors())  # ‖b_k‖, k = 1..N
        signal = np.arange(1.0, n + 1)  # Σ_t w_t = k
    else:
        rows, signal = momentum_rows(settings, beta)
    if inputs.mode == "step":  # the noised sum of b clipped gradients, divided by b
        divisor = inputs.batch_size * math.sqrt(inputs.learners)
    elif inputs.mode == "round":  # each learner's own noise, averaged over m
        divisor = math.sqrt(inputs.learners)
    else:  # central: one noise on the average of m updates, std V/m
        divisor = float(inputs.learners)
    # B_g cancels: V ∝ the calibration's clip norm (1 under adaptive clipping, whose noise
    # is added at unit clip and moves with C_t)
    scale = cal.std * math.sqrt(inputs.model_size) / (
        divisor * cal.clip_norm * inputs.signal)
    nsr_first = scale * rows[first - 1] / signal[first - 1]
    nsr_final = scale * rows[n - 1] / signal[n - 1]
    safe_lr = (safe_learning_rate(settings, inputs.batch_size, inputs.learners, beta)
               if inputs.mode == "step" else math.inf)
    return settings, float(nsr_first), float(nsr_final), float(safe_lr)


def momentum_rows(settings: PrivacySettings, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(‖Σ_t (w_t − w_{t+1})·b_t‖, Σ_t w_t)`` for ``k = 1..N`` under heavy-ball momentum
    ``β`` (module docstring): the model's noise per unit ``V`` and its signal bound per unit
    ``B_g`` after ``k`` steps. Materializes ``B`` (``N × N``).

    ``w_t − w_{t+1} = β^{k−t}`` (and ``w_k = 1``), so the noise vector after ``k`` steps is
    ``z_k = Σ_{t≤k} β^{k−t}·b_t = β·z_{k−1} + b_k``: one pass over the rows, ``O(N²)``
    (the quickstart's 2250 steps in well under a second), and
    ``Σ_t w_t = (k − β(1 − β^k)/(1 − β)) / (1 − β)``. Above :data:`MOMENTUM_EXACT_STEPS`
    steps ``B`` is not materialized and the noise is the triangle-inequality bound
    ``Σ_t β^{k−t}·‖b_t‖`` (from the row errors alone): pessimistic, never optimistic."""
    n = settings.horizon
    noise = np.empty(n)
    if n > MOMENTUM_EXACT_STEPS:  # B would not fit: ‖z_k‖ ≤ Σ β^{k−t}·‖b_t‖ (a bound)
        rows = np.sqrt(settings.factorization().row_errors())
        acc = 0.0
        for k in range(n):
            acc = beta * acc + float(rows[k])
            noise[k] = acc
    else:
        B, _ = settings.factorization().matrices()
        z = np.zeros(B.shape[1])
        for k in range(n):
            z *= beta
            z += B[k]
            noise[k] = float(np.linalg.norm(z))
    k = np.arange(1.0, n + 1)
    signal = (k - beta * (1.0 - beta ** k) / (1.0 - beta)) / (1.0 - beta)
    return noise, signal


def safe_learning_rate(settings: PrivacySettings, batch_size: int, learners: int = 1,
                       momentum: float = 0.0) -> float:
    """The step size at which the model's accumulated noise peaks at per-coordinate std
    :data:`SAFE_MODEL_NOISE` (``∞`` without noise): what the per-step helpers warn above
    (with ``momentum``, the heavy-ball weights of :func:`momentum_rows`; the noise is per
    unit clip norm of the calibration)."""
    cal = settings.calibration()
    if cal is None:
        return math.inf
    peak = (float(np.max(momentum_rows(settings, momentum)[0])) if momentum else
            float(np.sqrt(np.max(settings.factorization().row_errors()))))
    if settings.adaptive is not None:  # noise at unit clip × C_t, C_t at its initial value
        peak *= settings.clip_norm
    return SAFE_MODEL_NOISE * batch_size * math.sqrt(learners) / (cal.std * peak)


def verdict(nsr: float) -> str:
    return next(text for limit, text in VERDICTS if nsr < limit)


@dataclass(frozen=True)
class SignalEstimate:
    """A measured signal term for :attr:`PlanInput.signal`: the norm of the *expected*
    clipped gradient over the clip norm, ``‖E[clip(g)]‖ / B_g``, from a local sample of
    per-example gradients (or of round updates, for the per-round and central modes).

    Computed on the learner, before training, on its own data; **nothing of it is
    released** — it only sets what the plan prints locally. Its parts:
    ``norm_fraction = mean_i min(‖g_i‖, B_g) / B_g`` (what clipping leaves of the norms)
    and ``alignment = fraction / norm_fraction`` (how much of that survives averaging the
    directions; ``None`` when only norms were given, counted as 1: aligned)."""

    fraction: float
    norm_fraction: float
    alignment: float | None
    examples: int

    @property
    def basis(self) -> str:
        """How the plan labels the signal it used."""
        if self.alignment is None:
            return (f"measured on {self.examples} gradient norms (directions assumed "
                    "aligned: still an upper bound)")
        return (f"measured on {self.examples} gradients (norm fraction "
                f"{self.norm_fraction:.3g} × alignment {self.alignment:.3g})")


def estimate_signal(clipped_sum: np.ndarray, clipped_norms: np.ndarray,
                    clip_norm: float) -> SignalEstimate:
    """The signal term from the sufficient statistics of ``n`` clipped gradients
    ``c_i = g_i·min(1, B_g/‖g_i‖)``: their sum ``S`` and their norms ``‖c_i‖``.

    Why not ``‖S/n‖``: the mean of a sample is longer than the mean of the distribution —
    ``E‖S/n‖² = ‖μ‖² + tr(Σ)/n`` — so gradients that disagree would still look aligned
    on a small sample. ``Σ_{i≠j} c_i·c_j = ‖S‖² − Σ_i ‖c_i‖²`` has expectation
    ``n(n−1)·‖μ‖²`` (independent examples), the unbiased estimate used here. When it is
    not positive, the sample cannot tell the mean gradient from zero: an error, since no
    figure would be honest (measure more examples, or plan with the upper bound)."""
    norms = np.asarray(clipped_norms, dtype=float).ravel()
    n = norms.size
    b = float(clip_norm)
    if not (math.isfinite(b) and b > 0):
        raise ValueError(f"signal: clip norm must be positive, got {clip_norm!r}")
    if n < 2:
        raise ValueError(f"signal: need at least 2 gradients, got {n}")
    if not np.all(np.isfinite(norms)) or np.any(norms < 0) or np.any(norms > b * (1 + 1e-9)):
        raise ValueError("signal: clipped norms must be finite, in [0, clip norm]")
    total = float(np.sum(np.asarray(clipped_sum, dtype=float) ** 2))
    if not math.isfinite(total):
        raise ValueError("signal: the clipped sum is not finite")
    cross = (total - float(np.sum(norms ** 2))) / (n * (n - 1))  # ≈ ‖E c‖²
    norm_fraction = float(np.mean(norms)) / b
    if cross <= 0.0 or norm_fraction == 0.0:
        raise ValueError(
            f"signal: in these {n} examples the mean clipped gradient cannot be told from "
            "zero; measure more examples, or plan with the upper bound (signal 1)")
    fraction = min(1.0, math.sqrt(cross) / b)
    return SignalEstimate(fraction=fraction, norm_fraction=norm_fraction,
                          alignment=min(1.0, fraction / norm_fraction), examples=n)


def signal_from_gradients(gradients: np.ndarray, clip_norm: float) -> SignalEstimate:
    """:func:`estimate_signal` from per-example gradients (or round updates), one a row
    (``n × d``), clipped here at ``clip_norm``."""
    g = np.asarray(gradients, dtype=float)
    if g.ndim != 2:
        raise ValueError(f"signal: gradients must be n × d, got shape {g.shape}")
    norms = np.linalg.norm(g, axis=1)
    if not np.all(np.isfinite(norms)):
        raise ValueError("signal: a gradient is not finite")
    factor = np.minimum(1.0, float(clip_norm) / np.maximum(norms, np.finfo(float).tiny))
    return estimate_signal((g * factor[:, None]).sum(axis=0), norms * factor, clip_norm)


def signal_from_norms(norms: np.ndarray, clip_norm: float) -> SignalEstimate:
    """The signal term from per-example gradient *norms* only: clipping's share
    ``mean min(‖g_i‖, B_g) / B_g``, the directions assumed aligned (an upper bound that
    still counts what clipping removes)."""
    raw = np.asarray(norms, dtype=float).ravel()
    b = float(clip_norm)
    if raw.size < 1 or not np.all(np.isfinite(raw)) or np.any(raw < 0):
        raise ValueError("signal: norms must be a non-empty list of finite values ≥ 0")
    if not (math.isfinite(b) and b > 0):
        raise ValueError(f"signal: clip norm must be positive, got {clip_norm!r}")
    frac = float(np.mean(np.minimum(raw, b))) / b
    if frac == 0.0:
        raise ValueError("signal: every gradient norm is 0")
    return SignalEstimate(fraction=frac, norm_fraction=frac, alignment=None,
                          examples=int(raw.size))


def read_signal_sample(path: str, clip_norm: float) -> SignalEstimate:
    """The CLI's ``--grad-norm-sample FILE``: a ``.npy`` array or a text file (one value
    or one row a line, commas or spaces): one column is gradient norms
    (:func:`signal_from_norms`), more are per-example gradients
    (:func:`signal_from_gradients`)."""
    try:
        if str(path).endswith(".npy"):
            data = np.load(path, allow_pickle=False)
        else:
            text = Path(path).read_text().replace(",", " ")
            data = np.loadtxt(io.StringIO(text), ndmin=2)
    except (OSError, ValueError) as exc:
        raise ValueError(f"signal: cannot read {path}: {exc}") from exc
    data = np.asarray(data, dtype=float)
    if data.ndim == 1 or (data.ndim == 2 and data.shape[1] == 1):
        return signal_from_norms(data.ravel(), clip_norm)
    return signal_from_gradients(data, clip_norm)


def make_plan(inputs: PlanInput, *, levers: bool = True) -> Plan:
    """The plan for ``inputs``; with ``levers``, the alternatives ranked by end-of-run NSR."""
    settings, nsr_first, nsr_final, safe_lr = noise_to_signal(inputs)
    cal = settings.calibration()
    assert cal is not None
    ranked: list[tuple[str, float]] = []
    if levers:
        options: list[tuple[str, PlanInput]] = []
        if inputs.mode == "step" and inputs.batch_size * 2 <= inputs.examples:
            options.append((f"batch size {inputs.batch_size} → {inputs.batch_size * 2}",
                            replace(inputs, batch_size=inputs.batch_size * 2)))
        options.append((f"learners per round {inputs.learners} → {inputs.learners * 2}",
                        replace(inputs, learners=inputs.learners * 2)))
        options.append((f"ε {inputs.epsilon:g} → {inputs.epsilon * 2:g}",
                        replace(inputs, epsilon=inputs.epsilon * 2)))
        if inputs.mode == "step" and inputs.epochs >= 2:
            options.append((f"epochs {inputs.epochs} → {inputs.epochs // 2}",
                            replace(inputs, epochs=inputs.epochs // 2)))
        for other in ("blt", "independent", "toeplitz"):
            if other != inputs.mechanism:
                options.append((f"mechanism {inputs.mechanism} → {other}",
                                replace(inputs, mechanism=other)))
        for label, alt in options:
            ranked.append((label, noise_to_signal(alt)[2]))
        ranked.sort(key=lambda item: item[1])
    return Plan(inputs=inputs, horizon=settings.horizon,
                participation=settings.participation.describe(),
                sensitivity=cal.sensitivity, sensitivity_exact=cal.sensitivity_exact,
                std=cal.std, noise_multiplier=cal.noise_multiplier,
                nsr_first_round=nsr_first, nsr_final=nsr_final, safe_learning_rate=safe_lr,
                verdict=verdict(nsr_final), levers=ranked)


def with_signal(inputs: PlanInput, estimate: SignalEstimate) -> PlanInput:
    """``inputs`` with the measured signal term (its fraction and how it was measured)."""
    return replace(inputs, signal=estimate.fraction, signal_basis=estimate.basis)


def signal_label(inputs: PlanInput) -> str:
    """Which signal the figures used: the upper bound, a stated fraction or a measured
    one (:class:`SignalEstimate`)."""
    if inputs.signal_kind == "measured":
        return f"fraction {inputs.signal:.3g}, {inputs.signal_basis}"
    if inputs.signal_kind == "upper-bound":
        return ("at its upper bound (every gradient at the clip norm, all aligned): the "
                "verdict is optimistic; measure it (plan --grad-norm-sample, "
                "flwr_corrnoise.torch.measure_signal)")
    return f"fraction {inputs.signal:g} (as stated)"


def format_plan(plan: Plan) -> str:
    """The plan as the CLI prints it (and the learner logs it)."""
    i = plan.inputs
    lines = [
        f"plan: {i.mechanism}, ε = {i.epsilon:g}, δ = {i.delta:g}, clip norm {i.clip_norm:g}; "
        f"d = {i.model_size}, "
        + (f"{i.examples} examples per learner, batch {i.batch_size}, {i.epochs} epoch(s), "
           if i.mode == "step" else "")
        + f"{i.learners} learner(s) averaged per round",
        (f"  horizon: {plan.horizon} steps ({i.epochs} × {i.steps_per_epoch}); "
         if i.mode == "step" else
         f"  noise on the {'round update' if i.mode == 'round' else 'server average'}; "
         f"horizon: {plan.horizon} rounds; ") + f"participation: {plan.participation}",
        f"  sensitivity {plan.sensitivity:.4g} "
        f"({'exact' if plan.sensitivity_exact else 'certified bound'}), "
        f"noise std V = {plan.std:.4g} (noise multiplier {plan.noise_multiplier:.3g})",
        f"  noise-to-signal of the averaged update: {plan.nsr_first_round:.3g} after the first "
        f"round, {plan.nsr_final:.3g} at the end",
        f"  signal: {signal_label(i)}",
        f"  verdict: {plan.verdict} ({i.signal_kind} signal"
        + (", optimistic" if i.signal_kind == "upper-bound" else "") + ")",
    ]
    if math.isfinite(plan.safe_learning_rate):
        lines.append(f"  safe learning rate ≤ {plan.safe_learning_rate:.3g} (model noise std ≤ "
                     f"{SAFE_MODEL_NOISE:g} per coordinate)")
    if i.learning_rate is not None and i.learning_rate > plan.safe_learning_rate:
        lines.append(f"  WARNING: learning rate {i.learning_rate:g} exceeds it: the noise "
                     "will blow the model up")
    if plan.levers:
        lines.append("  levers, best first (end-of-run noise-to-signal):")
        lines += [f"    {label}: {nsr:.3g}" for label, nsr in plan.levers]
    return "\n".join(lines)


def round_plan(mode: str, settings: PrivacySettings, model_size: int,
               learners: int) -> Plan | None:
    """The plan of a round-level mode (``round``: the per-round mod, ``central``) for
    ``settings`` (its horizon in rounds) at this model size and number of learners averaged
    per round (the signal at its upper bound: the server has no data); ``None`` without
    noise."""
    if not settings.private:
        return None
    return make_plan(PlanInput(
        model_size=max(1, int(model_size)), examples=1, batch_size=1, epochs=1,
        learners=max(1, int(learners)), mechanism=settings.mechanism,
        epsilon=settings.epsilon, delta=settings.delta, clip_norm=settings.clip_norm,
        method=settings.method, rounds=settings.horizon, mode=mode,
        round_participation=settings.participation))


def summary_line(plan: Plan) -> str:
    """The plan in one line, for a server's start-up summary."""
    i = plan.inputs
    return (f"plan (d = {i.model_size}, {i.learners} learner(s) averaged per round): "
            f"noise-to-signal {plan.nsr_first_round:.3g} after the first round, "
            f"{plan.nsr_final:.3g} at the end → {plan.verdict} ({i.signal_kind} signal"
            + (", optimistic" if i.signal_kind == "upper-bound" else "") + ")")


def plan_warning(plan: Plan | None) -> str | None:
    """The servers' check before round 1 for the round-level modes: a loud warning text
    if their :func:`round_plan` says the run cannot learn (end-of-run noise-to-signal ≥
    :data:`NO_LEARNING_NSR`, even at the upper-bound signal); ``None`` otherwise. Why the
    servers ask: the per-round and central runs of Flower's quickstart (d = 62k, 2
    learners) destroyed the model without a word."""
    if plan is None or plan.nsr_final < NO_LEARNING_NSR:
        return None
    return ("flwr-corrnoise: this run is not expected to learn — " + format_plan(plan)
            + "\n  (the noise is calibrated for the whole run; the levers above are what "
            "would change that)")


@dataclass(frozen=True)
class LoopChoice:
    """:func:`choose_loop`'s answer: the loop and mechanism with the smallest prefix-sum
    noise RMSE (× clip norm, per coordinate), every candidate's figure, and why."""

    best: str
    rmse: dict[str, float]
    bands: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the candidates :func:`choose_loop` compares
FIXED_ORDER_BLT, AMPLIFIED_BANDMF, DP_SGD = ("fixed-order blt", "amplified bandmf",
                                             "dp-sgd (poisson, bandmf at 1 band)")


def choose_loop(epsilon: float, delta: float, steps_per_epoch: int, epochs: int,
                candidates: Iterable[int] | None = None) -> LoopChoice:
    """Which loop to run at ``(ε, δ)`` (replace-one) for ``epochs`` passes of
    ``steps_per_epoch`` steps: a fixed cyclic order with BLT calibrated to its fixed-epoch
    sensitivity (:class:`~flwr_corrnoise.data.loader.CyclicLoader`), cyclic Poisson
    sampling with BandMF at the bands
    :func:`~flwr_corrnoise.amplification.choose_bands` picks, or Poisson sampling with
    independent noise (``bands = 1``: DP-SGD) — by the prefix-sum noise RMSE each gives
    (``σ``-scaled ``√mean‖b_t‖²``, the same division by the batch for all; one learner in
    one round, where choose_bands' iterate error is this RMSE). Wider bands must beat
    DP-SGD by choose_bands' margin (``MIN_GAIN``, 10 %): at a 3 % predicted gain two bands
    trained worse (docs/results-multi-epoch.md). A proxy: it leaves out the batch-size
    variance of sampling (docs/results-multi-epoch.md compares trained models)."""
    from .amplification import choose_bands
    from .privacy import calibrate_factorization

    s, k = int(steps_per_epoch), int(epochs)
    n = s * k
    best, table = choose_bands(epsilon, delta, n, s, candidates=candidates)
    one = next((c for c in table if c.bands == 1), None) or \
        choose_bands(epsilon, delta, n, s, candidates=[1])[0]
    part = Participation.epochs(k, s) if k > 1 else Participation()

    blt = build_factorization("blt", n, **({"min_sep": s, "max_participations": k}
                                           if k > 1 else {}))
    cal = calibrate_factorization(blt, epsilon, delta, 1.0, "exact", part)
    rmse = {FIXED_ORDER_BLT: cal.std * float(np.sqrt(np.mean(blt.row_errors()))),
            AMPLIFIED_BANDMF: best.rmse, DP_SGD: one.rmse}
    pick = min(rmse, key=lambda m: (rmse[m], m != DP_SGD))
    if pick == FIXED_ORDER_BLT:
        why = (f"at ε = {epsilon:g} with {s} steps per epoch, amplification by sampling "
               f"buys less than BLT's correlation over {k} fixed epochs")
    elif pick == DP_SGD or best.bands == 1:
        pick = DP_SGD
        why = (f"at rate 1/{s} the amplification of one band beats every wider band: more "
               "bands mean a higher rate and less amplification")
    else:
        why = (f"{best.bands} bands at rate {best.sampling_rate:.4g}: correlation over "
               f"{best.bands} steps beats both the fixed order (no amplification) and "
               "independent noise")
    return LoopChoice(best=pick, rmse=rmse, bands=best.bands if pick != DP_SGD else 1,
                      reason=why)
