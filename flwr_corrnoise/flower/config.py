"""A learner's privacy settings from Flower's configs, and the server's proposal of them.

Why here and not with :class:`~flwr_corrnoise.settings.PrivacySettings`: the kebab-case
keys of ``context.run_config`` / ``node_config`` and the ``privacy-*`` keys a server sends
are the messaging layer's; the settings themselves (and their calibration) know nothing of
Flower. Every Flower front end reads its settings with :func:`settings_from_config`, and a
server proposal that would weaken them is refused by :func:`check_proposal` before
anything is applied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..adaptive_clipping import AdaptiveClipping
from ..mechanisms.participation import (
    Participation,
    ParticipationError,
    SampledParticipation,
)
from ..settings import NOISELESS, PrivacyConfigError, PrivacySettings
from ..settings_keys import lookup, require, summarized


@summarized(error=PrivacyConfigError)  # one line for the defaults; near misses refused
def settings_from_config(cfg: Mapping[str, Any], where: str = "config", *,
                         per_round: bool = False) -> PrivacySettings:
    """Read ``mechanism``, ``epsilon``, ``delta``, ``clip-norm``, ``horizon`` (or
    ``num-server-rounds`` × ``local-steps``), ``calibration`` and the participation
    (``data-reuse``, ``epochs``, ``min-sep``, ``max-participations``:
    :func:`participation_from_config`) by the key table
    (:mod:`flwr_corrnoise.settings_keys`): a missing key is its default with a logged
    warning naming it (``where`` names the config in that warning). ``per_round``: the
    horizon counts rounds (the per-round mod, central DP)."""
    try:
        horizon = lookup(cfg, "horizon", where)
        if horizon is None or horizon <= 0:
            horizon = (require(cfg, "num-server-rounds", where, "it sets the horizon")
                       * require(cfg, "local-steps", where, "it sets the horizon"))
        # validated first: a bad mechanism or budget is named before the rest
        base = PrivacySettings(
            mechanism=lookup(cfg, "mechanism", where),
            epsilon=lookup(cfg, "epsilon", where),
            delta=lookup(cfg, "delta", where),
            clip_norm=lookup(cfg, "clip-norm", where),
            horizon=int(horizon),
            method=lookup(cfg, "calibration", where),
        )
        adaptive = adaptive_from_config(cfg, where)
        if not base.private:  # no noise: no participation to account
            if adaptive is not None:
                raise PrivacyConfigError("adaptive clipping needs a noise mechanism: "
                                         "mechanism 'none' does not clip")
            return base
        return replace(
            base,
            participation=participation_from_config(cfg, where, int(horizon),
                                                    per_round=per_round),
            max_rounds=None if per_round else rounds_bound(cfg, where),
            adaptive=adaptive,
        )
    except (TypeError, ValueError) as err:
        if isinstance(err, PrivacyConfigError):
            raise
        raise PrivacyConfigError(f"malformed privacy configuration: {err}") from err


def adaptive_from_config(cfg: Mapping[str, Any], where: str) -> AdaptiveClipping | None:
    """The ``adaptive-clip-*`` keys (:class:`~flwr_corrnoise.adaptive_clipping.
    AdaptiveClipping`), or ``None`` without ``adaptive-clip-quantile``."""
    try:
        return AdaptiveClipping.from_config(
            lookup(cfg, "adaptive-clip-quantile", where, warn=False),
            lookup(cfg, "adaptive-clip-lr", where, warn=False),
            lookup(cfg, "adaptive-clip-noise", where, warn=False))
    except ValueError as err:
        raise PrivacyConfigError(f"the {where}: {err}") from err


def privacy_proposal(settings: PrivacySettings) -> dict[str, Any]:
    """What a server sends so learners can check it (``privacy-*`` keys)."""
    return {
        "privacy-mechanism": settings.mechanism,
        "privacy-epsilon": float(settings.epsilon),
        "privacy-delta": float(settings.delta),
        "privacy-clip-norm": float(settings.clip_norm),
        "privacy-horizon": int(settings.horizon),
    }


def check_proposal(settings: PrivacySettings, proposal: Mapping[str, Any]) -> None:
    """Refuse a server proposal that would weaken this learner's privacy.

    Weaker means: a different mechanism or noise turned off, a larger ε or δ, a larger
    clip norm, or a longer horizon than the noise is calibrated for. Keys the server
    does not send are not checked (the learner uses its own values regardless).
    """
    if not settings.private:
        return
    problems = []
    mech = proposal.get("privacy-mechanism")
    if mech is not None and mech != settings.mechanism:
        what = "turn the noise off" if mech == NOISELESS else f"switch to {mech!r}"
        problems.append(f"the server asks to {what}, but this learner uses {settings.mechanism!r}")
    for key, mine, name in (
        ("privacy-epsilon", settings.epsilon, "ε"),
        ("privacy-delta", settings.delta, "δ"),
        ("privacy-clip-norm", settings.clip_norm, "clip norm"),
        ("privacy-horizon", settings.horizon, "horizon"),
    ):
        if key not in proposal:
            continue
        try:
            theirs = float(proposal[key])
        except (TypeError, ValueError):
            problems.append(f"{key} is not a number: {proposal[key]!r}")
            continue
        if not math.isfinite(theirs) or theirs > mine:
            problems.append(f"{name} {theirs:g} exceeds this learner's {mine:g}")
    if problems:
        raise PrivacyConfigError(
            "refusing a configuration that would weaken this learner's privacy: "
            + "; ".join(problems)
        )


#: what a config must say when it declares no participation (no default: "each datum
#: once" made every epoch-training app print an ε that did not hold, issue 32)
PARTICIPATION_REQUIRED = (
    "how often each datum is used must be declared — the ε depends on it and a Flower app "
    "that trains epochs uses every example many times. Declare one of: data-reuse = "
    "'every-round' (the app trains on its local dataset every round: the safe choice for "
    "an ordinary train()), epochs = k (k passes in one order fixed once: use CyclicLoader, "
    "which sets it), min-sep / max-participations, or data-reuse = 'once' (a stream: each "
    "datum used once and discarded, Zhang et al.'s setting)")


#: the config keys that declare how often a datum is used (one of them is required)
PARTICIPATION_KEYS = ("data-reuse", "epochs", "min-sep", "max-participations")


def _reuse(cfg: Mapping[str, Any], where: str) -> str | None:
    raw = cfg.get("data-reuse")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    reuse = str(raw).strip().lower()
    if reuse not in ("once", "every-round"):
        raise PrivacyConfigError(f"'data-reuse' in the {where} must be 'once' or "
                                 f"'every-round', got {raw!r}")
    return reuse


def rounds_bound(cfg: Mapping[str, Any], where: str) -> int | None:
    """The most rounds a per-step learner may take part in under its declared data use:
    ``num-server-rounds`` with ``data-reuse = "every-round"`` (each round uses every datum
    once more), else ``None`` (the horizon bounds the steps)."""
    if _reuse(cfg, where) != "every-round":
        return None
    return int(require(cfg, "num-server-rounds", where,
                       "with data-reuse = 'every-round' it bounds a datum's uses"))


def sampled_participation(cfg: Mapping[str, Any], where: str,
                          horizon: int) -> SampledParticipation:
    """The participation of a sampling loop (``sampling-rate``, ``sampling-cycle``,
    ``expected-batch-size``: :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`
    sets all three; ``sampling-relation``, the neighbouring relation of the ε, default
    replace-one)."""
    try:
        return SampledParticipation.cyclic_poisson(
            lookup(cfg, "sampling-rate", where, warn=False),
            lookup(cfg, "sampling-cycle", where, warn=False), horizon,
            require(cfg, "expected-batch-size", where,
                    "a sampled step's noised sum is divided by it, never by the drawn size"),
            relation=str(lookup(cfg, "sampling-relation", where, warn=False)).strip().lower())
    except ParticipationError as err:
        raise PrivacyConfigError(f"sampling in the {where}: {err}") from err


def participation_from_config(cfg: Mapping[str, Any], where: str, horizon: int, *,
                              per_round: bool = False) -> Participation:
    """How often one datum enters the ``horizon`` steps (or rounds), from the keys
    ``data-reuse``, ``epochs``, ``min-sep`` and ``max-participations``.

    * ``data-reuse = "every-round"``: the app trains on its whole local dataset every
      round. Per round (``per_round``: the mod, central DP) a datum is in every one of the
      ``horizon`` rounds' updates; per step, it is used once per round at a step the
      library cannot know (≤ ``num-server-rounds`` uses, any separation; a round past
      ``num-server-rounds`` is refused, :attr:`PrivacySettings.max_rounds`).
    * ``epochs = k``: ``k`` passes over the data in one order fixed once
      (:class:`~flwr_corrnoise.data.loader.CyclicLoader`), ``horizon / k`` steps each.
    * ``min-sep = b`` / ``max-participations = k``: at most ``k`` uses (default: as many
      as fit), at least ``b`` steps apart (default 1).
    * ``data-reuse = "once"``: each datum once (Zhang, Zhu, Fay & Johansson's ("Locally
      Differentially Private Online Federated Learning With Correlated Noise") stream).
    * none of them: refused (:data:`PARTICIPATION_REQUIRED`). There is no default: the
      library cannot see how the app's own loop uses its data, and "once" made every app
      that trains epochs print an ε that did not hold.
    """
    reuse = _reuse(cfg, where)
    epochs = lookup(cfg, "epochs", where, warn=False)
    min_sep = lookup(cfg, "min-sep", where, warn=False)
    max_p = lookup(cfg, "max-participations", where, warn=False)
    if lookup(cfg, "sampling-rate", where, warn=False) is not None:
        if per_round or not (reuse is None and epochs is None and min_sep is None
                             and max_p is None):
            raise PrivacyConfigError(
                f"the {where} declares sampling-rate and "
                + ("a per-round update" if per_round else
                   "data-reuse / epochs / min-sep / max-participations")
                + ": sampling is a per-step participation of its own; declare one")
        return sampled_participation(cfg, where, horizon)
    if reuse is None and epochs is None and min_sep is None and max_p is None:
        raise PrivacyConfigError(f"the {where}: {PARTICIPATION_REQUIRED}")
    if reuse is not None and not (epochs is None and min_sep is None and max_p is None):
        raise PrivacyConfigError(
            f"the {where} declares data-reuse = {reuse!r} and epochs / min-sep / "
            "max-participations: declare one participation")
    try:
        if reuse == "every-round":
            if per_round:
                return Participation.every_step(horizon)
            return Participation.min_separation(1, int(rounds_bound(cfg, where) or 0))
        return Participation.from_options(horizon, epochs=epochs, min_sep=min_sep,
                                          max_participations=max_p)
    except ParticipationError as err:
        raise PrivacyConfigError(f"participation in the {where}: {err}") from err
