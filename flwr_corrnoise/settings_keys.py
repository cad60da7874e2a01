"""The one table of flwr-corrnoise's configuration keys: name, default, docs, who sets it.

Why one table: the learners (:class:`~flwr_corrnoise.flower.session.LearnerSession`) and
the server strategies (:meth:`CorrNoiseFedAvg.from_run_config
<flwr_corrnoise.flower.strategy.CorrNoiseFedAvg.from_run_config>`,
:meth:`CorrNoiseCentralDPStrategy.from_run_config
<flwr_corrnoise.flower.central_dp.CorrNoiseCentralDPStrategy.from_run_config>`,
:class:`~flwr_corrnoise.flower.local_dp.CorrNoiseLocalDPStrategy`) read the same keys with
the same defaults, so server and learners cannot drift apart by hand (the server proposing
``toeplitz`` while its learners default to ``blt``). A key that is missing is read as its
default, never silently: a reader that reads several keys (:func:`reading`, around
:func:`~flwr_corrnoise.flower.config.settings_from_config`
and the servers' ``from_run_config``) logs **one start-up line** naming every default it
used, once per process. A key that is *not* in the table but close to one (``epsilom``,
``clip_norm``) is an error that says "did you mean" (:func:`check_keys`): a typo must never
run silently at the default budget.

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

import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")

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
    Key("mechanism", str, "blt", (APP, RUN, NODE), "both",
        "noise mechanism (`none` = no noise, no clipping); the server proposes it, each "
        "learner refuses another one. Default `blt`: built in seconds at any horizon, "
        "RMSE within 5 % of the optimum (`optimized` solves for minutes at N in the "
        "thousands)"),
    Key("epsilon", float, 2.0, (APP, RUN, NODE), "both",
        "privacy budget ε over the whole horizon"),
    Key("delta", float, 1e-5, (APP, RUN, NODE), "both",
        "privacy parameter δ; keep it well below 1/n for n examples per learner (refused "
        "at δ ≥ 1/n where n is declared: a loader, `plan --examples`)"),
    Key("clip-norm", float, 1.0, (APP, RUN, NODE), "both",
        "L2 clip norm: of each gradient (per-step), of each round update (mod, central); "
        "with `adaptive-clip-quantile`, its initial value"),
    Key("adaptive-clip-quantile", float, None, (APP, RUN, NODE), "learner",
        "turns adaptive clipping on (Andrew et al. 2021, per learner): the fraction γ of "
        "norms the clip norm tracks, e.g. 0.5; the clip norm is learner state, never sent, "
        "and its noised counts are composed into ε (docs/privacy.md#adaptive-clipping)"),
    Key("adaptive-clip-lr", float, None, (APP, RUN, NODE), "learner",
        "with `adaptive-clip-quantile`: η_C, the geometric step of ln C per local step (per "
        "round in the mod); default 0.01"),
    Key("adaptive-clip-noise", float, None, (APP, RUN, NODE), "learner",
        "with `adaptive-clip-quantile`: σ_b, the std of the noise on each step's unclipped "
        "count; default: the counts take 10 % of μ² (the gradient noise grows 5.4 %)"),
    Key("calibration", str, "exact", (APP, RUN, NODE), "both",
        "how the noise std is calibrated to (ε, δ)"),
    Key("horizon", int, None, (APP, RUN, NODE), "both",
        "steps (per-step) or rounds (mod) the noise is calibrated for; default "
        "`num-server-rounds` × `local-steps` (per-step) or `num-server-rounds` (mod, central)"),
    Key("data-reuse", str, None, (APP, RUN, NODE), "both",
        "no default — declare it (or `epochs`, `min-sep`; `CyclicLoader` sets `epochs`): "
        "`every-round`: the app trains on its whole local dataset every round (the ε "
        "accounts for a datum in every round's update: mod, central; once per round at "
        "any step: per-step, and a round past `num-server-rounds` is refused); `once`: "
        "each datum used once (Zhang et al.'s stream)"),
    Key("epochs", int, None, (APP, RUN, NODE), "both",
        "per-step: passes over the local data in one order fixed once (`CyclicLoader`); "
        "`horizon / epochs` steps each"),
    Key("min-sep", int, None, (APP, RUN, NODE), "both",
        "fewest steps (per-step) or rounds (mod, central) between two uses of one datum"),
    Key("max-participations", int, None, (APP, RUN, NODE), "both",
        "most uses of one datum over the horizon (default with `min-sep`: as many as fit)"),
    Key("sampling-rate", float, None, (APP, RUN, NODE), "both",
        "per-step: the loop samples its batches (`CyclicPoissonLoader` sets it): each "
        "eligible example drawn with this probability, the noise calibrated to the "
        "amplified guarantee (docs/privacy.md#amplification-by-sampling-cyclic-poisson-and-"
        "banded-noise); needs `expected-batch-size`"),
    Key("sampling-cycle", int, 1, (APP, RUN, NODE), "both",
        "with `sampling-rate`: the groups of cyclic Poisson sampling (step i draws from "
        "group i mod cycle; 1 = Poisson sampling, DP-SGD); a banded mechanism gets this "
        "many bands"),
    Key("expected-batch-size", float, None, (APP, RUN, NODE), "both",
        "with `sampling-rate`: what every step's noised sum is divided by (never the "
        "drawn size, which stays secret)"),
    Key("sampling-relation", str, "replace-one", (APP, RUN, NODE), "both",
        "with `sampling-rate`: the neighbouring relation the amplified ε is stated for: "
        "`replace-one` (one example changed, the relation of every other guarantee here) "
        "or `add-remove` (one example added or removed, what Opacus reports: less noise "
        "for the same ε); the ε is labelled with it"),
    Key("local-examples", int, None, (APP, NODE), "learner",
        "the learner's declared number of training examples n: with `data-reuse = "
        "'every-round'` a `PrivateSteps` round of more than n steps (each uses an example "
        "at least) is refused, as is δ ≥ 1/n (docs/threat-model.md)"),
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
    Key("state-offload", str, "auto", (APP, RUN, NODE), "learner",
        "simulation only: keep a learner state in a file with a handle in `context.state` "
        "(`auto`: states ≥ 1 MiB; `on`; `off`), so the simulation process does not grow "
        "with every learner that trained"),
    Key("state-offload-dir", str, None, (APP, RUN, NODE), "learner",
        "simulation only: the run-level folder of offloaded learner states (default: "
        "`flwr-corrnoise-states` in the temp dir)"),
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

#: the defaults already announced in this process: (where, key)
_warned: set[tuple[str, str]] = set()


class ConfigKeyError(ValueError):
    """A configuration key is missing, malformed, or a near miss of one in the table."""


@dataclass
class _Reading:
    """The defaults one reader used (:func:`reading`), logged as one line at its end."""

    where: str
    defaults: dict[str, Any] = field(default_factory=dict)


_reading: ContextVar[_Reading | None] = ContextVar("flwr_corrnoise_reading", default=None)


def _normalized(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


def _distance(a: str, b: str) -> int:
    """Edit distance with adjacent transpositions (``epsilno`` is one edit from
    ``epsilon``): the optimal-string-alignment variant of Damerau–Levenshtein."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


