"""The task of the reference Flower app (:mod:`flwr_corrnoise.apps.logreg`): online
logistic regression on synthetic(α, β) streams, the setting of Zhang, Zhu, Fay & Johansson, "Locally
Differentially Private Online Federated Learning With Correlated Noise" (Sec. V-A).

Why this is library and not experiment code: it is what the installed ``flwr run`` example
(``examples/logreg-app``), the SuperNodes of a deployment (``deploy/``) and the demo run, and
those processes can import only installed code. The paper reproductions that drive it
(sweeps, the in-process runs of Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online
Federated Learning With Correlated Noise" (arXiv version) and Zhang, Zhu & Johansson's
("Differentially Private Online Federated Learning with Correlated Noise") variants, figures) live
in the repository's ``experiments/`` and ``simulations/`` (see ``docs/architecture.md``).

:class:`LogRegSetup` is the whole configuration (it maps one-to-one to the kebab-case
run-config keys of the Flower app); :class:`LogRegEvaluator` computes, for the global
model ``x^r`` of every round, the test accuracy and loss, the *online loss* ``f^r(x^r)`` on
round ``r``'s data (the ``n·τ`` points the learners consume in that round) and the
per-round optimum ``(f^r)*`` for the dynamic regret of paper eq. (1).

The evaluator sits on the server side of the experiment and regenerates round ``r``'s data
from the synthetic generator; learners never report losses, so the metrics cost no
privacy. It assumes every learner takes part in every round (the paper's setting), so that
learner ``i`` consumes positions ``r·τ … r·τ + τ − 1`` in round ``r``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from functools import cached_property
from typing import Any

import numpy as np

from ..data import SyntheticConfig, SyntheticFederation
from ..learner import GradientFn
from ..metrics import accuracy, logistic_grad, logistic_loss, round_optimum
from ..settings import NOISELESS, PrivacySettings
from ..variants import NOISE_AT

#: run-config key ↔ field name (Flower convention: kebab-case keys)
_KEYS = {
    "num-learners": "num_learners",
    "dim": "dim",
    "alpha": "alpha",
    "beta": "beta",
    "drift": "drift",
    "num-server-rounds": "rounds",
    "local-steps": "tau",
    "learning-rate": "eta",
    "server-learning-rate": "eta_g",
    "mechanism": "mechanism",
    "epsilon": "epsilon",
    "delta": "delta",
    "clip-norm": "clip",
    "calibration": "method",
    "seed": "seed",
    "data-seed": "data_seed",
    "test-size": "test_size",
    "fraction-train": "fraction_train",
    "labels": "labels",
    "noise-at": "noise_at",
    "data-reuse": "data_reuse",
}

#: how labels are drawn (see ``flwr_corrnoise.data.synthetic`` and ``docs/data.md``):
#: ``centred`` is our adaptation (balanced labels, shared model component), ``fedprox`` the
#: naive binary FedProx rule the paper's figure corresponds to (labels nearly constant per
#: learner, so test accuracy saturates and only the online loss separates the methods)
#: ``shared`` is a task a single global model learns well (≈ 0.89 noiseless): centred labels,
#: a strong shared model (``shared_scale = 5``) and feature means that differ between
#: learners only by FedProx's shift ``B_i`` (``mean_spread = 0``) — the demo's task
#: (``experiments/demo.py``), where what the noise costs shows in the accuracy
LABEL_RULES: dict[str, dict[str, Any]] = {
    "centred": {"centered": True, "shared_scale": 2.0},
    "fedprox": {"centered": False, "shared_scale": 0.0},
    "shared": {"centered": True, "shared_scale": 5.0, "mean_spread": 0.0},
}


@dataclass(frozen=True)
class LogRegSetup:
    """Zhang et al., Sec. V-A defaults: n = 20, d = 100, τ = 4, R = 1000, α = β = 0.1."""

    num_learners: int = 20
    dim: int = 100
    alpha: float = 0.1
    beta: float = 0.1
    drift: float = 0.0
    rounds: int = 1000
    tau: int = 4
    eta: float = 0.05
    eta_g: float = 1.0
    mechanism: str = "optimized"
    epsilon: float = 2.0
    delta: float = 1e-3
    clip: float = 1.0
    method: str = "exact"
    seed: int = 0  # noise seeds of the learners (derived per learner)
    data_seed: int = 0  # the synthetic federation
    test_size: int = 2000
    fraction_train: float = 1.0
    labels: str = "centred"
    #: "step" (Zhang et al.), "round" (Zhang et al., arXiv), "server" (Zhang, Zhu & Johansson)
    noise_at: str = "step"
    #: the task is Zhang et al.'s stream: each datum used once, at one step (its declaration,
    #: which every private config must make: the library has no default for it)
    data_reuse: str = "once"

    def __post_init__(self) -> None:
        if self.labels not in LABEL_RULES:
            raise ValueError(f"labels must be one of {sorted(LABEL_RULES)}, got {self.labels!r}")
        if self.noise_at not in NOISE_AT:
            raise ValueError(f"noise_at must be one of {NOISE_AT}, got {self.noise_at!r}")

    @property
    def horizon(self) -> int:
        return self.rounds * self.tau

    def settings(self) -> PrivacySettings:
        """The privacy settings every learner of this experiment owns."""
        return PrivacySettings(
            mechanism=self.mechanism,
            epsilon=self.epsilon,
            delta=self.delta,
            clip_norm=self.clip,
            horizon=self.horizon,
            method=self.method,
        )

    def to_run_config(self) -> dict[str, Any]:
        return {key: getattr(self, name) for key, name in _KEYS.items()}

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any]) -> LogRegSetup:
        types = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, name in _KEYS.items():
            if key in cfg and cfg[key] is not None:
                caster = {"int": int, "float": float, "str": str}[str(types[name])]
                kwargs[name] = caster(cfg[key])
        return cls(**kwargs)

    def with_(self, **changes: Any) -> LogRegSetup:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def round_clip(self) -> float:
        """``B`` for the per-round and central variants: ``η·τ·B_g``, the largest update
        τ clipped steps can make, so every variant clips at the same scale."""
        return self.eta * self.tau * self.clip

    @property
    def label(self) -> str:
        if self.mechanism == NOISELESS:
            return "noiseless"
        where = "" if self.noise_at == "step" else f" @{self.noise_at}"
        return f"{self.mechanism}{where} (ε={self.epsilon:g}, δ={self.delta:g})"


_FEDERATIONS: dict[tuple, SyntheticFederation] = {}


def federation(setup: LogRegSetup) -> SyntheticFederation:
    """The synthetic federation of a setup (memoized per process: every virtual learner
    of a simulation shares one generator)."""
    key = (setup.num_learners, setup.dim, setup.alpha, setup.beta, setup.drift, setup.data_seed,
           setup.labels)
    if key not in _FEDERATIONS:
        _FEDERATIONS[key] = SyntheticFederation(
            SyntheticConfig(
                num_learners=setup.num_learners,
                dim=setup.dim,
                alpha=setup.alpha,
                beta=setup.beta,
                drift=setup.drift,
                seed=setup.data_seed,
                **LABEL_RULES[setup.labels],
            )
        )
    return _FEDERATIONS[key]


def logistic_gradient(setup: LogRegSetup, learner: int) -> GradientFn:
    """Learner ``learner``'s gradient oracle: logistic loss on the datum at a position."""
    fed = federation(setup)

    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        a, b = fed.learner_batch(learner, position, 1)
        return [logistic_grad(params[0], a, b)]

    return gradient


