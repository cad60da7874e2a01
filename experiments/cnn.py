"""Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning With
Correlated Noise") CNN experiment (Sec. V-B, Fig. 4) on MNIST or Fashion-MNIST.

Needs the ``torch`` extra. The CNN is the paper's: two 3×3 convolutions with 32 filters,
2×2 max-pooling, fully connected 64 then 10 units, ReLU, cross-entropy. 10 learners; a
part of the training set spread evenly at random, the rest split by class (class ``l`` to
learner ``l``, :func:`~experiments.data.mnist.paper_partition`); the test set
evaluated on the server. Each local step uses the next ``batch_size`` images of the
learner's stream (each image once).

Two engines run the same learners: :func:`run_cnn` (in process, for sweeps) and
:func:`cnn_apps` (a ServerApp/ClientApp pair for Flower's Ray simulation). Both run the
private step on the model's device by default (``engine="device"``:
:func:`~flwr_corrnoise.torch.run_inprocess_device` and
:func:`~flwr_corrnoise.flower.torch_app.make_torch_client_app`, per-example clipping: one image
moves a step's clipped sum by at most ``2·B_g``, the sensitivity the calibration assumes,
whatever the batch size), or the NumPy reference round (``engine="host"``:
:func:`flwr_corrnoise.learner.local_round` through
:class:`~flwr_corrnoise.torch.ModuleGradient`, the batch's mean gradient clipped as a
whole — the same sensitivity, ``b``× more relative noise). For the paper's batch of one
image the two are the same algorithm.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cache
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from experiments.data.mnist import load_dataset, paper_partition
from flwr_corrnoise.data.idx import ImageDataset
from flwr_corrnoise.engine import run_inprocess
from flwr_corrnoise.flower import CorrNoiseFedAvg
from flwr_corrnoise.flower.torch_app import make_torch_client_app
from flwr_corrnoise.settings import NOISELESS, PrivacySettings
from flwr_corrnoise.torch import BatchStream, ModuleGradient, get_parameters, set_parameters


class PaperCNN(torch.nn.Module):
    """conv 3×3×32 → ReLU → conv 3×3×32 → ReLU → max-pool 2×2 → FC 64 → ReLU → FC 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 3)
        self.conv2 = torch.nn.Conv2d(32, 32, 3)
        self.fc1 = torch.nn.Linear(32 * 12 * 12, 64)
        self.fc2 = torch.nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@dataclass(frozen=True)
class CNNSetup:
    """One CNN run. ``steps`` = ``R·τ`` (fixed across τ, as in the paper); ``train_size``
    and ``iid_size`` shrink the data for reduced runs (``None``: the paper's 60,000 and
    30,000)."""

    dataset: str = "fashion-mnist"
    data_root: str | None = None
    num_learners: int = 10
    steps: int = 200
    tau: int = 1
    batch_size: int = 10
    mechanism: str = "blt"
    epsilon: float = 2.0
    delta: float = 1e-3
    clip: float = 1.0
    eta: float = 0.05
    eta_g: float = 1.0
    seed: int = 0
    data_seed: int = 0
    train_size: int | None = None
    iid_size: int | None = None
    test_size: int = 10000
    eval_every: int = 0  # rounds between test evaluations; 0: about 20 points per run
    threads: int = 0  # torch threads; 0: leave torch's default
    #: "device": the private step on the model's device (PrivateOptimizer, per-example
    #: clipping); "host": the NumPy reference round (local_round, float64, batch clipped
    #: as a whole) — the definition, ≈ 5–10× slower
    engine: str = "device"
    #: the (ε, δ) → noise calibration: "exact" (the analytic Gaussian, Balle & Wang 2018)
    #: or "zcdp" (Zhang, Zhu, Fay & Johansson's Lemma IV.8, the paper's own: 1.37× more
    #: noise at (2, 10⁻³))
    calibration: str = "exact"

    @property
    def rounds(self) -> int:
        if self.steps % self.tau:
            raise ValueError(f"steps {self.steps} is not a multiple of τ = {self.tau}")
        return self.steps // self.tau

    @property
    def label(self) -> str:
        return "noiseless" if self.mechanism == NOISELESS else self.mechanism

    def settings(self) -> PrivacySettings:
        return PrivacySettings(mechanism=self.mechanism, epsilon=self.epsilon,
                               delta=self.delta, clip_norm=self.clip, horizon=self.steps,
                               method=self.calibration)

    def with_(self, **changes: Any) -> CNNSetup:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@cache
def _dataset(name: str, root: str | None) -> ImageDataset:
    return load_dataset(name, root)


@dataclass
class CNNData:
    """The learners' streams and the test set of one setup."""

    dataset: ImageDataset
    streams: list[np.ndarray]  # per learner: indices into the training set, in stream order
    test_x: torch.Tensor
    test_y: torch.Tensor


