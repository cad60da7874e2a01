"""One learner's side of Zhang, Zhu, Fay and Johansson's Algorithm 1 ("Locally
Differentially Private Online Federated Learning With Correlated Noise"), independent of
any messaging layer: the private step and the local round, nothing else.

This module holds the **one private step** (:func:`private_step`: the horizon, a datum
without a gradient counted as zero, clipping, the stream's increment, the counters) and
the round built on it (:func:`local_round`), which every NumPy front end uses: the Flower
``NumPyClient`` subclass, the Message-API ``ClientApp`` helper,
:class:`~flwr_corrnoise.flower.PrivateSteps`, the per-round mod and the in-process sweep
engine; a sampled loop's step (:func:`private_sampled_steps`: per-example clipping, the
noised sum over the expected batch size) shares its horizon, datum and noise rules. The
torch device step (:class:`~flwr_corrnoise.torch.PrivateOptimizer`) keeps
its per-example clipping and noise add on the device and takes the rest from here (the
horizon rule :func:`check_horizon`, the refusals :func:`check_round`). The rest of the
learner lives by concern: its settings and their calibration in
:mod:`~flwr_corrnoise.settings`, its state and the state's one format in
:mod:`~flwr_corrnoise.learner_state`, the Flower config and the server's proposal (which
the learner refuses when it would weaken its settings) in
:mod:`~flwr_corrnoise.flower.config`, and the server step in
:mod:`~flwr_corrnoise.aggregation`.

Round ``r`` on learner ``i`` (Algorithm 1, lines 5–14)::

    z = x^r
    for t in 0..τ−1:
        g = clip(∇f(z; next datum), B_g)
        z = z − η (g + e[k]);  k += 1           # e[k]: the correlated-noise increment
    ĝ = (x^r − z) / (η τ) = (1/τ) Σ_t (g_t + e[k_t])

``ĝ`` is computed as the running mean on the right (the same number without the
cancellation of ``x^r − z``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import numpy as np

from .adaptive_clipping import AdaptiveClipState
from .learner_state import LearnerState
from .secure_noise import granularity, truncate_to_grid
from .settings import PrivacyConfigError, PrivacySettings, privacy_metrics
from .streams import HorizonExhaustedError, NoiseStream, split_flat

log = logging.getLogger(__name__)

#: gradient oracle: (parameters, stream position) → gradient on that datum, same shapes
GradientFn = Callable[[list[np.ndarray], int], Sequence[np.ndarray]]


class NonFiniteError(ValueError):
    """A gradient, loss or update is NaN or infinite; the step is not applied."""


#: a secure stream's clip norm is at most this many noise stds (the grid's exact range)
SECURE_CLIP_LIMIT = 2**20


# -- the one private step ---------------------------------------------------------------

def check_horizon(settings: PrivacySettings, taken: int, more: int = 1,
                  unit: str = "steps") -> None:
    """Refuse ``more`` steps (or rounds) after ``taken`` if they pass the horizon the
    noise is calibrated for. The one horizon rule: every front end asks it *before* it
    runs anything or releases anything, so a refusal is a function of the counters
    only (never of the data), and no increment past the calibration is ever drawn."""
    if settings.private and taken + more > settings.horizon:
        raise HorizonExhaustedError(
            f"this learner has taken {taken} of the {settings.horizon} {unit} its privacy "
            f"budget covers; {more} more would exceed it, so it stops contributing")



def check_rounds_left(state: LearnerState, settings: PrivacySettings) -> None:
    """Refuse a round past the declared uses (:attr:`PrivacySettings.max_rounds`): with
    ``data-reuse = "every-round"`` the ε counts one use of every datum per round for
    ``num-server-rounds`` rounds, and a server that runs more rounds while the horizon
    lasts would get them all (printed 2.00, true 3.17). A function of the counters only,
    asked before anything runs."""
    if settings.private and settings.max_rounds is not None \
            and state.rounds >= settings.max_rounds:
        raise HorizonExhaustedError(
            f"this learner has taken part in {state.rounds} rounds, all that its declared "
            f"data use covers (data-reuse = 'every-round' over {settings.max_rounds} "
            "rounds: each round uses every datum once more); another round would exceed "
            "the ε it reports, so it stops contributing")


def check_round(state: LearnerState, settings: PrivacySettings, size: int, more: int = 0,
                unit: str = "steps") -> None:
    """The data-independent refusals before a learner takes ``more`` steps on a model of
    ``size`` parameters: no stream for a private learner, the horizon
    (:func:`check_horizon`), a model of another size than the stream, a budget too large
    for a secure stream's grid. Asked before anything runs, so that none of them can
    happen mid-round, where the reply's kind would depend on the data."""
    if not settings.private:
        return
    noise = state.noise
    if noise is None:
        raise PrivacyConfigError("private learner has no noise stream")
    if more:
        check_horizon(settings, state.step, more, unit)
    if noise.dim != size:
        raise PrivacyConfigError(
            f"model has {size} parameters but the noise stream was created for {noise.dim}")
    if noise.secure and (1.0 if settings.adaptive else settings.clip_norm) \
            > SECURE_CLIP_LIMIT * noise.std:  # adaptive: the noised rows have norm ≤ 1
        # on the grid g ≥ V·2⁻³², |clipped + noise| must stay below 2⁵³·g ≥ 2²¹·V for the
        # release to be exact
        raise PrivacyConfigError(
            f"secure noise needs clip-norm ≤ 2^20 × noise std ({settings.clip_norm} > "
            f"{SECURE_CLIP_LIMIT} × {noise.std:.3g}): the budget is too large for its grid; "
            "set secure-noise = false")


