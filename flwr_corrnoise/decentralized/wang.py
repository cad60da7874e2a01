"""Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized
Online Learning": PD-FTGL (Algorithms 1–2), PD-OCG (Algorithms 3–4) and the PD-OGD baseline, as
per-node update rules over arrays with a leading node axis.

**Privacy model — read this before deploying.** PD-FTGL and PD-OCG are (ε, 0)-DP *of the
decisions* over all ``T`` rounds (Theorems 3.6/3.9). Their gossip messages are **raw sums of
clipped gradients**: neighbours and the Flower relay see un-noised data-dependent values, so
they must be trusted. This is **not local DP** (``local_dp = False``); contrast Chen & Wang,
"Locally Differentially Private Distributed Online Learning with Guaranteed Optimality", whose every
message is an LDP release. PD-OGD's messages are Laplace-noised iterates, so it is local DP (each
message is itself a private release).

One synchronous step ``t`` (0-based; round ``t+1`` of the paper) of a learner, for the two
blocked algorithms, block ``z = t // L + 1``, position ``k = t mod L``:

1. *release*: while gossiping (``z ≥ 2``, ``k < L_gossip``) the learner sends ``d^k(z−1)``, its
   current gossip iterate; otherwise zeros (nothing data-dependent leaves);
2. *update*: plays ``x(z)``, adds the clipped gradient ``g − αx(z)`` to ``d(z)``; one step of the
   accelerated gossip eq. (5) on block ``z−1`` (``P_ii`` times its own iterate plus the mixed
   neighbour iterates, :func:`~.gossip.gossip_step`); at the block's last step inserts
   ``d^{L_gossip}(z−1)`` into its Laplace tree (:mod:`.tree_laplace`, Algorithm 2) and
   moves to the next decision:

   * PD-FTGL: ``x(z+1) = argmin_K ⟨ẑ(z), x⟩ + (η_z/2)‖x‖² = Proj_K(−ẑ(z)/η_z)``,
     ``η_z = α(z−1)L + 2h`` (eq. (6));
   * PD-OCG: ``x(z+1) = CG(K, L, F_z, x(z))`` with ``F_z(x) = ⟨ẑ(z−1), x⟩ + (η'/2)‖x‖²``,
     ``η' = α(z−2)L + 2h`` (eq. (9): the tree output of the *previous* block, because the
     paper runs the CG iterations during the block), exact line search on the quadratic.

Parameters as the theorems set them (each overridable): ``θ`` and ``L`` (PD-OCG's ``L'``) from
eq. (7); PD-FTGL ``h = G√(14 L T (2 + log₂T))/R`` (convex) or ``αL``; PD-OCG ``L = ⌈√T⌉``,
``h = G√(15 L T)/R`` (Corollary 3.10's print ``√(15LTG/R)`` is dimensionally garbled; this is
the form its proof and PD-FTGL's analogue give) or ``L = T^{2/3} ln^{−2/3}T``, ``h = αL``; and
``h`` times a tuning multiplier ``h-scale``, as the paper's experiments do. ``G`` is the clip
``C``. The Laplace scale per coordinate comes from the learner's *own* ε
(:mod:`.wang_privacy`): the paper's calibration or the exact gossip-sensitivity one.

PD-OGD (Li et al. 2018, Wang et al.'s baseline): release ``ŵ = w + Lap(μ_t)^d``; ``b = Σ_j P_ij
ŵ_j`` (own release included); play ``x = Proj_K(b)`` (``b`` mixes noisy releases and may leave
``K``; projecting is post-processing, and with noise off ``b ∈ K`` so this is DOLA exactly);
``w⁺ = Proj_K(x − a_t g_clip(x))``, ``a_t = s₀R/(C√(t+1))``.
``μ_t`` from the learner's ε by basic composition over all ``T`` rounds (the paper's) or per
datum (both labelled).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from flwr_corrnoise.decentralized import wang_privacy as wp
from flwr_corrnoise.decentralized.chen_wang import count_zeroed
from flwr_corrnoise.decentralized.gossip import (
    block_length,
    gossip_step,
    mixing_matrix,
    theta_for,
)
from flwr_corrnoise.decentralized.graphs import Graph, second_singular_value
from flwr_corrnoise.decentralized.protocol import (
    Inbox,
    NodeAlgorithm,
    State,
    draw_laplace,
    node_seeds,
    register,
)
from flwr_corrnoise.decentralized.sets import ConstraintSet, L2Ball, make_set
from flwr_corrnoise.decentralized.tasks import Task, data_gradient
from flwr_corrnoise.decentralized.tree_laplace import tree_init, tree_insert

__all__ = ["PDFTGL", "PDOCG", "PDOGD", "conditional_gradient", "proximal_argmin"]

CALIBRATIONS = ("paper", "exact")


def proximal_argmin(K: ConstraintSet, zhat: np.ndarray, eta: float) -> np.ndarray:
    """``argmin_{x∈K} ⟨ẑ, x⟩ + (η/2)‖x‖² = Proj_K(−ẑ/η)`` per row."""
    return K.project(-np.asarray(zhat) / eta)


def conditional_gradient(K: ConstraintSet, zhat: np.ndarray, eta: float, x0: np.ndarray,
                         iters: int) -> np.ndarray:
    """Algorithm 4: ``iters`` Frank–Wolfe steps on ``F(x) = ⟨ẑ, x⟩ + (η/2)‖x‖²`` from ``x0``.

    The line search ``argmin_{σ∈[0,1]} F(x + σ(v − x))`` is exact for the quadratic:
    ``σ = clip(⟨∇F(x), x − v⟩ / (η‖v − x‖²), 0, 1)``.
    """
    x = np.asarray(x0, dtype=float).copy()
    warm = None  # consecutive gradients are close: each LMO starts from the last top vector
    for _ in range(int(iters)):
        g = zhat + eta * x
        v, warm = K.lmo_warm(g, warm)
        diff = v - x
        den = eta * np.einsum("kd,kd->k", diff, diff)
        num = -np.einsum("kd,kd->k", g, diff)
        sigma = np.clip(np.divide(num, den, out=np.zeros_like(num), where=den > 0), 0.0, 1.0)
        x = x + sigma[:, None] * diff
    return x


def _constraint_set(task: Task, cfg: Mapping[str, Any]) -> ConstraintSet:
    shape = getattr(task, "shape", None)
    kind = str(cfg.get("set", "nuclear" if shape is not None else "l2"))
    return make_set(kind, task.dim, float(cfg.get("set-size", 10.0)), shape,
                    lmo=str(cfg.get("lmo", "lanczos")))


class _Wang(NodeAlgorithm):
    """Shared machinery: mixing matrix, θ, the task, the set, the learner's own ε.

    No declared data bound is a privacy field here (contrast Chen & Wang's ``feature-bound``
    and ``clip``): the learner's own setting is its ε, and the Laplace scale is *calibrated*
    from it with ``G = C`` (and ``α``, ``R``, ``T``), while every per-example gradient is
    clipped to ``C`` — a malformed example counts as zero
    (:func:`~flwr_corrnoise.decentralized.tasks.data_gradient`) — so any ``C`` gives the
    same ε: a larger clip buys a larger scale, not a weaker guarantee.
    """

    privacy_fields: ClassVar[dict[str, int]] = {"epsilon": -1}

    def __init__(self, graph: Graph, task: Task, *, horizon: int, clip: float,
                 K: ConstraintSet | None = None, alpha: float = 0.0, P: np.ndarray | None = None,
                 theta_rule: str = "paper", default_epsilon: float = 10.0) -> None:
        super().__init__(graph, task.dim)
        if task.num_nodes != graph.num_nodes:
            raise ValueError(f"task has {task.num_nodes} learners, graph {graph.num_nodes}")
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"Wang et al.'s algorithms need a finite gradient clip C > 0 "
                             f"(G = C), got {clip!r}")
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"strong convexity α must be ≥ 0, got {alpha!r}")
        if int(horizon) < 1:
            raise ValueError(f"horizon T must be ≥ 1, got {horizon!r}")
        self.task, self.T, self.C, self.alpha = task, int(horizon), float(clip), float(alpha)
        self.K = K if K is not None else L2Ball(task.dim, 10.0)
        self.P = mixing_matrix(graph) if P is None else np.asarray(P, dtype=float)
        self.rho = 1.0 - second_singular_value(self.P)
        self.theta = theta_for(self.P, theta_rule)
        self.default_epsilon = float(default_epsilon)
        self.R = self.K.radius

    def default_privacy(self, nodes: np.ndarray) -> dict[str, np.ndarray]:
        return {"epsilon": np.full(np.asarray(nodes).size, self.default_epsilon)}

    def _epsilons(self, privacy: Mapping[str, np.ndarray], k: int) -> np.ndarray:
        eps = np.asarray(privacy["epsilon"], dtype=float).reshape(k)
        if np.any(np.isnan(eps)) or np.any(eps <= 0):
            raise ValueError(f"ε must be > 0 (inf turns the noise off), got {eps}")
        return eps

    def _batch_step(self, state: State) -> int:
        t = int(state["step"][0])
        if np.any(state["step"] != t):
            raise ValueError("learners in one batch must be at the same step")
        if t >= self.T:
            raise ValueError(f"step {t} is past the horizon T = {self.T}")
        return t

    def decision(self, state: State) -> np.ndarray:
        return state["x"]


class _Blocked(_Wang):
    """PD-FTGL and PD-OCG: blocks, block-decoupled gossip, a Laplace tree per learner."""

    local_dp = False
    #: the leaf inserted at the end of block z is d^{gossip_steps}(z−1)

    def __init__(self, graph: Graph, task: Task, *, horizon: int, clip: float,
                 block: int | None = None, gossip_steps: int | None = None,
                 h: float | None = None, h_scale: float = 1.0, calibration: str = "paper",
                 **kw: Any) -> None:
        super().__init__(graph, task, horizon=horizon, clip=clip, **kw)
        if calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")
        self.calibration = calibration
        self.L = int(block) if block else self.default_block()
        if not 1 <= self.L <= self.T:
            raise ValueError(f"block length L must be in 1..T, got {self.L}")
        eq7 = block_length(graph.num_nodes, self.T, self.rho) if self.rho > 0 else self.L
        steps = int(gossip_steps) if gossip_steps else self.default_gossip(eq7)
        self.gossip_steps = min(self.L, steps)
        self.h = (float(h) if h else self.default_h()) * float(h_scale)
        if not (math.isfinite(self.h) and self.h > 0):
            raise ValueError(f"h must be > 0, got {self.h!r}")
        self.blocks = self.T // self.L
        self.leaves = max(1, self.blocks - 1)
        self.delta_tot = wp.exact_sensitivity(self.P, self.gossip_steps, self.theta, self.C,
                                              self.dim)

    @abstractmethod
    def default_block(self) -> int:
        """The theorem's block length ``L`` for this algorithm."""

    def default_gossip(self, eq7: int) -> int:
        """Gossip steps per block: eq. (7)'s ``L`` (PD-OCG's ``L'``), capped at the block."""
        return eq7

    @abstractmethod
    def default_h(self) -> float:
        """The corollary's ``h`` (before the ``h-scale`` multiplier)."""

    # -- privacy -------------------------------------------------------------------------
    def scale_for(self, eps: float) -> float:
        """The learner's Laplace scale per coordinate from its own ε."""
        if self.calibration == "paper":
            return wp.paper_scale(self.dim, self.C, self.alpha, self.R, self.T, eps)
        return wp.exact_scale(self.delta_tot, self.leaves, eps)

    def epsilon(self, state: State, steps: int) -> dict[str, np.ndarray]:
        """ε per learner: Theorem 3.6's claim for its scale, the exact gossip-sensitivity
        accounting (assuming every learner uses its scale) and, when the batch holds the
        whole network, the exact guarantee of each learner's data under everyone's scales."""
        b = state["scale"]
        out = {
            wp.PAPER: np.array([wp.paper_epsilon(self.dim, self.C, self.alpha, self.R, self.T,
                                                 float(s)) for s in b]),
            wp.EXACT: np.array([wp.exact_epsilon(self.delta_tot, self.leaves, float(s))
                                for s in b]),
        }
        nodes = state["node"]
        if sorted(nodes.tolist()) == list(range(self.num_nodes)):
            full = np.empty(self.num_nodes)
            full[nodes] = b
            net = wp.network_epsilon(self.P, self.gossip_steps, self.theta, self.C, self.dim,
                                     self.leaves, full)
            out[wp.NETWORK] = net[nodes]
        return out

    # -- protocol ------------------------------------------------------------------------
    def init(self, nodes: np.ndarray, run_seed: int,
             privacy: Mapping[str, np.ndarray]) -> State:
        nodes = np.asarray(nodes, dtype=int)
        k = nodes.size
        eps = self._epsilons(privacy, k)
        zeros = np.zeros((k, self.dim))
        state = {
            "node": nodes.copy(),
            "step": np.zeros(k, dtype=np.int64),
            "rng": node_seeds(run_seed, nodes),
            "privacy_epsilon": eps.copy(),
            "scale": np.array([self.scale_for(float(e)) for e in eps]),
            "x": zeros.copy(),
            "played": zeros.copy(),
            "dsum": zeros.copy(),
            "gcur": zeros.copy(),
            "gprev": zeros.copy(),
            "zhat": zeros.copy(),
            "zeroed-data": np.zeros(k, dtype=np.int64),
        }
        state.update(tree_init(k, self.leaves, self.dim))
        return state

    def _gossiping(self, t: int) -> bool:
        z, k = t // self.L + 1, t % self.L
        return z >= 2 and k < self.gossip_steps

    def release(self, state: State) -> tuple[dict[str, np.ndarray], State]:
        t = self._batch_step(state)
        msg = state["gcur"].copy() if self._gossiping(t) else np.zeros_like(state["gcur"])
        return {"d": msg}, state

    def update(self, state: State, inbox: Inbox) -> State:
        t = self._batch_step(state)
        z, k = t // self.L + 1, t % self.L
        nodes, x = state["node"], state["x"]
        new = dict(state)
        X, y = self.task.batch(nodes, t)
        g, zeroed = data_gradient(self.task, x, X, y, self.C)  # a bad example: zero
        new.update(count_zeroed(state, zeroed))
        new["played"] = x.copy()
        new["dsum"] = state["dsum"] + (g - self.alpha * x)
        if self._gossiping(t):
            own = self.P[nodes, nodes][:, None] * state["gcur"]
            mixed = own + inbox.mix("d", inbox.weights(self.P))
            new["gprev"], new["gcur"] = state["gcur"], gossip_step(mixed, state["gprev"],
                                                                   self.theta)
        if k == self.L - 1:
            if z >= 2:
                new = self._end_of_block(new, z)
            new["gcur"], new["gprev"] = new["dsum"].copy(), new["dsum"].copy()
            new["dsum"] = np.zeros_like(new["dsum"])
        if not np.all(np.isfinite(new["x"])):
            raise FloatingPointError(f"non-finite decision at step {t}")
        new["step"] = state["step"] + 1
        return new

    def _tree(self, state: State) -> tuple[np.ndarray, State]:
        tree = {key: state[key] for key in ("tree_count", "tree_partial", "tree_noisy")}
        zhat, tree, words, _noise = tree_insert(tree, state["gcur"], state["scale"],
                                                state["rng"])
        return zhat, dict(state, **tree, rng=words, zhat=zhat)

    @abstractmethod
    def _end_of_block(self, state: State, z: int) -> State:
        """Insert the finished leaf and move to ``x(z+1)`` (the algorithms differ here)."""