def initial_parameters(setup: LogRegSetup) -> list[np.ndarray]:
    """``x^0 = 0`` (Zhang et al.'s paper assumes ``x^0 = 0``)."""
    return [np.zeros(setup.dim)]


class LogRegEvaluator:
    """Metrics of ``x^r`` for every round; callable as Flower's ``evaluate_fn``-style
    ``(round, params) -> dict``. Rows are kept in :attr:`rows`."""

    def __init__(self, setup: LogRegSetup, progress: bool = False, label: str = "",
                 regret: bool = True) -> None:
        self.setup = setup
        #: compute the round optimum ``(f^r)*`` for the dynamic regret: a logistic fit per
        #: round, most of an evaluation's time; ``False`` (the demo) skips it, and the
        #: regret is then NaN
        self.regret = regret
        self.rows: list[dict[str, float]] = []
        self.progress = progress
        self.label = label or setup.label
        self._start = time.perf_counter()

    @cached_property
    def _test(self) -> tuple[np.ndarray, np.ndarray]:
        return federation(self.setup).test_set(self.setup.test_size)

    def round_data(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n·τ`` points the learners consume in round ``r``."""
        fed, tau = federation(self.setup), self.setup.tau
        parts = [fed.learner_batch(i, r * tau, tau) for i in range(self.setup.num_learners)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def __call__(self, r: int, params: list[np.ndarray]) -> dict[str, float]:
        x = np.asarray(params[0], dtype=np.float64)
        if self.setup.drift:
            a, b = federation(self.setup).test_set(self.setup.test_size, r * self.setup.tau)
        else:
            a, b = self._test
        row: dict[str, float] = {
            "round": float(r),
            "test-accuracy": accuracy(x, a, b) if np.all(np.isfinite(x)) else math.nan,
            "test-loss": logistic_loss(x, a, b) if np.all(np.isfinite(x)) else math.nan,
        }
        if r < self.setup.rounds:
            ra, rb = self.round_data(r)
            row["online-loss"] = logistic_loss(x, ra, rb) if np.all(np.isfinite(x)) else math.nan
            if self.regret:
                row["round-optimum"] = round_optimum(ra, rb)
        self.rows.append(row)
        if self.progress:
            self._report(r)
        return row

    def _report(self, r: int) -> None:
        total = self.setup.rounds
        step = max(1, total // 10)
        if r % step == 0 or r == total:
            row = self.rows[-1]
            elapsed = time.perf_counter() - self._start
            print(
                f"  [{self.label}] round {r:>5}/{total}  acc {row['test-accuracy']:.3f}  "
                f"loss {row['test-loss']:.3f}  ({elapsed:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def summary(self) -> dict[str, float]:
        """Final accuracy, average online loss and dynamic regret (paper eq. (1))."""
        online = [row["online-loss"] for row in self.rows if "online-loss" in row]
        optima = [row["round-optimum"] for row in self.rows if "round-optimum" in row]
        final = self.rows[-1]
        regret = (self.setup.tau * float(np.sum(np.asarray(online) - np.asarray(optima)))
                  if len(optima) == len(online) else math.nan)
        return {
            "final_accuracy": final["test-accuracy"],
            "final_test_loss": final["test-loss"],
            "avg_online_loss": float(np.mean(online)) if online else math.nan,
            "dynamic_regret": regret,
        }