@dataclass
class StepCounts:
    """A round's data-dependent counts: steps whose gradient was clipped, and those whose
    gradient counted as zero (:data:`NONFINITE`, :data:`FAILED`). **Local diagnostics
    only**, never released."""

    clipped: int = 0
    nonfinite: int = 0
    failed: int = 0
    #: why the last step's gradient counted as zero (``""``: it did not)
    last: str = ""

    def zeroed(self, why: str) -> None:
        """Count a step whose gradient counted as zero (``why`` from :func:`attempt_datum`;
        ``""``: none)."""
        self.last = why
        if why == NONFINITE:
            self.nonfinite += 1
        elif why == FAILED:
            self.failed += 1

    def diagnostics(self, steps: int) -> dict[str, float]:
        return {"clipped-steps": float(self.clipped), "nonfinite-steps": float(self.nonfinite),
                "failed-steps": float(self.failed), "local-steps": float(steps)}


class RoundMetrics(Mapping[str, float]):
    """:func:`privacy_metrics` of ``settings`` after ``steps`` steps, computed when first
    read and then kept (a read-only mapping).

    Why lazy: ε spent takes a float root and its exact (60-digit) check per new step count,
    ≈ 0.35 ms, and the in-process engines never read a round's metrics — computing them
    every round was ≈ 20 % of the Fig. 3 sweep's CPU (docs/benchmarks-history.md, issue 22). What
    is computed is fixed when the round ends (its settings and step count), not when it is
    read, so a later round of the same state changes nothing here."""

    __slots__ = ("_settings", "_steps", "_value")

    def __init__(self, settings: PrivacySettings, steps: int) -> None:
        self._settings, self._steps = settings, int(steps)
        self._value: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._value is None:
            self._value = privacy_metrics(self._settings, self._steps)
        return self._value

    def __getitem__(self, key: str) -> float:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return f"RoundMetrics({self._get()!r})"


@dataclass
class RoundResult:
    """What one local round produces."""

    update: list[np.ndarray]  # ĝ, same shapes as the parameters
    state: LearnerState  # the advanced state (the same object that was passed in)
    #: what may leave the learner: functions of its settings and counters only
    #: (:class:`RoundMetrics`, computed when read)
    metrics: Mapping[str, float] = field(default_factory=dict)
    #: data-dependent diagnostics (clipped steps, non-finite steps, loss): **never
    #: released**; the learner logs them and a deployed learner keeps them on disk
    diagnostics: dict[str, float] = field(default_factory=dict)


def clip_margin(size: int, release_dtype: Any = np.float64) -> float:
    """The relative margin below ``B_g`` that a gradient of ``size`` numbers is clipped to
    (here, in :func:`clip_by_global_norm`, and in the torch step's
    :func:`~flwr_corrnoise.torch.grad_sample.clip_factors`), so that the vector released —
    scaled, then rounded to ``release_dtype`` (a float32 stream releases in float32) — has
    an **exact** norm of at most ``B_g``, the sensitivity the accounting assumes.

    Why a margin: clipping to exactly ``B_g`` in floating point overshoots. The norm ``n̂``
    is a float64 sum of ``d`` squares (its error at most ``γ_d = d·u/(1 − d·u)`` of ``n²``
    in any summation order, ``u = 2⁻⁵³``; Higham, "Accuracy and Stability of Numerical
    Algorithms", §3.1), the factor ``B_g/n̂`` and each scaled coordinate are rounded once
    more, and a float32 release rounds every coordinate again (``u₃₂ = 2⁻²⁴``). Measured
    before this margin: 44 % of clipped float32 releases had a norm above ``B_g``, by up to
    ``10⁻⁷`` of it. Together these are at most ``(1 + d·u/2 + 4u)(1 + u_out)²`` (a float32
    step may round its factor and products in float32), so the margin
    ``3·u_out + (d + 8)·2u`` covers them with room: ``1.8·10⁻⁷`` for float32 at
    d = 10⁵ and ``2·10⁻¹¹`` for float64 — far below anything training can see, and no
    longer a sensitivity above the one ε is computed for. The bound needs the norm summed
    in float64 whatever the model's dtype (torch's float32 norms were off by up to
    ``4.5·10⁻⁴`` of the norm at d = 3·10⁶: no small margin covers that)."""
    finfo = release_dtype if hasattr(release_dtype, "eps") else np.finfo(np.dtype(release_dtype))
    u_out = float(finfo.eps) / 2  # a dtype, or a finfo (torch.finfo for a torch model)
    return 3.0 * u_out + (int(size) + 8) * 2.0**-52


def clip_target(bound: float, size: int, release_dtype: Any = np.float64) -> float:
    """The norm a vector of ``size`` numbers is scaled to when it is clipped to ``bound``:
    ``bound·(1 − clip_margin(size, release_dtype))`` — the one rule of every clip in the
    library (NumPy and torch steps, the decentralized tasks' projections and clips)."""
    return bound * (1.0 - clip_margin(size, release_dtype))


def clip_by_global_norm(g: np.ndarray, clip_norm: float,
                        release_dtype: Any = np.float64) -> tuple[np.ndarray, float]:
    """Scale ``g`` to norm at most ``clip_norm`` (over all parameters) — exactly, once
    rounded to ``release_dtype`` (:func:`clip_margin`); return it and its norm
    (:func:`row_norms`, the norm of the private step's clipping)."""
    norm = float(row_norms(np.reshape(np.asarray(g, dtype=np.float64), (1, -1)))[0])
    target = clip_target(clip_norm, np.size(g), release_dtype)
    if norm > target:
        g = g * (target / norm)
    return g, norm


