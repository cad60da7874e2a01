"""A learner's own privacy settings: what its noise is calibrated to.

:class:`PrivacySettings` is the one object every front end (the Flower learners, the
torch optimizer, the in-process engines) calibrates and reports from; it never comes from
the server. Its calibration is :func:`~flwr_corrnoise.privacy.calibrate_factorization`,
the library's one chain factorization → sensitivity under the participation → noise std.
Reading the settings from a Flower config is :func:`flwr_corrnoise.flower.config.
settings_from_config` (the messaging layer's keys stay in the messaging layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .adaptive_clipping import AdaptiveClipping, calibrate_adaptive, epsilon_spent_adaptive
from .mechanisms import MECHANISMS, Factorization, build_factorization, get_mechanism
from .mechanisms.participation import ONCE, Participation
from .privacy import METHODS, Calibration, calibrate_factorization, check_budget, epsilon_spent

#: the mechanism name that means "no noise, no clipping" (Mitra et al.'s online FedAvg)
NOISELESS = "none"


class PrivacyConfigError(ValueError):
    """A configuration that would weaken the learner's privacy, or is malformed."""

@dataclass(frozen=True)
class PrivacySettings:
    """A learner's own privacy: what its noise is calibrated to. Never set by the server.

    ``mechanism="none"`` turns noise and clipping off (the noiseless baseline).
    ``clip_norm`` is the L2 clip norm ``B_g`` (config key ``clip-norm``; Flower's DP
    wrappers call it ``clipping_norm``, Opacus ``max_grad_norm``).
    """

    mechanism: str = "blt"
    epsilon: float = 2.0
    #: δ: the key table's default (learner, server proposal and ``plan`` agree); a
    #: declared data size ``n`` refuses ``δ ≥ 1/n`` (:func:`check_delta_for`)
    delta: float = 1e-5
    clip_norm: float = 1.0
    horizon: int = 4000
    method: str = "exact"
    #: how often one datum enters the ``horizon`` steps (default: once, Zhang, Zhu, Fay &
    #: Johansson's ("Locally Differentially Private Online Federated Learning With Correlated
    #: Noise") stream); the noise is calibrated to the sensitivity under it
    participation: Participation = ONCE
    #: the most rounds the learner may take part in (``data-reuse = "every-round"`` per
    #: step: the participation counts one use per round, so a round past this count would
    #: use every datum once more than the ε accounts for); ``None``: the horizon bounds it
    max_rounds: int | None = None
    #: the quantile clip-norm update (:mod:`~flwr_corrnoise.adaptive_clipping`; ``None``:
    #: the clip norm stays ``clip_norm``, else ``clip_norm`` is its initial value)
    adaptive: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        if self.mechanism != NOISELESS and self.mechanism not in MECHANISMS:
            raise PrivacyConfigError(
                f"unknown mechanism {self.mechanism!r}; use one of "
                f"{[NOISELESS, *sorted(MECHANISMS)]}"
            )
        if isinstance(self.horizon, bool) or int(self.horizon) != self.horizon or self.horizon < 1:
            raise PrivacyConfigError(f"horizon must be a positive integer, got {self.horizon!r}")
        if self.private:
            check_budget(self.epsilon, self.delta)
            if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
                raise PrivacyConfigError(
                    f"clip norm must be finite and > 0, got {self.clip_norm!r}")
            if self.method not in METHODS:
                raise PrivacyConfigError(f"calibration method must be one of {METHODS}")
        if self.max_rounds is not None and (isinstance(self.max_rounds, bool) or
                                            int(self.max_rounds) != self.max_rounds or
                                            self.max_rounds < 1):
            raise PrivacyConfigError(
                f"max_rounds must be a positive integer or None, got {self.max_rounds!r}")
        if not isinstance(self.participation, Participation):
            raise PrivacyConfigError(
                f"participation must be a Participation, got {self.participation!r}")
        if self.adaptive is not None and not (self.private and
                                              isinstance(self.adaptive, AdaptiveClipping)):
            raise PrivacyConfigError(
                f"adaptive clipping needs a noise mechanism and an AdaptiveClipping, got "
                f"mechanism {self.mechanism!r}, {self.adaptive!r}")

    @property
    def private(self) -> bool:
        return self.mechanism != NOISELESS

    def mechanism_params(self) -> dict[str, Any]:
        """The mechanism's build parameters these settings imply: a mechanism that can be
        optimized for a participation (``blt``: ``min_sep``, ``max_participations``) is
        built for this learner's, so its noise is the best for the loop that runs."""
        names = {p.name for p in get_mechanism(self.mechanism).params}
        bands = getattr(self.participation, "bands", None)  # a sampled participation's cycle
        if bands is not None and "bands" in names:  # a banded encoder fits the sampler's cycle
            return {"bands": min(int(bands), int(self.horizon))}
        if self.participation.single or not {"min_sep", "max_participations"} <= names:
            return {}
        return {"min_sep": self.participation.min_sep,
                "max_participations": self.participation.participations(self.horizon)}

    def factorization(self) -> Factorization:
        """The factorization these settings calibrate and stream (memoized per process)."""
        return build_factorization(self.mechanism, self.horizon, **self.mechanism_params())

    def calibration(self) -> Calibration | None:
        """The noise calibration (``None`` for the noiseless baseline; memoized)."""
        return _calibration(self) if self.private else None

    def count_noise(self) -> float | None:
        """``σ_b``, the std of the noise on each step's clip count (adaptive clipping
        only; ``None`` otherwise)."""
        if not self.private or self.adaptive is None:
            return None
        return _adaptive_calibration(self)[1]

    def epsilon_spent(self, steps: int) -> float:
        """ε of what has been released after ``steps`` of the horizon (memoized).

        Never above the budget: the calibrated std provably meets ``(ε, δ)`` for the whole
        release (checked in exact arithmetic by :func:`~flwr_corrnoise.privacy.calibrate`),
        and every prefix has at most the full sensitivity, so a float root a hair above ε
        is rounding, reported as ε.
        """
        return _epsilon_spent(self, int(steps)) if self.private else 0.0

    def binding(self, factorization_digest: str = "") -> dict[str, Any]:
        """What a stored learner state was made with, compared on every restore (the
        participation only when a datum is used more than once, so that states written
        before participations existed still compare equal)."""
        out: dict[str, Any] = {
            "mechanism": self.mechanism, "epsilon": float(self.epsilon),
            "delta": float(self.delta), "clip-norm": float(self.clip_norm),
            "horizon": int(self.horizon), "calibration": self.method,
            "factorization": factorization_digest,
        }
        if not self.participation.single:
            out["participation"] = self.participation.as_dict()
        if self.max_rounds is not None:
            out["max-rounds"] = int(self.max_rounds)
        if self.adaptive is not None:
            out["adaptive-clip"] = self.adaptive.as_dict()
        return out


