"""Per-step correlated noise inside the user's own NumPy training loop (Zhang, Zhu, Fay & Johansson,
"Locally Differentially Private Online Federated Learning With Correlated Noise").

The strict mode (:func:`~flwr_corrnoise.flower.make_client_app`) runs the local loop
itself, on a gradient oracle addressed by stream position, so it can enforce "each datum
once". Most apps already have a loop; Opacus' ``make_private`` showed that adoption is one
call that keeps it. Here the user's train function keeps its loop and calls the library
once per local step::

    client_app = ClientApp(mods=[PrivateSteps.guard()])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        for x, y in my_stream(context, steps):
            # clip + next correlated increment; the lambda lets a datum whose gradient
            # cannot be computed (it raises) count as a zero gradient, as in every front end
            w = w - lr * private.step(lambda: gradient(w, x, y))
        return private.reply([w])                          # built by the release gate

What the library owns: the learner's settings (the shared
:class:`~flwr_corrnoise.flower.session.LearnerSession`: app defaults < run config in
simulation < node config), the noise stream and the step counters (in ``context.state``,
and with a node-config ``state-dir`` on disk, locked for the whole message: the round is
one :class:`~flwr_corrnoise.flower.session.LearnerTransaction`, opened here and committed
by the reply), each step (:func:`~flwr_corrnoise.learner.private_step`, the one every
NumPy front end takes; a step past the horizon is refused before anything is released),
the server's proposal (refused if weaker) and the reply: :meth:`PrivateSteps.reply`
builds it through the release gate — the arrays and the privacy metadata, nothing else.
:meth:`PrivateSteps.guard` is a ClientApp mod that turns any failure into a data-free
error reply, refuses a train reply that the gate did not build (it could hold an un-noised
update), and refuses evaluate and query messages unless the learner opts in.

What the user promises (as with Opacus, the loop is theirs): the model they release is a
function of the received model and the gradients :meth:`PrivateSteps.step` returned only
(plain SGD, momentum, a fixed step-size schedule), and the **number of steps does not
depend on the data** (it is released, as ``steps``). How often each datum is used is
what the settings declare: once by default (online learning; the strict mode enforces
that, this mode trusts it), or the participation of ``data-reuse``/``epochs``/
``min-sep``/``max-participations``. With ``loader=CyclicLoader(...)`` the library knows it
instead of trusting it: the loader sets the horizon and the fixed-epoch participation, every
step needs a batch drawn from :meth:`PrivateSteps.batches`, and a config that disagrees with
the loader is refused. ``loader=CyclicPoissonLoader(..., key=...)`` samples the batches
instead (cyclic Poisson, Choquette-Choo et al., "(Amplified) Banded Matrix Factorization"):
the noise is calibrated to the amplified guarantee, the batches' sizes vary and stay
secret — pass each step the batch's *per-example* gradients (``private.step([lambda:
grad(w, x[i], y[i]) for i in idx])``): the library clips each to the clip norm, adds the
noise to their sum and divides by ``loader.expected_batch_size``, never by the drawn
count (:func:`~flwr_corrnoise.learner.private_sampled_steps`, the step of the in-process
engine's sampled run and of the torch device step). The library cannot see which
data a step touches; with a loader, feed each step exactly the loader's batch. A datum whose
gradient cannot be computed must not stop the loop: a non-finite or wrong-size gradient
passed to :meth:`PrivateSteps.step` counts as zero, and so does an exception raised
inside a callable passed to it; an exception raised in the user's code *outside* it turns
the round into an error reply (code 4100, a fixed reason; nothing released).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message

from ..data.sampling import CyclicPoissonLoader, Loader
from ..learner import StepCounts, check_horizon, private_sampled_steps, private_step
from ..learner_state import LearnerState, bind_data_order
from ..settings import PrivacyConfigError, PrivacySettings, check_delta_for
from ..settings_keys import lookup
from .session import LearnerSession, PrivateLearnerGuard, answer

log = logging.getLogger(__name__)

__all__ = ["PrivateSteps", "PrivateStepsGuard", "check_loader"]


def log_plan(loader: Loader, settings: PrivacySettings, size: int) -> None:
    """The plan of this learner's loop (:mod:`flwr_corrnoise.plan`), logged on its first
    round: the noise-to-signal of its own update at the loader's batch size (one learner;
    the server's average over ``m`` divides it by ``√m``)."""
    from ..plan import PlanInput, format_plan, make_plan

    plan = make_plan(PlanInput(
        model_size=size, examples=loader.num_examples, batch_size=loader.batch_size,
        epochs=loader.epochs, mechanism=settings.mechanism, epsilon=settings.epsilon,
        delta=settings.delta, clip_norm=settings.clip_norm, method=settings.method,
        rounds=loader.rounds,
        adaptive_quantile=None if settings.adaptive is None else settings.adaptive.quantile,
        adaptive_noise=None if settings.adaptive is None else settings.adaptive.noise),
        levers=False)
    log.info("flwr-corrnoise learner %s", format_plan(plan))


