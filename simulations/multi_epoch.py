"""Multi-epoch federated CNN: correlated noise (BLT for multiple participations) vs
independent noise vs DP-SGD as Opacus users run it, at equal ε (issue 21 item 6).

The setting most Flower apps have: every learner trains ``--local-epochs`` passes over a
fixed local partition in each of ``--rounds`` FedAvg rounds, so every example is used
``rounds × local_epochs`` times. Each learner's own dataset is its unit of privacy (local
DP: example-level (ε, δ) with respect to the learner's data, whatever the server does), the
same in every method:

* ``blt`` — the library's device step (:class:`~flwr_corrnoise.torch.PrivateOptimizer`,
  per-example clipping, the sum plus the next correlated increment, divided by the batch)
  fed by a :class:`~flwr_corrnoise.data.loader.CyclicLoader` (one order fixed once); the
  settings take the loader's participation, so BLT is optimized for its
  ``(k = epochs, b = steps per epoch)`` and calibrated to the exact fixed-epoch
  sensitivity (replace-one: ``2·B_g`` per use).
* ``independent`` — the same loop, loader and accounting with independent noise (DP-SGD
  without amplification: what a fixed order allows).
* ``opacus`` — DP-SGD as Opacus users run it: ``PrivacyEngine`` (PRV accountant, Opacus'
  default), Poisson sampling at rate ``batch/examples``, noise multiplier from
  ``get_noise_multiplier`` for ``rounds × local_epochs`` epochs — exactly what
  ``make_private_with_epsilon`` computes (computed once per ε here, not once per learner).
  Opacus' ε is for **add/remove-one** neighbours.
* ``opacus-replace-one`` — the same Opacus run with the noise multiplier calibrated by
  ``dp_accounting``'s PLD accountant for **replace-one** neighbours (Poisson-subsampled
  Gaussian), the relation ours are calibrated for: the like-for-like DP-SGD.
* ``none`` — noiseless reference (no clipping, no noise, the same cyclic loop).

The server is FedAvg (the mean of the learners' local models, η_g = 1); every learner
takes part in every round. Test accuracy of the global model after every round.

The run in docs/results-multi-epoch.md (≈ 25 min on 2 shared cores)::

    python -m simulations.multi_epoch --workers 2 --docs

Toy size (what tests/experiments/test_multi_epoch.py runs, on IDX files it makes)::

    python -m simulations.multi_epoch --quick --data-root DIR --out DIR

Outputs in ``--out``: ``runs.csv`` (one row per method × ε × seed: final accuracy, the ε
each method's own accountant reports, the ε under replace-one from ``dp_accounting``, the
noise std/multiplier), ``rounds.csv`` (accuracy per round), ``tuning.csv`` (the η grid on
the tuning seeds, one row per seed: ``--tune-seeds`` chooses η by the mean over them),
``multi_epoch.png``; ``--docs`` copies them to ``docs/`` and rewrites the tables of
``docs/results-multi-epoch.md``; ``--from-runs`` redoes plot and docs from ``--out``'s
CSVs.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.cnn import PaperCNN, accuracy
from experiments.data.mnist import load_dataset, paper_partition
from flwr_corrnoise.amplification import CyclicPoissonSampling, choose_bands
from flwr_corrnoise.data.loader import CyclicLoader
from flwr_corrnoise.data.sampling import CyclicPoissonLoader
from flwr_corrnoise.mechanisms import check_mechanism
from flwr_corrnoise.mechanisms.participation import Participation
from flwr_corrnoise.settings import NOISELESS, PrivacySettings, derive_seed
from flwr_corrnoise.torch import get_parameters, run_inprocess_device, set_parameters
from simulations.cnn import update_marked_section  # the same "table:NAME" markers

ROOT = Path(__file__).resolve().parents[1]
#: the library's mechanisms compared here (a deliberate subset, checked against the registry)
OURS = [check_mechanism(m) for m in ("bandmf", "blt", "independent")]
#: ours under cyclic Poisson sampling (the others: a fixed cyclic order)
SAMPLED = ["bandmf"]
OPACUS = ["opacus", "opacus-replace-one"]
METHODS = [NOISELESS, *OURS, *OPACUS]
NAMES = {
    NOISELESS: "noiseless",
    "bandmf": "amplified BandMF, cyclic Poisson, library's bands (ours)",
    "bandmf-b1": "BandMF at 1 band = DP-SGD, Poisson (ours)",
    "bandmf-b2": "BandMF at 2 bands, cyclic Poisson (ours; the prefix-sum RMSE's choice)",
    "blt": "BLT for k epochs (ours)",
    "independent": "independent noise, fixed order",
    "opacus": "Opacus DP-SGD (Poisson, PRV, add/remove)",
    "opacus-replace-one": "Opacus DP-SGD (Poisson, PLD, replace-one)",
}
#: Opacus' accountant (its default, the one ``make_private_with_epsilon`` uses)
OPACUS_ACCOUNTANT = "prv"
RUN_HEADER = [
    "dataset", "method", "epsilon", "delta", "seed", "final_accuracy", "final_loss",
    "best_accuracy", "eta", "rounds", "local_epochs", "examples", "batch_size", "learners",
    "model", "clip_norm", "steps", "accountant", "relation", "epsilon_reported",
    "epsilon_replace_one", "noise_std", "noise_multiplier", "sensitivity", "noise_rmse",
    "seconds",
]
ROUND_HEADER = ["dataset", "method", "epsilon", "seed", "eta", "round", "test_accuracy",
                "test_loss", "batch_size"]


class SmallCNN(torch.nn.Module):
    """conv 5×5×8 stride 2 → ReLU → conv 5×5×16 stride 2 → ReLU → FC 10 (5,994 weights).

    Why not Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated Learning
    With Correlated Noise") CNN (:class:`~experiments.cnn.PaperCNN`, 3·10⁵ weights): its per-example
    gradients cost ≈ 60× more, ≈ 15 min per run on 2 shared cores; a DP model this small is also
    what DP-SGD practice recommends (the noise grows with √d). ``--model paper`` runs the paper's
    CNN instead.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 5, stride=2)
        self.conv2 = torch.nn.Conv2d(8, 16, 5, stride=2)
        self.fc = torch.nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


MODELS = {"small": SmallCNN, "paper": PaperCNN}


