"""Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning With
Correlated Noise") logistic-regression experiment (Sec. V-A) in process: the sweep driver of
``simulations/logreg.py`` and of the tests that check the Flower app against it.

The task itself (:class:`~flwr_corrnoise.apps.logreg_task.LogRegSetup`, the synthetic
federation, the gradient oracle, the server-side evaluator) is the library's reference app;
what is here only *runs* it without messaging, including Zhang, Zhu, Fay & Johansson, "Locally
Differentially Private Online Federated Learning With Correlated Noise" (arXiv version) and Zhang,
Zhu & Johansson's ("Differentially Private Online Federated Learning with Correlated Noise")
per-round and central variants, so it is experiment code and is not installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flwr_corrnoise.apps.logreg_task import LogRegSetup, initial_parameters, logistic_gradient
from flwr_corrnoise.engine import InProcessResult, run_inprocess
from flwr_corrnoise.settings import NOISELESS, PrivacySettings
from flwr_corrnoise.variants import run_round_variant

__all__ = ["run_logreg_inprocess"]


def run_logreg_inprocess(
    setup: LogRegSetup,
    evaluate: Callable[[int, list[np.ndarray]], object] | None = None,
    schedule: Sequence[Sequence[int]] | None = None,
) -> InProcessResult:
    """Run the experiment on the in-process engine (same code as the Flower app).

    ``setup.noise_at = "round"`` or ``"server"`` runs the per-round variant (Zhang et al.,
    arXiv) or the central one (Zhang, Zhu & Johansson) instead
    (:func:`flwr_corrnoise.variants.run_round_variant`, the math of
    :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod` and
    :class:`~flwr_corrnoise.flower.CorrNoiseCentralDPStrategy`): τ plain local steps, the round
    update clipped to :attr:`LogRegSetup.round_clip`, noise once per round; it returns the
    final model only (``states``/``participation`` empty).
    """
    if setup.noise_at != "step" and setup.mechanism != NOISELESS:
        grads = [logistic_gradient(setup, i) for i in range(setup.num_learners)]

        def local_update(learner: int, r: int, x: np.ndarray) -> np.ndarray:
            z = x.copy()
            for t in range(setup.tau):
                z -= setup.eta * grads[learner]([z], r * setup.tau + t)[0]
            return z - x

        settings = PrivacySettings(setup.mechanism, setup.epsilon, setup.delta,
                                   setup.round_clip, setup.rounds, setup.method)
        final = run_round_variant(
            initial=initial_parameters(setup), local_update=local_update,
            num_learners=setup.num_learners, rounds=setup.rounds, noise_at=setup.noise_at,
            settings=settings, seed=setup.seed, evaluate=evaluate,
        )
        return InProcessResult(params=final, states=[])
    return run_inprocess(
        initial=initial_parameters(setup),
        gradients=[logistic_gradient(setup, i) for i in range(setup.num_learners)],
        settings=setup.settings(),
        rounds=setup.rounds,
        tau=setup.tau,
        eta=setup.eta,
        eta_g=setup.eta_g,
        seed=setup.seed,
        fraction_train=setup.fraction_train,
        evaluate=evaluate,
        schedule=schedule,
    )
