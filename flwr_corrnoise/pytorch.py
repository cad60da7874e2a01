"""PyTorch learners: paper 000's private local round for any ``torch.nn.Module``.

Needs the ``torch`` extra (``pip install -e ".[torch]"``); nothing else in the package
imports this module, so the core stays NumPy/SciPy/Flower only.

Design — why the round itself is not rewritten in torch: the clip, the correlated-noise
increment and the SGD step are :func:`flwr_corrnoise.learner.local_round`, the one
implementation every engine uses, and the noise comes from the one
:class:`~flwr_corrnoise.streams.NoiseStream` whose calibration, covariance and
bit-for-bit restore are tested. The module only supplies the gradient:
:class:`ModuleGradient` loads the current local iterate into the model (on the model's
device), computes the loss on the next batch of the learner's stream, checks it is
finite, back-propagates and returns the gradient of **all** parameters. ``local_round``
then clips that gradient to ``B_g`` over all parameter tensors together (the sensitivity
the calibration assumes), adds one increment of the learner's single noise stream over
the whole parameter list, and takes the step — in float64, so a torch learner and a NumPy
learner with the same seed give the same update to float tolerance. Per step this moves
``d`` floats each way between the host and the model's device (``d`` ≈ 3·10⁵ for the
paper's CNN, under a millisecond); the learner's state is the stream's state (small for
the tree and BLT mechanisms) and is what ``context.state`` and the state directory keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from .flower.client import CorrNoiseNumPyClient, make_client_app
from .learner import LearnerState, NonFiniteError, PrivacySettings, RoundResult, local_round
from .streams import HorizonExhaustedError

__all__ = [
    "BatchStream",
    "DeviceRound",
    "LossFn",
    "ModuleGradient",
    "PrivateOptimizer",
    "TorchCorrNoiseClient",
    "device_local_round",
    "get_parameters",
    "make_torch_client_app",
    "set_parameters",
    "torch_local_round",
]

#: a learner's data stream: position → (inputs, targets) of the batch used at that step
BatchStream = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def get_parameters(model: torch.nn.Module) -> list[np.ndarray]:
    """The model's parameters as float64 NumPy arrays, in ``model.parameters()`` order."""
    return [p.detach().cpu().numpy().astype(np.float64) for p in model.parameters()]


