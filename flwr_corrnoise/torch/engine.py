"""The in-process engine for PyTorch models, with the private step on the model's device.

:func:`flwr_corrnoise.engine.run_inprocess` runs Algorithm 1 with the NumPy reference
round (:func:`~flwr_corrnoise.learner.local_round`): every local step copies the
parameters to the host in float64, clips and adds noise in NumPy and copies them back.
That is the definition, and slow for a CNN (≈ 25 min for 50,000 steps of Zhang, Zhu, Fay &
Johansson's ("Locally Differentially Private Online Federated Learning With Correlated Noise") CNN
on one core). :func:`run_inprocess_device` runs the same algorithm with each learner's local round
on its model's device (:func:`~flwr_corrnoise.torch.optimizer.device_local_round`: clipping, the
correlated increment from a
:class:`~flwr_corrnoise.torch.streams.TorchNoiseStream` and the SGD step stay on the
device) and the server step of every engine
(:func:`~flwr_corrnoise.aggregation.aggregate`, float64 on the host, once per round). Noise
seeds come from :func:`~flwr_corrnoise.settings.derive_seed` as in the Flower layer, so
learner ``i`` of a run with seed ``s`` draws the stream a Flower learner with
``partition-id = i`` and seed ``s`` draws on the same device type.

The parameters cross host↔device twice per learner and round (the global model in, the
update ``ĝ`` out), as in a Flower round; never per step. Each learner's counters, stream
and data position are its optimizer's :class:`~flwr_corrnoise.learner_state.LearnerState`, the
state every front end keeps. Formerly ``flwr_corrnoise.torch_engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..aggregation import aggregate
from ..engine import run_rounds
from ..settings import PrivacySettings, derive_seed
from .optimizer import PrivateOptimizer, device_local_round
from .params import BatchStream, LossFn, get_parameters

__all__ = ["DeviceRunResult", "run_inprocess_device"]


@dataclass
class DeviceRunResult:
    """Final global parameters (float64, host) and the learners' optimizers (their noise
    streams and counters, e.g. to check the steps each took)."""

    params: list[np.ndarray]
    learners: list[PrivateOptimizer]
    models: list[list[np.ndarray]] = field(default_factory=list)


def run_inprocess_device(
    *,
    model_fn: Callable[[int], torch.nn.Module],
    batches: Sequence[BatchStream],
    settings: PrivacySettings,
    rounds: int,
    tau: int,
    eta: float,
    eta_g: float = 1.0,
    seed: int = 0,
    loss_fn: LossFn = torch.nn.functional.cross_entropy,
    per_example: bool = True,
    evaluate: Callable[[int, list[np.ndarray]], object] | None = None,
    keep_models: bool = False,
) -> DeviceRunResult:
    """Run Algorithm 1 for ``rounds`` rounds, every learner in every round.

    ``model_fn(i)`` builds learner ``i``'s model on its device (each learner keeps its own
    module, optimizer and noise stream; the global model is loaded into it every round);
    ``batches[i](position)`` is learner ``i``'s stream. The local step is plain SGD at rate
    ``eta`` on the privatized gradient (:class:`~flwr_corrnoise.torch.optimizer.PrivateOptimizer`,
    per-example clipping with ``per_example=True``, the batch clipped as a whole
    otherwise; for a batch of one the two coincide). ``evaluate(r, x^r)`` is called for
    ``r = 0..rounds`` like Flower's ``evaluate_fn``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be positive, got {rounds}")
    if rounds * tau > settings.horizon and settings.private:
        raise ValueError(f"R·τ = {rounds * tau} steps exceed the horizon {settings.horizon} "
                         "the noise is calibrated for")
    learners: list[PrivateOptimizer] = []
    for i in range(len(batches)):
        model = model_fn(i)
        opt = torch.optim.SGD(model.parameters(), lr=eta)
        learners.append(PrivateOptimizer(
            opt, model, settings, loss_fn=loss_fn,
            seed=derive_seed(seed, i) if settings.private else None))
    x = [np.array(p, dtype=np.float64, copy=True) for p in get_parameters(learners[0].model)]
    result = DeviceRunResult(params=x, learners=learners)

    def one_round(r: int, x: list[np.ndarray]) -> list[np.ndarray]:
        updates = []
        shared: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for i, private in enumerate(learners):
            _load(private, x, shared)
            # the learner state's position: every step advances it with the stream
            out = device_local_round(private, batches[i], tau, private.state.position,
                                     per_example=per_example)
            updates.append(out.update)
        return aggregate(x, updates, eta, eta_g, tau)

    result.params = run_rounds(x, rounds, one_round, evaluate,
                               result.models if keep_models else None)
    return result


def _load(private: PrivateOptimizer, x: list[np.ndarray],
          shared: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]) -> None:
    """Load the global model into a learner's parameters; the float64 host arrays are
    converted once per round per device and dtype, not once per learner."""
    key = (private.device, private.params[0].dtype)
    if key not in shared:
        shared[key] = [torch.as_tensor(a, dtype=key[1], device=key[0]) for a in x]
    with torch.no_grad():
        for p, t in zip(private.params, shared[key], strict=True):
            if p.shape != t.shape:
                raise ValueError(f"parameter of shape {tuple(p.shape)} got {tuple(t.shape)}")
            p.copy_(t)
