"""The in-process engine: the same learner round and server step, without messaging.

Flower's Ray simulation costs ≈ 0.4 s per round for 20 learners; a sweep over methods,
budgets, step sizes and seeds at R = 1000 needs something faster. :func:`run_inprocess`
loops over learners and rounds in one process and calls exactly the functions the Flower
layer calls (:func:`~flwr_corrnoise.learner.local_round`, whose every step is the one
:func:`~flwr_corrnoise.learner.private_step`,
:func:`~flwr_corrnoise.learner.aggregate`, with noise seeds from
:func:`~flwr_corrnoise.learner.derive_seed`), so for the same seeds it produces the same
global models as the Flower simulation (``tests/test_flower_simulation.py`` checks 1e-10).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .learner import (
    GradientFn,
    LearnerState,
    PrivacySettings,
    aggregate,
    derive_seed,
    local_round,
)


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
) -> InProcessResult:
    """Run Algorithm 1 for ``rounds`` rounds with ``len(gradients)`` learners.

    ``evaluate(r, x^r)`` is called for ``r = 0..rounds`` (before round ``r``'s training, and
    once with the final model), like Flower's ``evaluate_fn``. With ``fraction_train < 1``
    each round samples that fraction of learners (at least one) with a generator seeded by
    ``seed``; absent learners take no steps and keep their noise streams where they were.
    ``schedule[r]`` (if given) lists the learners of round ``r`` explicitly, e.g. to replay
    the participation of a Flower run.
    """
    n = len(gradients)
    per_learner = (
        [settings] * n if isinstance(settings, PrivacySettings) else list(settings)
    )
    shapes = [tuple(np.shape(p)) for p in initial]
    states = [
        LearnerState.create(s, shapes, None if seed is None else derive_seed(seed, i))
        for i, s in enumerate(per_learner)
    ]
    x = [np.array(p, dtype=np.float64, copy=True) for p in initial]
    sampler = np.random.default_rng(None if seed is None else [seed, 0xFED])
    result = InProcessResult(params=x, states=states)

    def one_round(r: int, x: list[np.ndarray]) -> list[np.ndarray]:
        if schedule is not None:
            chosen = sorted(int(i) for i in schedule[r])
        elif fraction_train >= 1.0:
            chosen = list(range(n))
        else:
            k = max(1, int(n * fraction_train))
            chosen = sorted(sampler.choice(n, size=k, replace=False).tolist())
        result.participation.append(chosen)
        updates = []
        for i in chosen:
            out = local_round(x, gradients[i], states[i], per_learner[i], tau, eta)
            states[i] = out.state
            updates.append(out.update)
        return aggregate(x, updates, eta, eta_g, tau)

    result.params = run_rounds(x, rounds, one_round, evaluate,
                               result.models if keep_models else None)
    result.states = states
    return result


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
