"""The in-process engine: the same learner round and server step, without messaging.

Flower's Ray simulation costs ≈ 0.4 s per round for 20 learners; a sweep over methods,
budgets, step sizes and seeds at R = 1000 needs something faster. :func:`run_inprocess`
loops over learners and rounds in one process and calls exactly the functions the Flower
layer calls (:func:`~flwr_corrnoise.learner.local_round`, whose every step is the one
:func:`~flwr_corrnoise.learner.private_step`,
:func:`~flwr_corrnoise.aggregation.aggregate`, with noise seeds from
:func:`~flwr_corrnoise.settings.derive_seed`), so for the same seeds it produces the same
global models as the Flower simulation (``tests/flower/test_flower_simulation.py`` checks 1e-10).

:func:`run_vectorized` is the same run with every learner of a round as one ``L×d`` array:
the gradients of a local step in one call, the learners' rounds in lockstep through
:func:`~flwr_corrnoise.learner.local_rounds` (whose ``L = 1`` case is ``local_round``),
every step :func:`~flwr_corrnoise.learner.private_steps` (whose ``L = 1`` case is
``private_step``: each learner's horizon, datum rule, clipping and counters as vector
operations over the rows) and the learners' noise one recurrence per round's group of
streams (:func:`~flwr_corrnoise.stream_group.grouped_noise`, each learner's rows still from
its own keyed generator: the engine is the one user of stream groups). The results equal
:func:`run_inprocess`'s to 1e-12 (``tests/learner/test_vectorized_engine.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .aggregation import aggregate
from .data.sampling import CyclicPoissonLoader
from .learner import GradientFn, local_rounds
from .learner_state import LearnerState
from .settings import PrivacyConfigError, PrivacySettings, derive_seed
from .stream_group import grouped_noise


@dataclass
class InProcessResult:
    """Final parameters, the per-round global models (if kept) and the learners' states."""

    params: list[np.ndarray]
    states: list[LearnerState]
    models: list[list[np.ndarray]] = field(default_factory=list)
    participation: list[list[int]] = field(default_factory=list)