@functools.lru_cache(maxsize=4096)
def suggest(name: str) -> str | None:
    """The table key ``name`` is a near miss of, or ``None`` (memoized: a function of the
    name and the fixed table only).

    Why memoized: every message a learner answers reads its run and node config, and each
    of an app's own keys (``num-learners``, ``num-partitions``) was compared with every
    table key each time — 26 edit distances in pure Python, ≈ 0.9 ms a key: the
    reference app's nine keys made its learner message 13.0 ms instead of 2.0 ms
    (docs/benchmarks-history.md, the configuration check).

    Near means: the same key up to case, ``_`` for ``-`` or spaces (``clip_norm``), or at
    most ``max(1, len(key) // 6)`` edits away (one edit for ``epsilon``, two for
    ``learning-rate``). Why so strict: a run config also holds the app's own keys
    (``beta``, ``num-learners``, ``local-epochs``), which must not be taken for typos of
    ours (``delta``, ``min-learners``, ``epochs`` are 2, 3 and 6 edits away)."""
    if name in KEYS:
        return None
    norm = _normalized(name)
    if norm in KEYS:
        return norm
    distance, best = min((_distance(norm, k), k) for k in KEYS)
    return best if distance <= max(1, len(best) // 6) else None


def check_keys(cfg: Mapping[str, Any], where: str, *, known: Iterable[str] = ()) -> None:
    """Refuse a key of ``cfg`` that is not in the table (nor in ``known``) but is a near
    miss of one (:func:`suggest`): ``epsilom = 0.5`` must not run at the default ε.

    Raises :class:`ConfigKeyError`, one line: "'epsilom' in the run config is not a
    flwr-corrnoise key: did you mean 'epsilon'?". Keys far from every table key are the
    app's own and pass."""
    allowed = set(known)
    for name in cfg:
        if name in KEYS or name in allowed:
            continue
        guess = suggest(str(name))
        if guess is not None:
            raise ConfigKeyError(
                f"flwr-corrnoise: {name!r} in the {where} is not a flwr-corrnoise key: did "
                f"you mean {guess!r}? (the keys: docs/flower.md#configuration-keys; an app "
                f"key of your own this close to one of them needs another name)")


@contextmanager
def reading(cfg: Mapping[str, Any], where: str, *, known: Iterable[str] = ()) -> Iterator[None]:
    """Read several keys of ``cfg`` as one reader: near-miss keys refused first
    (:func:`check_keys`), and the defaults :func:`lookup` falls back to inside the block
    logged as **one line** at its end (each default once per process and ``where``),
    instead of one warning per key. A reading inside another joins it (a
    server's ``from_run_config`` around
    :func:`~flwr_corrnoise.flower.config.settings_from_config`: one line)."""
    check_keys(cfg, where, known=known)
    if _reading.get() is not None:
        yield
        return
    current = _Reading(where)
    token = _reading.set(current)
    try:
        yield
    finally:
        _reading.reset(token)
    _log_defaults(current.where, current.defaults)


def summarized(func: Callable[..., _T] | None = None, *,
               error: type[Exception] | None = None) -> Any:
    """Decorator: run ``func(…, cfg, where, …)`` inside :func:`reading` (its ``cfg`` and
    ``where`` arguments), so that everything it reads gives one default line. ``error``:
    the exception class a near-miss key is raised as (the learner's
    ``PrivacyConfigError``, whose text its error reply carries), instead of
    :class:`ConfigKeyError`."""

    def decorate(inner: Callable[..., _T]) -> Callable[..., _T]:
        signature = inspect.signature(inner)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> _T:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            try:
                with reading(bound.arguments["cfg"], str(bound.arguments["where"])):
                    return inner(*args, **kwargs)
            except ConfigKeyError as err:
                if error is None or isinstance(err, error):
                    raise
                raise error(str(err)) from err

        return wrapper

    return decorate(func) if func is not None else decorate


def _log_defaults(where: str, defaults: Mapping[str, Any]) -> None:
    """One line for the defaults not announced yet for ``where`` in this process."""
    shown = [(k, v) for k, v in defaults.items() if (where, k) not in _warned]
    if not shown:
        return
    _warned.update((where, k) for k, _ in shown)
    log.warning("flwr-corrnoise: not set in the %s, using the defaults: %s "
                "(docs/flower.md#configuration-keys)", where,
                ", ".join(f"{k}={v!r}" for k, v in shown))


def lookup(cfg: Mapping[str, Any], name: str, where: str, *, warn: bool = True) -> Any:
    """``cfg[name]`` cast to the key's type, or its default; ``None`` if there is no
    default. A default is announced (``warn``): inside :func:`reading` in its one line,
    else in a line of its own (once per process)."""
    key = KEYS[name]
    value = cfg.get(name)
    if value is None:
        if warn and key.default is not None:
            current = _reading.get()
            if current is not None:
                current.defaults.setdefault(name, key.default)
            else:
                _log_defaults(where, {name: key.default})
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