def cnn_data(setup: CNNSetup) -> CNNData:
    """Partition the (possibly reduced) training set and check every stream is long enough
    for ``steps`` batches: a datum is never used twice (online learning)."""
    data = _partitioned(setup.dataset, setup.data_root, setup.num_learners, setup.train_size,
                        setup.iid_size, setup.data_seed, setup.test_size)
    need = setup.steps * setup.batch_size
    short = [i for i, s in enumerate(data.streams) if len(s) < need]
    if short:
        raise ValueError(
            f"learners {short} have fewer than steps·batch = {need} images "
            f"(shortest: {min(len(data.streams[i]) for i in short)}); use fewer steps, a "
            f"smaller batch or more training data"
        )
    return data


@cache
def _partitioned(dataset: str, root: str | None, num_learners: int, train_size: int | None,
                 iid_size: int | None, data_seed: int, test_size: int) -> CNNData:
    """The split depends on these fields only; cached because every Flower message (one
    per learner and round) and every method of a sweep asks for it again."""
    ds = _dataset(dataset, root)
    n = len(ds.train_y) if train_size is None else min(train_size, len(ds.train_y))
    rng = np.random.default_rng([data_seed, 0xC77])
    subset = np.sort(rng.permutation(len(ds.train_y))[:n]) if n < len(ds.train_y) else (
        np.arange(n))
    iid = n // 2 if iid_size is None else iid_size
    parts = paper_partition(ds.train_y[subset], num_learners, iid, data_seed)
    m = min(test_size, len(ds.test_y))
    return CNNData(ds, [subset[p] for p in parts], torch.from_numpy(ds.test_x[:m]),
                   torch.from_numpy(ds.test_y[:m]))


def batch_stream(data: CNNData, learner: int, batch_size: int) -> BatchStream:
    """Position ``p`` of learner ``learner``'s stream: its images ``p·b … p·b + b − 1``."""
    order = data.streams[learner]
    x, y = data.dataset.train_x, data.dataset.train_y

    def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = order[position * batch_size : (position + 1) * batch_size]
        if len(idx) < batch_size:
            raise IndexError(f"learner {learner}'s stream has no batch at position {position}")
        return torch.from_numpy(x[idx]), torch.from_numpy(y[idx])

    return batch


def initial_model(setup: CNNSetup) -> PaperCNN:
    torch.manual_seed(setup.seed)
    return PaperCNN(10)


@torch.no_grad()
def accuracy(model: torch.nn.Module, params: list[np.ndarray] | None, x: torch.Tensor,
             y: torch.Tensor, batch: int = 2000) -> tuple[float, float]:
    """Test accuracy and mean cross-entropy of ``params`` (loaded into ``model``)."""
    if params is not None:
        set_parameters(model, params)
    correct, loss = 0, 0.0
    for i in range(0, len(y), batch):
        out = model(x[i : i + batch])
        loss += float(torch.nn.functional.cross_entropy(out, y[i : i + batch], reduction="sum"))
        correct += int((out.argmax(1) == y[i : i + batch]).sum())
    return correct / len(y), loss / len(y)


