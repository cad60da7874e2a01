"""Per-example gradients for the device step: a grad sampler per layer type, else torch.func.

:class:`~flwr_corrnoise.torch.optimizer.PrivateOptimizer` clips every example's gradient
over all parameters, so it needs each example's gradient (or at least its norm and the
clipped sum). Two ways to get them, one answer (tested against a loop of single-example
backward passes):

* **grad samplers** (``"hooks"``): one batched forward with hooks on the parameterized
  layers, one backward to the layers' *outputs*, and per layer type a function that turns
  the layer's input ``a`` and output gradient ``δ`` into its parameters' per-example
  gradients — registered per type with :func:`register_grad_sampler`, as Opacus'
  ``register_grad_sampler`` does. A ``Linear`` weight's per-example gradient ``δ_i a_iᵀ``
  is never formed (:class:`Outer`: its norm is ``‖δ_i‖·‖a_i‖``, the clipped sum one matrix
  product); a ``Conv2d``'s comes from one grouped ``convolution_backward``.
* **torch.func** (``"func"``): ``vmap(grad)`` of the whole model over the batch, for any
  model — the fallback when a parameterized layer's type has no registered sampler.

Why the fallback is the whole model and not just the unregistered layer (Opacus runs
torch.func per layer): the hook path computes every ``δ`` from one *batched* forward, which
is each example's own gradient only if no layer mixes examples (a batch norm does). A
registered sampler is a promise that its layer does not; an unknown layer makes no such
promise, and under ``vmap`` every example is run alone, so the bound "one example moves
the clipped sum by ``2·B_g``" holds whatever the model does. Register a sampler only for a
layer whose output for example ``i`` depends on example ``i`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..learner import clip_target, row_sums_of_squares
from ..settings import PrivacyConfigError
from .params import LossFn, host_memory

__all__ = [
    "GradSampler",
    "Materialized",
    "Outer",
    "PerExample",
    "PerExampleGradients",
    "UnsupportedLayerError",
    "clip_factors",
    "grad_sampler",
    "register_grad_sampler",
    "sampled_layers",
]


class UnsupportedLayerError(Exception):
    """A grad sampler cannot form this layer's per-example gradients for this input (e.g. a
    ``Linear`` applied to a sequence): the model falls back to torch.func."""


class PerExample:
    """One parameter's per-example gradients, in whatever form is cheapest."""

    def sq(self) -> torch.Tensor:
        """``‖g_i‖²`` for every example (length ``b``), summed in float64 (the clip
        margin's bound, :func:`~flwr_corrnoise.learner.clip_margin`, needs it)."""
        raise NotImplementedError

    def numel(self) -> int:
        """Numbers in one example's gradient of this parameter."""
        raise NotImplementedError

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        """``Σ_i c_i·g_i`` over the examples with ``ok``; the others contribute zero even if
        their gradient holds NaN (``clean``: all are ok, skip the masking)."""
        raise NotImplementedError


def _host_sums_of_squares(rows: torch.Tensor) -> torch.Tensor | None:
    """Each row's float64 sum of squares by the host's
    :func:`~flwr_corrnoise.learner.row_sums_of_squares` (the NumPy learner's norms: the
    compiled kernel straight from float32, no float64 copy) when the tensor is a 2-D CPU
    float32/64 tensor NumPy can read in place; ``None`` otherwise (a GPU: torch's own
    float64 reduction). Why: for the paper CNN's 64 examples torch's ``vector_norm(dtype=
    float64)`` converted each per-example gradient to float64 first (≈ 0.26 ms for the second
    conv layer's 64 × 9,216 weights; docs/benchmarks.md, "Issue 34, tenth pass"). Any
    summation order is within the clip margin's bound."""
    if rows.dim() != 2 or not host_memory(rows):
        return None
    return torch.from_numpy(row_sums_of_squares(rows.numpy()))


