"""One private learner on Flower: settings, seed, state, ledger, lock — and the release gate.

Every learner front end (:func:`~flwr_corrnoise.flower.make_client_app`,
:class:`~flwr_corrnoise.flower.CorrNoiseNumPyClient` behind
:func:`~flwr_corrnoise.flower.numpy_client_app`, the PyTorch helpers, and
:class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`) goes through a :class:`LearnerSession`,
and every round it takes is one :class:`LearnerTransaction` (:meth:`LearnerSession.transaction`:
the server's proposal checked, the state directory locked, the state loaded and checked,
the round run, then committed — ledger, state, commit line — or rolled back), and every
reply a private learner sends is built by :meth:`LearnerTransaction.reply` (the release
gate, :meth:`LearnerSession.reply`) or :meth:`LearnerSession.error_reply` (:func:`answer`).
Why one gate: a reply may hold the noised arrays and
metadata that is a **function of the learner's settings, counters and the server's
message** (steps, horizon, ε, δ, ε spent, noise std, round) — nothing else. A clipping
rate, a loss, a data-dependent error message or reply kind is a release with ε = ∞; one
place that builds replies is one place to audit.

Who decides what (see ``docs/threat-model.md``):

* **Simulation** (Flower's simulation engine, detected by :func:`in_simulation`): the app's
  defaults < run config < node config, and reproducible seeds (node-config ``noise-seed``,
  else derived from the run's ``seed`` and the ``partition-id``). One party runs the whole
  simulation, so the run config is the learner's too.
* **A real SuperNode** (anything else): the app's defaults < node config, the run config's
  privacy keys are only a *proposal* that is refused if weaker, and the noise seed always
  comes from OS entropy — a seed in the node or run config is refused, so a wiped state
  can never replay noise and the server can never know a seed.

Secure noise (node config ``secure-noise = true``, or the app's defaults; never the run
config) makes the learner's stream ChaCha20 keyed from OS entropy on a power-of-two grid
(:mod:`~flwr_corrnoise.secure_noise`); it takes no seed, and a secure learner refuses to
continue a stored non-secure stream.

Data-dependent diagnostics (clipped steps, non-finite steps, loss) go to the learner's log
and, with a ``state-dir``, to ``diagnostics.jsonl`` there — never into a reply. A learner
may allow-list metrics it accepts to leak (node config ``release-metrics``, or
``release_metrics=`` in app code; never the run config): they are **not accounted** in ε.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from .. import arraypack, state_offload
from ..learner import NonFiniteError, StepCounts, check_round, check_rounds_left
from ..learner_state import LearnerState
from ..persistence import StateBusyError, StateIntegrityError, StateLostError, StateStore
from ..privacy import PrivacyBudgetError
from ..settings import (
    PRIVACY_METRICS,
    PrivacyConfigError,
    PrivacySettings,
    derive_seed,
    privacy_metrics,
)
from ..state_offload import OffloadHandle, OffloadPolicy
from ..streams import HorizonExhaustedError
from .config import PARTICIPATION_KEYS, check_proposal, settings_from_config
from .release_ledger import RoundReplayError, SimulationReleaseLedger

log = logging.getLogger(__name__)

#: keys of the learner's records in ``context.state``: per-step learner, per-round mod
STATE_KEY = "flwr-corrnoise"
ROUND_STATE_KEY = "flwr-corrnoise-round"


class QueryRefusedError(PermissionError):
    """A data-dependent query (evaluate, query) the learner's budget does not cover."""


#: error codes of the replies a learner sends instead of an update; every one is a function
#: of the learner's configuration, its state and the server's message — never of its data
ERROR_CODES: dict[type[Exception], int] = {
    PrivacyConfigError: 4101,
    PrivacyBudgetError: 4101,
    HorizonExhaustedError: 4102,
    NonFiniteError: 4103,  # the *server's* model is not finite
    StateLostError: 4104,
    StateBusyError: 4105,
    QueryRefusedError: 4106,
    RoundReplayError: 4107,  # a second release in one round (or an older round)
}
GENERIC_ERROR = 4100

#: what a private learner's reply may hold besides the noised arrays: functions of its
#: settings, counters and the server's message only (the privacy metadata of
#: :func:`~flwr_corrnoise.settings.privacy_metrics`, and what :meth:`LearnerSession.reply`
#: adds)
RELEASED_METRICS = frozenset(PRIVACY_METRICS) | {
    "rounds-noised", "num-examples", "learner-id", "server-round"}