def check_loader(loader: Loader, settings: PrivacySettings,
                 config: Mapping[str, Any]) -> None:
    """Refuse settings that do not match the loop the loader describes: a horizon, a
    participation, local steps or a round count other than the loader's would calibrate
    the noise for another loop than the one that runs."""
    if settings.private:  # the loader declares n: δ ≥ 1/n guarantees nothing
        check_delta_for(settings.delta, loader.num_examples, " by the loader")
    problems = []
    if settings.horizon != loader.horizon:
        problems.append(f"horizon {settings.horizon} (config) vs {loader.horizon} (loader: "
                        f"{loader.rounds} rounds × {loader.local_steps} steps)")
    if settings.private and settings.participation != loader.participation:
        problems.append(f"participation {settings.participation.describe()!r} (config) vs "
                        f"{loader.participation.describe()!r} (loader)")
    for key, mine in (("local-steps", loader.local_steps), ("num-server-rounds", loader.rounds)):
        theirs = config.get(key)
        if theirs is not None and int(theirs) != mine:
            problems.append(f"{key} {theirs} (config) vs {mine} (loader)")
    if problems:
        raise PrivacyConfigError("the learner's config disagrees with its loader: "
                                 + "; ".join(problems) + ". Leave 'horizon', 'local-steps' "
                                 "and 'epochs' out of the config: the loader derives them")

def round_step_limit(config: Mapping[str, Any], settings: PrivacySettings) -> int | None:
    """The data-independent backstop of ``data-reuse = "every-round"`` (issue 32,
    docs/threat-model.md): with ``local-examples = n`` declared, a round may take at most
    ``n`` steps — every step uses an example at least, so a step past ``n`` uses some example
    twice in the round (pigeonhole), more than the participation accounts. A function of
    the declared ``n`` and the step counter only, never of an example's content, so two
    neighbouring datasets (replace-one: the same ``n``) are refused alike. Also refuses
    ``δ ≥ 1/n``. ``None``: no ``n`` declared, or another participation."""
    n = lookup(config, "local-examples", "learner's config", warn=False)
    if n is None or not settings.private:
        return None
    if isinstance(n, bool) or int(n) < 1:
        raise PrivacyConfigError(f"local-examples must be a positive integer, got {n!r}")
    check_delta_for(settings.delta, int(n), " by local-examples")
    reuse = str(config.get("data-reuse") or "").strip().lower()
    return int(n) if reuse == "every-round" else None


_lock = threading.Lock()
#: per message (by ``id``): whether the guard is around it, the open PrivateSteps, and the
#: one reply the gate built for it
_GUARDED: set[int] = set()
_OPEN: dict[int, PrivateSteps] = {}
_BUILT: dict[int, Message] = {}
#: messages whose train function created a PrivateSteps at all (the guard's hint)
_CREATED: set[int] = set()

#: what the guard says when the train function never used PrivateSteps: the usual cause is
#: not the app's code but an older copy of it
STALE_APP_HINT = (
    "this train function never created PrivateSteps, so the code that ran is probably not "
    "your current app: a local SuperLink keeps the app directory of the first `flwr run` "
    "(its Ray workers import that copy) — stop the SuperLink you started (or use a fresh "
    "FLWR_HOME) and run again")


