"""Per-round correlated noise as a Flower mod around *any* ClientApp (paper 001's variant).

Paper 000 adds noise at every local step, which needs our training loop. Paper 001 adds the
correlated noise **once per communication round**, to the learner's round update: the
local steps stay the user's own, so the noise fits a Flower mod, attachable with
``ClientApp(mods=[...])`` or ``@app.train(mods=[...])``, around an unmodified app.

Per round ``r`` the mod lets the wrapped app train, takes its update
``Δ_r = returned − received`` (over all arrays), clips it to ``clip-norm`` ``B`` in global L2
norm, adds the next increment ``e[r]`` of an ``R×R`` correlated-noise stream, and replies
``received + clip(Δ_r) + e[r]``. The server's running sum of a learner's released updates
is then ``Σ_{s≤r} clip(Δ_s) + V·(B·ξ)[r]``: the matrix mechanism over *round* sums.

**Guarantee, and how it differs from the per-step algorithm.** Neighbouring data replace
one datum of the learner's stream, and each datum is used in **one** round (online
learning, as in paper 001). Replacing it changes one clipped round update by at most
``2B``, so the release is one Gaussian mechanism with L2 sensitivity
``2·B·max_j ‖c_j‖`` over the ``R×R`` factorization, calibrated by
:func:`flwr_corrnoise.privacy.calibrate` (the same code as everywhere else), under
adaptive continual release. The per-step algorithm clips every *gradient* and noises all
``N = R·τ`` prefix sums; here only the ``R`` round updates are clipped and noised, so ``V``
is calibrated over ``R`` (not ``N``) steps — less noise per release — but the intermediate
local models are never released, and the whole round update, not one gradient, is what
``B`` bounds. **If your app reuses data across rounds** (epochs over a fixed local set),
one datum changes every round's update and this calibration does not cover it.

State (noise stream, rounds done) lives in ``context.state`` like the per-step learner's,
and for a deployed learner (node config ``state-dir``) also on disk, written atomically
after every round and required on restart (``flwr_corrnoise.persistence``);
its privacy settings come from the app's defaults < run config < node config, with
``horizon`` = the number of rounds the noise is calibrated for (default
``num-server-rounds``); a server proposal that would weaken them is refused with an
``Error`` reply before the wrapped app runs, and so are non-finite updates and rounds past
the horizon — in each case nothing is applied and the stored state is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord
from flwr.clientapp.typing import ClientAppCallable

from ..learner import LearnerState, NonFiniteError, PrivacyConfigError, PrivacySettings
from ..persistence import StateLostError, StateStore
from ..streams import HorizonExhaustedError
from ..variants import round_release
from .client import (
    deployed,
    error_code,
    learner_config,
    learner_seed,
    run_config_proposal,
)

log = logging.getLogger(__name__)

#: key of the mod's record in ``context.state`` (separate from the per-step learner's)
ROUND_STATE_KEY = "flwr-corrnoise-round"


def round_settings(cfg: Mapping[str, Any]) -> PrivacySettings:
    """The mod's privacy settings: as the learner's, but the horizon counts *rounds*
    (``horizon``, else ``num-server-rounds``)."""
    horizon = cfg.get("horizon") or cfg.get("num-server-rounds") or 1
    return PrivacySettings.from_config({**dict(cfg), "horizon": int(horizon)})


class CorrNoiseRoundMod:
    """Clip each round's update and add per-round correlated noise (paper 001).

    ``settings`` (optional) fixes the privacy settings in code; otherwise they are read from
    the context as described in the module docstring. ``config_defaults`` are the app's
    defaults for the kebab-case keys.
    """

    def __init__(
        self,
        settings: PrivacySettings | None = None,
        config_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        if settings is not None and not settings.private:
            raise PrivacyConfigError("CorrNoiseRoundMod needs a noise mechanism, not 'none'")
        self.settings = settings
        self.defaults = dict(config_defaults or {})

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        try:
            settings = self.settings or round_settings(learner_config(ctxt, self.defaults))
            if not settings.private:
                raise PrivacyConfigError("CorrNoiseRoundMod needs a noise mechanism, not 'none'")
            config = dict(msg.content["config"]) if "config" in msg.content else {}
            settings.check_proposal({**run_config_proposal(ctxt), **config})
            received = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
            state = self._load(ctxt, settings, received)
            if state.step >= settings.horizon:
                raise HorizonExhaustedError(
                    f"this learner's per-round noise is calibrated for {settings.horizon} "
                    f"rounds and all of them have been used; it stops contributing"
                )
        except Exception as err:  # refuse before the wrapped app runs: nothing applied
            return self._error(msg, err)
        reply = call_next(msg, ctxt)
        if reply.has_error():
            return reply
        token = None
        try:
            record = reply.content["arrays"]
            if not isinstance(record, ArrayRecord):
                raise TypeError("the wrapped app's reply has no 'arrays' ArrayRecord")
            keys = list(record.keys())
            returned = record.to_numpy_ndarrays()
            if [np.shape(a) for a in returned] != [np.shape(a) for a in received]:
                raise ValueError("the wrapped app returned arrays of other shapes than it got")
            delta = np.concatenate([
                (np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).ravel()
                for a, b in zip(returned, received, strict=True)
            ])
            if not np.all(np.isfinite(delta)):
                raise NonFiniteError("the wrapped app's round update is not finite")
            token = state.noise.checkpoint()  # type: ignore[union-attr]
            noisy, norm = round_release(delta, settings.clip, state.noise)  # type: ignore[arg-type]
            state.step += 1
            state.rounds += 1
            out, offset = [], 0
            for base in received:
                base = np.asarray(base)
                part = noisy[offset : offset + base.size].reshape(base.shape)
                dtype = base.dtype if np.issubdtype(base.dtype, np.floating) else np.float64
                out.append((base.astype(np.float64) + part).astype(dtype))
                offset += base.size
            self._save(ctxt, state)
        except Exception as err:
            if token is not None:  # nothing was released: the increment may be reused
                state.noise.rollback(token)  # type: ignore[union-attr]
            return self._error(msg, err)
        reply.content["arrays"] = ArrayRecord(
            {k: Array(np.asarray(v)) for k, v in zip(keys, out, strict=True)}
        )
        cal = settings.calibration()
        assert cal is not None
        metrics = dict(reply.content["metrics"]) if "metrics" in reply.content else {}
        metrics.update({
            "epsilon-spent": settings.epsilon_spent(state.step),
            "epsilon": settings.epsilon,
            "delta": settings.delta,
            "noise-std": cal.std,
            "rounds-noised": float(state.step),
            "horizon": float(settings.horizon),
            "update-clipped": float(norm > settings.clip),
        })
        reply.content["metrics"] = MetricRecord(
            {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        )
        return reply

    @staticmethod
    def _store(ctxt: Context) -> StateStore | None:
        """A deployed learner's on-disk state (``state-dir``/round-mod), else ``None``."""
        if not deployed(ctxt):
            return None
        return StateStore(Path(str(ctxt.node_config["state-dir"])) / "round-mod")

    def _load(
        self, ctxt: Context, settings: PrivacySettings, arrays: list[np.ndarray]
    ) -> LearnerState:
        store = self._store(ctxt)
        if store is not None:
            data = store.load()  # StateLostError if it trained before and the state is gone
            if data is not None:
                try:
                    return LearnerState.from_bytes(data)
                except ValueError as err:
                    raise StateLostError(f"the mod's state {store.state_path} is corrupt, "
                                         f"refusing to train: {err}") from err
        elif ROUND_STATE_KEY in ctxt.state:
            record = ctxt.state[ROUND_STATE_KEY]
            return LearnerState.from_bytes(bytes(record["learner"]))  # type: ignore[index]
        seed = learner_seed(ctxt, self.defaults)
        return LearnerState.create(settings, [np.shape(a) for a in arrays], seed)

    def _save(self, ctxt: Context, state: LearnerState) -> None:
        data = state.to_bytes()
        store = self._store(ctxt)
        if store is not None:
            store.save(data)  # before the reply leaves: a crash releases nothing
        ctxt.state[ROUND_STATE_KEY] = ConfigRecord({"learner": data})

    @staticmethod
    def _error(msg: Message, err: Exception) -> Message:
        reason = f"flwr-corrnoise: {type(err).__name__}: {err}"
        log.warning("CorrNoiseRoundMod refuses the round: %s", reason)
        return Message(Error(code=error_code(err), reason=reason), reply_to=msg)

