"""The private step on the model's device: :class:`PrivateOptimizer` and the round driver.

Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning With
Correlated Noise") Algorithm 1, one local step at a time, on any ``torch.nn.Module``: the
per-example gradients (:mod:`~flwr_corrnoise.torch.grad_sample`), each clipped to ``B_g`` over all
parameters, summed; the next increment of the learner's
:class:`~flwr_corrnoise.torch.streams.TorchNoiseStream`, drawn on the model's device in the
model's dtype; the wrapped optimizer's step. Nothing crosses to the host during a round;
the update ``ĝ`` leaves the device once, at the end (:func:`device_local_round`). The
bookkeeping — horizon, counters, state format, released metrics — is the NumPy step's
(:mod:`flwr_corrnoise.learner`); only the clipping and the noise add are device operations.
Nothing here imports Flower: :mod:`flwr_corrnoise.flower.torch_app` puts this step in a
``ClientApp``.

Privacy: one datum = one example. With per-example clipping the *sum* over a batch of
``b`` moves by at most ``2·B_g`` when one example is replaced, the sensitivity
:class:`~flwr_corrnoise.settings.PrivacySettings` calibrates ``V`` to; the noise is added to
that sum and the step uses ``(sum + e)/b``, post-processing of the calibrated release
(sensitivity ``2·B_g/b`` and noise ``V/b`` on the mean).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import numpy as np
import torch

from ..adaptive_clipping import CLIP_STATE, AdaptiveClipState
from ..learner import attempt_datum, check_horizon, check_round, clip_target
from ..learner_state import LearnerState
from ..settings import PrivacyConfigError, PrivacySettings, privacy_metrics
from ..streams import HorizonExhaustedError, split_flat
from .grad_sample import PerExampleGradients, clip_factors
from .params import BatchStream, LossFn, check_parameters
from .streams import TorchNoiseStream

log = logging.getLogger(__name__)
#: (settings, batch, step size) already warned about: a ClientApp builds a new optimizer
#: every round, and one warning per configuration is enough
_WARNED_STEP_SIZES: set[tuple[object, int, float]] = set()

__all__ = [
    "DeviceRound",
    "PrivateOptimizer",
    "device_local_round",
    "device_stream",
    "refuse_secure_noise",
]


# -- the learner's stream on the model's device ------------------------------------------

def device_stream(state: LearnerState, settings: PrivacySettings,
                  shapes: Sequence[tuple[int, ...]], model: torch.nn.Module, secure: bool,
                  dtype: torch.dtype | None = None) -> TorchNoiseStream | None:
    """The learner's noise stream on ``model``'s device: a fresh learner's stream is made
    from its seed there; a stored torch stream is moved there; a stored host (NumPy)
    stream that has released noise is refused (its generator differs, so continuing it
    on the device would be another stream), as is secure noise (ChaCha20 is NumPy-only)."""
    noise = state.noise
    if secure or (noise is not None and noise.secure):
        refuse_secure_noise()
    params = list(model.parameters())
    check_parameters(params, shapes)
    device = params[0].device
    if noise is not None and not isinstance(noise, TorchNoiseStream):
        if noise.step != 0 or state.seed is None:
            raise PrivacyConfigError(
                "this learner's stored noise stream is a host (NumPy) stream that has "
                "released noise; it cannot continue on the device (another generator): "
                "keep using the host path, or start a new learner")
        noise = TorchNoiseStream.create(settings.mechanism, settings.horizon, list(shapes),
                                        noise.std, state.seed,
                                        factorization=noise.factorization, device=device,
                                        dtype=dtype or params[0].dtype)
    elif noise is not None and noise.device != device:
        noise = TorchNoiseStream.from_bytes(noise.to_bytes(), device)
    return noise


def refuse_secure_noise() -> NoReturn:
    """Secure noise is refused on the device with a clear error, not silently replaced by
    the device stream's Gaussian noise (another mechanism than the one configured)."""
    raise PrivacyConfigError(
        "secure noise (ChaCha20 on a grid) is NumPy-only: the device path cannot use it; use "
        "the host engine (PrivateSteps.step(), make_torch_client_app(engine='host')), or "
        "set secure-noise = false")


# -- the private step on the model's device ---------------------------------------------

