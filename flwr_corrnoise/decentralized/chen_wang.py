"""Chen & Wang, "Locally Differentially Private Distributed Online Learning with Guaranteed
Optimality", Algorithm 1: locally differentially private distributed online learning with growing
Laplace noise, a decaying coupling and all-history gradients.

Every node ``i`` at step ``t`` (0-based):

* releases ``y_t^i = θ_t^i + ζ_t^i``, ``ζ_t^i ~ Lap(ϱ_t^i)^dim``, ``ϱ_t^i = ϱ₀^i (t+1)^{ς^i}``
  (Assumption 4 writes ``ϱ₀ = σ/√2``) — the *only* thing it ever sends, so every message is
  an ε-LDP release and neither neighbours nor the relay learn more;
* computes ``d_t^i = (1/(t+1)) Σ_{k≤t} ∇l(θ_t^i, ξ_k^i)`` exactly (all data so far at the
  current parameter — eqs. (5)–(7)'s recursive shortcut is exact only for quadratic losses);
* ``θ̂ = θ_t^i + γ_t Σ_{j∈N_i} w_ij (y_t^j − θ_t^i) − λ_t d_t^i``, ``θ_{t+1}^i = Proj_Θ(θ̂)``,
  ``Θ`` the ℓ2 ball of radius ``R`` (the paper's experiments: ``10⁵``).

``γ_t = γ₀ (t+1)^{−u}``, ``λ_t = λ₀ (t+1)^{−v}``; :class:`StepSizes` gives both of the
paper's rules: the *global-parameter* ones of Theorems 1/2 (need W's eigenvalues, L, μ) and
the *parameter-free* ones of Sec. V (Theorems 3/4: any λ₀, γ₀ > 0, only exponent conditions),
which a node can pick without knowing anything about the rest of the network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from flwr_corrnoise.decentralized.chen_wang_privacy import (
    BOUND_FIELDS,
    CONTRACTIVE,
    THM5,
    TIGHT,
    NodeRelease,
    clipped,
    enforced_bounds,
    node_constants,
    node_epsilons,
    record_bounds,
)
from flwr_corrnoise.decentralized.graphs import Graph, eigenvalues, laplacian_weights
from flwr_corrnoise.decentralized.protocol import (
    Inbox,
    NodeAlgorithm,
    State,
    draw_laplace,
    node_seeds,
    register,
)
from flwr_corrnoise.decentralized.tasks import Task, data_gradient

__all__ = ["ChenWang", "StepSizes", "count_zeroed", "no_clip_is_inf", "project_ball"]


def no_clip_is_inf(name: str, raw: Any) -> float:
    """A privacy setting's value from a config: a ``clip`` of ``None``/``""``/``0`` is no
    clip (``from_config``'s reading), ``inf`` — the weakest, so a proposal to turn it off
    is refused like any larger bound."""
    if name == "clip" and raw in (None, "", 0, 0.0):
        return math.inf
    return float(raw)


def count_zeroed(state: State, zeroed: np.ndarray) -> dict[str, np.ndarray]:
    """The state's running count of samples whose gradient counted as zero (local
    diagnostics: the state never leaves the node; a state from before the count starts
    at 0)."""
    before = state.get("zeroed-data", np.zeros(len(zeroed), dtype=np.int64))
    return {"zeroed-data": before + np.asarray(zeroed, dtype=np.int64)}


def project_ball(theta: np.ndarray, radius: float) -> np.ndarray:
    """Row-wise Euclidean projection onto ``{‖θ‖ ≤ radius}``."""
    if math.isinf(radius):
        return theta
    norms = np.linalg.norm(theta, axis=-1, keepdims=True)
    return theta * np.minimum(1.0, radius / np.maximum(norms, 1e-300))


@dataclass(frozen=True)
class StepSizes:
    """``λ_t = λ₀(t+1)^{−v}`` (gradient step) and ``γ_t = γ₀(t+1)^{−u}`` (coupling)."""

    lambda0: float = 1.0
    v: float = 0.77
    gamma0: float = 1.0
    u: float = 0.65
    rule: str = "parameter-free"

    def __post_init__(self) -> None:
        for name in ("lambda0", "v", "gamma0", "u"):
            val = getattr(self, name)
            if not (math.isfinite(val) and val >= 0):
                raise ValueError(f"step-size parameter {name} must be finite and ≥ 0, got {val}")

    def lam(self, t: int | np.ndarray) -> np.ndarray | float:
        return self.lambda0 * (np.asarray(t, dtype=float) + 1.0) ** (-self.v)

    def gamma(self, t: int | np.ndarray) -> np.ndarray | float:
        return self.gamma0 * (np.asarray(t, dtype=float) + 1.0) ** (-self.u)

    @classmethod
    def parameter_free(cls, lambda0: float = 1.0, gamma0: float = 1.0, u: float = 0.65,
                       v: float = 0.77) -> StepSizes:
        """Sec. V (Theorems 3/4): any positive λ₀, γ₀; only ½ < u < v < 1 matters."""
        if not (lambda0 > 0 and gamma0 > 0):
            raise ValueError("λ₀ and γ₀ must be > 0")
        return cls(lambda0, v, gamma0, u, "parameter-free")

    @classmethod
    def global_parameters(cls, W: np.ndarray, L: float, mu: float = 0.0, *, u: float = 0.65,
                          v: float = 0.77, kappa: float = 0.0, D: float = 1.0) -> StepSizes:
        """Theorem 1 (μ > 0): ``γ₀ = 1/(3|δ_m|)``, ``λ₀ = γ₀|δ₂|μ/(μ² + 8L²)``; Theorem 2
        (μ = 0): ``λ₀ = |δ₂|γ₀ / (2(L² + κ² + D²))``. ``δ₂`` is W's largest non-zero and
        ``δ_m`` its smallest eigenvalue (both ≤ 0 for a Laplacian-form W; the paper prints the
        bounds with signs that only make sense as absolute values)."""
        ev = eigenvalues(W)  # descending: 0 = δ₁ ≥ δ₂ ≥ … ≥ δ_m
        if abs(ev[0]) > 1e-9 or ev.size < 2:
            raise ValueError("W must be Laplacian-form (zero row sums, eigenvalues ≤ 0)")
        delta2, delta_m = abs(ev[1]), abs(ev[-1])
        if delta2 <= 1e-12:
            raise ValueError("W's graph is disconnected (δ₂ = 0)")
        gamma0 = 1.0 / (3.0 * delta_m)
        if mu > 0:
            lambda0 = gamma0 * delta2 * mu / (mu**2 + 8 * L**2)
        else:
            lambda0 = delta2 * gamma0 / (2 * (L**2 + kappa**2 + D**2))
        return cls(lambda0, v, gamma0, u, "global-strongly-convex" if mu > 0 else "global-convex")

    def violated_conditions(self, varsigma_max: float = 0.0, strongly_convex: bool = True
                            ) -> list[str]:
        """The paper's conditions on the exponents that these settings break (empty if none).

        Assumption 4: ``max ς + ½ < u < v < 1``; Theorem 2/4 (convex): ``(1+2u)/3 < v``.
        The paper's own mushrooms run (u = 0.65, ς up to 0.15) sits *on* the boundary.
        """
        out = []
        if not varsigma_max + 0.5 < self.u:
            out.append(f"max ς + 1/2 < u fails ({varsigma_max:g} + 0.5 ≥ {self.u:g})")
        if not self.u < self.v < 1:
            out.append(f"u < v < 1 fails (u={self.u:g}, v={self.v:g})")
        if not strongly_convex and not (1 + 2 * self.u) / 3 < self.v:
            out.append(f"(1+2u)/3 < v fails ({(1 + 2 * self.u) / 3:g} ≥ {self.v:g})")
        return out

    def rate_beta(self, varsigma: float, strongly_convex: bool = True) -> float:
        """Theorem 1/3: ``β = min{1 − v, 2u − 2ς − 1}``; Theorem 2/4: ``β = (1 − v)/2``."""
        if strongly_convex:
            return min(1 - self.v, 2 * self.u - 2 * varsigma - 1)
        return (1 - self.v) / 2


class ChenWang(NodeAlgorithm):
    """Chen & Wang's Algorithm 1 as per-node update rules (see the module docstring)."""

    name = "chen-wang"
    local_dp = True
    #: ϱ₀ and ς, the node's own: larger = more noise; and the declared data bounds its ε
    #: is computed from (feature bound, clip), also its own: smaller = more private
    privacy_fields: ClassVar[dict[str, int]] = {"noise-scale": +1, "noise-exponent": +1,
                                                **BOUND_FIELDS}
    bound_fields: ClassVar[frozenset[str]] = frozenset(BOUND_FIELDS)

    def __init__(self, graph: Graph, task: Task, steps: StepSizes, *,
                 W: np.ndarray | None = None, radius: float = 1e5, clip: float | None = None,
                 init_scale: float = 0.0, default_noise_scale: float = 1.0,
                 default_noise_exponent: float = 0.1,
                 default_exponent_step: float = 0.01) -> None:
        super().__init__(graph, task.dim)
        if task.num_nodes != graph.num_nodes:
            raise ValueError(f"task has {task.num_nodes} nodes, graph {graph.num_nodes}")
        self.task = task
        self.steps = steps
        self.W = laplacian_weights(graph, 0.3) if W is None else np.asarray(W, dtype=float)
        if self.W.shape != (graph.num_nodes,) * 2:
            raise ValueError("W must be num_nodes × num_nodes")
        if not (radius > 0):
            raise ValueError("radius must be > 0")
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise ValueError("clip must be finite and > 0")
        self.radius = float(radius)
        self.clip = clip
        self.init_scale = float(init_scale)
        self.default_noise = (float(default_noise_scale), float(default_noise_exponent),
                              float(default_exponent_step))

    # -- construction from config (CLI, Flower) -------------------------------------------
    @classmethod
    def from_config(cls, graph: Graph, task: Task, config: Mapping[str, Any]) -> ChenWang:
        cfg = dict(config)
        steps = StepSizes(float(cfg.get("lambda0", 1.0)), float(cfg.get("v", 0.77)),
                          float(cfg.get("gamma0", 1.0)), float(cfg.get("u", 0.65)))
        clip = cfg.get("clip")
        return cls(graph, task, steps, W=laplacian_weights(graph, float(cfg.get("w", 0.3))),
                   radius=float(cfg.get("radius", 1e5)),
                   clip=None if clip in (None, "", 0, 0.0) else float(clip),
                   init_scale=float(cfg.get("init-scale", 0.0)),
                   default_noise_scale=float(cfg.get("noise-scale", 1.0)),
                   default_noise_exponent=float(cfg.get("noise-exponent", 0.1)),
                   default_exponent_step=float(cfg.get("noise-exponent-step", 0.01)))

    def default_privacy(self, nodes: np.ndarray) -> dict[str, np.ndarray]:
        """Chen & Wang's heterogeneous setting: node ``i`` (0-based) gets ``ς = ς₀ +
        step·(i+1)``."""
        b0, s0, ds = self.default_noise
        nodes = np.asarray(nodes, dtype=float)
        return {"noise-scale": np.full(nodes.size, b0), "noise-exponent": s0 + ds * (nodes + 1),
                **enforced_bounds(self, nodes.size)}

    def privacy_value(self, name: str, raw: Any) -> float:
        return no_clip_is_inf(name, raw)

    # -- the protocol ---------------------------------------------------------------------
    def init(self, nodes: np.ndarray, run_seed: int,
             privacy: Mapping[str, np.ndarray]) -> State:
        nodes = np.asarray(nodes, dtype=int)
        words = node_seeds(run_seed, nodes)
        theta = np.zeros((nodes.size, self.dim))
        if self.init_scale > 0:  # "θ₀ random in Θ", from a generator apart from the noise's
            for k, i in enumerate(nodes):
                gen = np.random.default_rng([int(run_seed), int(i), 0x7E7A])
                theta[k] = gen.normal(0.0, self.init_scale / math.sqrt(self.dim), self.dim)
        scale = np.asarray(privacy["noise-scale"], dtype=float).reshape(nodes.size)
        expo = np.asarray(privacy["noise-exponent"], dtype=float).reshape(nodes.size)
        if np.any(scale < 0) or not np.all(np.isfinite(scale)) or not np.all(np.isfinite(expo)):
            raise ValueError("noise scale must be finite and ≥ 0, the exponent finite")
        return {
            "node": nodes.copy(),
            "theta": project_ball(theta, self.radius),
            "step": np.zeros(nodes.size, dtype=np.int64),
            "rng": words,
            "noise": np.zeros((nodes.size, self.dim)),
            "privacy_noise-scale": scale.copy(),
            "privacy_noise-exponent": expo.copy(),
            **record_bounds(self, privacy, nodes.size),
            "zeroed-data": np.zeros(nodes.size, dtype=np.int64),
        }

    def noise_scale(self, state: State) -> np.ndarray:
        """ϱ_t per node at each node's current step."""
        t = state["step"].astype(float)
        return state["privacy_noise-scale"] * (t + 1.0) ** state["privacy_noise-exponent"]

    def release(self, state: State) -> tuple[dict[str, np.ndarray], State]:
        noise, words = draw_laplace(state["rng"], self.noise_scale(state), self.dim)
        new = dict(state, rng=words, noise=noise)
        return {"y": state["theta"] + noise}, new

    def update(self, state: State, inbox: Inbox) -> State:
        t = int(state["step"][0])
        if np.any(state["step"] != t):
            raise ValueError("nodes in one batch must be at the same step")
        theta, nodes = state["theta"], state["node"]
        X, y = self.task.history(nodes, t)
        d, zeroed = data_gradient(self.task, theta, X, y, self.clip)  # bad datum: zero
        w = inbox.weights(self.W)
        wsum = np.zeros(theta.shape[0])
        for s in range(w.shape[1]):
            wsum = wsum + w[:, s]
        consensus = inbox.mix("y", w) - wsum[:, None] * theta
        new_theta = theta + self.steps.gamma(t) * consensus - self.steps.lam(t) * d
        if not np.all(np.isfinite(new_theta)):
            raise FloatingPointError(f"non-finite parameters at step {t}")
        return dict(state, theta=project_ball(new_theta, self.radius), step=state["step"] + 1,
                    **count_zeroed(state, zeroed))

    def decision(self, state: State) -> np.ndarray:
        return state["theta"]

    # -- privacy: this algorithm describes its releases, the accountant composes them ---------
    def node_releases(self, state: State) -> list[NodeRelease]:
        """What the accountant reads of each node in ``state``: the step sizes, its own
        ``|w_ii|`` and the network's smallest, the declared constants its state records
        (:func:`~.chen_wang_privacy.node_constants`), the task's strong convexity and its
        noise — settings only, never data."""
        w_diag = np.abs(np.diag(self.W))
        w_bar = float(w_diag.min())
        mu = float(getattr(self.task, "strong_convexity", 0.0))
        out = []
        for k, node in enumerate(state["node"]):
            C, L = node_constants(self, state, k)
            out.append(NodeRelease(self.steps, w_self=float(w_diag[int(node)]), L=L, C=C,
                                   dim=self.dim,
                                   noise_scale=float(state["privacy_noise-scale"][k]),
                                   exponent=float(state["privacy_noise-exponent"][k]),
                                   w_bar=w_bar, mu=mu))
        return out

    def accountants(self, state: State) -> list[str]:
        """The labelled bounds that hold for ``state``'s nodes: eq. (22) and Theorem 5(i)
        always, the contractive one only for an unclipped, convex task (``task.convex``)."""
        labels = [TIGHT, THM5]
        if not clipped(self, state) and getattr(self.task, "convex", False):
            labels.append(CONTRACTIVE)
        return labels

    def epsilon(self, state: State, steps: int) -> dict[str, np.ndarray]:
        """ε per node after ``steps`` releases, under every label of :meth:`accountants`."""
        return node_epsilons(self.node_releases(state), steps, self.accountants(state))


@register("chen-wang")
def _build(graph: Graph, task: Task, config: Mapping[str, Any]) -> ChenWang:
    return ChenWang.from_config(graph, task, config)