def set_parameters(model: torch.nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Load ``arrays`` into the model's parameters (cast to their dtype and device)."""
    params = list(model.parameters())
    if len(params) != len(arrays):
        raise ValueError(f"the model has {len(params)} parameter tensors, got {len(arrays)}")
    with torch.no_grad():
        for p, a in zip(params, arrays, strict=True):
            if tuple(p.shape) != tuple(np.shape(a)):
                raise ValueError(f"parameter of shape {tuple(p.shape)} got {np.shape(a)}")
            p.copy_(torch.as_tensor(np.asarray(a), dtype=p.dtype, device=p.device))


class ModuleGradient:
    """A gradient oracle (:data:`flwr_corrnoise.learner.GradientFn`) backed by a module.

    ``gradient(params, position)`` sets the module's parameters to ``params``, evaluates
    ``loss_fn(model(x), y)`` on ``batches(position)`` (moved to the model's device) and
    returns the gradient of every parameter as float64 arrays. A non-finite loss raises
    :class:`~flwr_corrnoise.learner.NonFiniteError`: ``local_round`` then counts that step's
    gradient as zero (the reply must not depend on whether a datum's loss is finite) and
    the model the learner holds is not poisoned. The last finite loss is kept in
    ``last_loss`` for the learner's own diagnostics; it is never sent.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, batches: BatchStream) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.batches = batches
        self.params = list(model.parameters())
        if not self.params:
            raise ValueError("the model has no parameters")
        self.device = self.params[0].device
        self.last_loss = math.nan

    def __call__(self, params: list[np.ndarray], position: int) -> list[np.ndarray]:
        set_parameters(self.model, params)
        x, y = self.batches(position)
        x, y = x.to(self.device), y.to(self.device)
        self.model.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"non-finite loss {value} at stream position {position}; "
                                 f"step not applied")
        loss.backward()
        self.last_loss = value
        grads = []
        for p in self.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.detach().cpu().numpy().astype(np.float64))
        return grads


def torch_local_round(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: BatchStream,
    state: LearnerState,
    settings: PrivacySettings,
    tau: int,
    eta: float,
) -> RoundResult:
    """One private local round on ``model`` from its current parameters.

    Returns the round's result (the update ``ĝ`` to send, the advanced state); the model
    is left at the last local iterate ``z`` on success and untouched on failure.
    """
    start = get_parameters(model)
    grad = ModuleGradient(model, loss_fn, batches)
    try:
        result = local_round(start, grad, state, settings, tau, eta)
    except BaseException:
        set_parameters(model, start)
        raise
    z = [p - eta * tau * u for p, u in zip(start, result.update, strict=True)]
    set_parameters(model, z)
    if math.isfinite(grad.last_loss):  # data-dependent: local diagnostics only
        result.diagnostics["train-loss"] = grad.last_loss
    return result


class TorchCorrNoiseClient(CorrNoiseNumPyClient):
    """A ``NumPyClient`` for a PyTorch model: ``fit`` is the private local round.

    ``batches(position)`` is the learner's data stream; ``evaluate`` (optional) is yours.
    """

    def __init__(
        self,
        context: Context,
        model: torch.nn.Module,
        loss_fn: LossFn,
        batches: BatchStream,
        settings: PrivacySettings | None = None,
        seed: int | str | None = "from-context",
        evaluate_fn: Callable[[torch.nn.Module], tuple[float, int, dict[str, Any]]] | None = None,
    ) -> None:
        self.model = model
        self._gradient = ModuleGradient(model, loss_fn, batches)
        self._evaluate_fn = evaluate_fn
        super().__init__(context, settings, seed)

    def gradient(self, parameters: list[np.ndarray], position: int) -> list[np.ndarray]:
        return self._gradient(parameters, position)

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        if self._evaluate_fn is None:
            raise NotImplementedError("pass evaluate_fn to evaluate on the learner")
        set_parameters(self.model, parameters)
        return self._evaluate_fn(self.model)


def make_torch_client_app(
    model_fn: Callable[[Context], torch.nn.Module],
    batches_fn: Callable[[Context], BatchStream],
    loss_fn: LossFn = torch.nn.functional.cross_entropy,
    config_defaults: Mapping[str, Any] | None = None,
    *,
    release_metrics: Iterable[str] = (),
) -> ClientApp:
    """A Message-API ``ClientApp`` whose learners train ``model_fn(context)`` privately on
    ``batches_fn(context)`` (see :func:`flwr_corrnoise.flower.make_client_app`)."""

    def gradient_factory(context: Context) -> ModuleGradient:
        return ModuleGradient(model_fn(context), loss_fn, batches_fn(context))

    return make_client_app(gradient_factory, config_defaults=config_defaults,
                           release_metrics=release_metrics)


# -- the private step on the model's device ---------------------------------------------

PRIVATE_STATE_FORMAT = 1


class PrivateOptimizer:
    """A torch optimizer whose :meth:`step` is one private local step of paper 000's
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

    * :meth:`backward` — per-example gradients with ``torch.func`` (``functional_call`` +
      ``vmap(grad)``), each example's gradient clipped to ``B_g`` **over all parameters
      together**, summed: replacing one example moves the sum by at most ``2·B_g``, the
      sensitivity the calibration (:class:`~flwr_corrnoise.learner.PrivacySettings`)
      assumes. An example whose loss or gradient is not finite counts as zero (whether it
      is finite depends on the data, so it must not change what is released).
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

    The noise stream is a :class:`~flwr_corrnoise.torch_streams.TorchNoiseStream` on the
    model's device in the model's dtype (``noise_dtype`` overrides it): no parameter,
    gradient or noise crosses to the host during a step. The library owns the stream, the
    step counter and the horizon: a step past ``settings.horizon`` raises
    :class:`~flwr_corrnoise.streams.HorizonExhaustedError` before anything changes.
    :meth:`to_bytes` / ``state=`` carry everything across ``ClientApp`` instances and
    restarts; a state made under other privacy settings is refused.

    With plain SGD at learning rate ``η`` a step is exactly the reference
    ``z ← z − η·(clip(g) + e[k])`` of :func:`~flwr_corrnoise.learner.local_round` (for
    ``b = 1`` the two coincide; tested). Other optimizers (momentum, Adam) only
    post-process the privatized gradients, so the privacy is the same, but the update is
    no longer paper 000's. Models with batch-dependent layers (``BatchNorm``) cannot have
    per-example gradients; use ``GroupNorm``/``LayerNorm``, as with Opacus.

    Data-dependent numbers (the loss :meth:`backward` returns, :meth:`diagnostics`) are for
    the learner's own logs only; never put them in a Flower reply (:meth:`metrics` is what
    may leave).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        settings: PrivacySettings,
        *,
        seed: int | None = None,
        state: bytes | None = None,
        loss_fn: LossFn = torch.nn.functional.cross_entropy,
        noise_dtype: torch.dtype | None = None,
    ) -> None:
        from torch.func import functional_call, grad_and_value, vmap

        from .torch_streams import TorchNoiseStream

        self.optimizer = optimizer
        self.model = model
        self.settings = settings
        self.loss_fn = loss_fn
        self._named = [(n, p) for n, p in model.named_parameters()]
        self.params = [p for _, p in self._named]
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
        if state is not None and seed is not None:
            raise ValueError("give a seed for a new learner or a state to continue one, not both")
        self.noise: TorchNoiseStream | None = None
        self._steps = 0
        if state is not None:
            self._load(state)
        elif settings.private:
            cal = settings.calibration()
            assert cal is not None
            self.noise = TorchNoiseStream.create(settings.mechanism, settings.horizon,
                                                 self.shapes, cal.std, seed,
                                                 device=self.device, dtype=dtype)
        # per-example gradients: one vmapped grad over the batch dimension
        model_ref = model

        def one_example(params, buffers, x, y):
            out = functional_call(model_ref, (params, buffers), (x.unsqueeze(0),))
            return self.loss_fn(out, y.unsqueeze(0))

        self._per_example = vmap(grad_and_value(one_example), in_dims=(None, None, 0, 0))
        self._batch: int | None = None  # b after backward(), None in whole-batch mode
        self._round_sum: torch.Tensor | None = None
        self._round_steps = 0
        zero = torch.zeros((), device=self.device)
        self._clipped, self._nonfinite, self._examples = zero.clone(), zero.clone(), zero.clone()

    # -- the loop ----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and a :meth:`backward` not yet consumed by a step)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._batch = None

    def backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-example gradients of ``loss_fn(model(x_i), y_i)``, each clipped to ``B_g``
        over all parameters, summed into ``p.grad`` (on the model's device).

        Returns the batch's mean loss over the finite examples as a device tensor (for
        your local logs; it is data-dependent and must not be sent).
        """
        x = inputs.to(self.device)
        y = targets.to(self.device)
        b = int(x.shape[0])
        if b < 1:
            raise ValueError("an empty batch")
        params = {n: p.detach() for n, p in self._named}
        buffers = {n: t.detach() for n, t in self.model.named_buffers()}
        grads, losses = self._per_example(params, buffers, x, y)
        per = [grads[n] for n, _ in self._named]
        sq = torch.zeros(b, device=self.device, dtype=per[0].dtype)
        for g in per:
            sq += g.reshape(b, -1).pow(2).sum(dim=1)
        norms = sq.sqrt()
        ok = torch.isfinite(norms) & torch.isfinite(losses)
        if self.settings.private:
            clip = float(self.settings.clip)
            # min(1, B_g/‖g_i‖); a zero gradient gives inf → 1
            factor = torch.where(ok, (clip / norms).clamp(max=1.0), 0.0)
            self._clipped += (ok & (norms > clip)).sum()
        else:
            factor = ok.to(norms.dtype)
        self._nonfinite += (~ok).sum()
        self._examples += b
        # a non-finite example must contribute exactly zero: 0·NaN is NaN, so mask it out
        # (skipped on the CPU when every example is finite: the check is free there)
        clean = self.device.type == "cpu" and bool(ok.all())
        for p, g in zip(self.params, per, strict=True):
            if not clean:
                g = torch.where(ok.view(-1, *([1] * (g.dim() - 1))), g, 0.0)
            p.grad = torch.einsum("b,b...->...", factor.to(g.dtype), g).to(p.dtype)
        self._batch = b
        finite = torch.where(ok, losses, 0.0)
        return finite.sum() / ok.sum().clamp(min=1)

    @torch.no_grad()
    def step(self) -> None:
        """Privatize the gradient (see the class docstring) and take the wrapped step."""
        if self.noise is not None and self.noise.remaining < 1:
            raise HorizonExhaustedError(
                f"this learner has taken all {self.settings.horizon} steps its privacy "
                f"budget covers; another private step would exceed it (or reuse noise)"
            )
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self._batch is None:
            # whole-batch mode: the step's gradient is the unit of privacy
            norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))  # type: ignore[arg-type]
            ok = torch.isfinite(norm)
            if self.settings.private:
                factor = torch.where(ok, (self.settings.clip / norm).clamp(max=1.0), 0.0)
                self._clipped += (ok & (norm > self.settings.clip)).long()
            else:
                factor = ok.double()
            self._nonfinite += (~ok).long()
            self._examples += 1
            grads = [torch.where(ok, g * factor.to(g.dtype), 0.0) for g in grads]
            divisor = 1
        else:
            divisor = self._batch
        if self.noise is not None:
            e = self.noise.next()
            for g, ev in zip(grads, self.noise.split(e), strict=True):
                g.add_(ev.to(g.dtype))
        for p, g in zip(self.params, grads, strict=True):
            if divisor != 1:
                g.div_(divisor)
            p.grad = g
        if self._round_sum is None:
            self._round_sum = torch.zeros(self.dim, device=self.device, dtype=grads[0].dtype)
        offset = 0
        for g in grads:  # Σ of the privatized gradients, for ĝ
            n = g.numel()
            self._round_sum[offset : offset + n] += g.reshape(-1)
            offset += n
        self._round_steps += 1
        self._steps += 1
        self._batch = None
        self.optimizer.step()

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
        out, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[offset : offset + n].reshape(shape))
            offset += n
        return out

    # -- counters, privacy spent ---------------------------------------------------------
    @property
    def steps(self) -> int:
        """Private steps taken (= the noise stream's index)."""
        return self._steps

    @property
    def remaining(self) -> int:
        """Steps left before the horizon."""
        return self.settings.horizon - self._steps

    def metrics(self) -> dict[str, float]:
        """What may leave the learner: functions of its settings and counters only."""
        out = {"steps": float(self._steps)}
        cal = self.settings.calibration()
        if cal is not None:
            out.update({"epsilon-spent": self.settings.epsilon_spent(self._steps),
                        "epsilon": self.settings.epsilon, "delta": self.settings.delta,
                        "noise-std": cal.std, "horizon": float(self.settings.horizon)})
        return out

    def diagnostics(self) -> dict[str, float]:
        """Data-dependent counts (clipped and non-finite examples): **local logs only**."""
        return {"clipped-examples": float(self._clipped), "nonfinite-examples":
                float(self._nonfinite), "examples": float(self._examples)}

    # -- state ----------------------------------------------------------------------------
    def _binding(self) -> dict[str, Any]:
        digest = self.noise.factorization.digest if self.noise is not None else ""
        return self.settings.binding(digest)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything needed to continue: the step counter, the noise stream's state (its
        generator, buffers and counters) and the settings it was made with."""
        import json

        out = {
            "format": np.array(PRIVATE_STATE_FORMAT, dtype=np.int64),
            "steps": np.array(self._steps, dtype=np.int64),
            "binding": np.array(json.dumps(self._binding(), sort_keys=True)),
        }
        if self.noise is not None:
            out["noise"] = np.frombuffer(self.noise.to_bytes(), dtype=np.uint8)
        return out

    def to_bytes(self) -> bytes:
        """:meth:`state_dict` as bytes (:mod:`~flwr_corrnoise.arraypack`, no pickle), for
        ``context.state`` or disk. The wrapped optimizer's own state (momentum buffers)
        is yours to keep (``optimizer.state_dict()``)."""
        from . import arraypack

        return arraypack.pack(self.state_dict())

    def _load(self, data: bytes) -> None:
        import json

        from . import arraypack
        from .learner import PrivacyConfigError
        from .torch_streams import TorchNoiseStream

        try:
            arrays = arraypack.unpack(data)
            if int(arrays["format"]) != PRIVATE_STATE_FORMAT:
                raise ValueError(f"unsupported private-optimizer state {int(arrays['format'])}")
            steps = int(arrays["steps"])
            binding = json.loads(str(arrays["binding"]))
            noise = (TorchNoiseStream.from_bytes(arrays["noise"].tobytes(), self.device)
                     if "noise" in arrays else None)
        except (KeyError, TypeError, EOFError, OSError) as err:
            raise ValueError(f"unreadable private-optimizer state: {err!r}") from err
        now = self.settings.binding(binding.get("factorization", ""))
        if now != binding or (noise is None) == self.settings.private:
            raise PrivacyConfigError(
                f"the stored state was made with other privacy settings ({binding}) than "
                f"this learner has now ({now}); its noise is calibrated for those"
            )
        if noise is not None and (noise.step != steps or noise.dim != self.dim):
            raise ValueError("private-optimizer state does not match its noise stream or "
                             "this model")
        self.noise, self._steps = noise, steps


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

    All-or-nothing like :func:`~flwr_corrnoise.learner.local_round`: a round that would
    pass the horizon is refused before it starts, and one that fails half-way restores the
    parameters and the noise stream (nothing was released, so no noise is reused).
    """
    if isinstance(tau, bool) or int(tau) != tau or tau < 1:
        raise ValueError(f"local steps τ must be a positive integer, got {tau!r}")
    if private.noise is not None and private.steps + tau > private.settings.horizon:
        raise HorizonExhaustedError(
            f"this learner has taken {private.steps} of the {private.settings.horizon} steps "
            f"its privacy budget covers; a round of {tau} more would exceed it"
        )
    saved = [p.detach().clone() for p in private.params]
    token = private.noise.checkpoint() if private.noise is not None else None
    counters = (private._steps, private._round_steps)
    sum_saved = None if private._round_sum is None else private._round_sum.clone()
    try:
        for t in range(int(tau)):
            x, y = batches(position + t)
            private.zero_grad()
            if per_example:
                private.backward(x, y)
            else:
                x, y = x.to(private.device), y.to(private.device)
                loss = private.loss_fn(private.model(x), y)
                loss.backward()
            private.step()
        update = private.round_update()
    except BaseException:
        with torch.no_grad():
            for p, s in zip(private.params, saved, strict=True):
                p.copy_(s)
        if token is not None:
            private.noise.rollback(token)  # type: ignore[union-attr]
        private._steps, private._round_steps = counters
        private._round_sum = sum_saved
        raise
    return DeviceRound(update=update, position=position + int(tau), metrics=private.metrics(),
                       diagnostics=private.diagnostics())