#: run-config keys that carry privacy settings, and the proposal key each one maps to
RUN_CONFIG_PROPOSAL = {
    "mechanism": "privacy-mechanism",
    "epsilon": "privacy-epsilon",
    "delta": "privacy-delta",
    "clip-norm": "privacy-clip-norm",
    "horizon": "privacy-horizon",
}


def error_code(err: BaseException,
               codes: Mapping[type[Exception], int] | None = None) -> int:
    """The code of ``err``: a front end's own ``codes`` first (the relay node's), then the
    learner's :data:`ERROR_CODES`, else :data:`GENERIC_ERROR`."""
    for kind, code in (*dict(codes or {}).items(), *ERROR_CODES.items()):
        if isinstance(err, kind):
            return code
    return GENERIC_ERROR


def in_simulation() -> bool:
    """Whether this ClientApp runs inside Flower's simulation engine (a Ray actor).

    Why Ray: Flower 1.41 runs simulated ClientApps in Ray actors, and a real SuperNode
    runs them in its own process or a ``flwr-clientapp`` process without Ray. The server
    cannot make a SuperNode start Ray, so it cannot switch a learner into the simulation
    rules (reproducible seeds, run config as the learner's own).
    """
    return in_ray_actor()


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (what :func:`in_simulation` decides by; the
    simulation's release ledger asks it directly, so that tests which only *treat* a direct
    call under the simulation rules do not share ledgers between their fake runs)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized()) and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # any doubt: the strict rules
        return False


def deployed(context: Context) -> bool:
    """A learner with a ``state-dir`` in its node config keeps its state on disk."""
    return "state-dir" in context.node_config


