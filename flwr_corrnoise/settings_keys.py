"""The one table of flwr-corrnoise's configuration keys: name, default, docs, who sets it.

Why one table: the learners (:class:`~flwr_corrnoise.flower.session.LearnerSession`) and
the server strategies (:meth:`CorrNoiseFedAvg.from_run_config
<flwr_corrnoise.flower.strategy.CorrNoiseFedAvg.from_run_config>`,
:meth:`CorrNoiseCentralDPStrategy.from_run_config
<flwr_corrnoise.flower.central_dp.CorrNoiseCentralDPStrategy.from_run_config>`,
:class:`~flwr_corrnoise.flower.local_dp.CorrNoiseLocalDPStrategy`) read the same keys with
the same defaults, so server and learners cannot drift apart by hand (the server proposing
``blt`` while its learners default to ``optimized``). A key that is missing is read as its
default **with a logged warning naming the default** — never silently.

Where a key may be set (``who``):

* ``app``: the app's code (``config_defaults=`` of the learner front ends);
* ``run``: the run config (``[tool.flwr.app.config]`` in ``pyproject.toml``, or
  ``flwr run --run-config``): the server's. A learner reads it as its own only in Flower's
  simulation engine; on a real SuperNode its privacy keys are a proposal it checks;
* ``node``: the node config (``flower-supernode --node-config``): the learner operator's.

``docs/flower.md`` shows :func:`render_markdown`'s table (a test keeps it in sync;
``python -m flwr_corrnoise.settings_keys`` prints it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

APP, RUN, NODE = "app", "run", "node"


@dataclass(frozen=True)
class Key:
    """One configuration key. ``default=None`` means "no default": required, or derived
    as the docs say. ``side``: who reads it (``learner``, ``server`` or ``both``)."""

    name: str
    kind: type
    default: Any
    who: tuple[str, ...]
    side: str
    doc: str


KEYS: dict[str, Key] = {k.name: k for k in (
    Key("mechanism", str, "optimized", (APP, RUN, NODE), "both",
        "noise mechanism (`none` = no noise, no clipping); the server proposes it, each "
        "learner refuses another one"),
    Key("epsilon", float, 2.0, (APP, RUN, NODE), "both",
        "privacy budget ε over the whole horizon"),
    Key("delta", float, 1e-3, (APP, RUN, NODE), "both", "privacy parameter δ"),
    Key("clip-norm", float, 1.0, (APP, RUN, NODE), "both",
        "L2 clip norm: of each gradient (per-step), of each round update (mod, central)"),
    Key("calibration", str, "exact", (APP, RUN, NODE), "both",
        "how the noise std is calibrated to (ε, δ)"),
    Key("horizon", int, None, (APP, RUN, NODE), "both",
        "steps (per-step) or rounds (mod) the noise is calibrated for; default "
        "`num-server-rounds` × `local-steps` (per-step) or `num-server-rounds` (mod, central)"),
    Key("data-reuse", str, "once", (APP, RUN, NODE), "both",
        "`every-round`: the app trains on its whole local dataset every round (the ε "
        "accounts for a datum in every round's update: mod, central; once per round at "
        "any step: per-step); `once`: each datum used once (paper 000's stream)"),
    Key("epochs", int, None, (APP, RUN, NODE), "both",
        "per-step: passes over the local data in one order fixed once (`CyclicLoader`); "
        "`horizon / epochs` steps each"),
    Key("min-sep", int, None, (APP, RUN, NODE), "both",
        "fewest steps (per-step) or rounds (mod, central) between two uses of one datum"),
    Key("max-participations", int, None, (APP, RUN, NODE), "both",
        "most uses of one datum over the horizon (default with `min-sep`: as many as fit)"),
    Key("num-server-rounds", int, None, (APP, RUN, NODE), "both",
        "rounds of the run; required by the servers, and by a learner without `horizon`"),
    Key("local-steps", int, None, (APP, RUN, NODE), "both",
        "τ, local steps per round; required by `CorrNoiseFedAvg` and by a per-step learner "
        "without `horizon`"),
    Key("learning-rate", float, None, (RUN,), "server",
        "η, the learners' local step size, sent by `CorrNoiseFedAvg` in every round config "
        "(required by it)"),
    Key("server-learning-rate", float, 1.0, (RUN,), "server", "η_g, the server's step size"),
    Key("min-learners", int, 1, (RUN,), "server",
        "fewest learners a round needs; `CorrNoiseCentralDPStrategy` releases a round only "
        "with at least this many replies and raises the wrapped strategy's node minimums to "
        "it"),
    Key("connect-timeout", float, 60.0, (RUN,), "server",
        "seconds `CorrNoiseCentralDPStrategy` waits for `min-learners` SuperNodes before a "
        "round; then the run stops with an error"),
    Key("max-idle-rounds", int, 3, (RUN,), "server",
        "consecutive rounds with nothing released (every learner refused, or no reply) "
        "after which the run stops with an error naming the learners' error codes"),
    Key("seed", int, None, (RUN,), "both",
        "simulation only: learners derive reproducible noise seeds from it and "
        "`partition-id`"),
    Key("noise-seed", int, None, (APP, NODE), "learner",
        "simulation only: the learner's own noise seed (refused on a real SuperNode)"),
    Key("partition-id", int, None, (NODE,), "learner",
        "the learner's data partition; reported as `learner-id` and keys its ε in the "
        "round metrics"),
    Key("state-dir", str, None, (NODE,), "learner",
        "directory for the learner's state, ledger and diagnostics (deployment)"),
    Key("secure-noise", bool, False, (APP, NODE), "learner",
        "ChaCha20 noise keyed from OS entropy on a power-of-two grid (takes no seed); the "
        "learner's opt-in"),
    Key("release-metrics", str, "", (APP, NODE), "learner",
        "metrics the learner accepts to leak (unaccounted in ε); none by default"),
    Key("client-evaluation", bool, False, (APP, NODE), "learner",
        "answer evaluate messages (unaccounted client-side evaluation)"),
)}

#: the keys that make up a learner's privacy settings
PRIVACY_KEYS = ("mechanism", "epsilon", "delta", "clip-norm", "calibration")

_warned: set[tuple[str, str]] = set()


class ConfigKeyError(ValueError):
    """A required configuration key is missing or malformed."""


def lookup(cfg: Mapping[str, Any], name: str, where: str, *, warn: bool = True) -> Any:
    """``cfg[name]`` cast to the key's type, or its default with a warning (once per key
    and ``where``) that names the default; ``None`` if there is no default."""
    key = KEYS[name]
    value = cfg.get(name)
    if value is None:
        if warn and key.default is not None and (name, where) not in _warned:
            _warned.add((name, where))
            log.warning("flwr-corrnoise: no %r in the %s; using the default %r", name, where,
                        key.default)
        return key.default
    try:
        if key.kind is bool and isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes")
        return key.kind(value)
    except (TypeError, ValueError) as err:
        raise ConfigKeyError(f"{name!r} in the {where} is not a {key.kind.__name__}: "
                             f"{value!r}") from err


def require(cfg: Mapping[str, Any], name: str, where: str, why: str) -> Any:
    """``cfg[name]`` cast to the key's type, or a :class:`ConfigKeyError` saying why it is
    needed (a missing round count must never become a silent horizon of 1)."""
    if cfg.get(name) is None:
        raise ConfigKeyError(f"flwr-corrnoise: {name!r} is missing from the {where}: {why} "
                             f"({KEYS[name].doc})")
    return lookup(cfg, name, where)


def render_markdown() -> str:
    """The key table as Markdown (shown in ``docs/flower.md``)."""
    names = {APP: "app code", RUN: "run config", NODE: "node config"}
    lines = ["| key | type | default | set in | read by | what |",
             "|---|---|---|---|---|---|"]
    for k in KEYS.values():
        default = "—" if k.default is None else f"`{k.default!r}`".replace("'", '"')
        where = ", ".join(names[w] for w in k.who)
        lines.append(f"| `{k.name}` | {k.kind.__name__} | {default} | {where} | {k.side} | "
                     f"{k.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(render_markdown(), end="")