@dataclass(frozen=True)
class Setup:
    """One run: a method at one ε and seed."""

    method: str = "blt"
    epsilon: float = 2.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    eta: float = 0.1
    seed: int = 0
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    learners: int = 10
    examples: int = 512  # per learner
    batch_size: int = 32
    rounds: int = 5
    local_epochs: int = 2
    model: str = "small"
    test_size: int = 10000
    threads: int = 1
    #: ``bandmf``'s bands (= the sampler's cycle); 0: the library's choice
    bandmf_bands: int = 0

    @property
    def private(self) -> bool:
        return self.method != NOISELESS

    @property
    def steps_per_epoch(self) -> int:
        return self.loader(0).steps_per_epoch

    @property
    def steps(self) -> int:
        """Local steps per learner over the run (the horizon; Opacus' expected steps)."""
        return self.loader(0).horizon

    @property
    def sample_rate(self) -> float:
        """Opacus' Poisson rate: ``1/len(data_loader)`` (``batch/examples`` when it divides)."""
        return 1.0 / self.steps_per_epoch

    def loader(self, learner: int) -> CyclicLoader | CyclicPoissonLoader:
        """Learner ``learner``'s loop: its cyclic order (public: fixed before training), or
        for ``bandmf`` its cyclic Poisson sampler over the bands :func:`bands` chose, keyed
        by the learner's noise seed (the sampler derives its own sub-key from it)."""
        if self.method in SAMPLED:
            return CyclicPoissonLoader(self.examples, self.batch_size, rounds=self.rounds,
                                       key=derive_seed(self.seed, learner),
                                       local_epochs=self.local_epochs, bands=self.bands,
                                       order_seed=self.seed * 1000 + learner)
        return CyclicLoader(self.examples, self.batch_size, rounds=self.rounds,
                            local_epochs=self.local_epochs,
                            order_seed=self.seed * 1000 + learner)

    @property
    def bands(self) -> int:
        """``bandmf``'s bands: the library's choice for this (ε, δ, N, steps per epoch,
        steps per round, learners) (:func:`~flwr_corrnoise.amplification.choose_bands`,
        replace-one)."""
        if self.bandmf_bands:
            return self.bandmf_bands
        s = CyclicLoader(self.examples, self.batch_size, self.rounds, self.local_epochs)
        return chosen_bands(self.epsilon, self.delta, s.horizon, s.steps_per_epoch,
                            s.steps_per_epoch * self.local_epochs, self.learners)

    def settings(self) -> PrivacySettings:
        """Ours: the loader's horizon and participation (all learners share them)."""
        ld = self.loader(0)
        mech = self.method if self.method in OURS else NOISELESS
        return PrivacySettings(mechanism=mech, epsilon=self.epsilon, delta=self.delta,
                               clip_norm=self.clip_norm, horizon=ld.horizon,
                               participation=ld.participation)

    @property
    def label(self) -> str:
        """The method's name in the CSVs: ``bandmf-b<bands>`` when the bands are forced."""
        if self.method in SAMPLED and self.bandmf_bands:
            return f"{self.method}-b{self.bandmf_bands}"
        return self.method

    def with_(self, **changes: Any) -> Setup:
        return replace(self, **changes)


# -- data ---------------------------------------------------------------------------------

@cache
def _dataset(name: str, root: str | None) -> Any:
    return load_dataset(name, root)