def learner_config(
    context: Context, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The learner's own configuration: the app's ``defaults``, overridden by the run
    config (in simulation only), overridden by the node config (its operator's)."""
    run = dict(context.run_config) if in_simulation() else {}
    return {**dict(defaults or {}), **run, **dict(context.node_config)}


def run_config_proposal(context: Context) -> dict[str, Any]:
    """On a real SuperNode the run config's privacy keys are the server's proposal."""
    if in_simulation():
        return {}
    rc = context.run_config
    return {prop: rc[key] for key, prop in RUN_CONFIG_PROPOSAL.items() if key in rc}


def learner_seed(context: Context, defaults: Mapping[str, Any] | None = None) -> int | None:
    """The noise seed: in simulation the node config's ``noise-seed``, else one derived from
    the run's ``seed`` and the ``partition-id`` (reproducible runs), else OS entropy
    (``None``). On a real SuperNode always OS entropy: a fixed seed would replay its noise
    after a wiped state, and one from the run config would be known to the server."""
    if not in_simulation():
        for source, where in ((context.node_config, "node config"), (defaults or {}, "app")):
            if source.get("noise-seed") is not None:
                raise PrivacyConfigError(
                    f"a 'noise-seed' in the {where} is for simulations only: a learner on a "
                    "real SuperNode draws its seed from OS entropy, so that its noise can "
                    "never be replayed or known to anyone else"
                )
        return None
    cfg = learner_config(context, defaults)
    if cfg.get("noise-seed") is not None:
        return int(cfg["noise-seed"])
    if cfg.get("seed") is not None and cfg.get("partition-id") is not None:
        return derive_seed(int(cfg["seed"]), int(cfg["partition-id"]))
    return None


def round_settings(cfg: Mapping[str, Any]) -> PrivacySettings:
    """The per-round mod's privacy settings: as the learner's, but the horizon counts
    *rounds* (``horizon``, else ``num-server-rounds``)."""
    horizon = cfg.get("horizon") or cfg.get("num-server-rounds")
    if not horizon:
        raise PrivacyConfigError(
            "the per-round learner needs its horizon in rounds ('horizon', or "
            "'num-server-rounds' in a simulation)")
    return settings_from_config({**dict(cfg), "horizon": int(horizon)},
                                       where="learner's config", per_round=True)


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "unaccounted")
    return bool(value)


def _names(value: Any) -> set[str]:
    if value is None:
        return set()
    if isinstance(value, str):
        return {v.strip() for v in value.replace(",", " ").split() if v.strip()}
    return {str(v) for v in value}


def metric_record(metrics: Mapping[str, Any]) -> MetricRecord:
    """A MetricRecord of the numeric entries (Flower metrics are numbers)."""
    return MetricRecord({
        k: float(v) for k, v in metrics.items()
        if isinstance(v, int | float | np.floating | np.integer) and not isinstance(v, bool)
    })


class LearnerStorage:
    """Where one learner's :class:`~flwr_corrnoise.learner_state.LearnerState` lives — its
    ``state-dir`` (:class:`~flwr_corrnoise.persistence.StateStore`) if it has one, and
    ``context.state[key]`` — and the one code that locks, loads, verifies and commits it.

    Why a piece of its own: every learner (the :class:`LearnerSession` front ends and the
    decentralized relay node, whose privacy policy is its algorithm's) must hold the lock
    for the whole message, refuse a lost, corrupt, rolled-back, cloned or wiped state, and
    write the ledger line before the state and the state before the reply, in the same way.
    """

    def __init__(self, context: Context, key: str, store: StateStore | None,
                 offload: OffloadPolicy | None = None) -> None:
        self.context = context
        self.key = key
        self.store = store
        #: in a simulation without a ``state-dir``: whether a large state goes to a file
        #: with only its handle in ``context.state`` (:mod:`~flwr_corrnoise.state_offload`)
        self.offload = offload if store is None else None

    @property
    def where(self) -> str:
        if self.store is not None:
            return str(self.store.state_path)
        handle = self._handle()
        return (f"context.state[{self.key!r}]" if handle is None
                else f"{handle.path} (offloaded from context.state[{self.key!r}])")

    def _handle(self) -> OffloadHandle | None:
        if self.key not in self.context.state:
            return None
        return OffloadHandle.from_record(self.context.state[self.key])  # type: ignore[arg-type]

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state directory's lock for the whole message (no-op without one): two
        executions that both load step ``t`` would release the same noise with other data."""
        if self.store is None:
            yield
            return
        with self.store.lock():
            yield

    def read(self) -> LearnerState | None:
        """The stored state — with a ``state-dir`` checked against its ledger, marker and
        commit log (:meth:`~flwr_corrnoise.persistence.StateStore.verify`) — or ``None``
        for a learner that never committed a round. A lost, corrupt, rolled-back, cloned
        or wiped state is a :class:`~flwr_corrnoise.persistence.StateLostError` (4104),
        never a fresh start. Only reads."""
        data: bytes | None = None
        arrays = None
        if self.store is not None:
            data = self.store.load()  # StateLostError if it trained before and lost it
        elif (handle := self._handle()) is not None:
            if self.offload is None:  # not a simulation: no folder a handle may name
                raise StateIntegrityError(
                    f"context.state[{self.key!r}] holds a handle to an offloaded state "
                    f"({handle.path}), but this learner does not offload (not a simulation): "
                    f"refusing to train")
            # checked against the learner's own folder, the newest file there, the MAC
            arrays = state_offload.read(handle, self.offload.folder(
                self.context.run_id, self.context.node_id, self.key))
        elif self.key in self.context.state:
            data = bytes(self.context.state[self.key]["learner"])  # type: ignore[index]
        if data is None and arrays is None:
            return None
        try:
            state = (LearnerState.from_state_dict(arrays, adopt=True) if arrays is not None
                     else LearnerState.from_bytes(data))  # type: ignore[arg-type]
        except PrivacyConfigError:
            raise
        except ValueError as err:
            raise StateLostError(f"the learner state {self.where} is corrupt or not in the "
                                 f"learner-state format (a relay node's state from before "
                                 f"it was), refusing to train: {err}") from err
        if self.store is not None:
            self.store.verify(state.learner_id, state.generation, state.step)
        return state

    def write(self, state: LearnerState, entry: Mapping[str, Any],
              diagnostics: Mapping[str, Any] | None = None) -> None:
        """Commit ``state`` one generation on: with a ``state-dir`` the ledger line
        (``entry``, the identity and the new generation), the local ``diagnostics``, the
        state and the commit line, each durable before the next
        (:meth:`~flwr_corrnoise.persistence.StateStore.commit`); then ``context.state``.
        If it fails, the state keeps its old generation (the caller rolls back the rest)."""
        if state.learner_id is None:  # created before identities existed, never loaded
            state.learner_id = LearnerState.new_id()
        state.generation += 1
        try:
            offload = self.offload  # None with a state-dir (the constructor's rule)
            if offload is not None and offload.mode != "off":
                # the stream's live buffers, no copy: written (or packed) before it steps
                arrays = state.state_dict(flat=True, copy=False)
                if offload.wants(sum(np.asarray(a).nbytes for a in arrays.values())):
                    loaded = self._handle()  # the driver's handle until it gets the new one
                    handle = state_offload.write(  # private folders, seen by every node
                        offload.prepare(self.context.run_id, self.context.node_id, self.key),
                        arrays, identity=state.learner_id, generation=state.generation,
                        keep=None if loaded is None else loaded.path)
                    record = ConfigRecord(handle.to_record())
                else:  # small (auto): these arrays are the bytes, serialized once
                    record = ConfigRecord({"learner": arraypack.pack(arrays)})
            else:
                data = state.to_bytes()  # serialized once, for disk and context.state
                if self.store is not None:
                    self.store.commit(data, identity=state.learner_id,
                                      generation=state.generation,
                                      entry={**dict(entry), "time": time.time()},
                                      diagnostics=diagnostics)
                record = ConfigRecord({"learner": data})
        except BaseException:
            state.generation -= 1
            raise
        self.context.state[self.key] = record


class LearnerSession:
    """One learner's privacy identity for one Flower message.

    ``kind`` is ``"step"`` (Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online
    Federated Learning With Correlated Noise") per-step learner) or ``"round"`` (Zhang, Zhu, Fay &
    Johansson's ("Locally Differentially Private Online Federated Learning With Correlated Noise",
    arXiv version) mod: the horizon counts rounds). ``settings``/``seed`` given in code override the
    context (tests, in-process engines); ``release_metrics`` and ``allow_evaluation`` are the app
    code's opt-ins, added to the node config's ``release-metrics`` and ``client-evaluation`` (the
    run config can set neither).
    """

    def __init__(
        self,
        context: Context,
        *,
        kind: str = "step",
        defaults: Mapping[str, Any] | None = None,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        release_metrics: Iterable[str] = (),
        allow_evaluation: bool = False,
        stream_positions: bool = False,
    ) -> None:
        if kind not in ("step", "round"):
            raise ValueError(f"kind must be 'step' or 'round', got {kind!r}")
        self.context = context
        self.kind = kind
        self.defaults = dict(defaults or {})
        self.simulation = in_simulation()
        self.config = learner_config(context, self.defaults)
        if stream_positions and not any(k in self.config for k in PARTICIPATION_KEYS):
            # the strict modes address the data by stream position, which moves on by one
            # datum per step: "each datum once" is what the library enforces there, not a
            # guess (every other front end must declare its data use)
            self.config["data-reuse"] = "once"
        node = context.node_config
        self.allowed = _names(release_metrics) | _names(node.get("release-metrics"))
        self.allow_evaluation = bool(allow_evaluation) or _flag(
            node.get("client-evaluation", False))
        self.key = STATE_KEY if kind == "step" else ROUND_STATE_KEY
        self.store: StateStore | None = None
        if deployed(context):
            base = Path(str(node["state-dir"]))
            self.store = StateStore(base if kind == "step" else base / "round-mod")
        self.storage = LearnerStorage(
            context, self.key, self.store,
            OffloadPolicy.from_config(self.config) if self.simulation else None)
        #: in a simulation without a state-dir: the ledger that serializes this learner's
        #: messages and refuses a stale state (:mod:`~flwr_corrnoise.flower.release_ledger`)
        self.ledger = (SimulationReleaseLedger(context.run_id, context.node_id, self.key)
                       if self.simulation and self.store is None and in_ray_actor()
                       else None)
        self.settings = settings or self._settings_from_config()
        if seed == "from-context":
            self.seed = learner_seed(context, self.defaults)
        elif seed is not None and not self.simulation:
            raise PrivacyConfigError(
                "a fixed noise seed given in code is for simulations only: on a real "
                "SuperNode a learner draws its seed from OS entropy")
        else:
            self.seed = seed  # type: ignore[assignment]
        # Secure noise (ChaCha20 keyed from OS entropy, on a grid): opt-in, and the
        # learner's choice only (node config, or app code's defaults; never the run config).
        self.secure = _flag(node.get("secure-noise", self.defaults.get("secure-noise", False)))
        if self.secure:
            if node.get("noise-seed") is not None or seed not in ("from-context", None):
                raise PrivacyConfigError(
                    "'secure-noise' draws its key from OS entropy and takes no seed: remove "
                    "'noise-seed' or set secure-noise = false")
            self.seed = None

    def _settings_from_config(self) -> PrivacySettings:
        cfg = self.config
        if self.kind == "round":
            return round_settings(cfg)
        if not (cfg.get("horizon") or (cfg.get("num-server-rounds")
                                       and cfg.get("local-steps"))):
            where = "its app defaults or run config" if self.simulation else "its node config"
            raise PrivacyConfigError(
                f"the learner needs its horizon ('horizon' or 'num-server-rounds' × "
                f"'local-steps') in {where}; on a real SuperNode the run config is the "
                f"server's and is only a proposal"
            )
        return settings_from_config(cfg, where="learner's config")

    # -- the server's proposal --------------------------------------------------------------
    def check_proposal(self, config: Mapping[str, Any]) -> None:
        """Refuse a round config or run config that would weaken this learner's privacy."""
        check_proposal(self.settings, {**run_config_proposal(self.context), **dict(config)})

    def transaction(
        self,
        config: Mapping[str, Any],
        shapes: Sequence[Sequence[int]],
        *,
        steps: int | None = None,
        check: Callable[[LearnerState], None] | None = None,
        dtype: Any = None,
    ) -> LearnerTransaction:
        """One round on this learner's state (:class:`LearnerTransaction`): use it as
        ``with session.transaction(config, shapes, steps=τ) as tx: …`` and reply with
        ``tx.reply(msg, arrays, num_examples=…)`` after the block. ``dtype``: the model's
        float dtype, for a learner's first stream (:meth:`load`)."""
        return LearnerTransaction(self, config, shapes, steps=steps, check=check,
                                  dtype=dtype)

    # -- state --------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the state directory's lock for the whole message (:meth:`LearnerStorage.
        locked`), and in a simulation the learner's release ledger
        (:class:`~flwr_corrnoise.flower.release_ledger.SimulationReleaseLedger`)."""
        with ExitStack() as stack:
            if self.ledger is not None:
                stack.enter_context(self.ledger.locked())
            stack.enter_context(self.storage.locked())
            yield

    def check_fresh(self, state: LearnerState, server_round: int) -> None:
        """Refuse a message that would release noise a second time: a round this learner
        already released or an older one (the state's ``last_round``), or — in a
        simulation — a state that is not the learner's latest (the release ledger)."""
        if self.ledger is not None:
            self.ledger.check(state.learner_id if state.generation else None,
                              state.generation)
        if server_round >= 0 and state.last_round >= server_round:
            raise RoundReplayError(
                f"this learner already released server round {state.last_round}; a train "
                f"message for round {server_round} would release its noise a second time "
                "(one release per learner per round), so it is refused")

    def log_start(self) -> None:
        """One start-up line with what the noise is calibrated to (a fresh learner): the
        budget, the horizon, the participation, the sensitivity and whether it is exact,
        and the noise std — the figures of ``flwr-corrnoise plan`` that need no data."""
        cal = self.settings.calibration()
        if cal is None:
            log.info("flwr-corrnoise learner: noiseless baseline (no clipping, no noise)")
            return
        log.info("flwr-corrnoise learner: %s, ε = %g, δ = %g over %d steps; participation: "
                 "%s; sensitivity %.4g (%s); noise std %.4g (noise multiplier %.3g). The ε "
                 "assumes each datum is used as that participation says; the library cannot "
                 "see which data your loop touches, so if it uses a datum more often (more "
                 "epochs, a reshuffled order, more rounds), the ε printed does not hold",
                 self.settings.mechanism, cal.epsilon, cal.delta, self.settings.horizon,
                 cal.participation, cal.sensitivity,
                 "exact" if cal.sensitivity_exact else "certified bound", cal.std,
                 cal.noise_multiplier)

    def load(self, shapes: list[tuple[int, ...]], dtype: Any = None) -> LearnerState:
        """The stored state, checked against the current settings, or a fresh one on the
        learner's first round; a lost or corrupt state is an error, never a fresh start.

        With a ``state-dir`` the state is also checked against its ledger, marker and
        commit log (:meth:`~flwr_corrnoise.persistence.StateStore.verify`): a state rolled
        back, copied in from another learner, or a ledger left without its state (wiped)
        is refused (:class:`~flwr_corrnoise.persistence.StateIntegrityError`, code 4104).
        Loading only reads: a refused load releases nothing and changes nothing on disk.

        ``dtype``: the model's float dtype; a fresh learner's stream is float32 for a
        float32 model (:meth:`~flwr_corrnoise.learner_state.LearnerState.create`), float64
        otherwise. A stored stream keeps the dtype it was made in, whatever the model's
        dtype now (a strategy may send float64 after a float32 start): its noise goes on
        in the arithmetic it started in, never converted.
        """
        state = self.storage.read()
        if state is None:
            self.log_start()
            return LearnerState.create(self.settings, shapes, self.seed, secure=self.secure,
                                       dtype=dtype)
        where = self.storage.where
        state.check_binding(self.settings)
        if self.secure and state.noise is not None and not state.noise.secure:
            raise PrivacyConfigError(
                f"this learner asks for secure noise but its stored stream ({where}) is not "
                "secure; it refuses to continue that stream (start a new learner with a new "
                "state directory, or set secure-noise = false)")
        if state.learner_id is None:
            # a state written before identities existed (checked against its ledger by
            # step above): it is identified from its next commit on
            state.learner_id = LearnerState.new_id()
            log.warning("the learner state %s predates learner identities; it continues "
                        "under a new identity from this round on", where)
        return state

    def commit(
        self,
        state: LearnerState,
        *,
        first_step: int,
        position: int,
        server_round: int,
        diagnostics: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the round (ledger, local diagnostics) and store the state — before the
        reply leaves, so a crash afterwards releases nothing that could be reused.

        Each commit advances the state's ``generation``. With a ``state-dir`` the ledger
        line (naming the learner's identity and the new generation) is durable before the
        state is written, and a commit line after it
        (:meth:`~flwr_corrnoise.persistence.StateStore.commit`): what lets the next load
        tell this learner's latest state from an older or another learner's copy. If the
        commit fails, the state object keeps its old generation (the caller rolls back the
        rest)."""
        diag = {"server-round": server_round, "first-step": first_step,
                **dict(diagnostics or {})}
        log.info("flwr-corrnoise learner diagnostics (local only, never sent): %s", diag)
        last = state.last_round
        if server_round >= 0:
            state.last_round = server_round
        try:
            self.storage.write(
                state, {"server-round": server_round, "first-step": first_step,
                        "steps": state.step - first_step, "position": position},
                diagnostics={**diag, "time": time.time()})
        except BaseException:
            state.last_round = last
            raise
        if self.ledger is not None:  # still under its lock (the transaction's)
            self.ledger.record(str(state.learner_id), state.generation, state.step,
                               server_round)

    # -- what leaves the learner ------------------------------------------------------------
    def privacy_metrics(self, state: LearnerState) -> dict[str, float]:
        """ε spent and the settings: functions of the settings and the counters only."""
        std = state.noise.std if state.noise is not None else None
        out = privacy_metrics(self.settings, state.step, std)
        if self.kind == "round":
            out["rounds-noised"] = float(state.step)
        pid = self.config.get("partition-id")
        if pid is not None:
            out["learner-id"] = float(pid)
        return out

    def reply(
        self,
        msg: Message,
        arrays: ArrayRecord | list[np.ndarray],
        state: LearnerState,
        *,
        num_examples: float,
        user_metrics: Mapping[str, Any] | None = None,
    ) -> Message:
        """**The release gate**: the one place a private learner's train reply is built.

        It holds ``arrays`` (the noised release), :meth:`privacy_metrics`, ``num-examples``
        (a function of the server's message: τ, or 1 for the mod's uniform weights), the
        server's round, and of ``user_metrics`` only the names the learner allow-listed.
        """
        metrics: dict[str, Any] = self.privacy_metrics(state)
        metrics["num-examples"] = float(num_examples)
        config = msg.content.get("config", {})
        if "server-round" in config:
            metrics["server-round"] = float(config["server-round"])  # type: ignore[arg-type]
        dropped = []
        for name, value in dict(user_metrics or {}).items():
            if name in self.allowed:
                metrics[name] = value  # the learner's explicit, unaccounted choice
            elif name not in metrics:
                dropped.append(name)
        if dropped:
            log.debug("release gate: kept on the learner: %s", sorted(dropped))
        record = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(list(arrays))
        return Message(RecordDict({"arrays": record, "metrics": metric_record(metrics)}),
                       reply_to=msg)

    @staticmethod
    def error_reply(msg: Message, err: BaseException,
                    codes: Mapping[type[Exception], int] | None = None) -> Message:
        """An ``Error`` reply whose code and reason depend on config, state and the server's
        message only. Errors of other kinds (the user's own code) are reported with a fixed
        reason: their text may hold data; the details stay in the learner's log. ``codes``:
        a front end's own refusals (the relay node's), raised only with data-free texts."""
        code = error_code(err, codes)
        if code == GENERIC_ERROR:
            log.error("flwr-corrnoise: the learner's code failed (details stay local)",
                      exc_info=err)
            reason = ("flwr-corrnoise: the learner's code failed; the details stay in the "
                      "learner's log")
        else:
            reason = f"flwr-corrnoise: {type(err).__name__}: {err}"
            # an evaluate/query refusal repeats every round on every learner: the server
            # logs it once for the run (monitor.py), the learner at debug level
            level = logging.DEBUG if isinstance(err, QueryRefusedError) else logging.WARNING
            log.log(level, "learner refuses the message: %s", reason)
        return Message(Error(code=code, reason=reason), reply_to=msg)


class LearnerTransaction:
    """**The learner transaction**: one message's round on the learner's state, the same
    for every front end (the NumPy learner behind ``make_client_app`` and
    ``numpy_client_app``, :class:`~flwr_corrnoise.flower.PrivateSteps` and the device
    optimizer on it, :class:`~flwr_corrnoise.flower.CorrNoiseRoundMod`, the torch
    ``ClientApp``).

    :meth:`open` checks the server's proposal, takes the state directory's lock (held
    until the end), loads the state (checked against its settings, ledger, marker and
    commit log: :meth:`LearnerSession.load`), runs the front end's own ``check`` of it,
    then refuses what the data cannot decide — no stream, the horizon for ``steps`` more
    steps (rounds for the per-round mod), a model of another size, a budget too large
    for a secure grid (:func:`~flwr_corrnoise.learner.check_round`). The front end runs
    its round on :attr:`state`, counting into :attr:`counts` (or setting
    :attr:`diagnostics`). :meth:`commit` records and stores the round
    (:meth:`LearnerSession.commit`: the only write) and releases the lock; :meth:`abort`
    (any failure, including a failed commit) releases the lock and writes nothing — the
    stored state is the one loaded, and the next message loads it again — so nothing was
    released and nothing changed. Only after a commit may
    :meth:`reply` build the reply, through the release gate.

    As a context manager (``with session.transaction(...) as tx:``) it opens on entry and
    commits on a normal exit, or aborts and re-raises on an exception.
    """

    def __init__(
        self,
        session: LearnerSession,
        config: Mapping[str, Any],
        shapes: Sequence[Sequence[int]],
        *,
        steps: int | None = None,
        check: Callable[[LearnerState], None] | None = None,
        dtype: Any = None,
    ) -> None:
        self.session = session
        self.dtype = dtype
        self.config = dict(config)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.steps = steps
        self.check = check
        self.server_round = int(self.config.get("server-round", -1))
        #: the round's data-dependent counts (local diagnostics only)
        self.counts = StepCounts()
        #: the diagnostics committed with the round (default: :attr:`counts`)
        self.diagnostics: dict[str, Any] | None = None
        self.committed = False
        self._state: LearnerState | None = None
        self._exit = ExitStack()

    @property
    def state(self) -> LearnerState:
        if self._state is None:
            raise RuntimeError("the learner transaction is not open")
        return self._state

    @property
    def taken(self) -> int:
        """Steps taken in this round so far."""
        return self.state.step - self.first_step

    def open(self) -> LearnerState:
        """Proposal, lock, load, checks (see the class docstring)."""
        session = self.session
        session.check_proposal(self.config)
        self._exit.enter_context(session.locked())
        try:
            state = session.load(self.shapes, self.dtype)
            session.check_fresh(state, self.server_round)
            if self.check is not None:
                self.check(state)
            unit = "rounds" if session.kind == "round" else "steps"
            check_round(state, session.settings, sum(math.prod(s) for s in self.shapes),
                        self.steps or 0, unit)
            check_rounds_left(state, session.settings)
        except BaseException:
            self._exit.close()
            raise
        self._state = state
        self.first_step, self.position = state.step, state.position
        return state

    def commit(self, diagnostics: Mapping[str, Any] | None = None) -> None:
        """Record and store the round — before any reply leaves — and release the lock;
        a failed commit aborts (and re-raises)."""
        if diagnostics is not None:
            self.diagnostics = dict(diagnostics)
        diag = self.diagnostics if self.diagnostics is not None else \
            self.counts.diagnostics(self.taken)
        try:
            self.session.commit(self.state, first_step=self.first_step,
                                position=self.position, server_round=self.server_round,
                                diagnostics=diag)
        except BaseException:
            self.abort()
            raise
        self.committed = True
        self._exit.close()

    def abort(self) -> None:
        """Release the lock, writing nothing (idempotent; a no-op after a commit): the round
        released nothing, and its state object, advanced or not, is never stored."""
        self._exit.close()

    def __enter__(self) -> LearnerTransaction:
        self.open()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()

    def reply(
        self,
        msg: Message,
        arrays: ArrayRecord | list[np.ndarray],
        *,
        num_examples: float,
        user_metrics: Mapping[str, Any] | None = None,
    ) -> Message:
        """The train reply for the committed round, built by the release gate
        (:meth:`LearnerSession.reply`)."""
        if not self.committed:
            raise PrivacyConfigError("a reply before the round was committed")
        return self.session.reply(msg, arrays, self.state, num_examples=num_examples,
                                  user_metrics=user_metrics)


def answer(msg: Message, handler: Callable[..., Message], *args: Any,
           codes: Mapping[type[Exception], int] | None = None) -> Message:
    """``handler(*args)``, or — if it raises an ``Exception`` — the data-free error reply
    (:meth:`LearnerSession.error_reply`, with a front end's own ``codes``). Why: every
    learner front end answers every failure with a reply whose code and reason depend on
    configuration, state and the server's message only; an interrupt (``BaseException``)
    still stops it."""
    try:
        return handler(*args)
    except Exception as err:
        return LearnerSession.error_reply(msg, err, codes)


def round_config(config: Mapping[str, Any]) -> tuple[int, float]:
    """``(τ, η)`` from the server's train config (``local-steps``, ``learning-rate``): the
    round's shape, which every learner front end reads the same way."""
    try:
        return int(config["local-steps"]), float(config["learning-rate"])
    except (KeyError, TypeError, ValueError) as err:
        raise PrivacyConfigError(
            f"the server's round config lacks a valid 'local-steps'/'learning-rate': {err!r}"
        ) from err


def refuse_query(msg: Message) -> Message:
    """The reply to a data-dependent query a private learner does not answer."""
    kind = msg.metadata.message_type
    return LearnerSession.error_reply(msg, QueryRefusedError(
        f"a private learner does not answer {kind!r} messages: their answer depends on its "
        f"data and is not covered by its privacy budget. Evaluate on the server, or opt in "
        f"on the learner (node config client-evaluation = true, or allow_evaluation=True in "
        f"the app code) to unaccounted client-side evaluation"))


class PrivateLearnerGuard:
    """A ClientApp-level mod that lets only train messages reach a private learner.

    Attach it to the whole app (``ClientApp(mods=[PrivateLearnerGuard()])``, as
    :func:`~flwr_corrnoise.flower.make_client_app` does) so that *every* message type is
    guarded: evaluate and query messages are refused (code 4106) unless the learner opted
    in to unaccounted client-side evaluation (node config ``client-evaluation = true`` or
    ``allow_evaluation=True`` here); query messages are always refused.
    """

    def __init__(self, allow_evaluation: bool = False) -> None:
        self.allow_evaluation = bool(allow_evaluation)

    def __call__(self, msg: Message, ctxt: Context, call_next: Any) -> Message:
        kind = msg.metadata.message_type.split(".")[0]
        if kind == "train":
            return call_next(msg, ctxt)
        allowed = self.allow_evaluation or _flag(ctxt.node_config.get("client-evaluation"))
        if kind == "evaluate" and allowed:
            log.warning("answering an evaluate message: unaccounted client-side evaluation "
                        "(the learner opted in)")
            return call_next(msg, ctxt)
        return refuse_query(msg)