@register("pd-ftgl")
class PDFTGL(_Blocked):
    """PD-FTGL (Algorithm 1): one projection per block."""

    name = "pd-ftgl"

    def default_block(self) -> int:
        return min(self.T, block_length(self.num_nodes, self.T, self.rho)) if self.rho > 0 \
            else self.T

    def default_h(self) -> float:
        if self.alpha > 0:
            return self.alpha * self.L
        return self.C * math.sqrt(14 * self.L * self.T * (2 + math.log2(self.T))) / self.R

    def _end_of_block(self, state: State, z: int) -> State:
        zhat, state = self._tree(state)
        eta = self.alpha * (z - 1) * self.L + 2 * self.h
        return dict(state, x=proximal_argmin(self.K, zhat, eta))

    @classmethod
    def from_config(cls, graph: Graph, task: Task, config: Mapping[str, Any]) -> PDFTGL:
        return cls(graph, task, **_common(task, config))


@register("pd-ocg")
class PDOCG(_Blocked):
    """PD-OCG (Algorithms 3–4): projection-free, ``cg-iters`` (default ``L``) LMO calls per
    block on the previous block's private sum."""

    name = "pd-ocg"

    def __init__(self, graph: Graph, task: Task, *, cg_iters: int | None = None,
                 **kw: Any) -> None:
        super().__init__(graph, task, **kw)
        self.cg_iters = int(cg_iters) if cg_iters else self.L

    def default_block(self) -> int:
        if self.alpha > 0 and self.T > 2:
            L = self.T ** (2 / 3) * math.log(self.T) ** (-2 / 3)
        else:
            L = math.sqrt(self.T)
        return max(1, min(self.T, math.ceil(L)))

    def default_h(self) -> float:
        if self.alpha > 0:
            return self.alpha * self.L
        return self.C * math.sqrt(15 * self.L * self.T) / self.R

    def _end_of_block(self, state: State, z: int) -> State:
        eta = self.alpha * (z - 2) * self.L + 2 * self.h
        x_next = conditional_gradient(self.K, state["zhat"], eta, state["x"], self.cg_iters)
        _zhat, state = self._tree(state)  # ẑ(z), used at the end of block z + 1
        return dict(state, x=x_next)

    @classmethod
    def from_config(cls, graph: Graph, task: Task, config: Mapping[str, Any]) -> PDOCG:
        cg = config.get("cg-iters")
        return cls(graph, task, cg_iters=None if cg in (None, "") else int(cg),
                   **_common(task, config))