class CNNEvaluator:
    """Test accuracy of ``x^r`` every ``eval_every`` rounds (and the last); progress on
    stderr; rows in :attr:`rows`."""

    def __init__(self, setup: CNNSetup, data: CNNData, progress: bool = True,
                 label: str = "") -> None:
        self.setup, self.data, self.progress = setup, data, progress
        self.every = setup.eval_every or max(1, setup.rounds // 20)
        self.model = initial_model(setup)
        self.rows: list[dict[str, float]] = []
        self.label = label or f"{setup.label} τ={setup.tau}"
        self._start = time.perf_counter()

    def __call__(self, r: int, params: list[np.ndarray]) -> dict[str, float] | None:
        if r % self.every and r != self.setup.rounds:
            return None
        if all(np.all(np.isfinite(p)) for p in params):
            acc, loss = accuracy(self.model, params, self.data.test_x, self.data.test_y)
        else:
            acc, loss = float("nan"), float("nan")
        row = {"round": float(r), "test-accuracy": acc, "test-loss": loss}
        self.rows.append(row)
        if self.progress:
            print(f"  [{self.label}] round {r:>5}/{self.setup.rounds}  acc {acc:.3f}  "
                  f"loss {loss:.3f}  ({time.perf_counter() - self._start:.0f} s)",
                  file=sys.stderr, flush=True)
        return row


@dataclass
class CNNResult:
    setup: CNNSetup
    rows: list[dict[str, float]]
    params: list[np.ndarray]
    seconds: float

    @property
    def final_accuracy(self) -> float:
        return self.rows[-1]["test-accuracy"]


def run_cnn(setup: CNNSetup, progress: bool = True) -> CNNResult:
    """One run in process: :func:`~flwr_corrnoise.torch.run_inprocess_device`
    (``engine="device"``) or the NumPy reference engine
    :func:`~flwr_corrnoise.engine.run_inprocess` (``engine="host"``)."""
    if setup.threads:
        torch.set_num_threads(setup.threads)
    data = cnn_data(setup)
    if setup.engine == "device":
        from flwr_corrnoise.torch import run_inprocess_device

        evaluator = CNNEvaluator(setup, data, progress)
        start = time.perf_counter()
        dev = run_inprocess_device(
            model_fn=lambda i: initial_model(setup),
            batches=[batch_stream(data, i, setup.batch_size)
                     for i in range(setup.num_learners)],
            settings=setup.settings(), rounds=setup.rounds, tau=setup.tau, eta=setup.eta,
            eta_g=setup.eta_g, seed=setup.seed, evaluate=evaluator)
        return CNNResult(setup, evaluator.rows, dev.params, time.perf_counter() - start)
    if setup.engine != "host":
        raise ValueError(f"engine must be 'device' or 'host', not {setup.engine!r}")
    model = initial_model(setup)  # one module serves every learner: each call loads params
    grads = [ModuleGradient(model, torch.nn.functional.cross_entropy,
                            batch_stream(data, i, setup.batch_size))
             for i in range(setup.num_learners)]
    evaluator = CNNEvaluator(setup, data, progress)
    start = time.perf_counter()
    res = run_inprocess(
        initial=get_parameters(model), gradients=grads,
        settings=setup.settings(), rounds=setup.rounds, tau=setup.tau, eta=setup.eta,
        eta_g=setup.eta_g, seed=setup.seed, evaluate=evaluator,
    )
    return CNNResult(setup, evaluator.rows, res.params, time.perf_counter() - start)


def cnn_apps(setup: CNNSetup, progress: bool = True,
             on_finish: Callable[[CNNResult], None] | None = None
             ) -> tuple[ServerApp, ClientApp]:
    """The same run on Flower (``flwr.simulation.run_simulation``, Ray backend): learner
    ``partition-id`` streams its part; the server evaluates on the test set."""
    from flwr_corrnoise.apps.logreg import wait_for_nodes

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, setup.num_learners)
        data = cnn_data(setup)
        evaluator = CNNEvaluator(setup, data, progress, label=f"flower {setup.label}")
        strategy = CorrNoiseFedAvg(local_steps=setup.tau, learning_rate=setup.eta,
                                   server_learning_rate=setup.eta_g,
                                   privacy=setup.settings(),
                                   min_available_nodes=setup.num_learners)

        def evaluate_fn(r: int, arrays: ArrayRecord) -> MetricRecord | None:
            row = evaluator(r, arrays.to_numpy_ndarrays())
            return None if row is None else MetricRecord(row)

        start = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(
            get_parameters(initial_model(setup))), num_rounds=setup.rounds,
            evaluate_fn=evaluate_fn)
        if on_finish is not None:
            on_finish(CNNResult(setup, evaluator.rows, result.arrays.to_numpy_ndarrays(),
                                time.perf_counter() - start))

    def model_fn(context: Context) -> torch.nn.Module:
        if setup.threads:
            torch.set_num_threads(setup.threads)
        return initial_model(setup)

    def batches_fn(context: Context) -> BatchStream:
        return batch_stream(cnn_data(setup), int(context.node_config["partition-id"]),
                            setup.batch_size)

    defaults = {"mechanism": setup.mechanism, "epsilon": setup.epsilon,
                "delta": setup.delta, "clip-norm": setup.clip, "horizon": setup.steps,
                "seed": setup.seed}
    return server_app, make_torch_client_app(model_fn, batches_fn, config_defaults=defaults,
                                             engine=setup.engine)


def final_noise_to_signal(setup: CNNSetup, dim: int) -> float:
    """How large the privacy noise in the final model is next to the most the data can
    move it: ``‖noise‖ / (N·B_g)`` after ``N = R·τ`` steps, averaged over the learners.

    Why this number explains the CNN results: the final model is
    ``x⁰ − η·η_g·(1/n)·Σ_i Σ_k (g_i[k] + e_i[k])``; the data part has norm at most
    ``η·η_g·N·B_g``, and the noise part's expected norm is
    ``η·η_g·σ·‖b_{N−1}‖·√(d/n)`` (``b_{N−1}``: the last row of ``B``, so
    ``σ·‖b_{N−1}‖`` is the per-coordinate std of a learner's noise prefix sum). η, η_g and
    ``B_g`` (σ ∝ ``B_g``) cancel: only the mechanism, ``N``, ``d`` and ``n`` matter. Above
    1 the noise outweighs any signal; the correlated mechanisms' ``‖b_{N−1}‖`` grows like
    ``polylog(N)``, independent noise's like ``√N``, so longer horizons favour them.
    """
    from flwr_corrnoise.mechanisms import build_factorization

    cal = setup.settings().calibration()
    if cal is None:
        return 0.0
    last = float(build_factorization(setup.mechanism, setup.steps).row_errors()[-1])
    return cal.std * math.sqrt(last) * math.sqrt(dim / setup.num_learners) / (
        setup.steps * setup.clip)