def run_inprocess(
    *,
    initial: Sequence[np.ndarray],
    gradients: Sequence[GradientFn],
    settings: PrivacySettings | Sequence[PrivacySettings],
    rounds: int,
    tau: int,
    eta: float,
    eta_g: float = 1.0,
    seed: int | None = 0,
    fraction_train: float = 1.0,
    evaluate: Callable[[int, list[np.ndarray]], object] | None = None,
    keep_models: bool = False,
    schedule: Sequence[Sequence[int]] | None = None,
    batch_gradient: Callable[[np.ndarray, list[int], list[int]], np.ndarray] | None = None,
    loaders: Sequence[CyclicPoissonLoader] | None = None,
) -> InProcessResult:
    """Run Algorithm 1 for ``rounds`` rounds with ``len(gradients)`` learners.

    ``evaluate(r, x^r)`` is called for ``r = 0..rounds`` (before round ``r``'s training, and
    once with the final model), like Flower's ``evaluate_fn``. With ``fraction_train < 1``
    each round samples that fraction of learners (at least one) with a generator seeded by
    ``seed``; absent learners take no steps and keep their noise streams where they were.
    ``schedule[r]`` (if given) lists the learners of round ``r`` explicitly, e.g. to replay
    the participation of a Flower run. ``batch_gradient``: the vectorized engine
    (:func:`run_vectorized`); without it, one learner's round after the other.

    ``loaders`` (issue 35): one :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`
    per learner, so each step trains on the batch its sampler draws (cyclic Poisson,
    Choquette-Choo et al., "(Amplified) Banded Matrix Factorization"), as the Flower front
    ends do. A loader without a key is keyed with its learner's noise seed (the sampler's
    own BLAKE2b sub-key; the draws and their sizes never leave the learner); a learner
    without one (secure noise) needs a keyed loader. ``gradients[i](params, example)`` is
    then one example's gradient; every step is
    :func:`~flwr_corrnoise.learner.private_sampled_steps` (per-example clipping, the noised
    sum over the expected batch size), and the settings must carry the loader's
    participation, horizon and local steps (``τ``) — their ε is then the amplified one.
    ``batch_gradient`` is not called in a sampled run (the draws differ per learner); the
    learners still step in lockstep with grouped noise.
    """
    run = _Run(initial, len(gradients), settings, seed, fraction_train, schedule)
    keyed = None if loaders is None else _keyed_loaders(loaders, run, tau)

    def one_round(r: int, x: list[np.ndarray]) -> list[np.ndarray]:
        if batch_gradient is not None:
            return lockstep_round(r, x)
        updates = []
        for i in run.choose(r):
            out = local_rounds(x, [gradients[i]], [run.states[i]], run.settings[i], tau, eta,
                               loaders=None if keyed is None else [keyed[i]])[0]
            run.states[i] = out.state
            updates.append(out.update)
        return aggregate(x, updates, eta, eta_g, tau)

    def lockstep_round(r: int, x: list[np.ndarray]) -> list[np.ndarray]:
        assert batch_gradient is not None
        chosen = run.choose(r)
        groups: dict[PrivacySettings, list[int]] = {}
        for i in chosen:
            groups.setdefault(run.settings[i], []).append(i)
        by_learner = {}
        for group_settings, members in groups.items():
            def batch(z: np.ndarray, positions: list[int], members=members) -> np.ndarray:
                return batch_gradient(z, members, positions)

            outs = local_rounds(x, [gradients[i] for i in members],
                                [run.states[i] for i in members], group_settings, tau, eta,
                                batch=batch, noise=grouped_noise,
                                loaders=None if keyed is None else [keyed[i] for i in members])
            for i, out in zip(members, outs, strict=True):
                run.states[i] = out.state
                by_learner[i] = out.update
        return aggregate(x, [by_learner[i] for i in chosen], eta, eta_g, tau)

    return run.finish(run_rounds(run.x, rounds, one_round, evaluate,
                                 run.result.models if keep_models else None))


def run_vectorized(
    *,
    batch_gradient: Callable[[np.ndarray, list[int], list[int]], np.ndarray],
    **kwargs: Any,
) -> InProcessResult:
    """:func:`run_inprocess` (the same keyword arguments) with every learner of a round as
    one ``L×d`` array: ``run_inprocess(..., batch_gradient=batch_gradient)``.

    ``batch_gradient(Z, learners, positions)`` returns the ``L×d`` gradients of learners
    ``learners`` (their flat models are the rows of ``Z``) on their data at ``positions``:
    one vectorized call per local step instead of ``L``. The round is
    :func:`~flwr_corrnoise.learner.local_rounds` (the learners' steps in lockstep, each
    step :func:`~flwr_corrnoise.learner.private_steps`, the private step over ``L`` rows —
    every learner's own clipping, noise stream and counters — with the learners' streams
    as one :class:`~flwr_corrnoise.stream_group.StreamGroup`), and the results equal
    :func:`run_inprocess`'s on the same seeds (``tests/learner/test_vectorized_engine.py``: 1e-12).
    ``gradients`` (per learner) is what a learner falls back to when the batch fails (a
    datum that cannot be computed), so one datum never changes another learner's step.
    Learners with different settings are stepped in one group per settings.
    """
    return run_inprocess(batch_gradient=batch_gradient, **kwargs)


