"""One learner's side of paper 000's Algorithm 1, independent of any messaging layer.

This module holds the **one private step** (:func:`private_step`: the horizon, a datum
without a gradient counted as zero, clipping, the stream's increment, the counters) and
the round built on it (:func:`local_round`), which every NumPy front end uses: the Flower
``NumPyClient`` subclass, the Message-API ``ClientApp`` helper,
:class:`~flwr_corrnoise.flower.PrivateSteps`, the per-round mod and the in-process sweep
engine. The torch device step (:class:`~flwr_corrnoise.torch.PrivateOptimizer`) keeps
its per-example clipping and noise add on the device and takes the rest from here (the
horizon rule :func:`check_horizon`, the refusals :func:`check_round`, the learner state
and its counters, :func:`privacy_metrics`). The learner owns its privacy: its
:class:`PrivacySettings` come from its own configuration, and a server proposal that would
weaken them is refused (:meth:`PrivacySettings.check_proposal`) before anything is applied.

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

import json
import logging
import math
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from typing import Any, TypeVar

import numpy as np

from . import arraypack
from .mechanisms import (
    MECHANISMS,
    Factorization,
    FactorizationChangedError,
    build_factorization,
    get_mechanism,
)
from .mechanisms.participation import ONCE, Participation, ParticipationError
from .privacy import (
    METHODS,
    Calibration,
    calibrate_factorization,
    check_budget,
    epsilon_spent,
)
from .settings_keys import lookup, require, summarized
from .streams import (
    HorizonExhaustedError,
    NoiseStream,
    StreamGroup,
    new_seed,
    restore_stream,
    split_flat,
)

log = logging.getLogger(__name__)

#: the mechanism name that means "no noise, no clipping" (Mitra et al.'s online FedAvg)
NOISELESS = "none"

#: gradient oracle: (parameters, stream position) → gradient on that datum, same shapes
GradientFn = Callable[[list[np.ndarray], int], Sequence[np.ndarray]]


class PrivacyConfigError(ValueError):
    """A configuration that would weaken the learner's privacy, or is malformed."""


class NonFiniteError(ValueError):
    """A gradient, loss or update is NaN or infinite; the step is not applied."""