def clip_factors(pieces: list[PerExample], losses: torch.Tensor, clip_norm: float | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each example's gradient norm over all parameters, whether it counts, and its clip
    factor: ``(‖g_i‖, ok_i, c_i)`` with ``c_i = min(1, B_g/‖g_i‖)`` (a zero gradient gives
    ``inf`` → 1), ``ok_i`` a finite norm and loss, ``c_i = 0`` where not ok; ``clip_norm``
    ``None`` (no noise): ``c_i = ok_i``. The one clipping rule (Abadi et al., "Deep Learning
    with Differential Privacy") for the private step
    (:class:`~flwr_corrnoise.torch.optimizer.PrivateOptimizer`) and for the plan's measured
    signal (:func:`~flwr_corrnoise.torch.signal.measure_signal`), so that the plan's
    clipping is the run's, bit for bit. Norms accumulate in float64 on the losses' device,
    and ``c_i`` clips to ``B_g`` less :func:`~flwr_corrnoise.learner.clip_margin` of the
    losses' dtype (the model's), so that ``c_i·g_i`` in that dtype is within ``B_g``
    exactly."""
    sq = torch.zeros(int(losses.shape[0]), device=losses.device, dtype=torch.float64)
    for piece in pieces:
        sq += piece.sq()
    norms = sq.sqrt()
    ok = torch.isfinite(norms) & torch.isfinite(losses)
    if clip_norm is None:
        return norms, ok, ok.to(norms.dtype)
    # to B_g less the margin of the model's dtype: each example's clipped gradient, formed
    # in that dtype, then has an exact norm of at most B_g (its sensitivity)
    target = clip_target(clip_norm, sum(piece.numel() for piece in pieces),
                         torch.finfo(losses.dtype))
    return norms, ok, torch.where(ok, (target / norms).clamp(max=1.0), 0.0)


class Materialized(PerExample):
    """Per-example gradients held as one tensor ``(b, *parameter.shape)``."""

    def __init__(self, g: torch.Tensor) -> None:
        self.g = g

    def sq(self) -> torch.Tensor:
        host = _host_sums_of_squares(self.g.flatten(1))
        if host is not None:
            return host
        # vector_norm sums in float64 without a slow float64 reduction over dim 1 (8 ms
        # against 1 ms for 64 examples of a conv's 8k weights); squaring its root costs
        # two roundings more, within the clip margin's slack
        return torch.linalg.vector_norm(self.g.flatten(1), dim=1, dtype=torch.float64).square()

    def numel(self) -> int:
        return math.prod(self.g.shape[1:])

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        g = self.g
        if not clean:
            g = torch.where(ok.view(-1, *([1] * (g.dim() - 1))), g, 0.0)
        return torch.einsum("b,b...->...", c.to(g.dtype), g)


class Outer(PerExample):
    """``g_i = δ_i a_iᵀ`` (a ``Linear`` weight): ``‖g_i‖ = ‖δ_i‖·‖a_i‖``, and the weighted
    sum is one matrix product — never ``b×d`` numbers."""

    def __init__(self, delta: torch.Tensor, a: torch.Tensor) -> None:
        self.delta, self.a = delta, a

    def sq(self) -> torch.Tensor:
        d2, a2 = _host_sums_of_squares(self.delta), _host_sums_of_squares(self.a)
        if d2 is not None and a2 is not None:
            return d2 * a2  # ‖δ_i‖²·‖a_i‖², one rounding
        f64 = torch.float64
        return (torch.linalg.vector_norm(self.delta, dim=1, dtype=f64)
                * torch.linalg.vector_norm(self.a, dim=1, dtype=f64)).square()

    def numel(self) -> int:
        return int(self.delta.shape[1]) * int(self.a.shape[1])

    def weighted_sum(self, c: torch.Tensor, ok: torch.Tensor, clean: bool) -> torch.Tensor:
        delta, a = self.delta, self.a
        if not clean:
            delta = torch.where(ok[:, None], delta, 0.0)
            a = torch.where(ok[:, None], a, 0.0)
        return (delta * c.to(delta.dtype)[:, None]).T @ a


#: ``sampler(layer, activation, backprop)`` → the per-example gradient of each of the
#: layer's own parameters, by name (``"weight"``, ``"bias"``): a :class:`PerExample` or a
#: tensor ``(b, *parameter.shape)``. ``activation`` is the layer's input, ``backprop`` the
#: gradient of the sum of the per-example losses with respect to its output (both batch
#: first). Raise :class:`UnsupportedLayerError` for an input it cannot handle.
GradSampler = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor],
                       Mapping[str, "PerExample | torch.Tensor"]]


@dataclass(frozen=True)
class _Registration:
    sampler: GradSampler
    supports: Callable[[torch.nn.Module], bool] | None


_SAMPLERS: dict[type[torch.nn.Module], _Registration] = {}


def register_grad_sampler(
    *layer_types: type[torch.nn.Module],
    supports: Callable[[torch.nn.Module], bool] | None = None,
) -> Callable[[GradSampler], GradSampler]:
    """Register a :data:`GradSampler` for layers of exactly these types (a decorator)::

        @register_grad_sampler(MyScale)
        def my_scale(layer, a, delta):          # out = a * layer.scale
            return {"scale": a * delta}          # (b, *scale.shape)

    ``supports(layer)``: whether this instance is one the sampler handles (the built-in
    ``Conv2d`` sampler takes ``groups=1`` and zero padding only); the others fall back to
    torch.func. The type is matched exactly, as in Opacus: a subclass may change the
    forward the sampler's formula assumes. A later registration replaces an earlier one.
    Register only layers whose output for an example depends on that example alone (see
    the module docstring): that is what makes the hook path's gradients per-example.
    """
    if not layer_types:
        raise ValueError("name at least one layer type")

    def register(sampler: GradSampler) -> GradSampler:
        for layer_type in layer_types:
            _SAMPLERS[layer_type] = _Registration(sampler, supports)
        return sampler

    return register


def grad_sampler(layer: torch.nn.Module) -> GradSampler | None:
    """The grad sampler registered for ``layer`` (``None``: none, or it does not support
    this instance)."""
    entry = _SAMPLERS.get(type(layer))
    if entry is None or (entry.supports is not None and not entry.supports(layer)):
        return None
    return entry.sampler


def sampled_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, GradSampler]] | None:
    """The model's parameterized layers with their grad samplers, if every one has a
    sampler and no parameter belongs to two layers (shared weights); else ``None``."""
    layers, owned = [], set()
    for m in model.modules():
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        sampler = grad_sampler(m)
        if sampler is None or any(id(p) in owned for p in own):
            return None
        owned.update(id(p) for p in own)
        layers.append((m, sampler))
    return layers


def _weight_and_bias_only(layer: torch.nn.Module) -> bool:
    return set(dict(layer.named_parameters(recurse=False))) <= {"weight", "bias"}


def _plain_conv2d(layer: torch.nn.Module) -> bool:
    assert isinstance(layer, torch.nn.Conv2d)
    return (_weight_and_bias_only(layer) and layer.groups == 1
            and layer.padding_mode == "zeros" and not isinstance(layer.padding, str))


@register_grad_sampler(torch.nn.Linear, supports=_weight_and_bias_only)
def linear_grad_sample(layer: torch.nn.Module, a: torch.Tensor, delta: torch.Tensor
                       ) -> dict[str, PerExample | torch.Tensor]:
    """``Linear``: the weight's per-example gradients as outer products, the bias's ``δ``."""
    if a.dim() != 2:
        raise UnsupportedLayerError("a Linear layer applied to a sequence")
    out: dict[str, PerExample | torch.Tensor] = {"weight": Outer(delta, a)}
    if layer.bias is not None:
        out["bias"] = delta
    return out


@register_grad_sampler(torch.nn.Conv2d, supports=_plain_conv2d)
def conv2d_grad_sample(layer: torch.nn.Module, a: torch.Tensor, delta: torch.Tensor
                       ) -> dict[str, PerExample | torch.Tensor]:
    """``Conv2d`` (groups 1, zero padding): the weight's per-example gradients in one grouped
    ``convolution_backward``, the bias's ``δ`` summed over the positions."""
    assert isinstance(layer, torch.nn.Conv2d)
    out: dict[str, PerExample | torch.Tensor] = {
        "weight": _conv2d_weight_per_example(layer, a, delta)}
    if layer.bias is not None:
        out["bias"] = delta.sum(dim=(2, 3))
    return out


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
        # only the weight's shape is used: a stride-0 view of that shape, not b copies (a
        # 2.4 MB allocation a step for the paper CNN's second layer, and its page faults)
        m.weight.detach().new_empty(()).expand(b * out_ch, *m.weight.shape[1:]),
        None, m.stride, m.padding, m.dilation, False, (0, 0), b, (False, True, False),
    )[1]
    return grouped.view(b, *m.weight.shape)