def _common(task: Task, config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(config)

    def opt(key: str, cast: Any) -> Any:
        v = cfg.get(key)
        return None if v in (None, "", 0) else cast(v)

    return {
        "horizon": int(cfg.get("horizon", cfg.get("steps", getattr(task, "horizon", 100)))),
        "clip": float(cfg.get("clip", 1.0)),
        "K": _constraint_set(task, cfg),
        "alpha": float(cfg.get("alpha", 0.0)),
        "theta_rule": str(cfg.get("theta-rule", "paper")),
        "default_epsilon": float(cfg.get("epsilon", 10.0)),
        "block": opt("block-length", int),
        "gossip_steps": opt("gossip-steps", int),
        "h": opt("h", float),
        "h_scale": float(cfg.get("h-scale", 1.0)),
        "calibration": str(cfg.get("calibration", "paper")),
    }


@register("pd-ogd")
class PDOGD(_Wang):
    """PD-OGD: DOLA with the mixing matrix ``P`` and noise for (ε, 0) over all ``T`` rounds."""

    name = "pd-ogd"
    local_dp = True

    def __init__(self, graph: Graph, task: Task, *, step_scale: float = 1.0,
                 accounting: str = wp.OGD_COMPOSITION, **kw: Any) -> None:
        super().__init__(graph, task, **kw)
        self.factor = wp.ogd_scale_factor(accounting, self.T)
        self.accounting = accounting
        if not (math.isfinite(step_scale) and step_scale > 0):
            raise ValueError(f"step scale must be > 0, got {step_scale!r}")
        self.a0 = float(step_scale) * self.R / self.C

    def step_size(self, t: int | np.ndarray) -> np.ndarray | float:
        """``a_t = s₀R/(C√(t+1))`` (OGD's ``R/(G√t)``) used by the update at step ``t``."""
        return self.a0 / np.sqrt(np.asarray(t, dtype=float) + 1.0)

    def noise_scale(self, eps: np.ndarray, t: int) -> np.ndarray:
        """``μ_t = 2 a_{t−1} √d C · factor / ε`` (release 0 is data-independent; it gets μ_1)."""
        a = float(self.step_size(max(t - 1, 0)))
        with np.errstate(divide="ignore"):
            return np.where(np.isinf(eps), 0.0,
                            2 * a * math.sqrt(self.dim) * self.C * self.factor / eps)

    def init(self, nodes: np.ndarray, run_seed: int,
             privacy: Mapping[str, np.ndarray]) -> State:
        nodes = np.asarray(nodes, dtype=int)
        k = nodes.size
        eps = self._epsilons(privacy, k)
        zeros = np.zeros((k, self.dim))
        return {"node": nodes.copy(), "step": np.zeros(k, dtype=np.int64),
                "rng": node_seeds(run_seed, nodes), "privacy_epsilon": eps.copy(),
                "w": zeros.copy(), "noise": zeros.copy(), "x": zeros.copy(),
                "played": zeros.copy(), "zeroed-data": np.zeros(k, dtype=np.int64)}

    def release(self, state: State) -> tuple[dict[str, np.ndarray], State]:
        t = self._batch_step(state)
        mu = self.noise_scale(state["privacy_epsilon"], t)
        noise, words = draw_laplace(state["rng"], mu, self.dim)
        return {"w": state["w"] + noise}, dict(state, rng=words, noise=noise)

    def update(self, state: State, inbox: Inbox) -> State:
        t = self._batch_step(state)
        nodes = state["node"]
        own = self.P[nodes, nodes][:, None] * (state["w"] + state["noise"])
        b = own + inbox.mix("w", inbox.weights(self.P))
        # a decision must lie in K: b mixes *noisy* releases and can be far outside it, so the
        # learner plays Proj_K(b) — post-processing of releases, no privacy cost (noise off,
        # b ∈ K already and this is DOLA exactly)
        x = self.K.project(b)
        X, y = self.task.batch(nodes, t)
        g, zeroed = data_gradient(self.task, x, X, y, self.C)  # a bad example: zero
        w = self.K.project(x - self.step_size(t) * g)
        if not np.all(np.isfinite(w)):
            raise FloatingPointError(f"non-finite iterate at step {t}")
        return dict(state, w=w, x=x, played=x, step=state["step"] + 1,
                    **count_zeroed(state, zeroed))

    def epsilon(self, state: State, steps: int) -> dict[str, np.ndarray]:
        """Both accountings per learner over releases ``1..steps−1``."""
        out: dict[str, list[float]] = {wp.OGD_COMPOSITION: [], wp.OGD_PER_DATUM: []}
        ts = np.arange(1, max(int(steps), 1))
        a = np.asarray(self.step_size(ts - 1), dtype=float).reshape(-1)
        for e in state["privacy_epsilon"]:
            with np.errstate(divide="ignore"):
                mu = np.where(np.isinf(e), 0.0,
                              2 * a * math.sqrt(self.dim) * self.C * self.factor / e)
            res = wp.ogd_epsilon(a, mu, self.C, self.dim)
            for key in out:
                out[key].append(res[key])
        return {k: np.asarray(v) for k, v in out.items()}

    @classmethod
    def from_config(cls, graph: Graph, task: Task, config: Mapping[str, Any]) -> PDOGD:
        cfg = dict(config)
        common = _common(task, cfg)
        return cls(graph, task, horizon=common["horizon"], clip=common["clip"], K=common["K"],
                   alpha=common["alpha"], theta_rule=common["theta_rule"],
                   default_epsilon=common["default_epsilon"],
                   step_scale=float(cfg.get("step-scale", 1.0)),
                   accounting=str(cfg.get("ogd-accounting", wp.OGD_COMPOSITION)))