class PrivateSteps:
    """One round of per-step private training inside the user's loop.

    Create it at the start of the train function (it loads the learner's state and checks
    the server's proposal), call :meth:`step` on every local step's gradient, and return
    :meth:`reply` with the local model. ``config_defaults``, ``release_metrics``,
    ``settings`` and ``seed`` are as for :func:`~flwr_corrnoise.flower.make_client_app`.
    """

    def __init__(
        self,
        msg: Message,
        context: Context,
        *,
        config_defaults: Mapping[str, Any] | None = None,
        release_metrics: Iterable[str] = (),
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        loader: Loader | None = None,
    ) -> None:
        with _lock:
            guarded = id(msg) in _GUARDED
            again = id(msg) in _OPEN or id(msg) in _BUILT
        if again:  # two streams of steps on one stored state would reuse noise
            raise PrivacyConfigError("one PrivateSteps per train message")
        if not guarded:
            raise PrivacyConfigError(
                "PrivateSteps needs its guard around the ClientApp: "
                "ClientApp(mods=[PrivateSteps.guard()]); without it a failure or an "
                "un-noised reply could leave the learner")
        self.msg = msg
        #: the loop's batches, whose participation the noise is calibrated for
        self.loader = loader
        if loader is not None:
            if settings is not None:
                raise PrivacyConfigError("give a loader or settings, not both: the loader "
                                         "sets the horizon and the participation")
            config_defaults = {**dict(config_defaults or {}), **loader.config()}
        self.session = LearnerSession(context, kind="step", defaults=config_defaults,
                                      settings=settings, seed=seed,
                                      release_metrics=release_metrics)
        self.settings = self.session.settings
        if loader is not None:
            check_loader(loader, self.settings, self.session.config)
        #: the most steps a round may take under the declared data use (None: no bound)
        self._round_limit = round_step_limit(self.session.config, self.settings)
        self._issued = 0
        self.config = dict(msg.content["config"]) if "config" in msg.content else {}
        record = msg.content["arrays"]
        if not isinstance(record, ArrayRecord):
            raise PrivacyConfigError("the train message holds no 'arrays' ArrayRecord")
        self.keys = list(record.keys())
        self.received = [np.asarray(a) for a in record.to_numpy_ndarrays()]
        self.shapes = [tuple(a.shape) for a in self.received]
        self.size = sum(math.prod(s) for s in self.shapes)
        #: the round: proposal, lock, load, the data-independent refusals (no step yet)
        self.round = self.session.transaction(
            self.config, self.shapes,
            check=None if loader is None else
            (lambda state: bind_data_order(state, loader.order_digest)))
        self.state: LearnerState = self.round.open()
        if loader is not None and getattr(loader, "key", 0) is None:  # a sampler to key
            self.loader = self._keyed(loader)
        with _lock:  # from here on the guard closes the round if the train function fails
            _OPEN[id(msg)] = self
            _CREATED.add(id(msg))
        self.first_step, self.first_position = self.round.first_step, self.round.position
        if loader is not None and self.first_step == 0 and self.settings.private:
            log_plan(loader, self.settings, self.size)
        #: what step() returns: a single array or a list, with these shapes and dtypes —
        #: the last good gradient's structure this round, else the model's
        self._template: tuple[bool, list[tuple[tuple[int, ...], np.dtype]]] = (
            len(self.received) == 1,
            [(tuple(a.shape), a.dtype) for a in self.received])
        self._done = False
        #: the steps are taken by a device optimizer that owns the stream
        #: (:func:`flwr_corrnoise.flower.torch_app.private_optimizer`)
        self.external = False

    def _keyed(self, loader: Any) -> Any:
        """A sampler keyed with this learner's noise seed (its own sub-key: never the
        noise's keystream); refused where the learner has none (secure noise)."""
        if self.state.seed is None:
            self.round.abort()
            raise PrivacyConfigError(
                "a CyclicPoissonLoader without a key draws from the learner's noise seed, "
                "and this learner has none (secure noise): pass key= (128 bits or more of "
                "OS entropy, kept secret)")
        return loader.keyed(self.state.seed)

    @staticmethod
    def guard(allow_evaluation: bool = False) -> PrivateStepsGuard:
        """The ClientApp mod every app using :class:`PrivateSteps` attaches."""
        return PrivateStepsGuard(allow_evaluation)

    @property
    def steps(self) -> int:
        """Steps taken in this round."""
        return self.round.taken

    def batches(self) -> Iterator[np.ndarray]:
        """This round's batches of example indices, from the loader given at construction
        (:class:`~flwr_corrnoise.data.loader.CyclicLoader`): ``local_steps`` of them (fewer
        at the end of the horizon), continuing the fixed cyclic order at the learner's
        step counter. Every :meth:`step` needs a batch drawn here first."""
        if self.loader is None:
            raise PrivacyConfigError("batches() needs PrivateSteps(..., loader=CyclicLoader(...))")
        check_horizon(self.settings, self.first_step)  # nothing left: refused, data-free
        last = min(self.first_step + self.loader.local_steps, self.loader.horizon)
        for step in range(self.first_step, last):
            self._issued += 1
            yield self.loader.indices(step)

    def check_batch_drawn(self) -> None:
        """Refuse a step the loader has not handed a batch for: its data (and hence the
        participation the noise is calibrated for) would be unknown."""
        if self.loader is not None and self._issued <= self.steps:
            raise PrivacyConfigError(
                "a step without a batch from the loader: with a loader, every step's data "
                "must come from PrivateSteps.batches() (the participation the ε accounts "
                "for); this round has drawn "
                f"{self._issued} batch(es) and taken {self.steps} step(s)")

    @property
    def counts(self) -> StepCounts:
        """This round's data-dependent counts (:class:`~flwr_corrnoise.learner.StepCounts`;
        local diagnostics only)."""
        return self.round.counts

    def step(self, grad: np.ndarray | Sequence[np.ndarray] | Callable[[], Any]) -> Any:
        """Clip ``grad`` (one array, or a list over the model's arrays) to the clip norm in
        global L2 and add the next correlated-noise increment; returns the same structure.

        Pass the gradient's computation as a **callable** (``private.step(lambda:
        gradient(w, x, y))``) so that an exception in it — a malformed datum, a label out
        of range — counts as a zero gradient instead of failing the round: whether a
        datum's gradient can be computed depends on the data, so it must not change the
        reply. Likewise a non-finite gradient or one of the wrong size counts as zero
        (:func:`~flwr_corrnoise.learner.datum_gradient`, the rule every front end shares);
        the step's noise increment is still added and the result has the model's
        structure (that of the last good gradient this round, else the model's arrays), so
        the loop goes on. Past the horizon it refuses
        (:class:`~flwr_corrnoise.streams.HorizonExhaustedError`), before any release.

        With a :class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader` ``grad`` is the
        step's batch of **per-example** gradients (a list or tuple, one gradient or
        callable per drawn example; empty when nothing was drawn; an array is refused,
        since a 2-D one may be a parameter's batch mean) and
        the result ``(Σ clip(g_i) + e)/m``, ``m`` the loader's expected batch size: a
        clipped batch mean would let one example move the release by ``2·B_g``, twice what
        the amplified accounting assumes."""
        if self._done:
            raise PrivacyConfigError("step() after reply(): the round was released")
        if self.external:
            raise PrivacyConfigError("this round's steps belong to the device optimizer "
                                     "(private_optimizer): call its step()")
        self.check_batch_drawn()
        if self._round_limit is not None and self.steps >= self._round_limit:
            raise PrivacyConfigError(
                f"this round has taken {self.steps} steps, one per declared example "
                f"(local-examples = {self._round_limit}); another would use an example "
                "twice in one round, which data-reuse = 'every-round' does not account: "
                "take at most one pass over the local data per round (or declare epochs "
                "with a CyclicLoader)")
        if isinstance(self.loader, CyclicPoissonLoader):
            # a list or tuple only: a 2-D array could be one parameter's batch mean (a
            # Linear(d, 1) weight is 1 × d), which read as one example's row would be
            # clipped whole — the 2·B_g change this form exists to rule out
            drawn = list(grad) if isinstance(grad, list | tuple) else None
            if drawn is None:  # a batch mean or sum: refused whatever the data (its type)
                raise PrivacyConfigError(
                    "with a CyclicPoissonLoader, step() takes the batch's per-example "
                    "gradients as a list, one gradient or callable per drawn example "
                    "(rows of an array: list(rows)), not the batch's sum or mean")
            flat = private_sampled_steps([self.state], self.settings, self.size,
                                         [self.counts], [drawn],
                                         self.loader.expected_batch_size)[0]
            return self._shaped(flat)
        value: Any = None

        def compute() -> Any:
            nonlocal value
            value = grad() if callable(grad) else grad
            return value

        flat = private_step(self.state, self.settings, compute, self.size, self.counts)
        if not self.counts.last:  # a good gradient: the structure the loop expects back
            single = isinstance(value, np.ndarray) or np.isscalar(value)
            parts = [np.asarray(value)] if single else [np.asarray(g) for g in value]
            self._template = (single, [(p.shape, p.dtype) for p in parts])
        return self._shaped(flat)

    def _shaped(self, flat: np.ndarray) -> Any:
        """``flat`` in the structure the loop expects back (:meth:`step`)."""
        single, layout = self._template
        out, offset = [], 0
        for shape, dtype in layout:
            size = math.prod(shape)
            dtype = dtype if np.issubdtype(dtype, np.floating) else np.float64
            out.append(flat[offset : offset + size].reshape(shape).astype(dtype))
            offset += size
        return out[0] if single else out

    __call__ = step

    def reply(self, arrays: Sequence[np.ndarray] | ArrayRecord,
              metrics: Mapping[str, Any] | None = None) -> Message:
        """The train reply, built by the release gate: ``arrays`` (the local model after the
        private steps, in the received arrays' order) and the privacy metadata; weight 1
        (equal for every learner). Of the app's own ``metrics`` only the names the learner
        allow-listed leave (``release-metrics``; unaccounted), so an app can keep passing
        its metrics. The state is stored before the reply leaves."""
        if self._done:
            raise PrivacyConfigError("reply() called twice")
        values = arrays.to_numpy_ndarrays() if isinstance(arrays, ArrayRecord) else \
            [np.asarray(a) for a in arrays]
        ok = [tuple(np.shape(a)) for a in values] == self.shapes and all(
            np.all(np.isfinite(np.asarray(a, dtype=np.float64))) for a in values)
        if not ok:  # data-dependent: release the received model (a zero update) instead
            log.error("PrivateSteps: the local model is non-finite or of other shapes; "
                      "releasing the received model (a zero update)")
            values = self.received
        self.state.rounds += 1
        diagnostics = {**self.counts.diagnostics(self.steps), "model-replaced": float(not ok)}
        try:
            self.round.commit(diagnostics)  # before the reply leaves; aborts on failure
        finally:
            self.close()
        self._done = True
        record = ArrayRecord({k: Array(np.asarray(v)) for k, v in
                              zip(self.keys, values, strict=True)})
        out = self.round.reply(self.msg, record, num_examples=1.0,
                               user_metrics=dict(metrics or {}))
        with _lock:
            _BUILT[id(self.msg)] = out
        return out

    def close(self) -> None:
        """End the round: roll it back unless :meth:`reply` committed it, and release the
        state lock (the guard does it if the train function failed)."""
        with _lock:
            _OPEN.pop(id(self.msg), None)
        self.round.abort()


