"""Per-round correlated noise as a Flower mod around *any* ClientApp (Zhang, Zhu, Fay & Johansson's
("Locally Differentially Private Online Federated Learning With Correlated Noise", arXiv version)
variant).

Zhang, Zhu, Fay & Johansson's "Locally Differentially Private Online Federated Learning With
Correlated Noise" adds noise at every local step, which needs our training loop. Zhang et al.'s
arXiv version adds the correlated noise **once per communication round**, to the learner's round
update: the local steps stay the user's own, so the noise fits a Flower mod, attachable with
``ClientApp(mods=[...])`` or ``@app.train(mods=[...])``, around an unmodified app.

Per round ``r`` the mod lets the wrapped app train, takes its update
``Δ_r = returned − received`` (over all arrays), clips it to ``clip-norm`` ``B`` in global L2
norm, adds the next increment ``e[r]`` of an ``R×R`` correlated-noise stream, and replies
``received + clip(Δ_r) + e[r]``. The server's running sum of a learner's released updates
is then ``Σ_{s≤r} clip(Δ_s) + V·(B·ξ)[r]``: the matrix mechanism over *round* sums.

**Guarantee, and how it differs from the per-step algorithm.** Neighbouring data replace
one datum of the learner's stream, and each datum is used in **one** round (online
learning, as in Zhang et al. (arXiv)). Replacing it changes one clipped round update by at most
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
and for a deployed learner (node config ``state-dir``) also on disk, locked, written
atomically after every round, with a ledger of the noise indices it released; settings,
seed, state and replies come from the shared
:class:`~flwr_corrnoise.flower.session.LearnerSession`, with ``horizon`` = the number of
rounds the noise is calibrated for (default ``num-server-rounds``, in simulation). Each
round is one :class:`~flwr_corrnoise.flower.session.LearnerTransaction` (as for every
learner front end), and its release is one :func:`~flwr_corrnoise.learner.private_step`
with the round's update as the datum: clipped to ``B``, plus the stream's next
increment.

**What the reply holds** (the release gate): the noised arrays and the privacy metadata.
The wrapped app's own metrics and any other records are dropped (allow-list a metric with
the node config's ``release-metrics`` or ``release_metrics=``; it is then unaccounted), and
``num-examples`` is 1 for every learner (uniform weights: a weight must not depend on data).
If the wrapped app fails, replies with an error or returns a non-finite update, the round's
update counts as **zero** and the noise is still released: the reply's kind must not depend
on the data. Error replies are only for reasons that are functions of the configuration,
the state and the server's message (a weaker proposal, the horizon used up, a lost state).

**The server's model is checked before anything is spent.** A model that is not finite
(code 4103) or whose array shapes differ from the learner's stream — or from the shapes the
learner declared with ``model_shapes=`` — (code 4101) is refused with a fixed reason before
the wrapped app runs and before anything changes (the state is only read): no step, no
noise, no ε. Without a declaration the *first* model the learner accepts fixes the stream's
shapes (a function of the server's message, never of the data): a server that sends a model
of another size first would fix that size, and every later model of the right size would be
refused. Declare ``model_shapes`` (e.g. ``[p.shape for p in Net().state_dict().values()]``)
to rule that out.
Why not take the shapes from what the wrapped app returns: a wrong-size model usually makes
the app raise, and whether it raises may depend on a datum — the reply's kind must not.

**Attach it to the whole app**, ``ClientApp(mods=[CorrNoiseRoundMod()])``: it then also
refuses evaluate and query messages (their answers depend on the data and no budget covers
them) unless the learner opts in (``allow_evaluation=True`` or node config
``client-evaluation = true``). Attached with ``@app.train(mods=[...])`` it guards the train
messages only, and the app's evaluate function would answer the server unguarded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable

from ..learner import NonFiniteError, private_step
from ..learner_state import LearnerState
from ..settings import PrivacyConfigError, PrivacySettings
from .session import (
    ROUND_STATE_KEY,
    LearnerSession,
    PrivateLearnerGuard,
    answer,
    round_settings,
)

log = logging.getLogger(__name__)

__all__ = ["ROUND_STATE_KEY", "CorrNoiseRoundMod", "round_settings"]

Shapes = tuple[tuple[int, ...], ...]

#: fixed reasons (the details go to the learner's log): functions of the server's message
#: and the learner's settings/state only
NON_FINITE_MODEL = "the global model received from the server is not finite"
OTHER_SHAPES = ("the server's model does not have this learner's array shapes (declared, or "
                "fixed by the noise stream's first round); nothing was spent")


def declared_shapes(model: Any) -> Shapes:
    """Array shapes from shapes, arrays, an ``ArrayRecord`` or a state dict (mapping)."""
    items = model.values() if isinstance(model, Mapping) else model
    out = []
    for item in items:
        shape = getattr(item, "shape", item)
        try:
            out.append(tuple(int(d) for d in shape))
        except TypeError as err:
            raise PrivacyConfigError(
                f"model_shapes: give array shapes (tuples), arrays or a state dict, got "
                f"{item!r}") from err
    if not out:
        raise PrivacyConfigError("model_shapes: the model has no arrays")
    return tuple(out)


class CorrNoiseRoundMod:
    """Clip each round's update and add per-round correlated noise (Zhang et al., arXiv).

    ``settings`` (optional) fixes the privacy settings in code; otherwise they are read from
    the context as described in the module docstring. ``config_defaults`` are the app's
    defaults for the kebab-case keys; ``release_metrics`` and ``allow_evaluation`` are the
    app's (unaccounted) opt-ins. ``model_shapes`` declares the learner's model (shapes,
    arrays or a state dict): a server model of other shapes is then refused from the first
    round on, so it can never fix the noise stream's shapes.
    """

    def __init__(
        self,
        settings: PrivacySettings | None = None,
        config_defaults: Mapping[str, Any] | None = None,
        *,
        release_metrics: Iterable[str] = (),
        allow_evaluation: bool = False,
        model_shapes: Any = None,
    ) -> None:
        if settings is not None and not settings.private:
            raise PrivacyConfigError("CorrNoiseRoundMod needs a noise mechanism, not 'none'")
        self.settings = settings
        self.model_shapes: Shapes | None = (None if model_shapes is None
                                            else declared_shapes(model_shapes))
        self.defaults = dict(config_defaults or {})
        self.release_metrics = tuple(release_metrics)
        self.guard = PrivateLearnerGuard(allow_evaluation)

    def __call__(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return self.guard(msg, ctxt, call_next)
        # refused before anything was released: nothing applied
        return answer(msg, self._round, msg, ctxt, call_next)

    def _round(self, msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        session = LearnerSession(ctxt, kind="round", defaults=self.defaults,
                                 settings=self.settings, release_metrics=self.release_metrics)
        settings = session.settings
        if not settings.private:
            raise PrivacyConfigError("CorrNoiseRoundMod needs a noise mechanism, not 'none'")
        config = dict(msg.content["config"]) if "config" in msg.content else {}
        received = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        keys = list(msg.content["arrays"].keys())  # type: ignore[union-attr]
        shapes = tuple(tuple(int(d) for d in np.shape(a)) for a in received)

        def check_model(state: LearnerState) -> None:
            # the server's model, checked before the wrapped app runs or any noise is
            # drawn (the state is only read): a refusal here changes nothing
            self._check_model(received, shapes, self.model_shapes, "declared")
            if state.noise is not None:
                self._check_model(received, shapes, tuple(state.noise.shapes), "stream's")

        with session.transaction(config, shapes, steps=1, check=check_model) as tx:
            delta, failure = self._wrapped_update(msg, ctxt, call_next, received)
            # the release: clip(Δ, B) + e[r], the one private step (Δ is the datum)
            noisy = private_step(tx.state, settings, lambda: delta, delta.size, tx.counts)
            tx.state.rounds += 1
            out, offset = [], 0
            for base in received:
                base = np.asarray(base)
                part = noisy[offset : offset + base.size].reshape(base.shape)
                dtype = base.dtype if np.issubdtype(base.dtype, np.floating) else np.float64
                out.append((base.astype(np.float64) + part).astype(dtype))
                offset += base.size
            tx.diagnostics = {"update-norm-clipped": float(tx.counts.clipped),
                              "wrapped-app-failed": failure}
        arrays = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, out, strict=True)})
        return tx.reply(msg, arrays, num_examples=1.0)

    @staticmethod
    def _check_model(received: list[np.ndarray], shapes: Shapes, expected: Shapes | None,
                     what: str) -> None:
        """Refuse a non-finite server model (4103) or one of other shapes than
        ``expected`` (4101), with fixed reasons; the details stay in the local log."""
        if not all(np.all(np.isfinite(np.asarray(a))) for a in received):
            raise NonFiniteError(NON_FINITE_MODEL)
        if expected is not None and shapes != tuple(tuple(s) for s in expected):
            log.error("the server's model has shapes %s, the learner's %s shapes are %s: "
                      "refused", shapes, what, expected)
            raise PrivacyConfigError(OTHER_SHAPES)

    @staticmethod
    def _wrapped_update(
        msg: Message, ctxt: Context, call_next: ClientAppCallable, received: list[np.ndarray]
    ) -> tuple[np.ndarray, str]:
        """The wrapped app's flat round update, or zeros if it failed in any way (the
        failure is data-dependent: it must not change the reply). Returns the update and
        what failed (kept local)."""
        zero = np.zeros(sum(np.size(a) for a in received))
        try:
            reply = call_next(msg, ctxt)
            if reply.has_error():
                return zero, f"error reply {reply.error.code}"
            record = reply.content["arrays"]
            if not isinstance(record, ArrayRecord):
                return zero, "no 'arrays' ArrayRecord"
            returned = record.to_numpy_ndarrays()
            if [np.shape(a) for a in returned] != [np.shape(a) for a in received]:
                log.error("the wrapped app returned arrays of other shapes than the server's "
                          "model; its round update counts as zero (declare model_shapes= so "
                          "that a server model of other shapes is refused before anything "
                          "is spent)")
                return zero, "arrays of other shapes"
            delta = np.concatenate([
                (np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).ravel()
                for a, b in zip(returned, received, strict=True)
            ])
        except Exception as err:
            log.error("the wrapped app failed; its round update counts as zero", exc_info=err)
            return zero, type(err).__name__
        if not np.all(np.isfinite(delta)):
            return zero, "non-finite update"
        return delta, ""