class PerExampleGradients:
    """The per-example gradients of ``loss_fn(model(x_i), y_i)`` over a batch, and the
    per-example losses: ``pieces, losses = per_example(x, y)``, one :class:`PerExample` per
    parameter in ``model.parameters()`` order.

    ``mode``: ``"auto"`` — the grad samplers when every parameterized layer has one
    (:func:`sampled_layers`), else torch.func; ``"hooks"`` — the grad samplers, an error if
    a layer has none; ``"func"`` — torch.func. :attr:`mode` says which is in use: ``"auto"``
    switches to torch.func for good the first time a sampler cannot handle its input, or a
    layer is applied twice or not at all.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn, mode: str = "auto") -> None:
        from torch.func import functional_call, grad_and_value, vmap

        if mode not in ("auto", "func", "hooks"):
            raise ValueError(f"per_example must be 'auto', 'func' or 'hooks', not {mode!r}")
        self.model = model
        self.loss_fn = loss_fn
        self._named = list(model.named_parameters())
        self._layers = sampled_layers(model)
        if mode == "hooks" and self._layers is None:
            raise ValueError("per_example='hooks' needs a registered grad sampler for every "
                             "layer with parameters (Linear, plain Conv2d, or your own: "
                             "register_grad_sampler); use 'func' (torch.func) for this model")
        self._requested = mode
        #: "hooks" (the layers' grad samplers) or "func" (torch.func, any model)
        self.mode = "func" if mode == "func" or self._layers is None else "hooks"

        def one_example(params, buffers, x, y):  # type: ignore[no-untyped-def]
            out = functional_call(model, (params, buffers), (x.unsqueeze(0),))
            return self.loss_fn(out, y.unsqueeze(0))

        self._vmapped = vmap(grad_and_value(one_example), in_dims=(None, None, 0, 0))

    def __call__(self, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[list[PerExample], torch.Tensor]:
        if self.mode == "hooks":
            try:
                return self._from_samplers(x, y)
            except UnsupportedLayerError:
                if self._requested == "hooks":
                    raise
                self.mode = "func"  # e.g. a Linear applied to a sequence
        return self._from_func(x, y)

    def _from_func(self, x: torch.Tensor, y: torch.Tensor
                   ) -> tuple[list[PerExample], torch.Tensor]:
        """torch.func: ``vmap(grad)`` of the whole model, one example at a time."""
        params = {n: p.detach() for n, p in self._named}
        buffers = {n: t.detach() for n, t in self.model.named_buffers()}
        grads, losses = self._vmapped(params, buffers, x, y)
        return [Materialized(grads[n]) for n, _ in self._named], losses

    def _from_samplers(self, x: torch.Tensor, y: torch.Tensor
                       ) -> tuple[list[PerExample], torch.Tensor]:
        """One batched forward with hooks on the layers, one backward to their outputs (no
        weight gradient is formed), each layer's sampler on its ``(a, δ)``."""
        assert self._layers is not None
        acts: dict[torch.nn.Module, torch.Tensor] = {}
        outs: dict[torch.nn.Module, torch.Tensor] = {}

        def record(mod: torch.nn.Module, inp: tuple, out: torch.Tensor) -> None:
            if mod in outs:
                raise UnsupportedLayerError("a layer is applied twice (shared weights)")
            acts[mod], outs[mod] = inp[0], out

        handles = [m.register_forward_hook(record) for m, _ in self._layers]
        try:
            logits = self.model(x)
        finally:
            for h in handles:
                h.remove()
        if len(outs) != len(self._layers):
            raise UnsupportedLayerError("a layer with parameters was not used in the forward")
        losses = per_example_losses(self.loss_fn, logits, y)
        deltas = torch.autograd.grad(losses.sum(), [outs[m] for m, _ in self._layers])
        by_param: dict[int, PerExample] = {}
        for (m, sampler), delta in zip(self._layers, deltas, strict=True):
            pieces = sampler(m, acts[m].detach(), delta)
            for name, p in m.named_parameters(recurse=False):
                by_param[id(p)] = _checked(m, name, p, pieces.get(name), len(losses))
        return [by_param[id(p)] for _, p in self._named], losses.detach()


