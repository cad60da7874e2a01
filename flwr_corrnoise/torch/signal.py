"""The plan's measured signal term for a torch model, computed on the learner's own data.

:func:`flwr_corrnoise.plan.estimate_signal` needs the sum of a sample's clipped per-example
gradients and their norms; this module gets them from the model with the per-example
gradients the private step itself uses (:class:`~.grad_sample.PerExampleGradients`) and
its clip rule (:func:`~.grad_sample.clip_factors`, one function for both), so the figure is
the clipping the run will do. Nothing here is sent anywhere or changes the
model: the learner calls it before training, and only the plan it prints locally uses it
(a figure of the data that is never released, so it costs no privacy budget — as long as
the learner keeps it to itself).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from ..plan import SignalEstimate, estimate_signal
from .grad_sample import PerExampleGradients, clip_factors
from .params import LossFn

__all__ = ["measure_signal"]


def measure_signal(model: torch.nn.Module, loss_fn: LossFn,
                   batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                   clip_norm: float, max_examples: int = 512) -> SignalEstimate:
    """``‖E clip(g)‖ / B_g`` of ``model`` at its current parameters, from up to
    ``max_examples`` examples of ``batches`` (``(inputs, targets)`` pairs, e.g. a
    ``DataLoader`` yielding them): pass the result to
    :func:`flwr_corrnoise.plan.with_signal` for a plan whose verdict reflects this model and
    data (measure before training: the plan is about the run ahead). The model's
    parameters and gradients are left as they were."""
    if max_examples < 2:
        raise ValueError(f"measure_signal: max_examples must be ≥ 2, got {max_examples}")
    per_example = PerExampleGradients(model, loss_fn)
    total: list[torch.Tensor] | None = None
    norms: list[np.ndarray] = []
    seen = 0
    for inputs, targets in batches:
        take = min(len(inputs), max_examples - seen)
        if take <= 0:
            break
        pieces, losses = per_example(inputs[:take], targets[:take])
        norm, ok, factor = clip_factors(pieces, losses, clip_norm)  # the private step's clip
        if not bool(ok.all()):
            raise ValueError("measure_signal: a per-example gradient or loss is not finite")
        sums = [p.weighted_sum(factor, ok, True).detach() for p in pieces]
        total = sums if total is None else [t + s for t, s in zip(total, sums, strict=True)]
        # float32 rounding may put a clipped norm a hair above B_g
        norms.append(np.minimum((norm * factor).detach().cpu().double().numpy(), clip_norm))
        seen += take
    if total is None:
        raise ValueError("measure_signal: no examples")
    flat = np.concatenate([t.cpu().double().numpy().ravel() for t in total])
    return estimate_signal(flat, np.concatenate(norms), clip_norm)
