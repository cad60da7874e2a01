"""PyTorch learners: paper 000's private local round for any ``torch.nn.Module``.

Needs the ``torch`` extra (``pip install -e ".[torch]"``); nothing else in the package
imports this module, so the core stays NumPy/SciPy/Flower only.

Two paths, one algorithm:

* **On the device** — :class:`PrivateOptimizer` (wrap your ``torch.optim.SGD``; keep your
  own loop), :func:`device_local_round` (τ steps of it) and :func:`make_torch_client_app`
  (a Flower ``ClientApp`` running it; the default). Per-example gradients, each clipped to
  ``B_g`` over all parameters, summed; the next increment of the learner's
  :class:`~flwr_corrnoise.torch_streams.TorchNoiseStream`, drawn on the model's device in
  the model's dtype; the SGD step. Nothing crosses to the host during a round; the update
  ``ĝ`` leaves the device once, at the end. This is the fast path (``docs/pytorch.md``,
  ``benchmarks/torch_step.py``); :mod:`flwr_corrnoise.torch_engine` runs it in process.
* **The host reference** — :func:`torch_local_round`, :class:`TorchCorrNoiseClient`,
  ``make_torch_client_app(..., engine="host")``: :class:`ModuleGradient` turns the module
  into the gradient oracle of :func:`flwr_corrnoise.learner.local_round`, the one NumPy
  implementation every engine uses, which clips the step's gradient as a whole, adds the
  NumPy stream's increment and steps in float64 (``d`` floats each way between host and
  device per step). It is the reference the device path is tested against: at batch 1
  both give the same update to float tolerance when fed the same noise
  (``tests/test_torch_private.py``), and it serves secure noise (NumPy-only).

Privacy of the device path: one datum = one example. With per-example clipping the
*sum* over a batch of ``b`` moves by at most ``2·B_g`` when one example is replaced, the
sensitivity :class:`~flwr_corrnoise.learner.PrivacySettings` calibrates ``V`` to; the
noise is added to that sum and the step uses ``(sum + e)/b``, post-processing of the
calibrated release (sensitivity ``2·B_g/b`` and noise ``V/b`` on the mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn

import numpy as np
import torch
from flwr.app import Context
from flwr.clientapp import ClientApp

from .flower.client import CorrNoiseNumPyClient, make_client_app
from .learner import (
    LearnerState,
    NonFiniteError,
    PrivacyConfigError,
    PrivacySettings,
    RoundResult,
    attempt_datum,
    check_horizon,
    check_round,
    local_round,
    privacy_metrics,
)
from .streams import split_flat
from .torch_streams import TorchNoiseStream

__all__ = [
    "BatchStream",
    "DeviceRound",
    "FlowerPrivateOptimizer",
    "LossFn",
    "ModuleGradient",
    "PrivateOptimizer",
    "TorchCorrNoiseClient",
    "device_local_round",
    "get_parameters",
    "make_torch_client_app",
    "private_optimizer",
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


def _check_parameters(params: Iterable[torch.Tensor], shapes: Sequence[Sequence[int]]) -> None:
    """Refuse a model whose parameters are not the arrays the server sent (a
    data-independent mismatch, so an error reply, not a zero step)."""
    if [tuple(p.shape) for p in params] != [tuple(s) for s in shapes]:
        raise PrivacyConfigError(
            "the model's parameters are not the arrays the server sent (order and "
            "shapes must match; send model parameters only, no buffers)")


class ModuleGradient:
    """A gradient oracle (:data:`flwr_corrnoise.learner.GradientFn`) backed by a module.

    ``gradient(params, position)`` sets the module's parameters to ``params``, evaluates
    ``loss_fn(model(x), y)`` on ``batches(position)`` (moved to the model's device) and
    returns the gradient of every parameter as float64 arrays. A non-finite loss raises
    :class:`~flwr_corrnoise.learner.NonFiniteError`: ``local_round`` then counts that step's
    gradient as zero (the reply must not depend on whether a datum's loss is finite) and
    the model the learner holds is not poisoned; so does any other exception on a datum
    (the loader, the model or the loss raising on a wrong-shape input or a label out of
    range: :func:`~flwr_corrnoise.learner.attempt_datum`). Parameters that are not the
    model's (a data-independent mismatch) are refused with
    :class:`~flwr_corrnoise.learner.PrivacyConfigError` instead. The last finite loss is
    kept in ``last_loss`` for the learner's own diagnostics; it is never sent.
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
        _check_parameters(self.params, [np.shape(a) for a in params])
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
    engine: str = "device",
) -> ClientApp:
    """A Message-API ``ClientApp`` whose learners train ``model_fn(context)`` privately on
    ``batches_fn(context)`` (settings, state and replies as for
    :func:`flwr_corrnoise.flower.make_client_app`; ``batches(position)`` is the learner's
    stream, each position used at one step only).

    ``engine="device"`` (the default): each round is :func:`device_local_round` on the
    model's device — per-example clipping, the learner's
    :class:`~flwr_corrnoise.torch_streams.TorchNoiseStream` (stored in the learner's state),
    the parameters cross to the host once per round. ``engine="host"``: the NumPy reference
    round (:func:`flwr_corrnoise.learner.local_round` through :class:`ModuleGradient`;
    float64, the batch clipped as a whole, ``d`` floats each way per step) — what a
    learner whose state holds a NumPy stream, or a secure-noise learner, must use.
    """
    if engine == "host":
        def gradient_factory(context: Context) -> ModuleGradient:
            return ModuleGradient(model_fn(context), loss_fn, batches_fn(context))

        return make_client_app(gradient_factory, config_defaults=config_defaults,
                               release_metrics=release_metrics)
    if engine != "device":
        raise ValueError(f"engine must be 'device' or 'host', not {engine!r}")
    from flwr.app import Message

    from .flower.client import _refuse
    from .flower.session import LearnerSession, PrivateLearnerGuard, answer, round_config

    app = ClientApp(mods=[PrivateLearnerGuard(False)])
    defaults = dict(config_defaults or {})

    def device_round(msg: Message, context: Context) -> Message:
        session = LearnerSession(context, kind="step", defaults=defaults,
                                 release_metrics=release_metrics)
        config = dict(msg.content["config"])  # type: ignore[arg-type]
        tau, eta = round_config(config)
        params = msg.content["arrays"].to_numpy_ndarrays()  # type: ignore[union-attr]
        shapes = [tuple(np.shape(a)) for a in params]
        model = model_fn(context)
        with session.transaction(config, shapes, steps=tau) as tx:
            private = _session_optimizer(
                PrivateOptimizer, torch.optim.SGD(model.parameters(), lr=eta), model,
                session.settings, tx.state, shapes, session.secure, loss_fn=loss_fn)
            set_parameters(model, params)
            out = device_local_round(private, batches_fn(context), tau, tx.state.position)
            tx.diagnostics = out.diagnostics
        return tx.reply(msg, out.update, num_examples=float(tau))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return answer(msg, device_round, msg, context)  # every failure: a data-free reply

    app.evaluate()(_refuse)
    app.query()(_refuse)
    return app


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


def device_stream(state: LearnerState, settings: PrivacySettings,
                  shapes: Sequence[tuple[int, ...]], model: torch.nn.Module, secure: bool,
                  dtype: torch.dtype | None = None) -> TorchNoiseStream | None:
    """The learner's noise stream on ``model``'s device: a fresh learner's stream is made
    from its seed there; a stored torch stream is moved there; a stored host (NumPy)
    stream that has released noise is refused (its generator differs, so continuing it
    on the device would be another stream), as is secure noise (ChaCha20 is NumPy-only)."""
    noise = state.noise
    if secure or (noise is not None and noise.secure):
        _refuse_secure_noise()
    params = list(model.parameters())
    _check_parameters(params, shapes)
    device = params[0].device
    if noise is not None and not isinstance(noise, TorchNoiseStream):
        if noise.step != 0 or state.seed is None:
            raise PrivacyConfigError(
                "this learner's stored noise stream is a host (NumPy) stream that has "
                "released noise; it cannot continue on the device (another generator): "
                "keep using the host path, or start a new learner")
        noise = TorchNoiseStream.create(settings.mechanism, settings.horizon, list(shapes),
                                        noise.std, state.seed, device=device,
                                        dtype=dtype or params[0].dtype)
    elif noise is not None and noise.device != device:
        noise = TorchNoiseStream.from_bytes(noise.to_bytes(), device)
    return noise


def _session_optimizer(
    cls: type[PrivateOptimizer], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
    settings: PrivacySettings, state: LearnerState, shapes: Sequence[tuple[int, ...]],
    secure: bool, **kwargs: Any,
) -> PrivateOptimizer:
    """The device optimizer on a Flower learner's state (the torch ``ClientApp`` and
    :func:`private_optimizer`): the model must be the server's arrays, the stream is
    moved to the model's device (:func:`device_stream`), and the optimizer advances the
    learner's state in place, inside the session's transaction."""
    if secure:
        _refuse_secure_noise()
    _check_parameters(model.parameters(), shapes)
    return cls(optimizer, model, settings, state=state, **kwargs)


def _refuse_secure_noise() -> NoReturn:
    raise PrivacyConfigError(
        "secure noise (ChaCha20 on a grid) is NumPy-only: the device path cannot use it; use "
        "the host engine (PrivateSteps.step(), make_torch_client_app(engine='host')), or "
        "set secure-noise = false")


# -- the private step on the model's device ---------------------------------------------

#: the format of the states :class:`PrivateOptimizer` wrote before it stored the learner
#: state (:meth:`~flwr_corrnoise.learner.LearnerState.to_bytes`); still read
PRIVATE_STATE_FORMAT = 1


class _UnsupportedError(Exception):
    """The hook path cannot form this model's per-example gradients (use torch.func)."""


class _PerExample:
    """One parameter's per-example gradients, in whatever form is cheapest."""

    def sq(self) -> torch.Tensor:
        """``‖g_i‖²`` for every example (length ``b``)."""
        raise NotImplementedError

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        """``Σ_i c_i·g_i`` over the examples with ``ok``; the others contribute zero even if
        their gradient holds NaN (``clean``: all are ok, skip the masking)."""
        raise NotImplementedError


class _Materialized(_PerExample):
    def __init__(self, g: torch.Tensor) -> None:
        self.g = g

    def sq(self) -> torch.Tensor:
        return self.g.flatten(1).pow(2).sum(dim=1)

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        g = self.g
        if not clean:
            g = torch.where(ok.view(-1, *([1] * (g.dim() - 1))), g, 0.0)
        return torch.einsum("b,b...->...", c.to(g.dtype), g)


class _Outer(_PerExample):
    """``g_i = δ_i a_iᵀ`` (a ``Linear`` weight): ``‖g_i‖ = ‖δ_i‖·‖a_i‖``."""

    def __init__(self, delta: torch.Tensor, a: torch.Tensor) -> None:
        self.delta, self.a = delta, a

    def sq(self) -> torch.Tensor:
        return self.delta.pow(2).sum(dim=1) * self.a.pow(2).sum(dim=1)

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        delta, a = self.delta, self.a
        if not clean:
            delta = torch.where(ok[:, None], delta, 0.0)
            a = torch.where(ok[:, None], a, 0.0)
        return (delta * c.to(delta.dtype)[:, None]).T @ a


def _conv2d_weight_per_example(m: torch.nn.Conv2d, a: torch.Tensor,
                                delta: torch.Tensor) -> torch.Tensor:
    """Per-example weight gradients ``(b, *weight.shape)`` of a ``Conv2d`` with input ``a``
    and output gradient ``delta``, in one call.

    The batch is folded into the channels: the same layer applied to ``b`` examples is one
    grouped convolution with ``b`` groups (one per example) on a batch of one, and its
    weight gradient is exactly the ``b`` per-example gradients stacked. Measured on this
    machine's CPU for the paper CNN at batch 64: 0.7 ms (first layer) and 9 ms (second) —
    where ``unfold`` + ``bmm`` took 1.1 and 58 ms (its im2col buffer is ``b·C_in·k²·L``
    floats) and a per-example loop 6 and 9 ms; the batch-summed gradient of a bare step
    costs 0.3 and 3.8 ms.
    """
    b = a.shape[0]
    out_ch = m.weight.shape[0]
    grouped = torch.ops.aten.convolution_backward(
        delta.reshape(1, b * out_ch, *delta.shape[2:]),
        a.reshape(1, b * m.in_channels, *a.shape[2:]),
        m.weight.detach().repeat(b, 1, 1, 1),  # only its shape is used
        None, m.stride, m.padding, m.dilation, False, (0, 0), b, (False, True, False),
    )[1]
    return grouped.view(b, *m.weight.shape)


def _hookable_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The model's parameterized layers if all are ``Linear`` or plain ``Conv2d`` (groups
    1, zero padding given as numbers) holding only their ``weight``/``bias``; else None."""
    layers = []
    for m in model.modules():
        own = dict(m.named_parameters(recurse=False))
        if not own:
            continue
        if set(own) - {"weight", "bias"}:
            return None
        if isinstance(m, torch.nn.Linear) or (
            isinstance(m, torch.nn.Conv2d) and m.groups == 1
            and m.padding_mode == "zeros" and not isinstance(m.padding, str)
        ):
            layers.append(m)
        else:
            return None
    return layers


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
    restarts, in the one learner-state format
    (:class:`~flwr_corrnoise.learner.LearnerState`: the counters, the stream, the settings
    it was made with); a state made under other privacy settings is refused. The step's
    bookkeeping is the NumPy step's (:func:`~flwr_corrnoise.learner.private_step`): the
    horizon rule (:func:`~flwr_corrnoise.learner.check_horizon`), the learner state's
    counters, :func:`~flwr_corrnoise.learner.privacy_metrics`; only the per-example
    clipping and the noise add are device operations.

    With plain SGD at learning rate ``η`` a step is exactly the reference
    ``z ← z − η·(clip(g) + e[k])`` of :func:`~flwr_corrnoise.learner.local_round` (for
    ``b = 1`` the two coincide; tested). Other optimizers (momentum, Adam) only
    post-process the privatized gradients, so the privacy is the same, but the update is
    no longer paper 000's. Models with batch-dependent layers (``BatchNorm``) cannot have
    per-example gradients; use ``GroupNorm``/``LayerNorm``, as with Opacus.

    Data-dependent numbers (the loss :meth:`backward` returns, :meth:`diagnostics`) are for
    the learner's own logs only; never put them in a Flower reply (:meth:`metrics` is what
    may leave).

    Arguments: ``seed`` — the learner's noise seed for a new learner (``None``: OS
    entropy, for deployment); ``state`` — bytes from :meth:`to_bytes` to continue one, or
    a :class:`~flwr_corrnoise.learner.LearnerState` to advance in place (the Flower front
    ends: the learner transaction's state; its stream moves to the model's device);
    ``stream`` — a stream to continue (not more than one of the three);
    ``loss_fn(outputs, targets)`` — applied to one example at a time for per-example
    gradients (so its reduction does not matter); ``noise_dtype`` — the
    stream's dtype for a new learner (default: the parameters'; a restored stream keeps
    its own); ``per_example`` — ``"auto"`` (hooks when every parameter sits in a
    ``Linear`` or plain ``Conv2d``, else ``torch.func``), ``"hooks"`` or ``"func"``.
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
        from torch.func import functional_call, grad_and_value, vmap

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
        if sum(x is not None for x in (seed, state, stream)) > 1:
            raise ValueError("give a seed for a new learner, or a state or a stream to "
                             "continue one; only one of them")
        #: the learner's state: counters, stream, the settings it was made with
        self.state = self._learner_state(seed, state, stream, dtype)
        # per-example gradients: one vmapped grad over the batch dimension
        model_ref = model

        def one_example(params, buffers, x, y):
            out = functional_call(model_ref, (params, buffers), (x.unsqueeze(0),))
            return self.loss_fn(out, y.unsqueeze(0))

        self._per_example = vmap(grad_and_value(one_example), in_dims=(None, None, 0, 0))
        if per_example not in ("auto", "func", "hooks"):
            raise ValueError(f"per_example must be 'auto', 'func' or 'hooks', not {per_example!r}")
        self._requested = per_example
        self._layers = _hookable_layers(model)
        if per_example == "hooks" and self._layers is None:
            raise ValueError("per_example='hooks' needs every parameter in a Linear or a plain "
                             "Conv2d layer; use 'func' (torch.func) for this model")
        #: how per-example gradients are formed: "hooks" (Linear/Conv2d layers only, no
        #: b×d per-example tensor for Linear weights) or "func" (torch.func, any model)
        self.per_example = ("func" if per_example == "func" or self._layers is None
                            else "hooks")
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
        pieces: list[_PerExample] | None = None
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
        if self.per_example == "hooks":
            try:
                pieces, losses = self._hook_pieces(x, y)
            except _UnsupportedError:
                if self._requested == "hooks":
                    raise
                self.per_example = "func"  # e.g. a Linear applied to a sequence
        if pieces is None:  # torch.func: vmap(grad) over the batch
            params = {n: p.detach() for n, p in self._named}
            buffers = {n: t.detach() for n, t in self.model.named_buffers()}
            grads, losses = self._per_example(params, buffers, x, y)
            pieces = [_Materialized(grads[n]) for n, _ in self._named]
        sq = torch.zeros(b, device=self.device, dtype=losses.dtype)
        for piece in pieces:
            sq += piece.sq().to(sq.dtype)
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
        # a non-finite example must contribute exactly zero: 0·NaN is NaN, so it is masked
        # out (skipped on the CPU when every example is finite: the check is free there)
        clean = self.device.type == "cpu" and bool(ok.all())
        for p, piece in zip(self.params, pieces, strict=True):
            p.grad = piece.weighted_sum(factor, ok, clean).to(p.dtype)
        self._batch = b
        finite = torch.where(ok, losses, 0.0)
        return finite.sum().detach() / ok.sum().clamp(min=1)

    def _hook_pieces(self, x: torch.Tensor, y: torch.Tensor) -> tuple[list[_PerExample],
                                                                       torch.Tensor]:
        """Per-example gradients of ``Linear``/``Conv2d`` layers from one batched forward
        and one backward to the layers' *outputs* (no weight gradients are formed): a
        ``Linear`` weight's per-example gradient is the outer product ``δ_i a_iᵀ``, so its
        norm is ``‖δ_i‖·‖a_i‖`` and the clipped sum one matrix product (never ``b×d``
        numbers); a ``Conv2d``'s is ``δ_i·unfold(a_i)ᵀ``, materialized (it is small).
        The same per-example gradients as the ``torch.func`` path (tested), faster."""
        from torch.func import vmap

        acts: dict[torch.nn.Module, torch.Tensor] = {}
        outs: dict[torch.nn.Module, torch.Tensor] = {}

        def record(mod: torch.nn.Module, inp: tuple, out: torch.Tensor) -> None:
            if mod in outs:
                raise _UnsupportedError("a layer is applied twice (shared weights)")
            acts[mod], outs[mod] = inp[0], out

        handles = [m.register_forward_hook(record) for m in self._layers]
        try:
            logits = self.model(x)
        finally:
            for h in handles:
                h.remove()
        if set(outs) != set(self._layers):
            raise _UnsupportedError("a layer with parameters was not used in the forward pass")
        losses = vmap(lambda o, t: self.loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(logits, y)
        deltas = torch.autograd.grad(losses.sum(), [outs[m] for m in self._layers])
        by_param: dict[int, _PerExample] = {}
        for m, delta in zip(self._layers, deltas, strict=True):
            a = acts[m].detach()
            if isinstance(m, torch.nn.Linear):
                if a.dim() != 2:
                    raise _UnsupportedError("a Linear layer applied to a sequence")
                by_param[id(m.weight)] = _Outer(delta, a)
                bias_grad = delta
            else:
                assert isinstance(m, torch.nn.Conv2d)
                by_param[id(m.weight)] = _Materialized(_conv2d_weight_per_example(m, a, delta))
                bias_grad = delta.sum(dim=(2, 3))
            if m.bias is not None:
                by_param[id(m.bias)] = _Materialized(bias_grad)
        return [by_param[id(p)] for p in self.params], losses.detach()

    def _learner_state(self, seed: int | None, state: bytes | LearnerState | None,
                       stream: TorchNoiseStream | None, dtype: torch.dtype) -> LearnerState:
        """The learner state this optimizer advances, its stream on the model's device,
        checked against the settings and the model (:func:`~flwr_corrnoise.learner.check_round`)."""
        settings = self.settings
        if isinstance(state, LearnerState):
            learner = state  # advanced in place: the Flower learner transaction's state
        elif state is not None:
            learner = _read_state(bytes(state), self.device)
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
                device=self.device, dtype=dtype)
            learner = LearnerState(
                noise=noise, seed=None if noise is None else seed,
                binding=settings.binding("" if noise is None else noise.factorization.digest))
        # a fresh learner's host stream is made anew on the device; a stored one is moved
        learner.noise = device_stream(learner, settings, self.shapes, self.model, False, dtype)
        check_round(learner, settings, self.dim)
        return learner

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
        else:
            divisor = self._batch
        if self.noise is not None:
            views = self.noise.split(self.noise.next())
            if views[0].dtype != grads[0].dtype:
                views = [v.to(grads[0].dtype) for v in views]
            torch._foreach_add_(grads, views)
        if divisor != 1:
            torch._foreach_div_(grads, divisor)
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

    def _clip_whole(self, grads: list[torch.Tensor], loss: torch.Tensor | None
                    ) -> list[torch.Tensor]:
        """Clip one gradient (all parameters together) to ``B_g``; zero if it (or its
        loss) is not finite. In place where possible: on the CPU a host check is free, so
        an unclipped finite gradient costs no pass at all; on a GPU it would sync."""
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        ok = torch.isfinite(norm) if loss is None else torch.isfinite(norm) & torch.isfinite(loss)
        clip = self.settings.clip
        if self.settings.private:
            factor = torch.where(ok, (clip / norm).clamp(max=1.0), 0.0)
            self._clipped += (ok & (norm > clip)).long()
        else:
            factor = ok.to(norm.dtype)
        self._nonfinite += (~ok).long()
        self._examples += 1
        if self.device.type != "cpu":
            return [torch.where(ok, g * factor.to(g.dtype), 0.0) for g in grads]
        if not bool(ok):
            return [torch.zeros_like(g) for g in grads]
        if self.settings.private and bool(norm > clip):
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
        (:func:`~flwr_corrnoise.learner.privacy_metrics`, as in every front end)."""
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
        (:meth:`~flwr_corrnoise.learner.LearnerState.state_dict`)."""
        return self.state.state_dict()

    def to_bytes(self) -> bytes:
        """The learner state (:meth:`~flwr_corrnoise.learner.LearnerState.to_bytes`, the one
        format every front end stores: the counters, the noise stream's state and the
        settings it was made with), for ``context.state`` or disk. The wrapped optimizer's
        own state (momentum buffers) is yours to keep (``optimizer.state_dict()``)."""
        return self.state.to_bytes()


def _read_state(data: bytes, device: torch.device) -> LearnerState:
    """A stored optimizer state: the learner-state format, or the optimizer's own earlier
    one (:data:`PRIVATE_STATE_FORMAT`: steps, binding, stream), read into a learner
    state; its torch stream restored on ``device``."""
    import json

    from . import arraypack

    try:
        arrays = arraypack.unpack(data)
    except (OSError, ValueError, EOFError):
        arrays = {}
    if "format" not in arrays:
        return LearnerState.from_bytes(data, device)
    try:
        if int(arrays["format"]) != PRIVATE_STATE_FORMAT:
            raise ValueError(f"unsupported private-optimizer state {int(arrays['format'])}")
        steps = int(arrays["steps"])
        noise = (TorchNoiseStream.from_bytes(arrays["noise"].tobytes(), device)
                 if "noise" in arrays else None)
        binding = json.loads(str(arrays["binding"]))
    except (KeyError, TypeError, EOFError, OSError) as err:
        raise ValueError(f"unreadable private-optimizer state: {err!r}") from err
    if noise is not None and noise.step != steps:
        raise ValueError("private-optimizer state does not match its noise stream")
    return LearnerState(step=steps, position=steps, noise=noise, binding=binding)


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
    token = private.state.checkpoint()
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
        private.state.rollback(token)
        private._round_steps, private._round_sum = round_steps, sum_saved
        raise
    return DeviceRound(update=update, position=position + int(tau), metrics=private.metrics(),
                       diagnostics=private.diagnostics())


class FlowerPrivateOptimizer(PrivateOptimizer):
    """:class:`PrivateOptimizer` inside a Flower ``ClientApp``, built by
    :func:`private_optimizer`: its noise stream and counters are the learner's state that
    :class:`~flwr_corrnoise.flower.PrivateSteps` loads, locks and stores, and
    :meth:`reply` is the release gate's reply."""

    private: Any  # the round's PrivateSteps (annotated loosely: no Flower import cycle)

    def reply(self, arrays: Any, metrics: Mapping[str, Any] | None = None) -> Any:
        """The train reply (see :meth:`PrivateSteps.reply`): ``arrays`` is the local model
        (e.g. ``ArrayRecord(model.state_dict())``) after the private steps. The steps taken
        are recorded in the learner's state before it is stored."""
        private = self.private
        diag = self.diagnostics()  # data-dependent: the learner's diagnostics file only
        counts = private.counts  # the steps are already in the shared learner state
        counts.clipped += int(diag["clipped-examples"])
        counts.nonfinite += int(diag["nonfinite-examples"])
        counts.failed += int(diag["failed-examples"])
        return private.reply(arrays, metrics)