def per_example_losses(loss_fn: LossFn, logits: torch.Tensor, y: torch.Tensor
                       ) -> torch.Tensor:
    """Each example's loss as its own batch of one: ``loss_fn(logits[i:i+1], y[i:i+1])``.

    ``vmap`` does that for any loss. For cross-entropy with int64 class-index targets and no
    class weights (``F.cross_entropy`` with its defaults, or an ``nn.CrossEntropyLoss``
    without ``weight``, hooks or a replaced ``forward``, reducing by mean or sum) the same
    values come from one call with ``reduction="none"``: a batch of one's mean (or sum) is
    its one value. The one difference is a target equal to ``ignore_index`` under a mean:
    its batch of one averages over no example (0/0, NaN) where ``"none"`` gives 0, so it
    is set to NaN — the example is then counted non-finite and contributes zero, as
    before. Why: the ``vmap`` and its
    backward took ≈ 0.30 ms a step of the paper CNN at batch 64 against 0.06
    (docs/benchmarks.md, "Issue 34, tenth pass"); tests check the losses and the
    gradients equal ``vmap``'s."""
    ce = _plain_cross_entropy(loss_fn)
    # int64 targets only: the batched call refuses int32 ones, which a batch of one takes
    if ce is not None and logits.dim() == 2 and y.dim() == 1 and y.dtype == torch.int64:
        ignore, smoothing, mean = ce
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none",
                                                   ignore_index=ignore,
                                                   label_smoothing=smoothing)
        return losses.masked_fill(y == ignore, math.nan) if mean else losses
    from torch.func import vmap

    return vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(logits, y)