def check_delta_for(delta: float, examples: int, where: str = "") -> None:
    """Refuse ``δ ≥ 1/n`` for a learner whose data size ``n`` is declared (a loader's
    ``num_examples``, ``plan``'s ``examples``). Why: an ``(ε, δ)`` mechanism may publish
    one of ``n`` examples outright with probability ``n·δ`` (the "name and shame" mechanism,
    Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", §2.3), so a δ of
    ``1/n`` or more guarantees nothing; common practice keeps it well below ``1/n``. ``n``
    is a declared setting, equal on neighbouring datasets (replace-one), so the refusal
    says nothing about the data."""
    n = int(examples)
    if n >= 1 and float(delta) * n >= 1.0:
        raise PrivacyConfigError(
            f"δ = {float(delta):g} is at least 1/n for the {n} examples declared{where}: a "
            f"mechanism may then publish an example outright; use δ ≪ 1/n, e.g. "
            f"{min(1e-5, 0.1 / n):.1g}")


def derive_seed(run_seed: int, learner: int) -> int:
    """A learner's 128-bit noise seed for *reproducible simulations*.

    Every engine (Flower's simulation and the in-process one) derives learner ``i``'s seed
    this way, so the same run seed gives the same noise everywhere. Deployed learners use
    OS entropy instead (``seed=None``) and never share their seed.
    """
    words = np.random.SeedSequence([int(run_seed), int(learner), 0x5EED]).generate_state(
        4, dtype=np.uint32
    )
    return int(sum(int(w) << (32 * i) for i, w in enumerate(words)))



@lru_cache(maxsize=256)
def _adaptive_calibration(settings: PrivacySettings) -> tuple[Calibration, float]:
    return calibrate_adaptive(settings.factorization(), settings.epsilon, settings.delta,
                              settings.adaptive, settings.method,  # type: ignore[arg-type]
                              settings.participation)


@lru_cache(maxsize=256)
def _calibration(settings: PrivacySettings) -> Calibration:
    if settings.adaptive is not None:  # unit clip, the clip counts composed in
        return _adaptive_calibration(settings)[0]
    return calibrate_factorization(
        settings.factorization(), settings.epsilon, settings.delta, settings.clip_norm,
        settings.method, settings.participation)  # type: ignore[arg-type]


@lru_cache(maxsize=8192)
def _epsilon_spent(settings: PrivacySettings, steps: int) -> float:
    cal = _calibration(settings)
    if settings.adaptive is not None:
        spent = epsilon_spent_adaptive(settings.factorization(), cal.std,
                                       _adaptive_calibration(settings)[1], settings.delta,
                                       settings.method, settings.participation, steps)
        return min(spent, float(settings.epsilon))
    spent = epsilon_spent(
        cal.std, settings.delta, settings.clip_norm, settings.mechanism, settings.horizon, steps,
        settings.method, settings.participation, settings.mechanism_params(),  # type: ignore[arg-type]
    )
    return min(spent, float(settings.epsilon))


#: the privacy metadata a learner releases (:func:`privacy_metrics`): functions of its
#: settings and its step counter only
PRIVACY_METRICS = ("steps", "horizon", "epsilon", "delta", "epsilon-spent", "noise-std")


def privacy_metrics(settings: PrivacySettings, steps: int,
                    noise_std: float | None = None) -> dict[str, float]:
    """What a learner may release besides its noised arrays, after ``steps`` steps of its
    stream: the steps, the horizon and — with noise — ε, δ, ε spent and the noise std
    (``noise_std``: the stream's own, else the calibrated one). The one definition every
    front end reports (the NumPy round, the torch optimizer, the Flower release gate), so
    that the released metadata cannot drift from one front end to another."""
    out: dict[str, float] = {"steps": float(steps), "horizon": float(settings.horizon)}
    cal = settings.calibration()
    if cal is not None:
        out.update({"epsilon": float(settings.epsilon), "delta": float(settings.delta),
                    "epsilon-spent": settings.epsilon_spent(steps),
                    "noise-std": float(cal.std if noise_std is None else noise_std)})
    return out
