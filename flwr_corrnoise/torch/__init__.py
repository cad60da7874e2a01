"""PyTorch learners without Flower: Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private
Online Federated Learning With Correlated Noise") private local round for any ``nn.Module``.

Needs the ``torch`` extra (``pip install -e ".[torch]"``); nothing in the core imports this
package, and nothing in it imports Flower, so a torch training loop, a benchmark or an
in-process sweep runs with NumPy, SciPy and torch alone. The Flower front ends built on it
(``make_torch_client_app``, ``private_optimizer``, ``TorchCorrNoiseClient``) live in
:mod:`flwr_corrnoise.flower`.

Two paths, one algorithm (``docs/pytorch.md``):

* **on the device** — :class:`PrivateOptimizer` (wrap your ``torch.optim.SGD``, keep your
  loop), :func:`device_local_round` (τ steps of it), :func:`run_inprocess_device` (every
  learner, every round, in process): per-example gradients (:mod:`.grad_sample`, a grad
  sampler per layer type, else torch.func), clipped, the next increment of the learner's
  :class:`TorchNoiseStream` on the model's device, the SGD step;
* **the host reference** — :class:`ModuleGradient` / :func:`torch_local_round`: the module
  as the gradient oracle of :func:`flwr_corrnoise.learner.local_round`, the NumPy round
  every engine is tested against, and the path for secure noise.

Importing this package registers the ``"torch"`` stream backend
(:func:`flwr_corrnoise.streams.restore_stream` then reads learner states holding a torch
stream). Modules: :mod:`.params` (parameter I/O), :mod:`.grad_sample`, :mod:`.optimizer`,
:mod:`.streams`, :mod:`.engine`, :mod:`.host`, :mod:`.signal` (the plan's measured
signal term).
"""

from .engine import run_inprocess_device
from .grad_sample import register_grad_sampler
from .host import ModuleGradient, torch_local_round
from .optimizer import PrivateOptimizer, device_local_round
from .params import BatchStream, get_parameters, set_parameters
from .signal import measure_signal
from .streams import TorchNoiseStream

__all__ = [
    "BatchStream",
    "ModuleGradient",
    "PrivateOptimizer",
    "TorchNoiseStream",
    "device_local_round",
    "get_parameters",
    "measure_signal",
    "register_grad_sampler",
    "run_inprocess_device",
    "set_parameters",
    "torch_local_round",
]