@dataclass(frozen=True)
class PrivacySettings:
    """A learner's own privacy: what its noise is calibrated to. Never set by the server.

    ``mechanism="none"`` turns noise and clipping off (the noiseless baseline).
    ``clip_norm`` is the L2 clip norm ``B_g`` (config key ``clip-norm``; Flower's DP
    wrappers call it ``clipping_norm``, Opacus ``max_grad_norm``).
    """

    mechanism: str = "blt"
    epsilon: float = 2.0
    delta: float = 1e-3
    clip_norm: float = 1.0
    horizon: int = 4000
    method: str = "exact"
    #: how often one datum enters the ``horizon`` steps (default: once, paper 000's
    #: stream); the noise is calibrated to the sensitivity under it
    participation: Participation = ONCE
    #: the most rounds the learner may take part in (``data-reuse = "every-round"`` per
    #: step: the participation counts one use per round, so a round past this count would
    #: use every datum once more than the ε accounts for); ``None``: the horizon bounds it
    max_rounds: int | None = None

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

    @property
    def private(self) -> bool:
        return self.mechanism != NOISELESS

    def mechanism_params(self) -> dict[str, Any]:
        """The mechanism's build parameters these settings imply: a mechanism that can be
        optimized for a participation (``blt``: ``min_sep``, ``max_participations``) is
        built for this learner's, so its noise is the best for the loop that runs."""
        names = {p.name for p in get_mechanism(self.mechanism).params}
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
        return out

    # -- Flower config (kebab-case keys, as in context.run_config / node_config) ---------
    @classmethod
    @summarized(error=PrivacyConfigError)  # one line for the defaults; near misses refused
    def from_config(cls, cfg: Mapping[str, Any], where: str = "config", *,
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
            base = cls(  # validated first: a bad mechanism or budget is named before the rest
                mechanism=lookup(cfg, "mechanism", where),
                epsilon=lookup(cfg, "epsilon", where),
                delta=lookup(cfg, "delta", where),
                clip_norm=lookup(cfg, "clip-norm", where),
                horizon=int(horizon),
                method=lookup(cfg, "calibration", where),
            )
            if not base.private:  # no noise: no participation to account
                return base
            return replace(
                base,
                participation=participation_from_config(cfg, where, int(horizon),
                                                        per_round=per_round),
                max_rounds=None if per_round else rounds_bound(cfg, where),
            )
        except (TypeError, ValueError) as err:
            if isinstance(err, PrivacyConfigError):
                raise
            raise PrivacyConfigError(f"malformed privacy configuration: {err}") from err

    def proposal(self) -> dict[str, Any]:
        """What a server sends so learners can check it (``privacy-*`` keys)."""
        return {
            "privacy-mechanism": self.mechanism,
            "privacy-epsilon": float(self.epsilon),
            "privacy-delta": float(self.delta),
            "privacy-clip-norm": float(self.clip_norm),
            "privacy-horizon": int(self.horizon),
        }

    def check_proposal(self, proposal: Mapping[str, Any]) -> None:
        """Refuse a server proposal that would weaken this learner's privacy.

        Weaker means: a different mechanism or noise turned off, a larger ε or δ, a larger
        clip norm, or a longer horizon than the noise is calibrated for. Keys the server
        does not send are not checked (the learner uses its own values regardless).
        """
        if not self.private:
            return
        problems = []
        mech = proposal.get("privacy-mechanism")
        if mech is not None and mech != self.mechanism:
            what = "turn the noise off" if mech == NOISELESS else f"switch to {mech!r}"
            problems.append(f"the server asks to {what}, but this learner uses {self.mechanism!r}")
        for key, mine, name in (
            ("privacy-epsilon", self.epsilon, "ε"),
            ("privacy-delta", self.delta, "δ"),
            ("privacy-clip-norm", self.clip_norm, "clip norm"),
            ("privacy-horizon", self.horizon, "horizon"),
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


#: what a config must say when it declares no participation (no default: "each datum
#: once" made every epoch-training app print an ε that did not hold, issue 32)
PARTICIPATION_REQUIRED = (
    "how often each datum is used must be declared — the ε depends on it and a Flower app "
    "that trains epochs uses every example many times. Declare one of: data-reuse = "
    "'every-round' (the app trains on its local dataset every round: the safe choice for "
    "an ordinary train()), epochs = k (k passes in one order fixed once: use CyclicLoader, "
    "which sets it), min-sep / max-participations, or data-reuse = 'once' (a stream: each "
    "datum used once and discarded, paper 000's setting)")


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
    * ``data-reuse = "once"``: each datum once (paper 000's stream).
    * none of them: refused (:data:`PARTICIPATION_REQUIRED`). There is no default: the
      library cannot see how the app's own loop uses its data, and "once" made every app
      that trains epochs print an ε that did not hold.
    """
    reuse = _reuse(cfg, where)
    epochs = lookup(cfg, "epochs", where, warn=False)
    min_sep = lookup(cfg, "min-sep", where, warn=False)
    max_p = lookup(cfg, "max-participations", where, warn=False)
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


@lru_cache(maxsize=256)
def _calibration(settings: PrivacySettings) -> Calibration:
    return calibrate_factorization(
        settings.factorization(), settings.epsilon, settings.delta, settings.clip_norm,
        settings.method, settings.participation)  # type: ignore[arg-type]


@lru_cache(maxsize=8192)
def _epsilon_spent(settings: PrivacySettings, steps: int) -> float:
    cal = _calibration(settings)
    spent = epsilon_spent(
        cal.std, settings.delta, settings.clip_norm, settings.mechanism, settings.horizon, steps,
        settings.method, settings.participation, settings.mechanism_params(),  # type: ignore[arg-type]
    )
    return min(spent, float(settings.epsilon))


@dataclass
class LearnerState:
    """Everything a learner must remember between rounds (lives in ``context.state``).

    ``step`` counts local steps taken (= the noise stream's index), ``position`` the next
    datum of the learner's data stream, ``rounds`` the rounds it took part in.
    """

    step: int = 0
    position: int = 0
    rounds: int = 0
    noise: NoiseStream | None = None
    #: the noise seed (secret, like the generator state beside it; kept so an operator
    #: can audit or replay their own learner, never sent anywhere)
    seed: int | None = None
    #: the settings and factorization this state was made with (:meth:`PrivacySettings.binding`)
    binding: dict[str, Any] | None = None
    #: the learner's identity: 128 bits of OS entropy (hex), drawn when the learner is created
    #: and recorded in its ledger and marker, so that a state copied into another learner's
    #: directory is recognised (``None``: a state written before identities existed)
    learner_id: str | None = None
    #: how many rounds this state has committed; the ledger records it before every commit,
    #: so that an older copy of the state (rolled back) is recognised
    generation: int = 0
    #: a front end's own named arrays (the decentralized relay node's algorithm state),
    #: stored in this one format beside the counters (``payload/<name>`` when packed)
    payload: dict[str, np.ndarray] | None = None
    #: the last server round this learner released (``-1``: none yet, or rounds without a
    #: ``server-round``): a train message for it or an older round is refused, so one
    #: learner never releases twice in one round, whatever the server sends
    last_round: int = -1

    @staticmethod
    def new_id() -> str:
        """A fresh learner identity: 128 bits from OS entropy (``secrets``), so no two
        learners share one and no one can choose one to match another's."""
        return secrets.token_hex(16)

    @classmethod
    def create(
        cls,
        settings: PrivacySettings,
        shapes: Sequence[Sequence[int]],
        seed: int | None,
        *,
        secure: bool = False,
        dtype: Any = None,
    ) -> LearnerState:
        """A fresh learner. ``seed=None`` draws the noise seed from OS entropy.

        ``secure=True``: the noise comes from ChaCha20 keyed by OS entropy, on a
        power-of-two grid (:mod:`~flwr_corrnoise.secure_noise`); it takes no seed, and the
        state records none (its key lives only in the stream's state).

        ``dtype``: the stream's float dtype — float32 for a float32 model (its buffers,
        draws, recurrence and release in float32: :meth:`~flwr_corrnoise.streams.
        NoiseStream.create`), float64 otherwise (the default; secure streams always). It
        is the stream's for its whole life: a restored state keeps the dtype it records."""
        cal = settings.calibration()
        noise = None
        if secure and seed is not None:
            raise PrivacyConfigError("secure noise is keyed from OS entropy: it takes no seed")
        seed = None if secure else new_seed() if seed is None else int(seed)
        digest = ""
        if cal is not None:
            noise = NoiseStream.create(settings.mechanism, settings.horizon, shapes, cal.std,
                                       seed, secure=secure,
                                       factorization=settings.factorization(),
                                       dtype=None if secure else dtype)
            digest = noise.factorization.digest
        return cls(noise=noise, seed=seed, binding=settings.binding(digest),
                   learner_id=cls.new_id())

    def check_binding(self, settings: PrivacySettings) -> None:
        """Refuse to continue under other settings or another factorization than the
        state was made with: its noise is calibrated for those, and reporting new ones
        would misstate the privacy spent. The error names old and new."""
        if self.binding is None:
            return  # a state written before bindings existed: nothing to compare
        digest = self.noise.factorization.digest if self.noise is not None else ""
        now = settings.binding(str(self.binding.get("factorization", "")))
        # the loader's order is bound by the front end that knows the loader
        old = {k: v for k, v in self.binding.items() if k != DATA_ORDER}
        if self.noise is not None and digest != old.get("factorization"):
            raise PrivacyConfigError(
                f"the stored noise stream's factorization {digest[:16]}… is not the one the "
                f"state records ({str(old.get('factorization'))[:16]}…)"
            )
        if now != old:
            diff = "; ".join(f"{k}: stored {old.get(k)!r}, now {now.get(k)!r}"
                             for k in sorted(set(now) | set(old)) if now.get(k) != old.get(k))
            raise PrivacyConfigError(
                "the stored learner state was made with other privacy settings than this "
                f"learner has now ({diff}); its noise is calibrated for the stored ones, so it "
                "refuses to continue (restore the old settings, or start a new learner with a "
                "new state directory)"
            )
        if self.noise is not None:
            fresh = settings.factorization().digest
            if fresh != digest:
                log.warning("the %s factorization for N = %d in this process (%s…) differs "
                            "from the one this stream was made with (%s…); the stream keeps "
                            "its own", settings.mechanism, settings.horizon, fresh[:16],
                            digest[:16])

    def advance(self) -> None:
        """One step taken: the stream's index and the data position move on together."""
        self.step += 1
        self.position += 1

    def checkpoint(self) -> tuple[Any, ...]:
        """A token for :meth:`rollback`: the counters, the stream object and its own
        checkpoint. Why one place: every front end undoes a round that released nothing
        (an interrupt, a failed commit) the same way, so no released noise is reused and
        no counter moves without a release."""
        token = self.noise.checkpoint() if self.noise is not None else None
        return (self.step, self.position, self.rounds, self.generation, self.last_round,
                self.noise, token)

    def rollback(self, token: tuple[Any, ...]) -> None:
        """Undo everything since :meth:`checkpoint` (the stream object put back, too: a
        front end may have moved it to a device)."""
        (self.step, self.position, self.rounds, self.generation, self.last_round,
         self.noise, inner) = token
        if inner is not None:
            self.noise.rollback(inner)  # type: ignore[union-attr]

    def to_bytes(self) -> bytes:
        """The one learner-state format (:mod:`~flwr_corrnoise.arraypack`): every front
        end — the Flower learners, :class:`~flwr_corrnoise.torch.PrivateOptimizer` —
        stores this, whatever its stream's backend."""
        return arraypack.pack(self.state_dict())

    def state_dict(self, *, flat: bool = False, copy: bool = True) -> dict[str, np.ndarray]:
        """The named arrays :meth:`to_bytes` packs: the counters, the stream's state, the
        seed, the binding, the identity and generation. The stream's state is one packed
        ``noise`` array, or with ``flat=True`` its own arrays as ``noise/<name>`` (no packed
        copy of the buffers: an offloaded state is written this way, chunk by chunk);
        :meth:`from_state_dict` reads both. ``flat=True, copy=False``: the stream's rows
        are its live buffers (:meth:`~flwr_corrnoise.streams.NoiseStream.state_dict`), for
        a caller that writes them out before the stream steps again."""
        arrays: dict[str, np.ndarray] = {
            "counters": np.array([self.step, self.position, self.rounds], dtype=np.int64),
        }
        if self.noise is not None and flat:
            # a backend that overrides state_dict (torch) copies its rows to the host anyway
            view = not copy and type(self.noise).state_dict is NoiseStream.state_dict
            saved = self.noise.state_dict(copy=False) if view else self.noise.state_dict()
            arrays.update({f"noise/{k}": v for k, v in saved.items()})
        elif self.noise is not None:
            arrays["noise"] = np.frombuffer(self.noise.to_bytes(), dtype=np.uint8)
        if self.seed is not None:
            arrays["seed"] = np.array(str(self.seed))
        if self.binding is not None:
            arrays["binding"] = np.array(json.dumps(self.binding, sort_keys=True))
        if self.learner_id is not None:
            arrays["identity"] = np.array(self.learner_id)
            arrays["generation"] = np.array(self.generation, dtype=np.int64)
        for name, value in (self.payload or {}).items():
            arrays[f"payload/{name}"] = value
        if self.last_round >= 0:
            arrays["last-round"] = np.array(self.last_round, dtype=np.int64)
        return arrays

    @classmethod
    def from_bytes(cls, data: bytes, device: Any = None) -> LearnerState:
        """Inverse of :meth:`to_bytes` (also reads the ``.npz`` states of version 0.1).
        ``device``: where a torch stream is restored (default: a device of the type it
        was saved on); a NumPy stream stays on the host."""
        try:
            arrays = arraypack.unpack_any(data)
        except (OSError, ValueError, KeyError, EOFError, TypeError) as err:
            raise ValueError(f"unreadable learner state: {err}") from err
        return cls.from_state_dict(arrays, device, adopt=True)  # arrays: fresh copies

    @classmethod
    def from_state_dict(cls, arrays: Mapping[str, np.ndarray],
                        device: Any = None, *, adopt: bool = False) -> LearnerState:
        """Inverse of :meth:`state_dict` (what :meth:`from_bytes` reads; an offloaded
        simulation state is read straight into these arrays, :mod:`~flwr_corrnoise.
        state_offload`). ``adopt=True``: the stream may keep the flat rows array as its
        buffers (no copy; ``arrays`` is handed over, :func:`~flwr_corrnoise.streams.
        restore_stream`)."""
        try:
            step, position, rounds = (int(x) for x in arrays["counters"])
            flat = {k.removeprefix("noise/"): v for k, v in arrays.items()
                    if k.startswith("noise/")}
            noise = (_stream_from_bytes(memoryview(arrays["noise"]), device)
                     if "noise" in arrays else
                     restore_stream(flat, device, adopt=adopt) if flat else None)
            seed = int(str(arrays["seed"])) if "seed" in arrays else None
            binding = json.loads(str(arrays["binding"])) if "binding" in arrays else None
            learner_id = str(arrays["identity"]) if "identity" in arrays else None
            generation = int(arrays["generation"]) if "generation" in arrays else 0
            last_round = int(arrays["last-round"]) if "last-round" in arrays else -1
            payload = {k.removeprefix("payload/"): v for k, v in arrays.items()
                       if k.startswith("payload/")} or None
            if learner_id is not None and len(bytes.fromhex(learner_id)) != 16:
                raise ValueError("the learner identity is not 128 bits")
            if generation < 0:
                raise ValueError("negative commit generation")
        except FactorizationChangedError as err:
            raise PrivacyConfigError(str(err)) from err
        except (OSError, ValueError, KeyError, EOFError, TypeError) as err:
            raise ValueError(f"unreadable learner state: {err}") from err
        if noise is not None and noise.step != step:
            raise ValueError("learner state is inconsistent: noise step != step counter")
        return cls(step=step, position=position, rounds=rounds, noise=noise, seed=seed,
                   binding=binding, learner_id=learner_id, generation=generation,
                   payload=payload, last_round=last_round)


def _stream_from_bytes(blob: bytes | memoryview, device: Any = None) -> NoiseStream:
    """A stored stream: NumPy on the host, a device backend's on ``device`` (or the type it
    was saved on), through the backend table (:func:`~flwr_corrnoise.streams.restore_stream`).
    Why no torch import here: the core must not depend on torch; a caller that passes a
    device is torch code (:mod:`flwr_corrnoise.torch`), whose import registered the backend,
    and anyone else reading a torch state gets restore_stream's error naming the import."""
    return restore_stream(arraypack.unpack_any(blob), device, adopt=True)  # fresh copies


#: the binding key of the loop's data order (:func:`bind_data_order`)
DATA_ORDER = "data-order"

#: a secure stream's clip norm is at most this many noise stds (the grid's exact range)
SECURE_CLIP_LIMIT = 2**20

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


def bind_data_order(state: LearnerState, digest: str) -> None:
    """Record the loop's data order (:attr:`~flwr_corrnoise.data.loader.CyclicLoader.
    order_digest`) in a fresh state's binding, and refuse a stored state made with another
    order: the fixed-epoch participation the ε accounts for holds for one order fixed
    before training, not for an order that changes between rounds."""
    if state.binding is None:
        return  # a state written before bindings existed: nothing to compare
    stored = state.binding.get(DATA_ORDER)
    if stored is None:
        if state.step > 0:
            raise PrivacyConfigError(
                "this learner trained without a loader's fixed order; it refuses to continue "
                "with one (start a new learner, or keep the loop it started with)")
        state.binding[DATA_ORDER] = digest
    elif stored != digest:
        raise PrivacyConfigError(
            "the loader's example order differs from the one this learner trained in (its "
            "state records a digest of it): the fixed-epoch ε holds for one order fixed "
            "before training, not for an order reshuffled between rounds. Build the "
            "CyclicLoader with the same num_examples, batch_size, local_epochs and "
            "order_seed every round")


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
    if noise.secure and settings.clip_norm > SECURE_CLIP_LIMIT * noise.std:
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


def clip_by_global_norm(g: np.ndarray, clip_norm: float) -> tuple[np.ndarray, float]:
    """Scale ``g`` to norm at most ``clip_norm`` (over all parameters); return it and its
    norm (:func:`row_norms`, the norm of the private step's clipping)."""
    norm = float(row_norms(np.reshape(np.asarray(g, dtype=np.float64), (1, -1)))[0])
    if norm > clip_norm:
        g = g * (clip_norm / norm)
    return g, norm


def row_norms(g: np.ndarray) -> np.ndarray:
    """The L2 norm of every row of the 2-D ``g``. Why one function: the private step clips
    ``L`` learners' rows at once, and a release clipped alone (:func:`clip_by_global_norm`)
    must be clipped by the same floats."""
    return np.sqrt(np.einsum("ij,ij->i", g, g))


def _flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays as one flat float64 vector. One float64 array comes back as a view (no
    copy: at d = 10⁵ a copy per step was ≈ 2 % of a learner's message); both callers copy
    it before anything writes to it (into the step's gradient rows, into the local
    models)."""
    if isinstance(arrays, (list, tuple)) and len(arrays) == 1:
        return np.asarray(arrays[0], dtype=np.float64).ravel()
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


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


def datum_gradient(compute: Callable[[], Any], size: int) -> tuple[np.ndarray, str]:
    """One datum's flat float64 gradient for a model of ``size`` parameters, or zeros (and
    why, see :func:`attempt_datum`) if it cannot be computed: an exception, a result that
    is not ``size`` numbers, or a non-finite one. The NumPy front ends'
    (:func:`local_round`, :meth:`~flwr_corrnoise.flower.PrivateSteps.step`) one place for
    the rule."""
    def flat() -> np.ndarray:
        value = compute()
        if isinstance(value, np.ndarray) or np.isscalar(value):
            return np.asarray(value, dtype=np.float64).ravel()
        return _flatten(value)

    g, why = attempt_datum(flat)
    if g is not None and g.size != size:
        log.debug("a gradient of %d numbers for a model of %d: zero gradient", g.size, size)
        g, why = None, FAILED
    if g is not None and not np.all(np.isfinite(g)):
        g, why = None, NONFINITE
    return (np.zeros(size) if g is None else g), why


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
    noise: Sequence[tuple[list[int], StreamGroup]] | None = None,
) -> np.ndarray:
    """:func:`private_step` for ``L`` learners of one settings at once: row ``i`` of the
    ``L×size`` result is learner ``i``'s release, computed by the same rules in the same
    order — each learner's horizon; its gradient (``rows[i]``, or ``computes[i]()``
    through :func:`datum_gradient`), zero if it cannot be computed or is not finite; its
    own clipping to ``B_g``; its own stream's increment; its counters and ``counts[i]``.

    Why one function for both: the vectorized engine's learners step in lockstep, and the
    rules above are vector operations over the rows (one norm per row, one finiteness
    test per row) plus one recurrence for all the learners' noise
    (:class:`~flwr_corrnoise.streams.StreamGroup`), so ``L`` learners cost about what one
    costs in Python calls; one learner is ``L = 1`` of the same code.

    ``rows``: the ``L`` gradients already computed (a batch); ``computes``: each learner's
    code for its datum otherwise. ``noise``: the learners' streams as open groups
    (``(indices, group)`` from :meth:`StreamGroup.partition`, kept open over a round by
    :func:`local_rounds`); by default they are grouped here and closed on return.
    """
    if states:  # the learner furthest along decides (one check for the L counters)
        check_horizon(settings, max(state.step for state in states))
    g = _gradient_rows(len(states), size, counts, computes, rows)
    if settings.private:
        norms = row_norms(g)
        over = norms > settings.clip_norm
        if over.any():
            g[over] *= (settings.clip_norm / norms[over])[:, None]
            for i in np.flatnonzero(over).tolist():
                counts[i].clipped += 1
        if noise is not None:
            g = _add_noise(g, noise)
        elif len(states) == 1:  # the one-stream group: the stream's own add_next
            g[0] = states[0].noise.add_next(g[0])  # type: ignore[union-attr]
        else:
            groups = StreamGroup.partition([s.noise for s in states])  # type: ignore[misc]
            try:
                g = _add_noise(g, groups)
            finally:
                for _, group in groups:
                    group.close()
    for state in states:
        state.advance()
    return g


def _gradient_rows(count: int, size: int, counts: Sequence[StepCounts],
                   computes: Sequence[Callable[[], Any]] | None,
                   rows: np.ndarray | None) -> np.ndarray:
    """The ``count×size`` gradients of a step: ``rows`` (a batch, copied) with every row
    that is not all finite set to zero, or each ``computes[i]`` through
    :func:`datum_gradient`; each learner's :class:`StepCounts` told why."""
    if rows is not None:
        g = np.array(rows, dtype=np.float64)
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
    g = np.empty((count, size))
    for i, compute in enumerate(computes):
        g[i], why = datum_gradient(compute, size)
        counts[i].zeroed(why)
    return g


def _add_noise(g: np.ndarray, groups: Sequence[tuple[list[int], StreamGroup]]) -> np.ndarray:
    """Each group's releases ``g[rows] + e`` (exact on a secure stream's grid)."""
    if len(groups) == 1 and len(groups[0][0]) == g.shape[0]:
        return groups[0][1].add_next(g)
    out = np.empty_like(g)
    for idx, group in groups:
        out[idx] = group.add_next(g[idx])
    return out


def local_round(
    params: Sequence[np.ndarray],
    gradient: GradientFn,
    state: LearnerState,
    settings: PrivacySettings,
    tau: int,
    eta: float,
) -> RoundResult:
    """Run ``τ`` local steps from ``params`` (paper 000, Algorithm 1 lines 5–14).

    ``state`` is advanced in place (and returned in the result). On any error (horizon used
    up, a non-finite model from the server, an interrupt) it is rolled back to exactly
    what it was: a failed round releases nothing, so no released noise is ever reused.

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
) -> list[RoundResult]:
    """:func:`local_round` for ``L`` learners from the same ``params``, their steps in
    lockstep (``L = 1`` *is* :func:`local_round`). Why: the vectorized engine
    (:func:`flwr_corrnoise.engine.run_vectorized`) keeps the ``L`` local models as one
    ``L×d`` array and may compute their ``L`` gradients in one ``batch`` call; every step
    is :func:`private_steps` (the private step over the ``L`` rows: each learner's own
    horizon, datum rule, clipping, noise stream and counters), the learners' streams
    advanced as one :class:`~flwr_corrnoise.streams.StreamGroup` per round (one
    recurrence, each learner's rows from its own generator), and the round's rule is this
    one function.

    A ``batch`` that raises or returns another shape computes nothing: each learner's
    datum then goes through its own ``gradients[i]`` (so one learner's datum can never
    zero another's gradient). On any error every learner of the call is rolled back.
    """
    if isinstance(tau, bool) or int(tau) != tau or tau < 1:
        raise PrivacyConfigError(f"local steps τ must be a positive integer, got {tau!r}")
    if not (math.isfinite(eta) and eta > 0):
        raise PrivacyConfigError(f"step size η must be finite and > 0, got {eta!r}")
    shapes = [tuple(np.shape(p)) for p in params]
    size = sum(math.prod(s) for s in shapes)
    for state in states:
        check_round(state, settings, size, int(tau))
    x = _flatten(params)
    if not np.all(np.isfinite(x)):
        raise NonFiniteError("the global model received from the server is not finite")
    # Work on the states in place and undo everything on failure: a failed round released
    # nothing, so rolling the noise streams back reuses no released noise.
    tokens = [state.checkpoint() for state in states]
    counts = [StepCounts() for _ in states]
    noise: list[tuple[list[int], StreamGroup]] = []
    try:
        z = np.tile(x, (len(states), 1))
        total = np.zeros_like(z)
        if settings.private:  # one recurrence per group of streams, for the whole round
            noise = StreamGroup.partition([state.noise for state in states],  # type: ignore[misc]
                                          ahead=int(tau))
        for _ in range(int(tau)):
            rows = _batch_rows(batch, z, [state.position for state in states])
            computes = None if rows is not None else [
                partial(gradients[i], split_flat(z[i], shapes), state.position)
                for i, state in enumerate(states)]
            g = private_steps(states, settings, x.size, counts, computes=computes, rows=rows,
                              noise=noise)
            z -= eta * g
            total += g
        for state in states:
            state.rounds += 1
    except BaseException:
        for _, group in noise:
            group.close()
        for state, token in zip(states, tokens, strict=True):
            state.rollback(token)
        raise
    for _, group in noise:
        group.close()
    metrics: dict[int, RoundMetrics] = {}  # one computation per step count, when read
    for state in states:
        if state.step not in metrics:
            metrics[state.step] = RoundMetrics(settings, state.step)
    total /= tau  # ĝ of every learner at once (the same floats as row by row)
    return [RoundResult(update=split_flat(total[i], shapes), state=state,
                        metrics=metrics[state.step],
                        diagnostics=counts[i].diagnostics(int(tau)))
            for i, state in enumerate(states)]


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


def aggregate(
    params: Sequence[np.ndarray],
    updates: Sequence[Sequence[np.ndarray]],
    eta: float,
    eta_g: float,
    tau: int,
) -> list[np.ndarray]:
    """Server step (Algorithm 1 line 16): ``x^{r+1} = x^r − η_g·η·τ·mean_i ĝ_i``.

    Averages over the learners that answered; with no valid update the model is kept.
    """
    running = UpdateSum(params)
    for u in updates:
        running.add(u)
    return running.step(eta, eta_g, tau)


class UpdateSum:
    """The server step's sum of updates, one update at a time: :func:`aggregate` is
    ``add`` for each update in order, then ``step``.

    Why one at a time: a server that deserializes every reply before summing holds all of
    them at once (1000 replies at d = 10⁶: 8 GB in float64); added as each is checked, it
    holds one. The floats are :func:`aggregate`'s whatever the caller: each parameter's
    sum is taken in the order the updates are added (float32 updates widen exactly)."""

    def __init__(self, params: Sequence[np.ndarray]) -> None:
        self.params = params
        self.total = [np.zeros(np.shape(p), dtype=np.float64) for p in params]
        self.count = 0

    def add(self, update: Sequence[np.ndarray]) -> None:
        """Add one learner's update (already checked: :func:`check_update`)."""
        for total, u in zip(self.total, update, strict=True):
            total += u
        self.count += 1

    def step(self, eta: float, eta_g: float, tau: int) -> list[np.ndarray]:
        """``x^{r+1} = x^r − η_g·η·τ·mean ĝ``; with nothing added, a copy of ``x^r``."""
        if not self.count:
            return [np.array(p, dtype=np.float64, copy=True) for p in self.params]
        scale = eta_g * eta * tau / self.count
        return [np.asarray(p, dtype=np.float64) - scale * total
                for p, total in zip(self.params, self.total, strict=True)]


def check_update(update: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> None:
    """Reject a learner's reply that would skew or crash the aggregate."""
    if len(update) != len(reference):
        raise ValueError(f"update has {len(update)} arrays, the model {len(reference)}")
    for j, (u, p) in enumerate(zip(update, reference, strict=True)):
        u = np.asarray(u)
        if u.shape != np.shape(p):
            raise ValueError(f"array {j} has shape {u.shape}, expected {np.shape(p)}")
        if not np.issubdtype(u.dtype, np.floating):
            raise ValueError(f"array {j} has dtype {u.dtype}, expected a float type")
        if not np.all(np.isfinite(u)):
            raise ValueError(f"array {j} contains NaN or Inf")