@cache
def partitions(dataset: str, root: str | None, learners: int, examples: int,
               data_seed: int) -> tuple[np.ndarray, ...]:
    """Each learner's fixed local dataset (indices into the training set): Zhang et al.'s
    split (half spread at random, half by class) of a random subset of ``2·learners·examples``
    images, each part cut to ``examples`` — disjoint, the same for every method."""
    ds = _dataset(dataset, root)
    n = min(2 * learners * examples, len(ds.train_y))
    rng = np.random.default_rng([data_seed, 0x3E9])
    subset = np.sort(rng.permutation(len(ds.train_y))[:n])
    parts = paper_partition(ds.train_y[subset], learners, n // 2, data_seed)
    short = [i for i, p in enumerate(parts) if len(p) < examples]
    if short:
        raise ValueError(f"learners {short} have fewer than {examples} images; use fewer "
                         "examples per learner or more training data")
    return tuple(subset[p[:examples]] for p in parts)


def learner_data(s: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ds = _dataset(s.dataset, s.data_root)
    return [(torch.from_numpy(ds.train_x[idx]), torch.from_numpy(ds.train_y[idx]))
            for idx in partitions(s.dataset, s.data_root, s.learners, s.examples, s.seed)]


def test_data(s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    ds = _dataset(s.dataset, s.data_root)
    m = min(s.test_size, len(ds.test_y))
    return torch.from_numpy(ds.test_x[:m]), torch.from_numpy(ds.test_y[:m])


def initial_model(s: Setup) -> torch.nn.Module:
    torch.manual_seed(s.seed)
    return MODELS[s.model]()


# -- accounting ---------------------------------------------------------------------------

@cache
def chosen_bands(epsilon: float, delta: float, horizon: int, steps_per_epoch: int,
                 steps_per_round: int | None = None, learners: int = 1) -> int:
    """The bands :func:`~flwr_corrnoise.amplification.choose_bands` picks for this FedAvg
    loop (the iterate noise of ``learners`` learners restarting every ``steps_per_round``
    steps; ``b > 1`` only 10 % below DP-SGD's)."""
    return choose_bands(epsilon, delta, horizon, steps_per_epoch,
                        steps_per_round=steps_per_round, learners=learners)[0].bands


@cache
def opacus_noise_multiplier(epsilon: float, delta: float, sample_rate: float,
                            epochs: int) -> float:
    """What ``PrivacyEngine.make_private_with_epsilon`` uses: Opacus' own calibration with
    its default accountant, add/remove-one neighbours."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                      sample_rate=sample_rate, epochs=epochs,
                                      accountant=OPACUS_ACCOUNTANT))


def pld_epsilon_poisson(noise_multiplier: float, sample_rate: float, steps: int,
                        delta: float, relation: str = "replace-one",
                        discretization: float = 1e-4) -> float:
    """ε of ``steps`` Poisson-subsampled Gaussian steps (``dp_accounting``'s PLD)."""
    import dp_accounting as dpa
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    rel = (dpa.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
           else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc = PLDAccountant(rel, value_discretization_interval=discretization)
    acc.compose(dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier)),
                steps)
    return float(acc.get_epsilon(delta))


@cache
def replace_one_noise_multiplier(epsilon: float, delta: float, sample_rate: float,
                                 steps: int) -> float:
    """The smallest noise multiplier (to 0.1 %) whose replace-one ε (PLD, the fine grid)
    is ≤ ``epsilon``: bisection on a coarse grid, then checked and raised on the fine one."""
    lo, hi = 0.1, 1.0
    while pld_epsilon_poisson(hi, sample_rate, steps, delta, discretization=1e-3) > epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            raise ValueError("no noise multiplier reaches this ε")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if pld_epsilon_poisson(mid, sample_rate, steps, delta, discretization=1e-3) > epsilon:
            lo = mid
        else:
            hi = mid
    while pld_epsilon_poisson(hi, sample_rate, steps, delta) > epsilon:
        hi *= 1.001
    return hi


def gaussian_pld_epsilon(std: float, l2_sensitivity: float, delta: float) -> float:
    """ε of one Gaussian release (``dp_accounting``'s PLD): ours release the whole noised
    stream at once, with the library's multi-participation sensitivity."""
    import dp_accounting as dpa
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.GaussianDpEvent(std / l2_sensitivity))
    return float(acc.get_epsilon(delta))


def privacy_columns(s: Setup) -> dict[str, Any]:
    """Accountant, relation, ε reported, ε under replace-one, noise std (on the clipped sum
    of a step), multiplier (std/B_g), sensitivity (in units of ``2·B_g``) and the RMSE of
    the noise in the prefix sums (per coordinate, for a learner, in units of ``B_g``)."""
    n = s.steps
    if not s.private:
        return {"accountant": "", "relation": "", "epsilon_reported": 0.0,
                "epsilon_replace_one": 0.0, "noise_std": 0.0, "noise_multiplier": 0.0,
                "sensitivity": 0.0, "noise_rmse": 0.0}
    if s.method in SAMPLED:
        st = s.settings()
        cal = st.calibration()
        fact = st.factorization()
        sampling = CyclicPoissonSampling.of(st.participation, n)
        sigma = cal.noise_multiplier
        return {"accountant": f"flwr-corrnoise pld b={cal.bands}",
                "relation": cal.relation, "epsilon_reported": st.epsilon_spent(n),
                # dp_accounting's PLD on the same events: ⌈N/b⌉ Poisson-subsampled steps
                "epsilon_replace_one": pld_epsilon_poisson(
                    sigma, sampling.sampling_rate, sampling.cycles(), s.delta),
                "noise_std": cal.std, "noise_multiplier": sigma,
                "sensitivity": cal.column_norm,
                "noise_rmse": cal.std / s.clip_norm * math.sqrt(
                    float(np.mean(fact.row_errors())))}
    if s.method in OURS:
        st = s.settings()
        cal = st.calibration()
        fact = st.factorization()
        sens = fact.participation_sensitivity(st.participation).value
        return {"accountant": f"flwr-corrnoise {st.method}", "relation": "replace-one",
                "epsilon_reported": st.epsilon_spent(n),
                "epsilon_replace_one": gaussian_pld_epsilon(cal.std, cal.l2_sensitivity,
                                                            s.delta),
                "noise_std": cal.std, "noise_multiplier": cal.std / s.clip_norm,
                "sensitivity": sens,
                "noise_rmse": cal.std / s.clip_norm * math.sqrt(
                    float(np.mean(fact.row_errors())))}
    q = s.sample_rate
    sigma = (opacus_noise_multiplier(s.epsilon, s.delta, q, s.rounds * s.local_epochs)
             if s.method == "opacus" else
             replace_one_noise_multiplier(s.epsilon, s.delta, q, n))
    from opacus.accountants import create_accountant

    acc = create_accountant(OPACUS_ACCOUNTANT)
    acc.history = [(sigma, q, n)]
    opacus_eps = float(acc.get_epsilon(s.delta))
    r1 = pld_epsilon_poisson(sigma, q, n, s.delta)
    # independent noise each step: the prefix sum k has variance (k+1)·σ²
    rmse = sigma * math.sqrt(float(np.mean(np.arange(1, n + 1))))
    return {"accountant": f"opacus {OPACUS_ACCOUNTANT}" if s.method == "opacus"
            else "dp_accounting pld",
            "relation": "add/remove" if s.method == "opacus" else "replace-one",
            "epsilon_reported": opacus_eps if s.method == "opacus" else r1,
            "epsilon_replace_one": r1, "noise_std": sigma * s.clip_norm,
            "noise_multiplier": sigma, "sensitivity": 0.0, "noise_rmse": rmse}


NOISE_HEADER = ["epsilon", "delta", "steps_per_epoch", "epochs", "steps", "method",
                "noise_multiplier", "noise_rmse"]


def noise_rows(epsilons: list[float], delta: float, steps_per_epoch: list[int],
               epochs: list[int]) -> list[dict[str, Any]]:
    """No training: each method's noise at equal ε for ``k`` epochs of ``b`` steps — the
    noise std per step (× B_g) and the RMSE of the noise in the prefix sums (what the
    model accumulates, per coordinate, × B_g). Ours from the library's calibration and
    factorization; DP-SGD with i.i.d. noise each step at Poisson rate ``1/b``."""
    rows = []
    for e in epsilons:
        for b in steps_per_epoch:
            for k in epochs:
                n = b * k
                for m in METHODS[1:]:
                    if m in SAMPLED:  # the library's bands at rate bands/b, Thm 4's PLD
                        best, _ = choose_bands(e, delta, n, b)
                        sigma, rmse = best.noise_multiplier, best.rmse
                    elif m in OURS:
                        st = PrivacySettings(m, e, delta, 1.0, n,
                                             participation=Participation.epochs(k, b))
                        sigma = st.calibration().std
                        rmse = sigma * math.sqrt(float(np.mean(st.factorization().row_errors())))
                    else:
                        sigma = (opacus_noise_multiplier(e, delta, 1.0 / b, k) if m == "opacus"
                                 else replace_one_noise_multiplier(e, delta, 1.0 / b, n))
                        rmse = sigma * math.sqrt(float(np.mean(np.arange(1, n + 1))))
                    rows.append({"epsilon": e, "delta": delta, "steps_per_epoch": b,
                                 "epochs": k, "steps": n, "method": m,
                                 "noise_multiplier": sigma, "noise_rmse": rmse})
                    print(f"  ε={e:g} b={b} k={k} {m}: σ/B_g {sigma:.3f}, prefix-sum RMSE "
                          f"{rmse:.1f}", file=sys.stderr, flush=True)
    return rows


def noise_table(rows: list[dict[str, str]]) -> str:
    """Prefix-sum noise RMSE per (ε, b, k) (rows) and method (columns), the smallest bold."""
    methods = [m for m in METHODS[1:] if any(r["method"] == m for r in rows)]
    lines = ["| ε | steps/epoch b | epochs k | " + " | ".join(NAMES[m] for m in methods)
             + " |", "|---|---|---|" + "---|" * len(methods)]
    for key in dict.fromkeys((r["epsilon"], r["steps_per_epoch"], r["epochs"]) for r in rows):
        val = {r["method"]: float(r["noise_rmse"]) for r in rows
               if (r["epsilon"], r["steps_per_epoch"], r["epochs"]) == key}
        best = min(val.values())
        cells = [(f"**{val[m]:.1f}**" if val[m] == best else f"{val[m]:.1f}") for m in methods]
        lines.append(f"| {float(key[0]):g} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BANDS_HEADER = ["epsilon", "delta", "steps_per_epoch", "steps", "steps_per_round",
                "learners", "bands", "sampling_rate", "noise_multiplier", "column_norm",
                "prefix_rmse", "iterate_rmse", "chosen"]


def band_rows(cases: list[tuple[float, int]], delta: float, epochs_per_round: int,
              rounds: int, learners: int) -> list[dict[str, Any]]:
    """No training: every candidate :func:`~flwr_corrnoise.amplification.choose_bands`
    weighs for each trained (ε, steps per epoch) — σ by the PLD, the prefix-sum RMSE (the
    paper's criterion) and the FedAvg iterate RMSE it compares — and which it picks."""
    rows = []
    for e, s in cases:
        n, per = s * epochs_per_round * rounds, s * epochs_per_round
        best, table = choose_bands(e, delta, n, s, steps_per_round=per, learners=learners)
        for c in table:
            rows.append({"epsilon": e, "delta": delta, "steps_per_epoch": s, "steps": n,
                         "steps_per_round": per, "learners": learners, "bands": c.bands,
                         "sampling_rate": c.sampling_rate,
                         "noise_multiplier": c.noise_multiplier,
                         "column_norm": c.column_norm, "prefix_rmse": c.rmse,
                         "iterate_rmse": c.error, "chosen": int(c.bands == best.bands)})
        print(f"  ε={e:g} s={s}: {best.bands} bands", file=sys.stderr, flush=True)
    return rows


def bands_table(rows: list[dict[str, str]]) -> str:
    """Per (ε, steps per epoch): each candidate's prefix-sum and iterate RMSE relative to
    DP-SGD's (b = 1), the choice in bold."""
    lines = ["| ε | steps/epoch | bands b | σ_b | prefix-sum RMSE / DP-SGD's | iterate RMSE / "
             "DP-SGD's | chosen |", "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["epsilon"], r["steps_per_epoch"]) for r in rows):
        sub = [r for r in rows if (r["epsilon"], r["steps_per_epoch"]) == key]
        one = next(r for r in sub if int(r["bands"]) == 1)
        for r in sub:
            mark = "**yes**" if int(r["chosen"]) else ""
            lines.append(
                f"| {float(key[0]):g} | {key[1]} | {r['bands']} | "
                f"{float(r['noise_multiplier']):.3f} | "
                f"{float(r['prefix_rmse']) / float(one['prefix_rmse']):.3f} | "
                f"{float(r['iterate_rmse']) / float(one['iterate_rmse']):.3f} | {mark} |")
    return "\n".join(lines)


# -- the runs -----------------------------------------------------------------------------

class Evaluator:
    """Test accuracy and loss of the global model after each round (``r = 0 … R``)."""

    def __init__(self, s: Setup, label: str, progress: bool) -> None:
        self.s, self.label, self.progress = s, label, progress
        self.model = MODELS[s.model]()
        self.x, self.y = test_data(s)
        self.rows: list[tuple[int, float, float]] = []
        self.start = time.perf_counter()

    def __call__(self, r: int, params: list[np.ndarray]) -> None:
        if all(np.all(np.isfinite(p)) for p in params):
            acc, loss = accuracy(self.model, params, self.x, self.y)
        else:
            acc, loss = float("nan"), float("nan")
        self.rows.append((r, acc, loss))
        if self.progress:
            print(f"    [{self.label}] round {r}/{self.s.rounds}  acc {acc:.3f}  loss "
                  f"{loss:.3f}  ({time.perf_counter() - self.start:.0f} s)",
                  file=sys.stderr, flush=True)


def run_ours(s: Setup, evaluate: Evaluator) -> None:
    """``blt``, ``independent``, ``none``: the library's in-process device engine, each
    learner's batch at step ``t`` being its loader's ``indices(t)``."""
    data = learner_data(s)
    loaders = [s.loader(i) for i in range(s.learners)]

    def batches(i: int) -> Any:
        x, y = data[i]

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.from_numpy(loaders[i].indices(step))
            return x[idx], y[idx]

        return batch

    run_inprocess_device(
        model_fn=lambda i: initial_model(s), batches=[batches(i) for i in range(s.learners)],
        settings=s.settings(), rounds=s.rounds, tau=loaders[0].local_steps, eta=s.eta,
        eta_g=1.0, seed=s.seed, evaluate=evaluate)


def run_opacus(s: Setup, evaluate: Evaluator, sigma: float) -> float:
    """``opacus``, ``opacus-replace-one``: one ``PrivacyEngine`` per learner over its
    local data (Poisson sampling, flat clipping to ``B_g``, noise on the sum divided by the
    expected batch), ``local_epochs`` passes of its DP data loader per round, FedAvg of the
    local models. Returns learner 0's ε from Opacus' accountant after the run."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    x = get_parameters(initial_model(s))
    torch.manual_seed(s.seed + 7919)  # Opacus' sampling and noise use the global generator
    learners = []
    for xs, ys in learner_data(s):
        engine = PrivacyEngine(accountant=OPACUS_ACCOUNTANT)
        model = MODELS[s.model]()
        opt = torch.optim.SGD(model.parameters(), lr=s.eta)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt,
            data_loader=DataLoader(TensorDataset(xs, ys), batch_size=s.batch_size),
            noise_multiplier=sigma, max_grad_norm=s.clip_norm, poisson_sampling=True)
        learners.append((engine, model, opt, loader))
    for r in range(s.rounds):
        evaluate(r, x)
        local = []
        for _engine, model, opt, loader in learners:
            set_parameters(model._module, x)
            for _ in range(s.local_epochs):
                for xb, yb in loader:
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(xb), yb).backward()
                    opt.step()
            local.append(get_parameters(model._module))
        x = [np.mean([m[j] for m in local], axis=0) for j in range(len(x))]
    evaluate(s.rounds, x)
    steps = {sum(h[2] for h in e.accountant.history) for e, *_ in learners}
    if steps != {s.steps}:
        raise RuntimeError(f"Opacus took {steps} steps, accounted for {s.steps}")
    return float(learners[0][0].get_epsilon(s.delta))


def run_one(s: Setup, progress: bool = True) -> tuple[dict[str, Any], list[list]]:
    """One run: its runs.csv row (a dict) and rounds.csv rows."""
    with warnings.catch_warnings():
        # Opacus' notices that do not change what runs: secure_mode off (fine for a
        # simulation), its hooks on a model whose inputs need no gradient, and its RDP
        # domain estimate inside the PRV accountant
        for text in ("Secure RNG turned off", "Full backward hook is firing",
                     "Optimal order is the largest alpha"):
            warnings.filterwarnings("ignore", message=text)
        return _run_one(s, progress)


def _run_one(s: Setup, progress: bool) -> tuple[dict[str, Any], list[list]]:
    torch.set_num_threads(s.threads)
    # the η grid deliberately spans rates above the plan's "safe" one (the tuning picks);
    # its once-per-learner warning would print ten times per run
    logging.getLogger("flwr_corrnoise.torch.optimizer").setLevel(logging.ERROR)
    label = f"{s.method} ε={s.epsilon:g} seed {s.seed} η={s.eta:g}"
    evaluate = Evaluator(s, label, progress)
    start = time.perf_counter()
    cols = privacy_columns(s)
    if s.method in OPACUS:
        spent = run_opacus(s, evaluate, cols["noise_multiplier"])
        if s.method == "opacus":
            cols["epsilon_reported"] = spent  # Opacus' accountant, after the run
    else:
        run_ours(s, evaluate)
    seconds = time.perf_counter() - start
    accs = [a for _, a, _ in evaluate.rows]
    row = {"dataset": s.dataset, "method": s.label,
           "epsilon": s.epsilon if s.private else math.inf, "delta": s.delta,
           "seed": s.seed, "final_accuracy": accs[-1], "final_loss": evaluate.rows[-1][2],
           "best_accuracy": float(np.nanmax(accs)) if not np.all(np.isnan(accs)) else math.nan,
           "eta": s.eta, "rounds": s.rounds, "local_epochs": s.local_epochs,
           "examples": s.examples, "batch_size": s.batch_size, "learners": s.learners,
           "model": s.model, "clip_norm": s.clip_norm, "steps": s.steps, **cols,
           "seconds": seconds}
    rounds = [[s.dataset, s.label, row["epsilon"], s.seed, s.eta, r, a, lo, s.batch_size]
              for r, a, lo in evaluate.rows]
    if progress:
        print(f"  {label}: final accuracy {accs[-1]:.3f} ({seconds:.0f} s)", file=sys.stderr,
              flush=True)
    return row, rounds


def _job(s: Setup) -> tuple[dict[str, Any], list[list]]:
    return run_one(s)


def run_all(jobs: list[Setup], workers: int) -> list[tuple[dict[str, Any], list[list]]]:
    if workers <= 1:
        return [run_one(j) for j in jobs]
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_job, jobs))


# -- the sweep ----------------------------------------------------------------------------

def base_setup(args: argparse.Namespace) -> Setup:
    return Setup(delta=args.delta, clip_norm=args.clip_norm, dataset=args.dataset,
                 data_root=args.data_root, learners=args.learners, examples=args.examples,
                 batch_size=args.batch_size, rounds=args.rounds,
                 local_epochs=args.local_epochs, model=args.model, test_size=args.test_size,
                 threads=args.threads, bandmf_bands=args.bandmf_bands)


def cells(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(method, ε) pairs: the noiseless reference once (ε = ∞)."""
    return [(m, math.inf if m == NOISELESS else e) for m in args.methods
            for e in (args.epsilons if m != NOISELESS else [math.inf])]


def tune_seeds(args: argparse.Namespace) -> list[int]:
    """The tuning seeds: ``--tune-seeds`` if given, else the one ``--tune-seed``."""
    return list(args.tune_seeds) if args.tune_seeds else [args.tune_seed]


def choose_etas(results: list[tuple[tuple[str, float], float, int, float]]
                ) -> dict[tuple[str, float], float]:
    """η per (method, ε) from ``(cell, η, tuning seed, final accuracy)``: the best **mean**
    final accuracy over the tuning seeds, ties to the smaller η; a diverged run counts as
    −1. Why a mean: one seed's gap between two η can be far below the spread over seeds
    (0.655 against 0.647 for BandMF at 16 steps per epoch, ε = 8, where the evaluation
    seeds' std is 0.017), so a one-seed choice decides a comparison by chance. Every η of a
    cell must have run on the same seeds, or the means would not be comparable."""
    accs: dict[tuple[str, float], dict[float, dict[int, float]]] = {}
    for cell, eta, seed, acc in results:
        accs.setdefault(cell, {}).setdefault(eta, {})[seed] = (
            acc if np.isfinite(acc) else -1.0)
    chosen = {}
    for cell, by_eta in accs.items():
        seeds = {frozenset(v) for v in by_eta.values()}
        if len(seeds) != 1:
            raise ValueError(f"η of {cell} tuned on different seeds: {sorted(map(sorted, seeds))}")
        chosen[cell] = min(by_eta, key=lambda eta: (-float(np.mean(list(by_eta[eta].values()))),
                                                    eta))
    return chosen


def tune(args: argparse.Namespace, base: Setup) -> tuple[dict[tuple[str, float], float],
                                                         list[dict[str, Any]]]:
    """η per (method, ε): the best mean final accuracy over the tuning seeds (seeds no
    evaluation run uses: their partitions, initializations and noise are their own);
    ``choose_etas``. The rows: one per (method, ε, η, tuning seed)."""
    if len(args.etas) == 1:
        return {c: args.etas[0] for c in cells(args)}, []
    jobs = [base.with_(method=m, epsilon=2.0 if math.isinf(e) else e, eta=eta, seed=seed)
            for m, e in cells(args) for eta in args.etas for seed in tune_seeds(args)]
    results = run_all(jobs, args.workers)
    rows = [row for row, _ in results]
    chosen = choose_etas([((j.method, math.inf if j.method == NOISELESS else j.epsilon),
                           j.eta, j.seed, row["final_accuracy"])
                          for j, row in zip(jobs, rows, strict=True)])
    return chosen, rows


def write_csv(path: Path, header: list[str], rows: list[Any]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for r in rows:
            w.writerow([_fmt(r[h]) for h in header] if isinstance(r, dict) else
                       [_fmt(v) for v in r])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.10g}"
    return str(v)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def order(method: str) -> int:
    names = list(NAMES)  # the methods' order in the tables and the plot
    return names.index(method) if method in names else len(names)


def plot(runs: list[dict[str, str]], rounds: list[dict[str, str]], path: Path) -> None:
    """Accuracy vs round, mean ± std over seeds, one panel per ε (noiseless in each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = sorted({float(r["epsilon"]) for r in runs} - {math.inf})
    r0 = runs[0]
    fig, axes = plt.subplots(1, len(eps), figsize=(4.8 * len(eps), 5.2), squeeze=False,
                             sharey=True)
    keys = row_keys(runs)
    several = len({k[1] for k in keys}) > 1
    spes = sorted({k[1] for k in keys})
    for ax, e in zip(axes[0], eps, strict=True):
        for m, b in keys:
            sub = [c for c in rounds if c["method"] == m
                   and (float(c["epsilon"]) == e or m == NOISELESS)
                   and steps_per_epoch_of({**r0, "batch_size": c["batch_size"]}) == b]
            if not sub:
                continue
            seeds = sorted({c["seed"] for c in sub})
            xs = sorted({int(c["round"]) for c in sub})
            acc = np.array([[float(c["test_accuracy"]) for c in sorted(
                (c for c in sub if c["seed"] == sd), key=lambda c: int(c["round"]))]
                for sd in seeds])
            mean, std = acc.mean(axis=0), acc.std(axis=0)
            # a line style per steps per epoch (solid, dotted, dash-dot); a colour per method
            style = "--" if m == NOISELESS else ("-", ":", "-.")[min(spes.index(b), 2)]
            color = f"C{order(m) % 10}"  # one colour per method in every panel
            ax.plot(xs, mean, style, marker="o", ms=3, label=key_name((m, b), several),
                    color=color)
            ax.fill_between(xs, mean - std, mean + std, alpha=0.2, color=color)
        ax.set_title(f"ε = {e:g}, δ = {runs[0]['delta']}")
        ax.set_xlabel("FedAvg round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"test accuracy ({r0['dataset']})")
    seen: dict[str, Any] = {}  # one legend for all panels, below them (not over a curve)
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=3, fontsize=7)
    batches = "/".join(sorted({r["batch_size"] for r in runs}, key=int))
    fig.suptitle(f"{r0['learners']} learners × {r0['examples']} examples, batch "
                 f"{batches}, {r0['rounds']} rounds × {r0['local_epochs']} local "
                 f"epochs; bands: ± std over {len({r['seed'] for r in runs})} seeds",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05 * ((len(seen) + 2) // 3) + 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steps_per_epoch_of(row: dict[str, str]) -> int:
    """A run's steps per epoch (``⌈examples/batch⌉``), from its CSV row."""
    return -(-int(row["examples"]) // int(row["batch_size"]))


def row_keys(rows: list[dict[str, str]]) -> list[tuple[str, int]]:
    """(method, steps per epoch) in table order: by steps per epoch, then method."""
    keys = {(r["method"], steps_per_epoch_of(r)) for r in rows}
    return sorted(keys, key=lambda k: (k[1], order(k[0])))


def key_name(key: tuple[str, int], several: bool) -> str:
    """A row's name; with more than one steps-per-epoch in the tables, the steps too."""
    name = NAMES.get(key[0], key[0])
    return f"{name}, {key[1]} steps/epoch" if several else name


def _cell(rows: list[dict[str, str]], key: tuple[str, int], e: float) -> list[dict[str, str]]:
    return [r for r in rows if r["method"] == key[0] and steps_per_epoch_of(r) == key[1]
            and (float(r["epsilon"]) == e or key[0] == NOISELESS)]


def versus_table(runs: list[dict[str, str]]) -> str:
    """The library's choice (``bandmf``) against Opacus replace-one (like for like) per
    (steps per epoch, ε), where both ran: the difference of the means and whether it is
    within the spread (the larger of the two stds over seeds)."""
    lines = ["| steps/epoch | ε | library's bands | ours: `bandmf`, library's choice | "
             "Opacus DP-SGD, replace-one | ours − Opacus | spread (larger std) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    spe = sorted({steps_per_epoch_of(r) for r in runs})
    eps = sorted({float(r["epsilon"]) for r in runs} - {math.inf})
    for b in spe:
        for e in eps:
            ours = _cell(runs, ("bandmf", b), e)
            them = _cell(runs, ("opacus-replace-one", b), e)
            if not ours or not them:
                continue
            a = np.array([float(r["final_accuracy"]) for r in ours])
            o = np.array([float(r["final_accuracy"]) for r in them])
            diff, spread = float(a.mean() - o.mean()), float(max(a.std(), o.std()))
            verdict = ("within the spread" if abs(diff) <= spread else
                       "ahead beyond the spread" if diff > 0 else "behind beyond the spread")
            bands = ours[0]["accountant"].rsplit("b=", 1)[-1]
            lines.append(f"| {b} | {e:g} | {bands} | {a.mean():.3f} ± {a.std():.3f} | "
                         f"{o.mean():.3f} ± {o.std():.3f} | {diff:+.3f} | {spread:.3f} | "
                         f"{verdict} |")
    return "\n".join(lines)


def tables(runs: list[dict[str, str]], tuning: list[dict[str, str]]) -> dict[str, str]:
    """The doc's tables: accuracy (mean ± std per method × ε, per steps per epoch), the
    privacy/noise per cell, the library's choice against Opacus replace-one, tuning."""
    eps = sorted({float(r["epsilon"]) for r in runs} - {math.inf})
    keys = row_keys(runs)
    several = len({k[1] for k in keys}) > 1
    acc = ["| method | " + " | ".join(f"ε = {e:g}" for e in eps) + " |",
           "|---|" + "---|" * len(eps)]
    noise = ["| method | ε | accountant (relation) | ε reported | ε replace-one (PLD) | "
             "noise std / B_g per step | sensitivity (×2B_g) | prefix-sum noise RMSE / B_g |",
             "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        row = []
        for e in eps:
            sub = _cell(runs, key, e)
            a = np.array([float(r["final_accuracy"]) for r in sub])
            etas = ", ".join(sorted({r["eta"] for r in sub}))
            row.append(f"{np.mean(a):.3f} ± {np.std(a):.3f} (η = {etas})" if len(a) else "")
            if key[0] != NOISELESS and sub:
                r = sub[0]
                noise.append(
                    f"| {key_name(key, several)} | {e:g} | {r['accountant']} "
                    f"({r['relation']}) | "
                    f"{float(r['epsilon_reported']):.3f} | "
                    f"{float(r['epsilon_replace_one']):.3f} | "
                    f"{float(r['noise_multiplier']):.3f} | "
                    + (f"{float(r['sensitivity']):.3f}" if float(r["sensitivity"]) else "—")
                    + f" | {float(r['noise_rmse']):.1f} |")
        acc.append(f"| {key_name(key, several)} | " + " | ".join(row) + " |")
    out = {"accuracy": "\n".join(acc), "noise": "\n".join(noise),
           "versus": versus_table(runs)}
    if tuning:
        out["tuning"] = tuning_table(tuning)
    return out


def tuning_table(tuning: list[dict[str, str]]) -> str:
    """The η grid: one line per (method, steps per epoch, ε, tuning seed), and where a
    cell was tuned on several seeds a line of their mean (what ``choose_etas`` compares)."""
    grid = sorted({float(r["eta"]) for r in tuning})
    lines = ["| method | ε | tuning seed | " + " | ".join(f"η = {g:g}" for g in grid) + " |",
             "|---|---|---|" + "---|" * len(grid)]
    several = len({k[1] for k in row_keys(tuning)}) > 1
    for key in sorted(dict.fromkeys((r["method"], steps_per_epoch_of(r), r["epsilon"])
                                    for r in tuning),
                      key=lambda k: (k[1], order(k[0]), float(k[2]))):
        sub = [r for r in tuning if (r["method"], steps_per_epoch_of(r), r["epsilon"]) == key]
        seeds = sorted({int(r["seed"]) for r in sub})
        by_seed = {sd: {float(r["eta"]): float(r["final_accuracy"]) for r in sub
                        if int(r["seed"]) == sd} for sd in seeds}
        if len(seeds) > 1:
            by_seed["mean"] = {g: float(np.mean([by_seed[sd][g] for sd in seeds]))
                               for g in grid if all(g in by_seed[sd] for sd in seeds)}
        for sd, accs in by_seed.items():
            lines.append(f"| {key_name(key[:2], several)} | "
                         f"{'∞' if key[0] == NOISELESS else key[2]} | {sd} | "
                         + " | ".join(f"{accs[g]:.3f}" if g in accs else "" for g in grid)
                         + " |")
    return "\n".join(lines)


def _batch(d: Path) -> dict[str, str]:
    """The batch size of a directory's runs, for round rows written before rounds.csv had
    the column (each such directory ran one batch size; an error if it did not)."""
    if not (d / "runs.csv").exists():
        return {}
    sizes = {r["batch_size"] for r in read_csv(d / "runs.csv")}
    return {"batch_size": sizes.pop()} if len(sizes) == 1 else {}


def _held_once(keys: list[tuple], what: str) -> None:
    """Refuse a merge in which two directories hold the same result (``keys``, one per
    row): it would be counted twice."""
    twice = {k for k in keys if keys.count(k) > 1}
    if twice:
        raise ValueError(f"{what} held by more than one directory: {sorted(twice)}")


def merge(dirs: list[Path], out: Path) -> None:
    """Join the CSVs of several ``--out`` directories (a grid split into invocations) into
    ``out``: every run, round, tuning and band-choice row, in the order given, and the last
    noise table; a (method, ε, seed, batch) or a band candidate that two directories both
    hold is an error, so no result is counted twice."""
    out.mkdir(parents=True, exist_ok=True)
    for name, header in (("runs.csv", RUN_HEADER), ("rounds.csv", ROUND_HEADER),
                         ("tuning.csv", RUN_HEADER)):
        rows = [{**_batch(d), **r} for d in dirs if (d / name).exists()
                for r in read_csv(d / name)]
        if name == "runs.csv":
            _held_once([(r["method"], r["epsilon"], r["seed"], r["batch_size"])
                        for r in rows], "runs")
        if name == "tuning.csv":
            _held_once([(r["method"], r["epsilon"], r["eta"], r["seed"], r["batch_size"])
                        for r in rows], "tuning runs")
        if rows:
            write_csv(out / name, header, rows)
    found = [d / "noise.csv" for d in dirs if (d / "noise.csv").exists()]
    if found:  # no training, one grid: the last directory's
        shutil.copy(found[-1], out / "noise.csv")
    # the band choice, one --band-choice invocation per set of cells: every directory's
    # cells joined, a candidate two directories both weighed an error (as for runs)
    bands = [r for d in dirs if (d / "bands.csv").exists() for r in read_csv(d / "bands.csv")]
    _held_once([(float(r["epsilon"]), r["delta"], r["steps_per_epoch"],
                 r["steps_per_round"], r["learners"], r["bands"]) for r in bands],
               "band candidates")
    if bands:
        write_csv(out / "bands.csv", BANDS_HEADER, bands)


def finish(out: Path, docs: bool) -> None:
    """Plot and tables from ``out``'s CSVs; with ``docs``, copy them into docs/."""
    runs, rounds = read_csv(out / "runs.csv"), read_csv(out / "rounds.csv")
    tuning = read_csv(out / "tuning.csv") if (out / "tuning.csv").exists() else []
    plot(runs, rounds, out / "multi_epoch.png")
    tabs = tables(runs, tuning)
    if (out / "noise.csv").exists():
        tabs["rmse"] = noise_table(read_csv(out / "noise.csv"))
    if (out / "bands.csv").exists():
        tabs["bands"] = bands_table(read_csv(out / "bands.csv"))
    (out / "tables.md").write_text("\n\n".join(tabs.values()) + "\n")
    print((out / "tables.md").read_text())
    if docs:
        shutil.copy(out / "runs.csv", ROOT / "docs" / "results-multi-epoch.csv")
        shutil.copy(out / "rounds.csv", ROOT / "docs" / "results-multi-epoch-rounds.csv")
        if tuning:
            shutil.copy(out / "tuning.csv", ROOT / "docs" / "results-multi-epoch-tuning.csv")
        if (out / "noise.csv").exists():
            shutil.copy(out / "noise.csv", ROOT / "docs" / "results-multi-epoch-noise.csv")
        if (out / "bands.csv").exists():
            shutil.copy(out / "bands.csv", ROOT / "docs" / "results-multi-epoch-bands.csv")
        shutil.copy(out / "multi_epoch.png", ROOT / "docs" / "figures" / "multi_epoch.png")
        for name, text in tabs.items():
            update_marked_section(ROOT / "docs" / "results-multi-epoch.md", name, text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    p.add_argument("--data-root", default=None, help="a directory of the 4 IDX files")
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--epsilons", nargs="+", type=float, default=[2.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seeds", type=int, default=3, help="evaluation seeds 0 … N−1")
    p.add_argument("--bandmf-bands", type=int, default=0,
                   help="bandmf's bands (the sampler's cycle; 1 = DP-SGD); default: the "
                   "library's choice (amplification.choose_bands)")
    p.add_argument("--seed-values", nargs="+", type=int, default=None,
                   help="these evaluation seeds instead of 0 … N−1 (to split a grid into "
                   "runs that --merge joins)")
    p.add_argument("--etas", nargs="+", type=float, default=[0.03, 0.1, 0.3, 1.0],
                   help="learning-rate grid (one value: no tuning)")
    p.add_argument("--tune-seed", type=int, default=100, help="the one tuning seed")
    p.add_argument("--tune-seeds", nargs="+", type=int, default=None,
                   help="several tuning seeds: η by the mean final accuracy over them "
                   "(instead of --tune-seed)")
    p.add_argument("--learners", type=int, default=10)
    p.add_argument("--examples", type=int, default=512, help="images per learner")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "multi-epoch")
    p.add_argument("--docs", action="store_true",
                   help="copy CSVs and plot to docs/ and rewrite the doc's tables")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="DIR",
                   help="join these directories' CSVs into --out, then as --from-runs")
    p.add_argument("--from-runs", action="store_true",
                   help="only redo plot and tables from --out's CSVs")
    p.add_argument("--noise-table", action="store_true",
                   help="no training: each method's noise at equal ε over --table-b steps "
                   "per epoch × --table-k epochs (noise.csv), then the docs as --from-runs")
    p.add_argument("--band-choice", nargs="+", type=str, default=None, metavar="EPS:S",
                   help="no training: every candidate choose_bands weighs at each ε:steps "
                   "per epoch for this loop (--rounds, --local-epochs, --learners) "
                   "(bands.csv), then the docs as --from-runs")
    p.add_argument("--table-b", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--table-k", nargs="+", type=int, default=[10])
    p.add_argument("--quick", action="store_true",
                   help="toy size for the tests: 3 learners × 32 images, 2 rounds × 2 "
                   "epochs, batch 8, one seed, one η")
    args = p.parse_args(argv)
    if args.quick:
        args.learners, args.examples, args.batch_size = 3, 32, 8
        args.rounds, args.local_epochs, args.seeds = 2, 2, 1
        args.etas, args.test_size = args.etas[-1:], min(args.test_size, 200)
    evaluation = set(args.seed_values or range(args.seeds))
    if len(args.etas) > 1 and set(tune_seeds(args)) & evaluation:
        p.error(f"tuning seeds {tune_seeds(args)} overlap the evaluation seeds "
                f"{sorted(evaluation)}: η would be chosen on the runs it is judged by")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.noise_table:
        write_csv(args.out / "noise.csv", NOISE_HEADER,
                  noise_rows(args.epsilons, args.delta, args.table_b, args.table_k))
        if not (args.out / "runs.csv").exists():
            print(noise_table(read_csv(args.out / "noise.csv")))
            return 0
    if args.band_choice:
        cases = [(float(c.split(":")[0]), int(c.split(":")[1])) for c in args.band_choice]
        write_csv(args.out / "bands.csv", BANDS_HEADER,
                  band_rows(cases, args.delta, args.local_epochs, args.rounds, args.learners))
        if not (args.out / "runs.csv").exists():
            print(bands_table(read_csv(args.out / "bands.csv")))
            return 0
    if args.merge:
        merge(args.merge, args.out)
    if args.from_runs or args.noise_table or args.merge or args.band_choice:
        finish(args.out, args.docs)
        return 0
    base = base_setup(args)
    print(f"{args.learners} learners × {args.examples} {args.dataset} images, batch "
          f"{args.batch_size}, {args.rounds} rounds × {args.local_epochs} local epochs = "
          f"{base.steps} steps ({base.loader(0).participation.describe()}); methods "
          f"{args.methods}, ε {args.epsilons}, δ {args.delta}, seeds 0…{args.seeds - 1}",
          file=sys.stderr, flush=True)
    evaluation = list(args.seed_values or range(args.seeds))
    start = time.perf_counter()
    etas, tuning_rows = tune(args, base)
    if tuning_rows:
        write_csv(args.out / "tuning.csv", RUN_HEADER, tuning_rows)
        print(f"η chosen on seeds {tune_seeds(args)}: "
              + ", ".join(f"{m} ε={e:g}: {v:g}" for (m, e), v in etas.items()),
              file=sys.stderr, flush=True)
    elif (args.out / "tuning.csv").exists():
        (args.out / "tuning.csv").unlink()
    jobs = [base.with_(method=m, epsilon=2.0 if math.isinf(e) else e, eta=etas[(m, e)],
                       seed=s)
            for s in evaluation for m, e in cells(args)]
    results = run_all(jobs, args.workers)
    write_csv(args.out / "runs.csv", RUN_HEADER, [r for r, _ in results])
    write_csv(args.out / "rounds.csv", ROUND_HEADER, [c for _, cs in results for c in cs])
    print(f"{len(jobs) + len(tuning_rows)} runs in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)
    finish(args.out, args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

