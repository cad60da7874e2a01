"""The math of the two other variants (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private
Online Federated Learning With Correlated Noise" (arXiv version) and Zhang, Zhu & Johansson,
"Differentially Private Online Federated Learning with Correlated Noise"), shared by Flower and the
sweeps.

Nothing here imports Flower: :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod` and
:class:`~flwr_corrnoise.flower.CorrNoiseCentralDPStrategy` call these functions, and so does the
in-process engine of the logistic-regression experiment (:func:`run_round_variant`), so the
experiment measures exactly what the Flower classes do.

* per-round local noise (Zhang et al., arXiv): a learner releases ``clip(Δ_r, B) + e[r]``, with
  ``e`` its own ``R×R`` stream calibrated by :func:`round_calibration`;
* central noise (Zhang, Zhu & Johansson): the trusted server releases
  ``mean_i clip(Δ_i, B) + e[r]`` with one stream whose std is :func:`central_noise_std`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .learner import clip_by_global_norm
from .mechanisms.participation import ONCE, Participation
from .privacy import Calibration, Method, calibrate_mechanism
from .settings import PrivacySettings, derive_seed
from .streams import NoiseStream

#: where the noise is added: every local step (Zhang, Zhu, Fay & Johansson, "Locally Differentially
#: Private Online Federated Learning With Correlated Noise"), every round on the learner (Zhang et
#: al., arXiv), or once per round on the server (Zhang, Zhu & Johansson)
NOISE_AT = ("step", "round", "server")


def round_release(
    delta: np.ndarray, clip_norm: float, noise: NoiseStream
) -> tuple[np.ndarray, float]:
    """Zhang et al. (arXiv): ``clip(Δ, B) + e[r]`` for one learner's flat round update ``Δ``
    (``B`` = ``clip_norm``).

    Returns the released update and ``‖Δ‖`` before clipping. ``noise`` advances one step.
    """
    clipped, norm = clip_by_global_norm(delta, clip_norm)
    return noise.add_next(clipped), norm


def central_calibration(
    mechanism: str, epsilon: float, delta: float, clip_norm: float, rounds: int,
    method: Method = "exact", participation: Participation = ONCE,
    params: Mapping[str, Any] | None = None,
) -> Calibration:
    """The Gaussian mechanism on the *sum* of clipped round updates over ``R`` rounds:
    one datum of one learner moves one clipped update, hence the sum, by ``≤ 2B`` — the
    same release description as a learner's, with rounds for steps. ``participation``:
    the rounds one datum is in (``Participation.every_step(R)`` for an app that trains on
    its whole dataset every round)."""
    return calibrate_mechanism(epsilon, delta, clip_norm, mechanism, rounds, method,
                               participation, params)


def central_noise_std(calibration: Calibration, min_learners: int) -> float:
    """Std of the noise on the *average* of at least ``min_learners`` clipped updates."""
    if min_learners < 1:
        raise ValueError(f"min_learners must be >= 1, got {min_learners}")
    return calibration.std / min_learners


def run_round_variant(
    *,
    initial: Sequence[np.ndarray],
    local_update: Callable[[int, int, np.ndarray], np.ndarray],
    num_learners: int,
    rounds: int,
    noise_at: str,
    settings: PrivacySettings,
    seed: int = 0,
    evaluate: Callable[[int, list[np.ndarray]], object] | None = None,
) -> list[np.ndarray]:
    """In-process run of the per-round (``"round"``) or central (``"server"``) variant.

    ``local_update(learner, round, x)`` returns the learner's flat round update ``Δ`` from
    the flat model ``x`` (its own, unclipped, noiseless local steps). ``settings.horizon``
    is the number of rounds and ``settings.clip_norm`` the round-update clip norm ``B``. Every
    learner takes part in every round; the server step is the plain average (FedAvg with
    equal weights), as in the Flower classes.
    """
    if noise_at not in ("round", "server"):
        raise ValueError(f"noise_at must be 'round' or 'server', got {noise_at!r}")
    shapes = [np.shape(p) for p in initial]
    sizes = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
    x = np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in initial])

    def unflat(v: np.ndarray) -> list[np.ndarray]:
        return [p.reshape(s) for p, s in zip(np.split(v, sizes), shapes, strict=True)]

    if noise_at == "round":
        std = settings.calibration().std  # type: ignore[union-attr]
        streams = [NoiseStream.create(settings.mechanism, rounds, shapes, std,
                                      derive_seed(seed, i),
                                      factorization=settings.factorization())
                   for i in range(num_learners)]
    else:
        cal = central_calibration(settings.mechanism, settings.epsilon, settings.delta,
                                  settings.clip_norm, rounds, settings.method,  # type: ignore[arg-type]
                                  settings.participation, settings.mechanism_params())
        server = NoiseStream.create(settings.mechanism, rounds, shapes,
                                    central_noise_std(cal, num_learners),
                                    derive_seed(seed, 10**6),
                                    factorization=settings.factorization())
    for r in range(rounds):
        if evaluate is not None:
            evaluate(r, unflat(x))
        deltas = [local_update(i, r, x) for i in range(num_learners)]
        if noise_at == "round":
            released = [round_release(d, settings.clip_norm, streams[i])[0]
                        for i, d in enumerate(deltas)]
            x = x + np.mean(released, axis=0)
        else:
            clipped = [clip_by_global_norm(d, settings.clip_norm)[0] for d in deltas]
            x = x + np.mean(clipped, axis=0) + server.next()
    if evaluate is not None:
        evaluate(rounds, unflat(x))
    return unflat(x)
