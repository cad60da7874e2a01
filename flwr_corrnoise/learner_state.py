"""The learner's state: its one format and its serialization.

Everything a learner remembers between rounds — the counters (steps, data position,
rounds), its noise stream's state, the settings it is bound to, its identity and commit
generation, the last round it released, a front end's own payload arrays — is one
:class:`LearnerState`, and its bytes are :meth:`LearnerState.to_bytes` (named arrays,
:mod:`~flwr_corrnoise.arraypack`, no pickle). Persistence (:mod:`~flwr_corrnoise.
persistence`), the offloaded simulation states (:mod:`~flwr_corrnoise.state_offload`), the
Flower learners (:mod:`~flwr_corrnoise.flower.session`), the decentralized relay
(:mod:`~flwr_corrnoise.flower.relay`) and the torch optimizer store this and nothing else.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from . import arraypack
from .adaptive_clipping import AdaptiveClipState
from .mechanisms import FactorizationChangedError
from .settings import PrivacyConfigError, PrivacySettings
from .streams import NoiseStream, new_seed, restore_stream

log = logging.getLogger(__name__)

#: the format of the states :class:`~flwr_corrnoise.torch.PrivateOptimizer` wrote before it
#: stored learner states (steps, binding, its stream); :meth:`LearnerState.from_bytes`
#: still reads them
OPTIMIZER_STATE_FORMAT = 1

#: the binding key of the loop's data order (:func:`bind_data_order`)
DATA_ORDER = "data-order"


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
        if cal is not None and settings.adaptive is not None:  # C_0 and the count key
            payload = AdaptiveClipState.create(settings.clip_norm, seed).to_payload()
        else:
            payload = None
        return cls(noise=noise, seed=seed, binding=settings.binding(digest), payload=payload,
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

    def fork(self) -> LearnerState:
        """A copy that a round advances while this state stays as it was: the counters,
        the binding and the payload copied (the payload's arrays are replaced, never
        written in place: adaptive clipping, the relay node), the stream forked
        (:meth:`~flwr_corrnoise.streams.NoiseStream.fork`: the same kernel state, which no
        step changes, and a copy of the generator). Why: a round that fails half-way (an
        interrupt, a failed commit) released nothing, and undoing it is not writing it —
        the learner keeps this state, never a half-advanced one, so no released noise is
        reused and no counter moves without a release. A round that succeeds is taken
        with :meth:`assign`."""
        return replace(self, noise=None if self.noise is None else self.noise.fork(),
                       binding=None if self.binding is None else dict(self.binding),
                       payload=None if self.payload is None else dict(self.payload))

    def assign(self, other: LearnerState) -> None:
        """Take everything ``other`` holds (a :meth:`fork` whose round succeeded): the one
        write of a round into the learner's state object."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))

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
        if "format" in arrays and "steps" in arrays:  # the torch optimizer's earlier format
            return cls._from_optimizer_format(arrays, device)
        return cls.from_state_dict(arrays, device, adopt=True)  # arrays: fresh copies

    @classmethod
    def _from_optimizer_format(cls, arrays: Mapping[str, np.ndarray],
                               device: Any) -> LearnerState:
        """A state :class:`~flwr_corrnoise.torch.PrivateOptimizer` wrote before it stored
        learner states (:data:`OPTIMIZER_STATE_FORMAT`: steps, binding, its stream), read
        as one; its torch stream restored on ``device`` through the backend table."""
        try:
            if int(arrays["format"]) != OPTIMIZER_STATE_FORMAT:
                raise ValueError(
                    f"unsupported private-optimizer state {int(arrays['format'])}")
            steps = int(arrays["steps"])
            noise = (restore_stream(arraypack.unpack_any(np.asarray(arrays["noise"]).tobytes()),
                                    device, adopt=True) if "noise" in arrays else None)
            binding = json.loads(str(arrays["binding"]))
        except (KeyError, TypeError, EOFError, OSError) as err:
            raise ValueError(f"unreadable private-optimizer state: {err!r}") from err
        if noise is not None and noise.step != steps:
            raise ValueError("private-optimizer state does not match its noise stream")
        return cls(step=steps, position=steps, noise=noise, binding=binding)

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