def _plain_cross_entropy(loss_fn: LossFn) -> tuple[int, float, bool] | None:
    """``(ignore_index, label_smoothing, mean)`` if ``loss_fn`` is cross-entropy whose
    one-example loss is its ``reduction="none"`` value (an ignored target's: NaN under a
    mean, 0 under a sum), else ``None``."""
    if loss_fn is torch.nn.functional.cross_entropy:
        return -100, 0.0, True
    if (type(loss_fn) is torch.nn.CrossEntropyLoss and loss_fn.weight is None
            and loss_fn.reduction in ("mean", "sum")
            # a hook or a replaced forward would change what the module computes
            and not (loss_fn._forward_hooks or loss_fn._forward_pre_hooks
                     or torch.nn.modules.module._global_forward_hooks
                     or torch.nn.modules.module._global_forward_pre_hooks
                     or "forward" in loss_fn.__dict__)):
        return (int(loss_fn.ignore_index), float(loss_fn.label_smoothing),
                loss_fn.reduction == "mean")
    return None


def _checked(layer: torch.nn.Module, name: str, param: torch.Tensor,
             piece: PerExample | torch.Tensor | None, batch: int) -> PerExample:
    """A sampler's answer for one parameter, or a :class:`PrivacyConfigError`: a sampler
    that skips a parameter or gives the wrong shape is a bug in the code, not in the datum,
    so it must stop the round — not count as a zero gradient, as a datum's failure does."""
    if isinstance(piece, torch.Tensor):
        piece = Materialized(piece)
    if isinstance(piece, Materialized) and tuple(piece.g.shape) != (batch, *param.shape):
        raise PrivacyConfigError(
            f"the grad sampler for {type(layer).__name__} gave per-example gradients of "
            f"shape {tuple(piece.g.shape)} for {name!r}, not {(batch, *param.shape)}")
    if not isinstance(piece, PerExample):
        raise PrivacyConfigError(f"the grad sampler for {type(layer).__name__} gave no "
                                 f"per-example gradient for its parameter {name!r}")
    return piece