class PrivateStepsGuard(PrivateLearnerGuard):
    """ClientApp mod for apps using :class:`PrivateSteps`: every train reply must be the
    one the gate built; any failure is a data-free error reply; evaluate and query
    messages are refused unless the learner opts in (as :class:`PrivateLearnerGuard`)."""

    def __call__(self, msg: Message, ctxt: Context, call_next: Any) -> Message:
        if msg.metadata.message_type.split(".")[0] != "train":
            return super().__call__(msg, ctxt, call_next)
        key = id(msg)
        with _lock:
            _GUARDED.add(key)
        try:  # every failure becomes a clear, data-free reply
            return answer(msg, self._gated, msg, ctxt, call_next)
        finally:
            with _lock:
                _GUARDED.discard(key)
                _BUILT.pop(key, None)
                _CREATED.discard(key)
                left = _OPEN.pop(key, None)
            if left is not None:
                left.close()

    @staticmethod
    def _gated(msg: Message, ctxt: Context, call_next: Any) -> Message:
        """The train function's reply, if it is the one :meth:`PrivateSteps.reply` built."""
        reply = call_next(msg, ctxt)
        with _lock:
            built = _BUILT.get(id(msg))
            created = id(msg) in _CREATED
            open_round = _OPEN.get(id(msg))
        # a private_training round (flwr_corrnoise.flower.training): the train function's
        # own reply is rebuilt by the gate (its arrays checked, its metrics filtered)
        adopt = getattr(open_round, "adopt_reply", None)
        if built is None and adopt is not None and isinstance(reply, Message):
            return adopt(reply)  # type: ignore[no-any-return]
        if reply is not built:
            raise PrivacyConfigError(
                "the train function returned a reply that PrivateSteps.reply() did not "
                "build; it could hold an un-noised update, so the learner refuses"
                + ("" if created else f". {STALE_APP_HINT}"))
        return reply