#: the lanes of :func:`row_sums_of_squares`' order (``SUMSQ_LANES`` in ``noise_kernel.c``)
SUMSQ_LANES = 64


def row_norms(g: np.ndarray) -> np.ndarray:
    """The L2 norm of every row of the 2-D ``g``. Why one function: the private step clips
    ``L`` learners' rows at once, and a release clipped alone (:func:`clip_by_global_norm`)
    must be clipped by the same floats. Summed in float64 whatever ``g``'s dtype (the
    bound behind :func:`clip_margin`, which holds in any order; a float32 row's squares
    are exact in float64), in one defined order (:func:`row_sums_of_squares`), so that a
    learner with the compiled kernel and one without clip by the same floats."""
    return np.sqrt(row_sums_of_squares(g))


def row_sums_of_squares(g: np.ndarray) -> np.ndarray:
    """Each row's sum of squares in float64, in this order: :data:`SUMSQ_LANES` (64) lanes,
    lane ``l`` the running sum of the squares of elements ``l, l + 64, l + 128, …`` (as if
    the row were padded with zeros to a multiple of 64: a lane past its end adds nothing),
    then the lanes added left to right.

    Why this order: the compiled kernel (``cn_sumsq32``/``64``) runs it as vectorized
    float64 lanes straight from a float32 row, where NumPy's ``einsum`` first made a float64
    copy of it (at d = 10⁵, ≈ 16 µs a step against 60–78; docs/benchmarks.md, "Issue 34,
    tenth pass"). Without the kernel NumPy runs the same additions: its reduction down the
    middle axis of ``(rows, n/64, 64)`` adds the 64-wide blocks one after another into the
    64 sums, and ``cumsum`` adds the lanes one after another (a test checks both paths
    against a scalar reference of the order), in chunks of rows that keep its temporaries
    near 8 MB, at about einsum's speed."""
    g = np.asarray(g)
    if g.dtype not in (np.float32, np.float64):
        g = g.astype(np.float64)
    if g.ndim != 2:
        raise ValueError(f"rows of a 2-D array, not of shape {g.shape}")
    rows, n = g.shape
    out = np.empty(rows, dtype=np.float64)
    if not rows:
        return out
    if n <= SUMSQ_LANES and rows * n <= 256:  # a few short rows: each lane one square or
        for i, row in enumerate(g.tolist()):  # none, so the squares left to right, in
            total = 0.0  # Python's float64 (faster here than any array call)
            for v in row:
                total += v * v
            out[i] = total
        return out
    item = g.itemsize
    if n and _kernel_rows(g):
        from . import compiled_kernel

        dll = compiled_kernel.kernel()
        if dll is not None:
            fn = dll.cn_sumsq32 if item == 4 else dll.cn_sumsq64  # (ctypes caches it)
            fn(compiled_kernel.addr(g), rows, g.strides[0] // item, n,
               compiled_kernel.addr(out))
            return out
    lanes = SUMSQ_LANES
    body = n // lanes * lanes
    step = max(1, (1 << 20) // max(n, 1))
    for lo in range(0, rows, step):
        sq = np.square(g[lo:lo + step], dtype=np.float64)  # each element cast, then squared
        if n <= lanes:  # each lane one square or none: the squares left to right
            total = np.zeros(len(sq))
            for j in range(n):
                total += sq[:, j]
            out[lo:lo + step] = total
            continue
        blocks = body // lanes
        if blocks > 32:  # a reduction down the middle axis: block after block into the lanes
            acc = np.add.reduce(sq[:, :body].reshape(len(sq), blocks, lanes), axis=1)
        else:  # the same additions, a block at a time (NumPy's reduction is slow on few)
            acc = sq[:, :lanes].copy()
            for b in range(1, blocks):
                acc += sq[:, b * lanes:(b + 1) * lanes]
        if n > body:  # the last, partial block (0 + x is x: the same as not padded)
            acc[:, :n - body] += sq[:, body:]
        if len(acc) < lanes:  # the lanes left to right: cumsum adds them one by one
            out[lo:lo + step] = np.cumsum(acc, axis=1)[:, -1]
        else:  # the same additions over many rows at once (cumsum is slow across them)
            by_lane = np.ascontiguousarray(acc.T)
            total = by_lane[0].copy()
            for j in range(1, lanes):
                total += by_lane[j]
            out[lo:lo + step] = total
    return out


def _kernel_rows(g: np.ndarray) -> bool:
    """Whether the compiled kernel's row loops (``cn_sumsq``, ``cn_scale``) can take the
    2-D ``g`` in place: unit column stride, a non-negative row stride of whole elements,
    aligned."""
    item = g.itemsize
    return (g.strides[1] == item and g.strides[0] % item == 0 and g.strides[0] >= 0
            and g.flags.aligned)


def scale_rows(g: np.ndarray, factors: np.ndarray) -> np.ndarray:
    """Row ``i`` of ``g`` times ``factors[i]`` (float64), in place: each element widened to
    float64, multiplied, rounded back to ``g``'s dtype — what ``g[i] *= numpy.float64(f)``
    computes. A factor of exactly 1 leaves its row untouched (``x · 1`` is ``x``). Returns
    ``g``.

    Why a function: the clip scales a float32 row by a float64 factor (the rounding that
    :func:`clip_margin` bounds), and NumPy's masked
    ``g[over] *= (target / norms)[over][:, None]`` runs it through a copy and its buffered
    casting loop: 72 µs at 1 × 10⁵ float32, against 19 for the compiled kernel's same
    products (``cn_scale32``/``64``; ``benchmarks/clip_norms.py``, docs/benchmarks.md,
    "Issue 34, eleventh pass"). Without the kernel NumPy runs that masked multiply, the
    same floats (a test checks both paths against a scalar reference)."""
    factors = np.asarray(factors, dtype=np.float64)
    if g.ndim != 2 or factors.shape != (g.shape[0],):
        raise ValueError(f"one factor per row of a 2-D array, not {factors.shape} for "
                         f"{g.shape}")
    rows, n = g.shape
    item = g.itemsize
    if (g.dtype in (np.float32, np.float64) and rows and n and _kernel_rows(g)
            and g.flags.writeable):
        from . import compiled_kernel

        dll = compiled_kernel.kernel()
        if dll is not None:
            fn = dll.cn_scale32 if item == 4 else dll.cn_scale64
            factors = np.ascontiguousarray(factors)
            fn(compiled_kernel.addr(g), rows, g.strides[0] // item, n,
               compiled_kernel.addr(factors))
            return g
    over = factors != 1.0
    if over.any():  # float64 factors: each product in float64, then rounded to g's dtype
        g[over] *= factors[over][:, None]
    return g


def _flatten(arrays: Sequence[np.ndarray], dtype: Any = np.float64) -> np.ndarray:
    """The arrays as one flat vector of ``dtype`` (float64, or a float32 learner's float32:
    :func:`step_dtype`). One array of that dtype comes back as a view (no copy: at
    d = 10⁵ a copy per step was ≈ 2 % of a learner's message); both callers copy it
    before anything writes to it (into the step's gradient rows, into the local models)."""
    if isinstance(arrays, (list, tuple)) and len(arrays) == 1:
        return np.asarray(arrays[0], dtype=dtype).ravel()
    return np.concatenate([np.asarray(a, dtype=dtype).ravel() for a in arrays])


def step_dtype(states: Sequence[LearnerState], settings: PrivacySettings,
               params: Sequence[Any]) -> np.dtype:
    """The dtype a round's arithmetic runs in: float32 for a float32 model (every array of
    ``params``) whose learners all have float32 streams, float64 otherwise (a float64
    model — even one whose stream began in float32 —, float64 or secure streams, the
    noiseless baseline).

    Why: a float32 stream releases in float32 anyway (``float32(clip(g)) + e``), so the
    local models, gradients and round sums in float64 bought nothing but twice the memory
    traffic and a conversion each way — a fifth of a float32 learner's message at
    d = 10⁵ — and handed the user's gradient code float64 parameters for a float32
    model. The clip stays exact either way: norms are summed in float64 and the margin is
    the release dtype's (:func:`clip_margin`)."""
    f32 = np.dtype(np.float32)
    if settings.private and states and all(
            getattr(s.noise, "noise_dtype", None) == f32 for s in states) and all(
            getattr(p, "dtype", None) == f32 for p in params):
        return f32
    return np.dtype(np.float64)


# -- a datum whose gradient cannot be computed: the one rule every front end applies -------

_T = TypeVar("_T")

#: why a step's gradient counted as zero (local diagnostics only): a non-finite value
#: (or a :class:`NonFiniteError` from the user's code), or a failure (an exception, a
#: gradient of the wrong size)
NONFINITE, FAILED = "nonfinite", "failed"

#: refusals that are functions of the configuration, the state and the server's message —
#: not of a datum — and so keep their error reply even when raised inside the user's code
_NOT_DATA_ERRORS: tuple[type[BaseException], ...] = (PrivacyConfigError, HorizonExhaustedError)

_reported: set[str] = set()


def attempt_datum(compute: Callable[[], _T], where: str = "the gradient") -> tuple[_T | None, str]:
    """Run the user's code for one datum (load it, run the model and the loss, form the
    gradient): ``(result, "")``, or ``(None, why)`` with ``why`` :data:`NONFINITE` or
    :data:`FAILED`.

    Why this exists: whether a datum's gradient can be computed is a property of the datum
    — a wrong-size input, a label out of range, a non-finite value, anything that makes
    the user's code raise — so it must not change anything that leaves the learner (a
    changed reply kind or error text is a release with ε = ∞). Every front end (the NumPy
    round, :class:`~flwr_corrnoise.flower.PrivateSteps`, the torch device step) calls this
    and counts such a step as a **zero gradient**: its noise increment is still added, and
    replacing a clipped gradient by zero moves the release by at most ``B_g``, within the
    ``2·B_g`` sensitivity the noise is calibrated for.

    Only ``Exception`` s count: an interrupt (``KeyboardInterrupt``, ``SystemExit``) still
    stops the round, which is then rolled back (nothing released). The library's own
    refusals (:class:`PrivacyConfigError`, :class:`HorizonExhaustedError`) are not data
    and propagate. The exception's text may quote the datum, so it goes to the learner's
    log only (a warning with the traceback the first time each kind is seen, then debug).
    """
    try:
        return compute(), ""
    except _NOT_DATA_ERRORS:
        raise
    except NonFiniteError:
        return None, NONFINITE
    except Exception as err:
        key = f"{where}:{type(err).__name__}"
        if key not in _reported:
            _reported.add(key)
            log.warning("flwr-corrnoise: %s could not be computed for a datum (%s); that "
                        "step counts as a zero gradient. If this happens on every datum, "
                        "the code has a bug. Local only, never sent.", where,
                        type(err).__name__, exc_info=err)
        else:
            log.debug("%s failed on a datum (%s); zero gradient", where, type(err).__name__)
        return None, FAILED


def datum_gradient(compute: Callable[[], Any], size: int,
                   dtype: Any = np.float64) -> tuple[np.ndarray, str]:
    """One datum's flat gradient (in ``dtype``: float64, or a float32 step's float32) for
    a model of ``size`` parameters, or zeros (and why, see :func:`attempt_datum`) if it
    cannot be computed: an exception, a result that is not ``size`` numbers, or a
    non-finite one. The NumPy front ends'
    (:func:`local_round`, :meth:`~flwr_corrnoise.flower.PrivateSteps.step`) one place for
    the rule."""
    def flat() -> np.ndarray:
        value = compute()
        if isinstance(value, np.ndarray) or np.isscalar(value):
            return np.asarray(value, dtype=dtype).ravel()
        return _flatten(value, dtype)

    # converted first, then checked: a finite float64 number beyond float32's range
    # becomes inf in a float32 step, and is then not finite (zero), never a NaN release
    with np.errstate(over="ignore"):
        g, why = attempt_datum(flat)
    if g is not None and g.size != size:
        log.debug("a gradient of %d numbers for a model of %d: zero gradient", g.size, size)
        g, why = None, FAILED
    if g is not None and not np.all(np.isfinite(g)):
        g, why = None, NONFINITE
    return (np.zeros(size, dtype=dtype) if g is None else g), why


class RoundNoise(Protocol):
    """How a step's ``L`` rows get their noise when the streams are not stepped one by one
    (:func:`private_steps`' ``noise``): the in-process engine's open stream groups
    (:class:`~flwr_corrnoise.stream_group.GroupedNoise`). ``add(g)``: the ``L`` releases
    ``g[i] + e_i`` (each row's own stream moved on one step); ``close()``: every stream
    holds its own state again."""

    def add(self, g: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


def private_step(
    state: LearnerState,
    settings: PrivacySettings,
    compute: Callable[[], Any],
    size: int,
    counts: StepCounts,
) -> np.ndarray:
    """**The private step** (NumPy): the release ``clip(g, B_g) + e[k]`` of one datum's
    gradient, with the learner's counters advanced.

    ``compute()`` is the user's code for the step's datum (any structure of arrays of
    ``size`` numbers in all). In order: the horizon (:func:`check_horizon`, before
    anything is drawn); the gradient, or zeros if it cannot be computed
    (:func:`datum_gradient`: whether it can depends on the data, so it must not change
    what leaves); clipping to ``B_g`` in global L2; the stream's next increment
    (:meth:`~flwr_corrnoise.streams.NoiseStream.add_next`: exact on a secure stream's
    grid); then ``step`` (= the stream's index) and ``position`` (the next datum) move
    on. The noiseless baseline skips the clipping and the noise. Every NumPy front end
    steps through here: :func:`local_round`, :meth:`~flwr_corrnoise.flower.PrivateSteps.step`
    and, with the round's update as the datum,
    :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`. It is the ``L = 1`` case of
    :func:`private_steps`."""
    return private_steps([state], settings, size, [counts], computes=[compute])[0]


def private_steps(
    states: Sequence[LearnerState],
    settings: PrivacySettings,
    size: int,
    counts: Sequence[StepCounts],
    *,
    computes: Sequence[Callable[[], Any]] | None = None,
    rows: np.ndarray | None = None,
    noise: RoundNoise | None = None,
    dtype: Any = np.float64,
) -> np.ndarray:
    """:func:`private_step` for ``L`` learners of one settings at once: row ``i`` of the
    ``L×size`` result is learner ``i``'s release, computed by the same rules in the same
    order — each learner's horizon; its gradient (``rows[i]``, or ``computes[i]()``
    through :func:`datum_gradient`), zero if it cannot be computed or is not finite; its
    own clipping to ``B_g``; its own stream's increment; its counters and ``counts[i]``.

    Why one function for both: the vectorized engine's learners step in lockstep, and the
    rules above are vector operations over the rows (one norm per row, one finiteness
    test per row) plus, in the engine, one recurrence for all the learners' noise
    (``noise``: :class:`~flwr_corrnoise.stream_group.GroupedNoise`), so ``L`` learners
    cost about what one costs in Python calls; one learner is ``L = 1`` of the same code.

    ``rows``: the ``L`` gradients already computed (a batch); ``computes``: each learner's
    code for its datum otherwise. ``noise``: how the ``L`` rows get their noise (the
    engine's open stream groups, kept over a round by :func:`local_rounds`); by default
    each learner's own stream adds its increment (:meth:`~flwr_corrnoise.streams.
    NoiseStream.add_next`). ``dtype``: the rows' (:func:`step_dtype`, from
    :func:`local_rounds`); float64 by default.
    """
    if states:  # the learner furthest along decides (one check for the L counters)
        check_horizon(settings, max(state.step for state in states))
    g = _gradient_rows(len(states), size, counts, computes, rows, dtype)
    if settings.private:
        adaptive = settings.adaptive is not None  # each learner's own C_t (state)
        clips = [AdaptiveClipState.from_payload(s.payload) for s in states] if adaptive else []
        clip = (np.array([c.clip_norm for c in clips]) if adaptive
                else np.full(len(states), settings.clip_norm))
        # each row to its clip norm less the margin of its release's dtype: the released
        # vector's exact norm is then at most the clip norm (clip_margin)
        target = np.array([clip_target(c, size, _release_dtype(s))
                           for c, s in zip(clip.tolist(), states, strict=True)])
        norms = row_norms(g)
        over = norms > target
        if over.any():
            factors = np.ones(len(states))
            np.divide(target, norms, out=factors, where=over)
            scale_rows(g, factors)
            for i in np.flatnonzero(over).tolist():
                counts[i].clipped += 1
        if adaptive:  # rows of norm ≤ 1: the stream's noise is calibrated at unit clip
            g /= clip[:, None]
        g = _add_noise(states, g, noise)
        if adaptive:  # × C_t (post-processing), then C_{t+1} from the noised count
            g *= clip[:, None]
            _next_clip_norms(states, clips, ~over, settings)
    for state in states:
        state.advance()
    return g


def _release_dtype(state: LearnerState) -> np.dtype:
    """The dtype a learner's release is formed in: its stream's (float32 for a float32
    model), float64 without a stream."""
    return np.dtype(getattr(state.noise, "noise_dtype", np.float64))


class BlockNoise:
    """A round's noise drawn as one block per stream (:meth:`~flwr_corrnoise.streams.
    NoiseStream.next_block`) when the round opens: the :class:`RoundNoise`
    :func:`local_rounds` uses for learners whose streams all draw blocks. Why: a BLT
    stream stepped once a step reads and writes its ``k×d`` buffers ``τ`` times a round;
    as one block, once. The increments are the same floats, released the same way
    (:meth:`~flwr_corrnoise.streams.NoiseStream.release`), step ``i`` of the round getting
    row ``i``; the noise is data-independent, so drawing it first changes nothing else. A
    round that fails after opening is not written back (the streams are forks), like any
    other."""

    def __init__(self, streams: Sequence[NoiseStream], tau: int) -> None:
        self.streams = list(streams)
        self.blocks = [stream.next_block(tau) for stream in self.streams]
        self.at = 0

    @staticmethod
    def usable(streams: Sequence[NoiseStream | None]) -> bool:
        """Whether every stream draws blocks (NumPy, from the kernel, not secure)."""
        return bool(streams) and all(getattr(s, "draws_blocks", False) for s in streams)

    def add(self, g: np.ndarray) -> np.ndarray:
        if self.at >= len(self.blocks[0]):
            raise HorizonExhaustedError("more steps than the round's block of noise")
        for i, (stream, block) in enumerate(zip(self.streams, self.blocks, strict=True)):
            row = g[i]
            stream.release(row, block[self.at], out=row)
        self.at += 1
        return g

    def close(self) -> None:
        self.blocks = []


def _add_noise(states: Sequence[LearnerState], g: np.ndarray,
               noise: RoundNoise | None) -> np.ndarray:
    """Each row of ``g`` plus its learner's next increment: through the open stream
    groups ``noise`` (the engine), else each learner's own stream."""
    if noise is not None:
        return noise.add(g)
    for i, state in enumerate(states):
        g[i] = state.noise.add_next(g[i])  # type: ignore[union-attr]
    return g


def private_sampled_steps(
    states: Sequence[LearnerState],
    settings: PrivacySettings,
    size: int,
    counts: Sequence[StepCounts],
    examples: Sequence[Sequence[Any]],
    expected_batch: float,
    *,
    noise: RoundNoise | None = None,
) -> np.ndarray:
    """**The private step of a sampled loop** (NumPy), for ``L`` learners of one settings:
    row ``i`` is ``(Σ_j clip(g_ij, B_g) + e_i) / m`` over the examples learner ``i``'s
    sampler drew, ``m`` = ``expected_batch`` (public: the loader's expected batch size).

    Why this form (issue 35): the amplified accounting (Choquette-Choo et al., "(Amplified)
    Banded Matrix Factorization", Thm. 4; :mod:`flwr_corrnoise.amplification`) treats each
    step as a Poisson-subsampled Gaussian mechanism in which one example moves the noised
    sum by at most ``B_g`` (its own clipped gradient) — true of a sum of *per-example*
    clipped gradients, not of a clipped batch mean (one example can swing that by ``2·B_g``).
    Dividing by the expected size, never the drawn count, keeps the count out of the
    release (as Opacus's ``expected_batch_size``); it is what the torch device step
    (:class:`~flwr_corrnoise.torch.PrivateOptimizer`) does with such settings.

    ``examples[i]``: learner ``i``'s drawn examples, each a gradient (any structure of
    ``size`` numbers) or a callable computing it; each goes through
    :func:`datum_gradient` (zero if it cannot be computed, so a datum never changes the
    step's kind). An empty draw is a zero sum, noised like any other. The horizon is asked
    first, the counters advance as in :func:`private_steps`; adaptive clipping is refused
    (its count is per step, not per example, here)."""
    if states:
        check_horizon(settings, max(state.step for state in states))
    if len(examples) != len(states):
        raise ValueError("one list of drawn examples per learner is needed")
    m = float(expected_batch)
    if not (math.isfinite(m) and m > 0):
        raise PrivacyConfigError(f"expected batch size must be finite and > 0, got "
                                 f"{expected_batch!r}")
    if settings.adaptive is not None:
        raise PrivacyConfigError("adaptive clipping is not supported with a sampled loop "
                                 "in the NumPy step; use a fixed clip-norm")
    g = np.zeros((len(states), size))
    # A secure stream releases trunc_g(sum) + e on its grid (NoiseStream.add_next). Of a
    # sum of clipped gradients, truncation could move one example's share by up to g a
    # coordinate beyond B_g (the accounting's bound); each example truncated to the grid
    # first keeps its share within B_g, and their float sum is then exact and on the grid
    # (secure_noise.add_on_grid), so the release's truncation changes nothing.
    grid = [granularity(s.noise.std) if s.noise is not None and s.noise.secure else 0.0
            for s in states]
    for i, drawn in enumerate(examples):
        why_last = ""
        for example in drawn:
            row, why = datum_gradient(example if callable(example) else
                                      (lambda v=example: v), size)
            if why:
                why_last = why
                counts[i].zeroed(why)
                continue
            if settings.private:  # the private step's clipping, by the same floats
                row, norm = clip_by_global_norm(row, settings.clip_norm,
                                                _release_dtype(states[i]))
                if norm > settings.clip_norm:
                    counts[i].clipped += 1
                if grid[i]:  # each example on the secure grid before the sum (below)
                    row = truncate_to_grid(row, grid[i])
            g[i] += row
        counts[i].last = why_last
    if settings.private:
        g = _add_noise(states, g, noise)
    for state in states:
        state.advance()
    return g / m


def _next_clip_norms(states: Sequence[LearnerState], clips: Sequence[AdaptiveClipState],
                     unclipped: np.ndarray, settings: PrivacySettings) -> None:
    """Each learner's ``C_{t+1}`` from its step's unclipped count (one datum a step) and
    the count noise of its step (:meth:`~flwr_corrnoise.adaptive_clipping.
    AdaptiveClipState.update`), stored as new payload arrays (never written in place:
    the state the round was forked from keeps the old ones)."""
    sigma_b = settings.count_noise()
    for state, clip, ok in zip(states, clips, unclipped.tolist(), strict=True):
        clip.update(float(ok), 1, state.step, settings.adaptive, sigma_b)  # type: ignore[arg-type]
        state.payload = {**(state.payload or {}), **clip.to_payload()}


def _gradient_rows(count: int, size: int, counts: Sequence[StepCounts],
                   computes: Sequence[Callable[[], Any]] | None,
                   rows: np.ndarray | None, dtype: Any = np.float64) -> np.ndarray:
    """The ``count×size`` gradients of a step: ``rows`` (a batch, copied) with every row
    that is not all finite set to zero, or each ``computes[i]`` through
    :func:`datum_gradient`; each learner's :class:`StepCounts` told why."""
    if rows is not None:
        with np.errstate(over="ignore"):  # beyond float32's range: inf, then zeroed below
            g = np.array(rows, dtype=dtype)
        if g.shape != (count, size):
            raise ValueError(f"gradient rows of shape {g.shape}, expected {(count, size)}")
        finite = np.isfinite(g).all(axis=1)
        if finite.all():  # the common case: every learner's step counts, none zeroed
            for c in counts:
                c.last = ""
            return g
        g[~finite] = 0.0
        for c, ok in zip(counts, finite.tolist(), strict=True):
            c.zeroed("" if ok else NONFINITE)
        return g
    if computes is None or len(computes) != count:
        raise ValueError("one gradient computation per learner is needed")
    g = np.empty((count, size), dtype=dtype)
    for i, compute in enumerate(computes):
        g[i], why = datum_gradient(compute, size, dtype)
        counts[i].zeroed(why)
    return g


def local_round(
    params: Sequence[np.ndarray],
    gradient: GradientFn,
    state: LearnerState,
    settings: PrivacySettings,
    tau: int,
    eta: float,
) -> RoundResult:
    """Run ``τ`` local steps from ``params`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially
    Private Online Federated Learning With Correlated Noise", Algorithm 1 lines 5–14).

    ``state`` is advanced in place (and returned in the result). On any error (horizon used
    up, a non-finite model from the server, an interrupt) it stays exactly what it was:
    the round runs on a fork of it (:meth:`~flwr_corrnoise.learner_state.LearnerState.
    fork`) that is written back only when the round succeeded, so a failed round releases
    nothing and no released noise is ever reused.

    A **datum whose gradient cannot be computed** is *not* an error: a non-finite gradient
    (NaN/Inf, or the oracle raising :class:`NonFiniteError` for a non-finite loss), a
    gradient of the wrong size, or the oracle raising (a malformed datum, a label out of
    range). Whether that happens depends on the data, so an error reply would leak it
    (:func:`attempt_datum`). That step's clipped gradient counts as zero (a change of at
    most ``B_g`` from any finite one, within the ``2·B_g`` sensitivity), its noise
    increment is still added, the stream position moves on, and the event is counted in
    :attr:`RoundResult.diagnostics` (``nonfinite-steps``, ``failed-steps``), which never
    leaves the learner.
    """
    return local_rounds(params, [gradient], [state], settings, tau, eta)[0]


#: gradients of L learners' data at once: ``batch(Z, positions)`` with ``Z`` the ``L×d``
#: flat models and ``positions`` their data positions → an ``L×d`` array
BatchGradientFn = Callable[[np.ndarray, list[int]], np.ndarray]


def local_rounds(
    params: Sequence[np.ndarray],
    gradients: Sequence[GradientFn],
    states: Sequence[LearnerState],
    settings: PrivacySettings,
    tau: int,
    eta: float,
    batch: BatchGradientFn | None = None,
    noise: Callable[[Sequence[NoiseStream], int], RoundNoise] | None = None,
    loaders: Sequence[Any] | None = None,
) -> list[RoundResult]:
    """:func:`local_round` for ``L`` learners from the same ``params``, their steps in
    lockstep (``L = 1`` *is* :func:`local_round`). Why: the vectorized engine
    (:func:`flwr_corrnoise.engine.run_vectorized`) keeps the ``L`` local models as one
    ``L×d`` array and may compute their ``L`` gradients in one ``batch`` call; every step
    is :func:`private_steps` (the private step over the ``L`` rows: each learner's own
    horizon, datum rule, clipping, noise stream and counters), and the round's rule is
    this one function. ``noise(streams, τ)``: the round's :class:`RoundNoise` over the
    learners' streams — the engine passes :func:`~flwr_corrnoise.stream_group.
    grouped_noise` (one recurrence per group of streams at one step, each learner's rows
    from its own generator); by default each stream steps on its own.

    A ``batch`` that raises or returns another shape computes nothing: each learner's
    datum then goes through its own ``gradients[i]`` (so one learner's datum can never
    zero another's gradient). On any error no learner of the call is written.

    ``loaders`` (a sampled loop, issue 35): learner ``i``'s keyed
    :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`; step ``k`` of its stream
    takes exactly the batch ``loaders[i].indices(k)`` (the round's batches from
    :meth:`~flwr_corrnoise.data.loader.EpochLoop.round_indices`, which refuses a round
    that does not start on the loader's round boundary), each drawn example's gradient
    ``gradients[i](params, example)``, and the step is :func:`private_sampled_steps`
    (per-example clipping, the sum noised and divided by the expected batch size). τ must
    be the loader's local steps. ``batch`` is not used then (the draws differ per learner).
    """
    if isinstance(tau, bool) or int(tau) != tau or tau < 1:
        raise PrivacyConfigError(f"local steps τ must be a positive integer, got {tau!r}")
    if not (math.isfinite(eta) and eta > 0):
        raise PrivacyConfigError(f"step size η must be finite and > 0, got {eta!r}")
    shapes = [tuple(np.shape(p)) for p in params]
    size = sum(math.prod(s) for s in shapes)
    for state in states:
        check_round(state, settings, size, int(tau))
    dtype = step_dtype(states, settings, params)
    with np.errstate(over="ignore"):  # a float64 model beyond float32's range: refused below
        x = _flatten(params, dtype)
    if not np.all(np.isfinite(x)):
        raise NonFiniteError("the global model received from the server is not finite")
    # The round runs on forks of the states and is written back only when it succeeded: a
    # failed round released nothing, and not writing it reuses no released noise.
    schedule = None if loaders is None else _sampled_schedule(loaders, states, int(tau))
    work = [state.fork() for state in states]
    counts = [StepCounts() for _ in states]
    opened: RoundNoise | None = None
    try:
        z = np.tile(x, (len(work), 1))
        total = np.zeros_like(z)
        if settings.private and noise is not None:  # e.g. one recurrence per group
            opened = noise([w.noise for w in work], int(tau))  # type: ignore[misc]
        elif settings.private and BlockNoise.usable([w.noise for w in work]):
            opened = BlockNoise([w.noise for w in work], int(tau))  # type: ignore[misc]
        for _ in range(int(tau)):
            if schedule is not None:
                drawn = [[partial(gradients[i], split_flat(z[i], shapes), int(j))
                          for j in next(batches)] for i, batches in enumerate(schedule)]
                g = private_sampled_steps(work, settings, x.size, counts, drawn,
                                          loaders[0].expected_batch_size,  # type: ignore[index]
                                          noise=opened)
                z -= eta * g
                total += g
                continue
            rows = _batch_rows(batch, z, [w.position for w in work])
            computes = None if rows is not None else [
                partial(gradients[i], split_flat(z[i], shapes), w.position)
                for i, w in enumerate(work)]
            g = private_steps(work, settings, x.size, counts, computes=computes, rows=rows,
                              noise=opened, dtype=dtype)
            z -= eta * g
            total += g
        for w in work:
            w.rounds += 1
    finally:
        if opened is not None:
            opened.close()
    for state, done in zip(states, work, strict=True):
        state.assign(done)
    metrics: dict[int, RoundMetrics] = {}  # one computation per step count, when read
    for state in states:
        if state.step not in metrics:
            metrics[state.step] = RoundMetrics(settings, state.step)
    total /= tau  # ĝ of every learner at once (the same floats as row by row)
    return [RoundResult(update=split_flat(total[i], shapes), state=state,
                        metrics=metrics[state.step],
                        diagnostics=counts[i].diagnostics(int(tau)))
            for i, state in enumerate(states)]


def _sampled_schedule(loaders: Sequence[Any], states: Sequence[LearnerState],
                      tau: int) -> list[Iterator[np.ndarray]]:
    """Each learner's batches for this round from its sampler, refused (before anything
    runs: a function of the counters and the loaders only) if τ is not the loader's local
    steps, the loaders' expected batch sizes differ, or the round does not start on the
    loader's round boundary."""
    if len(loaders) != len(states):
        raise PrivacyConfigError("one loader per learner is needed")
    sizes = {float(ld.expected_batch_size) for ld in loaders}
    if len(sizes) != 1:
        raise PrivacyConfigError("the learners of one settings share one expected batch size")
    out = []
    for ld, state in zip(loaders, states, strict=True):
        if ld.local_steps != tau:
            raise PrivacyConfigError(f"τ = {tau} local steps, but the loader's round has "
                                     f"{ld.local_steps}: a step outside its schedule")
        if state.step % tau or state.step + tau > ld.horizon:
            raise PrivacyConfigError(
                f"a step outside the sampler's schedule: a round from step {state.step} "
                f"of a loader whose rounds start every {tau} steps up to {ld.horizon}")
        out.append(ld.round_indices(state.step))
    return out


def _batch_rows(batch: BatchGradientFn | None, z: np.ndarray,
                positions: list[int]) -> np.ndarray | None:
    """``batch(z, positions)`` as an ``L×d`` float64 array, or ``None`` (no batch, or it
    failed: the learners then compute their data one at a time)."""
    if batch is None:
        return None
    try:
        rows = np.asarray(batch(z.copy(), positions), dtype=np.float64)
    except _NOT_DATA_ERRORS:
        raise
    except Exception:  # a datum's failure: each learner's own rule decides (above)
        return None
    return rows if rows.shape == z.shape else None