class PrivateOptimizer:
    """A torch optimizer whose :meth:`step` is one private local step of Zhang et al.'s
    Algorithm 1, on the model's device; you keep your own training loop.

    Modelled on Opacus' ``make_private``: wrap your optimizer once, then per step::

        model = MyNet().to(device)
        private = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=eta), model,
                                   settings, seed=seed)      # or state=saved_bytes
        for x, y in fresh_batches:                   # each datum used at one step only
            private.zero_grad()
            private.backward(x, y)                   # per-example grads, clipped, summed
            private.step()                           # + next correlated increment, SGD step
        update = private.round_update()              # ĝ for the server (leaves the device)
        saved_bytes = private.to_bytes()             # e.g. into context.state

    What a step computes (one datum = one example; ``b`` = the batch size):

    * :meth:`backward` — per-example gradients (the layers' grad samplers, else
      ``torch.func``'s ``vmap(grad)``: :mod:`~flwr_corrnoise.torch.grad_sample`), each
      example's gradient clipped to ``B_g`` **over all parameters together**, summed:
      replacing one example moves the sum by at most ``2·B_g``, the sensitivity the
      calibration (:class:`~flwr_corrnoise.settings.PrivacySettings`) assumes. An example
      whose loss or gradient is not finite counts as zero (whether it is finite depends on
      the data, so it must not change what is released).
    * :meth:`step` — adds the next increment ``e[k]`` (std ``V``) of the learner's
      correlated-noise stream to that sum and divides by ``b``: the gradient handed to
      the wrapped optimizer is ``(Σ_i clip(g_i) + e[k]) / b``. The noisy *sum* is the
      calibrated Gaussian release; the mean is post-processing of it, so it has
      sensitivity ``2·B_g/b`` and noise ``V/b`` — the same ``(ε, δ)``, ``b``× less noise
      relative to the signal than clipping the batch as a whole.
    * If you call ``loss.backward()`` yourself instead of :meth:`backward`, :meth:`step`
      clips the step's gradient *as a whole* to ``B_g`` (non-finite → zero) and adds
      ``e[k]``: the whole batch is then the unit of privacy, which is still private at the
      same calibration because each datum enters one step only (this is what
      :func:`flwr_corrnoise.learner.local_round` does, and what a batch of one reduces to).

    The noise stream is a :class:`~flwr_corrnoise.torch.streams.TorchNoiseStream` on the
    model's device in the model's dtype (``noise_dtype`` overrides it): no parameter,
    gradient or noise crosses to the host during a step. The library owns the stream, the
    step counter and the horizon: a step past ``settings.horizon`` raises
    :class:`~flwr_corrnoise.streams.HorizonExhaustedError` before anything changes.
    :meth:`to_bytes` / ``state=`` carry everything across ``ClientApp`` instances and
    restarts, in the one learner-state format
    (:class:`~flwr_corrnoise.learner_state.LearnerState`: the counters, the stream, the settings
    it was made with); a state made under other privacy settings is refused. The step's
    bookkeeping is the NumPy step's (:func:`~flwr_corrnoise.learner.private_step`): the
    horizon rule (:func:`~flwr_corrnoise.learner.check_horizon`), the learner state's
    counters, :func:`~flwr_corrnoise.settings.privacy_metrics`; only the per-example
    clipping and the noise add are device operations.

    With plain SGD at learning rate ``η`` a step is exactly the reference
    ``z ← z − η·(clip(g) + e[k])`` of :func:`~flwr_corrnoise.learner.local_round` (for
    ``b = 1`` the two coincide; tested). Other optimizers (momentum, Adam) only
    post-process the privatized gradients, so the privacy is the same, but the update is
    no longer Zhang et al.'s. Models with batch-dependent layers (``BatchNorm``) cannot have
    per-example gradients; use ``GroupNorm``/``LayerNorm``, as with Opacus.

    Data-dependent numbers (the loss :meth:`backward` returns, :meth:`diagnostics`) are for
    the learner's own logs only; never put them in a Flower reply (:meth:`metrics` is what
    may leave).

    Arguments: ``seed`` — the learner's noise seed for a new learner (``None``: OS
    entropy, for deployment); ``state`` — bytes from :meth:`to_bytes` to continue one, or
    a :class:`~flwr_corrnoise.learner_state.LearnerState` to advance in place (the Flower front
    ends: the learner transaction's state; its stream moves to the model's device);
    ``stream`` — a stream to continue (not more than one of the three);
    ``loss_fn(outputs, targets)`` — applied to one example at a time for per-example
    gradients (so its reduction does not matter); ``noise_dtype`` — the
    stream's dtype for a new learner (default: the parameters'; a restored stream keeps
    its own); ``per_example`` — ``"auto"`` (the grad samplers when every layer with
    parameters has one registered — ``Linear``, plain ``Conv2d``, or yours:
    :func:`~flwr_corrnoise.torch.grad_sample.register_grad_sampler` — else ``torch.func``),
    ``"hooks"`` or ``"func"`` (:class:`~flwr_corrnoise.torch.grad_sample.PerExampleGradients`).
    ``settings.mechanism == "none"`` is the noiseless baseline: no clipping, no noise.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        settings: PrivacySettings,
        *,
        seed: int | None = None,
        state: bytes | LearnerState | None = None,
        stream: TorchNoiseStream | None = None,
        loss_fn: LossFn = torch.nn.functional.cross_entropy,
        noise_dtype: torch.dtype | None = None,
        per_example: str = "auto",
    ) -> None:
        self.optimizer = optimizer
        self.model = model
        self.settings = settings
        self._loss_fn = loss_fn
        self.params = list(model.parameters())
        if not self.params:
            raise ValueError("the model has no parameters")
        wrapped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if wrapped != {id(p) for p in self.params}:
            raise ValueError("the optimizer must update exactly the model's parameters: a "
                             "parameter it skips gets noise it never uses, one it adds "
                             "would be trained without privacy")
        self.device = self.params[0].device
        if any(p.device != self.device for p in self.params):
            raise ValueError("all parameters must live on one device")
        self.shapes = [tuple(p.shape) for p in self.params]
        self.dim = sum(p.numel() for p in self.params)
        dtype = noise_dtype or self.params[0].dtype
        if sum(x is not None for x in (seed, state, stream)) > 1:
            raise ValueError("give a seed for a new learner, or a state or a stream to "
                             "continue one; only one of them")
        #: the learner's state: counters, stream, the settings it was made with
        self.state = self._learner_state(seed, state, stream, dtype)
        # per-example gradients of this optimizer's loss_fn (kept in step by the setter;
        # the loss function itself, so that cross-entropy's batched losses are recognized)
        self._grads = PerExampleGradients(model, loss_fn, per_example)
        self._batch: int | None = None  # b after backward(), None in whole-batch mode
        self._round_sum: torch.Tensor | None = None
        self._round_steps = 0
        zero = torch.zeros((), device=self.device)
        self._clipped, self._nonfinite, self._examples = zero.clone(), zero.clone(), zero.clone()
        #: examples or steps whose gradient could not be computed (the user's code raised
        #: on them): a host count, since the exception already reached the host
        self._failed = 0
        #: the last batch size seen, the divisor of a step whose batch could not be loaded
        self._last_batch = 1
        self._step_size_checked = False
        #: a sampled participation's expected batch size (what every per-example step's
        #: noised sum is divided by), else None: the step's own batch size
        expected = getattr(settings.participation, "expected_batch_size", None)
        self._expected_batch: float | None = None if expected is None else float(expected)
        #: adaptive clipping: the clipped examples counted up to the last step (host)
        self._clipped_seen = 0
        if settings.adaptive is not None:
            self._adaptive_state(seed)

    @property
    def loss_fn(self) -> LossFn:
        """The loss of one batch: ``loss_fn(model(x), y)`` (may be replaced between steps)."""
        return self._loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: LossFn) -> None:
        self._loss_fn = fn
        self._grads.loss_fn = fn

    # -- the loop ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and a :meth:`backward` not yet consumed by a step)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._batch = None

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example gradients of ``loss_fn(model(x_i), y_i)``, each clipped to ``B_g``
        over all parameters, summed into ``p.grad`` (on the model's device).

        Never fails on the data: an example whose gradient cannot be computed counts as
        zero — a non-finite loss or gradient (masked on the device), or the model or the
        loss raising on it (a wrong-shape input, a label out of range; the rule of
        :func:`~flwr_corrnoise.learner.attempt_datum`, shared by every front end). If the
        batch raises, its examples are retried one at a time so that only the failing ones
        count as zero: one bad example must not zero the others (that would move the sum by
        more than the ``2·B_g`` the noise is calibrated for). Inputs that are not a batch at
        all make the whole step zero.

        Returns the batch's mean loss over the finite examples as a device tensor (for
        your local logs; it is data-dependent and must not be sent).
        """
        b = _batch_size(inputs)
        if b == 0 and self._expected_batch is not None:
            # a sampled step that drew nothing: a zero sum, noised and divided like any other
            self.optimizer.zero_grad(set_to_none=True)
            self._batch = 0
            return torch.zeros((), device=self.device)
        loss, why = attempt_datum(partial(self._backward, inputs, targets),
                                  "a per-example gradient")
        if not why:
            self._last_batch = b or 1
            return loss  # type: ignore[return-value]
        if b is not None and b > 1:
            self._last_batch = b
            return self._backward_each(inputs, targets, b)
        self.zero_gradient(per_example=True, batch_size=b or None)
        return torch.zeros((), device=self.device)

    def zero_gradient(self, per_example: bool = True, batch_size: int | None = None) -> None:
        """This step's datum has no gradient (it could not be loaded, or your code raised
        on it): its gradient counts as zero. Call :meth:`step` next, as for any step — the
        noise increment is still added, so what leaves does not depend on the failure.
        ``per_example``: the step's noised sum is divided by ``batch_size`` (default: the
        last batch size seen) as after :meth:`backward`; else it is a whole-batch step.
        Use it in your own loop around a ``loss.backward()`` that may raise on a datum."""
        self.optimizer.zero_grad(set_to_none=True)
        self._failed += 1
        self._batch = max(1, int(batch_size or self._last_batch)) if per_example else None
        if self._batch is not None:
            self._examples += self._batch

    @contextmanager
    def guard(self, per_example: bool = False,
              batch_size: int | None = None) -> Iterator[PrivateOptimizer]:
        """One step of **your** loop, kept data-independent if your code fails on its data::

            for x, y in trainloader:
                with opt.guard():                 # a raise inside: a zero-gradient step
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()   # your forward and backward
                    opt.step()

        Whether your forward or backward pass raises (a wrong shape, a label out of range)
        depends on the data, so it must not change what the learner sends: an exception
        raised inside the block before :meth:`step` ran makes this step a zero-gradient
        step (:meth:`zero_gradient`, then :meth:`step`: the step's noise increment is still
        added, exactly as for a datum whose gradient is zero); one raised after it is
        dropped. Either way the loop goes on, and the exception's text stays in the
        learner's log at debug level (it may hold data). The library's own refusals (a
        step past the horizon, a step without the loader's batch, a config that weakens
        the budget) are data-free and propagate. ``per_example``: your loop calls
        :meth:`backward` (per-example clipping; the zero step is divided by ``batch_size``,
        default the last batch size seen — pass it when the first step may fail, so the
        divisor does not depend on the data); else the step's gradient is the unit of
        privacy (whole-batch clipping, ``loss.backward()``)."""
        taken = self.state.step
        try:
            yield self
        except (PrivacyConfigError, HorizonExhaustedError):
            raise
        except Exception as err:  # the user's code raised on this step's data
            log.debug("a guarded step raised (a zero-gradient step instead): %r", err)
            if self.state.step == taken:
                self.zero_gradient(per_example=per_example, batch_size=batch_size)
                self.step()

    def _backward_each(self, inputs: torch.Tensor, targets: torch.Tensor, b: int
                       ) -> torch.Tensor:
        """:meth:`backward` one example at a time (after the batch raised): the failing
        examples count as zero, the others are clipped and summed as usual."""
        sums = [torch.zeros_like(p) for p in self.params]
        losses = []
        for i in range(b):
            loss, why = attempt_datum(partial(self._backward_one, inputs, targets, i),
                                      "a per-example gradient")
            if why:
                self._failed += 1
                self._examples += 1
                continue
            losses.append(loss)
            torch._foreach_add_(sums, [p.grad for p in self.params])  # type: ignore[misc]
        for p, g in zip(self.params, sums, strict=True):
            p.grad = g
        self._batch = b
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum() / len(losses)

    def _backward_one(self, inputs: torch.Tensor, targets: torch.Tensor, i: int
                      ) -> torch.Tensor:
        return self._backward(inputs[i : i + 1], targets[i : i + 1])

    def _backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = inputs.to(self.device)
        y = targets.to(self.device)
        b = int(x.shape[0])
        if b < 1:
            raise ValueError("an empty batch")  # a zero step (backward())
        if b == 1:
            # one example: its gradient is the batch gradient; no per-example machinery
            loss = self.loss_fn(self.model(x), y)
            grads1 = torch.autograd.grad(loss, self.params, allow_unused=True)
            clipped = self._clip_whole(
                [g if g is not None else torch.zeros_like(p)
                 for g, p in zip(grads1, self.params, strict=True)], loss.detach())
            for p, g in zip(self.params, clipped, strict=True):
                p.grad = g
            self._batch = 1
            return torch.where(torch.isfinite(loss), loss, 0.0).detach()
        pieces, losses = self._grads(x, y)  # one PerExample per parameter
        clip_norm = self.clip_norm if self.settings.private else None
        norms, ok, factor = clip_factors(pieces, losses, clip_norm)  # the plan's clip too
        if clip_norm is not None:
            self._clipped += (ok & (norms > clip_norm)).sum()
        self._nonfinite += (~ok).sum()
        self._examples += b
        # a non-finite example must contribute exactly zero: 0·NaN is NaN, so it is masked
        # out (skipped on the CPU when every example is finite: the check is free there)
        clean = self.device.type == "cpu" and bool(ok.all())
        for p, piece in zip(self.params, pieces, strict=True):
            p.grad = piece.weighted_sum(factor, ok, clean).to(p.dtype)
        self._batch = b
        finite = torch.where(ok, losses, 0.0)
        return finite.sum().detach() / ok.sum().clamp(min=1)

    def _learner_state(self, seed: int | None, state: bytes | LearnerState | None,
                       stream: TorchNoiseStream | None, dtype: torch.dtype) -> LearnerState:
        """The learner state this optimizer advances, its stream on the model's device,
        checked against the settings and the model (:func:`~flwr_corrnoise.learner.check_round`)."""
        settings = self.settings
        if isinstance(state, LearnerState):
            learner = state  # advanced in place: the Flower learner transaction's state
        elif state is not None:
            # the learner-state format, or the optimizer's earlier one (learner_state.py)
            learner = LearnerState.from_bytes(bytes(state), self.device)
            learner.check_binding(settings)
        elif stream is not None:
            if not settings.private:
                raise ValueError("the noiseless baseline has no noise stream")
            learner = LearnerState(step=stream.step, position=stream.step, noise=stream,
                                   binding=settings.binding(stream.factorization.digest))
        else:
            cal = settings.calibration()
            noise = None if cal is None else TorchNoiseStream.create(
                settings.mechanism, settings.horizon, self.shapes, cal.std, seed,
                factorization=settings.factorization(), device=self.device, dtype=dtype)
            learner = LearnerState(
                noise=noise, seed=None if noise is None else seed,
                binding=settings.binding("" if noise is None else noise.factorization.digest))
        # a fresh learner's host stream is made anew on the device; a stored one is moved
        learner.noise = device_stream(learner, settings, self.shapes, self.model, False, dtype)
        check_round(learner, settings, self.dim)
        return learner

    @property
    def per_example(self) -> str:
        """How per-example gradients are formed: ``"hooks"`` (the layers' grad samplers)
        or ``"func"`` (torch.func, any model)."""
        return self._grads.mode

    @property
    def noise(self) -> TorchNoiseStream | None:
        """The learner's correlated-noise stream on the model's device."""
        return self.state.noise  # type: ignore[return-value]

    @torch.no_grad()
    def step(self) -> None:
        """Privatize the gradient (see the class docstring) and take the wrapped step."""
        check_horizon(self.settings, self.state.step)  # before anything changes
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._batch is None:
            # whole-batch mode: the step's gradient is the unit of privacy
            grads = self._clip_whole(grads, None)
            divisor = 1
        elif self._expected_batch is not None:
            # a sampled loop: the expected batch size, never the drawn one (public, the same
            # at every step, so the update does not reveal how many examples a step drew)
            divisor = self._expected_batch
        else:
            divisor = self._batch
        if self.noise is not None:
            views = self.noise.split(self.noise.next())
            if views[0].dtype != grads[0].dtype:
                views = [v.to(grads[0].dtype) for v in views]
            if self.settings.adaptive is not None:  # unit-clip noise × C_t (not in place),
                # C_t rounded up in the noise's dtype: never less noise than calibrated
                scale = _at_least(self.clip_norm, views[0].dtype)
                views = [v * scale for v in views]
            torch._foreach_add_(grads, views)
            if self.settings.adaptive is not None:
                self._next_clip_norm(1 if self._batch is None else self._batch)
        if divisor != 1:
            torch._foreach_div_(grads, divisor)
        if not self._step_size_checked:
            self._step_size_checked = True
            self._check_step_size(max(1, round(divisor)))
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        if self._round_sum is None:
            self._round_sum = torch.zeros(self.dim, device=self.device, dtype=grads[0].dtype)
            # views of the sum (slices of a contiguous flat tensor reshape without a copy)
            self._round_views = split_flat(self._round_sum, self.shapes)
        torch._foreach_add_(self._round_views, grads)  # Σ of the privatized grads, for ĝ
        self._round_steps += 1
        self.state.advance()
        self._batch = None
        self.optimizer.step()

    @property
    def clip_norm(self) -> float:
        """The clip norm of the next step: ``clip-norm``, or with adaptive clipping the
        learner's ``C_t`` (its state, :mod:`~flwr_corrnoise.adaptive_clipping`)."""
        if self.settings.adaptive is None:
            return float(self.settings.clip_norm)
        return AdaptiveClipState.from_payload(self.state.payload).clip_norm

    def _adaptive_state(self, seed: int | None) -> None:
        """A fresh learner's clip state (``C_0`` and the count key), or refuse a stored
        one that has none (it trained with a fixed clip norm)."""
        if self.state.payload and CLIP_STATE in self.state.payload:
            return
        if self.state.step:
            raise PrivacyConfigError("this learner trained without adaptive clipping; it "
                                     "refuses to continue with it (start a new learner)")
        fresh = AdaptiveClipState.create(self.settings.clip_norm,
                                         self.state.seed if seed is None else seed)
        self.state.payload = {**(self.state.payload or {}), **fresh.to_payload()}

    def _next_clip_norm(self, examples: int) -> None:
        """``C_{t+1}`` from this step's unclipped count (its ``examples`` less those
        clipped; a zeroed example counts as unclipped, norm 0) and the step's count noise
        (:meth:`~flwr_corrnoise.adaptive_clipping.AdaptiveClipState.update`). One host
        sync a step, for the count."""
        total = int(self._clipped.item())
        clipped, self._clipped_seen = total - self._clipped_seen, total
        clip = AdaptiveClipState.from_payload(self.state.payload)
        clip.update(float(examples - clipped), examples, self.state.step,
                    self.settings.adaptive, self.settings.count_noise())  # type: ignore[arg-type]
        self.state.payload = {**(self.state.payload or {}), **clip.to_payload()}

    def _check_step_size(self, batch: int) -> None:
        """Warn (once) when the step size would let the noise blow the model up: above
        :func:`~flwr_corrnoise.plan.safe_learning_rate` the model's accumulated noise has a
        per-coordinate std above 0.1. A function of the settings, the batch size and the
        optimizer's step size and momentum only (no data): heavy-ball momentum ``β``
        carries every step's noise into the later steps too, up to ``1/(1 − β)`` times
        (ten-fold at the quickstart's 0.9), so the safe step size is the plan's under that
        momentum (:func:`~flwr_corrnoise.plan.momentum_rows`)."""
        from ..plan import safe_learning_rate

        group = self.optimizer.param_groups[0]
        lr = float(group.get("lr", 0.0) or 0.0)
        momentum, scale = effective_momentum(group)
        safe = (safe_learning_rate(self.settings, batch, momentum=momentum) / scale
                if scale > 0 else float("inf"))
        key = (self.settings, batch, lr, momentum, scale)
        if lr > safe and key not in _WARNED_STEP_SIZES:  # once per process, not per round
            _WARNED_STEP_SIZES.add(key)
            log.warning(
                "flwr-corrnoise: learning rate %g with batch %d and momentum %g exceeds "
                "the safe %.3g for this noise (std %.3g over %d steps): the model's noise "
                "would swamp its weights. Lower the learning rate or the momentum, raise "
                "the batch size or ε, or run `flwr-corrnoise plan` for the levers", lr,
                batch, momentum, safe,
                self.settings.calibration().std, self.settings.horizon)  # type: ignore[union-attr]

    def _clip_whole(self, grads: list[torch.Tensor], loss: torch.Tensor | None
                    ) -> list[torch.Tensor]:
        """Clip one gradient (all parameters together) to ``B_g``; zero if it (or its
        loss) is not finite. In place where possible: on the CPU a host check is free, so
        an unclipped finite gradient costs no pass at all; on a GPU it would sync."""
        # summed in float64 (torch's float32 norms drift by up to 4.5·10⁻⁴ of the norm at
        # d = 3·10⁶), then to B_g less the dtype's margin: exactly within B_g (clip_margin)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
            grads, 2, dtype=torch.float64)))
        ok = torch.isfinite(norm) if loss is None else torch.isfinite(norm) & torch.isfinite(loss)
        clip_norm = self.clip_norm
        if self.settings.private:
            target = clip_target(clip_norm, sum(g.numel() for g in grads),
                                 torch.finfo(grads[0].dtype))
            factor = torch.where(ok, (target / norm).clamp(max=1.0), 0.0)
            self._clipped += (ok & (norm > clip_norm)).long()
        else:
            factor = ok.to(norm.dtype)
        self._nonfinite += (~ok).long()
        self._examples += 1
        if self.device.type != "cpu":
            return [torch.where(ok, g * factor.to(g.dtype), 0.0) for g in grads]
        if not bool(ok):
            return [torch.zeros_like(g) for g in grads]
        if self.settings.private and bool(norm > clip_norm):
            torch._foreach_mul_(grads, float(factor))
        return grads

    def round_update(self) -> list[np.ndarray]:
        """ĝ: the mean privatized gradient of the steps since the last call (with SGD at
        rate ``η`` over ``τ`` steps, ``(x^r − z)/(ητ)``), as float64 NumPy arrays in
        ``model.parameters()`` order — the one time per round the parameters' worth of
        numbers leaves the device. Resets the round."""
        if self._round_steps == 0 or self._round_sum is None:
            raise RuntimeError("no private step since the last round_update()")
        flat = (self._round_sum / self._round_steps).cpu().numpy()
        self._round_sum.zero_()
        self._round_steps = 0
        return split_flat(flat, self.shapes)

    # -- counters, privacy spent ---------------------------------------------------------
    @property
    def steps(self) -> int:
        """Private steps taken (= the noise stream's index)."""
        return self.state.step

    @property
    def remaining(self) -> int:
        """Steps left before the horizon."""
        return self.settings.horizon - self.state.step

    def metrics(self) -> dict[str, float]:
        """What may leave the learner: functions of its settings and counters only
        (:func:`~flwr_corrnoise.settings.privacy_metrics`, as in every front end)."""
        return privacy_metrics(self.settings, self.state.step)

    def diagnostics(self) -> dict[str, float]:
        """Data-dependent counts (clipped, non-finite and failed examples or steps):
        **local logs only**."""
        return {"clipped-examples": float(self._clipped), "nonfinite-examples":
                float(self._nonfinite), "failed-examples": float(self._failed),
                "examples": float(self._examples)}

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything needed to continue, as named arrays: the learner state's
        (:meth:`~flwr_corrnoise.learner_state.LearnerState.state_dict`)."""
        return self.state.state_dict()

    def to_bytes(self) -> bytes:
        """The learner state (:meth:`~flwr_corrnoise.learner_state.LearnerState.to_bytes`, the one
        format every front end stores: the counters, the noise stream's state and the
        settings it was made with), for ``context.state`` or disk. The wrapped optimizer's
        own state (momentum buffers) is yours to keep (``optimizer.state_dict()``)."""
        return self.state.to_bytes()


def _at_least(value: float, dtype: torch.dtype) -> float:
    """The ``dtype`` number nearest ``value`` from above, as a Python float (which a multiply
    in ``dtype`` then uses exactly): a factor that scales noise must not round it below
    its calibration (:func:`~flwr_corrnoise.streams.float32_at_least`, any float dtype)."""
    t = torch.tensor(value, dtype=torch.float64).to(dtype)
    if float(t) < value:
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
    return float(t)


def effective_momentum(group: dict[str, Any]) -> tuple[float, float]:
    """``(β, scale)`` of an optimizer's parameter group as the noise sees it: torch's
    ``SGD(momentum=β, dampening=τ_d)`` keeps ``v ← β·v + (1 − τ_d)·u``, the heavy ball of
    :func:`~flwr_corrnoise.plan.momentum_rows` on ``(1 − τ_d)·u``, so the step size counts
    as ``lr·scale`` with ``scale = 1 − τ_d`` (1 without momentum). Nesterov's look-ahead
    (``u + β·v``) has the same ``1/(1 − β)`` limit and is counted at ``β``. A group without
    ``momentum`` (Adam's betas normalize the step by the gradient's own statistics, which
    this bound does not describe) counts as ``β = 0``."""
    beta = float(group.get("momentum", 0.0) or 0.0)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {beta}")
    scale = 1.0 - float(group.get("dampening", 0.0) or 0.0) if beta else 1.0
    return beta, scale


@dataclass
class DeviceRound:
    """What :func:`device_local_round` returns: the update to send and the learner's
    public metrics; ``diagnostics`` (data-dependent) are for local logs only."""

    update: list[np.ndarray]
    position: int
    metrics: dict[str, float]
    diagnostics: dict[str, float]


def device_local_round(
    private: PrivateOptimizer,
    batches: BatchStream,
    tau: int,
    position: int,
    per_example: bool = True,
) -> DeviceRound:
    """τ private steps on the device from the model's current parameters (Algorithm 1,
    lines 5–14): the batches at ``position, position+1, …`` (one per step), each step
    :meth:`PrivateOptimizer.backward` (``per_example=False``: ``loss.backward()`` on the
    batch mean, clipped as a whole) and :meth:`PrivateOptimizer.step`.

    A datum whose gradient cannot be computed — ``batches`` raising on it, or the model
    or the loss raising (a wrong-shape input, a label out of range), or a non-finite loss
    or gradient — counts as a zero gradient for its example or step, as in every front end
    (:func:`~flwr_corrnoise.learner.attempt_datum`): the noise is still added and the round
    goes on. With per-example clipping and batches of ``b > 1``, a loader that fails for a
    whole batch zeroes all ``b`` examples, which the calibration (one example moves the sum
    by ``2·B_g``) does not cover: a loader should not fail on one example's content.

    All-or-nothing like :func:`~flwr_corrnoise.learner.local_round`: a round that would
    pass the horizon is refused before it starts, and one that fails half-way (an
    interrupt) restores the parameters and the noise stream (nothing was released, so no
    noise is reused).
    """
    if isinstance(tau, bool) or int(tau) != tau or tau < 1:
        raise ValueError(f"local steps τ must be a positive integer, got {tau!r}")
    check_horizon(private.settings, private.steps, int(tau))
    saved = [p.detach().clone() for p in private.params]
    kept = private.state.fork()  # the state before the round (no step changes it)
    round_steps = private._round_steps
    sum_saved = None if private._round_sum is None else private._round_sum.clone()
    try:
        for t in range(int(tau)):
            private.zero_grad()
            batch, why = attempt_datum(partial(_load, batches, position + t), "a batch")
            if batch is None:
                private.zero_gradient(per_example)
            elif per_example:
                private.backward(*batch)
            else:
                _, why = attempt_datum(partial(_whole_batch_backward, private, *batch),
                                       "a batch's gradient")
                if why:
                    private.zero_gradient(per_example=False)
            private.step()
        update = private.round_update()
        private.state.rounds += 1
    except BaseException:
        with torch.no_grad():
            for p, s in zip(private.params, saved, strict=True):
                p.copy_(s)
        private.state.assign(kept)  # the round is not written: the state before it
        private._round_steps, private._round_sum = round_steps, sum_saved
        raise
    return DeviceRound(update=update, position=position + int(tau), metrics=private.metrics(),
                       diagnostics=private.diagnostics())


def _batch_size(inputs: Any) -> int | None:
    """The leading dimension of a batch, or ``None`` if ``inputs`` is not a batch."""
    try:
        return int(inputs.shape[0])
    except Exception:
        return None


def _load(batches: BatchStream, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batches(position)
    return x, y


def _whole_batch_backward(private: PrivateOptimizer, x: torch.Tensor, y: torch.Tensor
                          ) -> None:
    x, y = x.to(private.device), y.to(private.device)
    private.loss_fn(private.model(x), y).backward()