def _keyed_loaders(loaders: Sequence[CyclicPoissonLoader], run: _Run,
                   tau: int) -> list[CyclicPoissonLoader]:
    """Each learner's sampler, keyed with its noise seed where it has no key, after the
    refusals that make its ε the one printed: a sampler per learner, the settings'
    participation, horizon and local steps the loader's (else the noise would be calibrated
    for another loop than the one that runs)."""
    if len(loaders) != run.n:
        raise PrivacyConfigError(f"{len(loaders)} loaders for {run.n} learners")
    out = []
    for i, (ld, st, state) in enumerate(zip(loaders, run.settings, run.states, strict=True)):
        if not isinstance(ld, CyclicPoissonLoader):
            raise PrivacyConfigError(f"learner {i}: the engine samples with a "
                                     f"CyclicPoissonLoader, got {type(ld).__name__}")
        problems = []
        if st.horizon != ld.horizon:
            problems.append(f"horizon {st.horizon} vs the loader's {ld.horizon}")
        if st.private and st.participation != ld.participation:
            problems.append(f"participation {st.participation.describe()!r} vs the "
                            f"loader's {ld.participation.describe()!r}")
        if int(tau) != ld.local_steps:
            problems.append(f"τ = {tau} vs the loader's {ld.local_steps} local steps")
        if problems:
            raise PrivacyConfigError(f"learner {i}'s settings disagree with its loader: "
                                     + "; ".join(problems))
        if ld.key is None:
            if state.seed is None:
                raise PrivacyConfigError(
                    f"learner {i} has no noise seed (secure noise) to key its sampler: "
                    "pass a CyclicPoissonLoader with key= (128 bits or more of OS entropy)")
            ld = ld.keyed(state.seed)
        out.append(ld)
    return out


class _Run:
    """What both in-process engines share: one :class:`LearnerState` per learner (noise
    seeds from :func:`~flwr_corrnoise.settings.derive_seed`), the global model, the
    round's learners (all, a sampled fraction, or ``schedule[r]``) and the result."""

    def __init__(self, initial: Sequence[np.ndarray], n: int,
                 settings: PrivacySettings | Sequence[PrivacySettings], seed: int | None,
                 fraction_train: float, schedule: Sequence[Sequence[int]] | None) -> None:
        self.n = n
        self.settings = ([settings] * n if isinstance(settings, PrivacySettings)
                         else list(settings))
        shapes = [tuple(np.shape(p)) for p in initial]
        self.states = [
            LearnerState.create(s, shapes, None if seed is None else derive_seed(seed, i))
            for i, s in enumerate(self.settings)
        ]
        self.x = [np.array(p, dtype=np.float64, copy=True) for p in initial]
        self.sampler = np.random.default_rng(None if seed is None else [seed, 0xFED])
        self.fraction_train = fraction_train
        self.schedule = schedule
        self.result = InProcessResult(params=self.x, states=self.states)

    def choose(self, r: int) -> list[int]:
        """The learners of round ``r``, sorted; recorded in the result."""
        if self.schedule is not None:
            chosen = sorted(int(i) for i in self.schedule[r])
        elif self.fraction_train >= 1.0:
            chosen = list(range(self.n))
        else:
            k = max(1, int(self.n * self.fraction_train))
            chosen = sorted(self.sampler.choice(self.n, size=k, replace=False).tolist())
        self.result.participation.append(chosen)
        return chosen

    def finish(self, params: list[np.ndarray]) -> InProcessResult:
        self.result.params = params
        self.result.states = self.states
        return self.result


def run_rounds(
    x: list[np.ndarray],
    rounds: int,
    one_round: Callable[[int, list[np.ndarray]], list[np.ndarray]],
    evaluate: Callable[[int, list[np.ndarray]], object] | None = None,
    models: list[list[np.ndarray]] | None = None,
) -> list[np.ndarray]:
    """The server's loop shared by the in-process engines: ``evaluate(r, x^r)`` before
    round ``r`` and once after the last (like Flower's ``evaluate_fn``), ``x^{r+1} =
    one_round(r, x^r)``, and every global model appended to ``models`` if given."""
    for r in range(rounds):
        if evaluate is not None:
            evaluate(r, x)
        if models is not None:
            models.append([p.copy() for p in x])
        x = one_round(r, x)
    if evaluate is not None:
        evaluate(rounds, x)
    if models is not None:
        models.append([p.copy() for p in x])
    return x