def private_optimizer(
    msg: Any,
    context: Context,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    *,
    config_defaults: Mapping[str, Any] | None = None,
    release_metrics: Iterable[str] = (),
    **kwargs: Any,
) -> FlowerPrivateOptimizer:
    """Per-step correlated noise in the user's own PyTorch loop inside a Flower
    ``ClientApp`` (the app needs ``ClientApp(mods=[PrivateSteps.guard()])``)::

        opt = private_optimizer(msg, context, torch.optim.SGD(model.parameters(), lr=lr), model)
        for x, y in my_stream(context, steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # or opt.backward(x, y): per-example clipping
            opt.step()                        # clip + next correlated increment + SGD step
        return opt.reply(ArrayRecord(model.state_dict()), metrics)

    Why on top of :class:`~flwr_corrnoise.flower.PrivateSteps`: one learner session owns
    the settings, the proposal check, the lock, the stored state and the reply, whichever
    loop runs; the optimizer only supplies the device step. The learner's stream is a
    :class:`~flwr_corrnoise.torch_streams.TorchNoiseStream` on the model's device, stored
    in the learner's state like any stream. A fresh learner's stream is made from the
    learner's seed on the model's device; a stored host (NumPy) stream that has released
    noise cannot be moved to the device (its generator differs), so that is refused, as is
    secure noise (ChaCha20 is NumPy-only: use :meth:`PrivateSteps.step`). The model's
    parameters must be the received arrays (same order and shapes: no buffers).
    ``kwargs`` go to :class:`PrivateOptimizer` (``loss_fn``, ``noise_dtype``,
    ``per_example``).
    """
    from .flower.steps import PrivateSteps

    private = PrivateSteps(msg, context, config_defaults=config_defaults,
                           release_metrics=release_metrics)
    try:
        opt = _session_optimizer(FlowerPrivateOptimizer, optimizer, model, private.settings,
                                 private.state, private.shapes, private.session.secure,
                                 **kwargs)
        opt.private = private
        private.external = True  # its own step() would mix host and device noise
    except BaseException:
        private.close()
        raise
    return opt
