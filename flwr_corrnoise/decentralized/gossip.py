"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") accelerated gossip (Liu & Morse 2011), block-decoupled as PD-FTGL uses it.

Within block ``z`` every learner runs ``L`` steps of eq. (5) on the *previous* block's sums:

    d_i^{k+1} = (1 + θ) Σ_j P_ij d_j^k − θ d_i^{k−1},   d^0 = d^{−1} = d_i(z−1).

Stacking the learners as rows, ``D^k = M_k(P) D^0`` with the *gossip polynomial*
``M_{−1} = M_0 = I``, ``M_{k+1} = (1+θ) P M_k − θ M_{k−1}``. Why this matters:

* ``1ᵀ M_k = 1ᵀ`` for a doubly stochastic ``P`` (the recursion's coefficients sum to one), so
  the network mean of the block sums is preserved *exactly* — PD-FTGL's leaves
  ``d_i^L(z−1)`` sum to the true block gradient sum of all learners;
* on the disagreement subspace every eigenvalue ``λ`` of ``P`` evolves by the two-term
  recurrence ``r² − (1+θ)λ r + θ = 0``, whose roots have modulus ``√θ`` when complex; with
  ``θ = 1/(1 + √(1−σ₂²))`` (eq. (7) as printed) that gives the paper's contraction
  ``‖D^L − D̄‖_F ≤ √14 (1 − (1 − 1/√2)√ρ)^L ‖D^0 − D̄‖_F`` (Wan et al. 2024, Lemma 3);
* the gossip is restarted at every block (``d^0 = d^{−1}``) — *block-decoupled* — so each
  block's gossip output is a fixed linear function ``M_L(P)`` of that block's sums only, which
  is what lets the tree-based private sum (:mod:`.tree_laplace`) work on it and what makes the
  exact sensitivity ``max_j ‖M_L e_j‖₁`` (:mod:`.wang_privacy`) computable.

``P`` must be symmetric, doubly stochastic and positive semidefinite (Assumption 3.4):
:func:`mixing_matrix` gives Metropolis–Hastings weights (``J/n`` on the complete graph, which is
PSD) and their lazy version ``(I + P)/2`` on any other graph.

Pure NumPy; the per-node step :func:`gossip_step` is what both engines call.
"""

from __future__ import annotations

import math

import numpy as np

from flwr_corrnoise.decentralized.graphs import (
    Graph,
    GraphError,
    is_doubly_stochastic,
    metropolis_hastings,
    second_singular_value,
)

__all__ = [
    "THETA_RULES",
    "block_length",
    "check_mixing",
    "contraction_bound",
    "gossip",
    "gossip_polynomial",
    "gossip_step",
    "mixing_matrix",
    "theta_for",
]

#: ``paper``: θ = 1/(1+√(1−σ₂²)) as printed in eqs. (7)/(10); ``chebyshev``: FastMix's
#: θ = (1−s)/(1+s), s = √(1−σ₂²) (faster, same mean preservation)
THETA_RULES = ("paper", "chebyshev")


def check_mixing(P: np.ndarray, atol: float = 1e-10) -> np.ndarray:
    """Validate Assumption 3.4 (symmetric, doubly stochastic, PSD, σ₂ < 1); return ``P``."""
    P = np.asarray(P, dtype=float)
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise GraphError(f"mixing matrix must be square, got shape {P.shape}")
    if not np.all(np.isfinite(P)):
        raise GraphError("mixing matrix has non-finite entries")
    if not np.allclose(P, P.T, atol=atol):
        raise GraphError("mixing matrix must be symmetric")
    if not is_doubly_stochastic(P, atol=atol):
        raise GraphError("mixing matrix must be doubly stochastic with non-negative entries")
    if np.linalg.eigvalsh(P).min() < -atol:
        raise GraphError("mixing matrix must be positive semidefinite (Wang et al., "
                         "Assumption 3.4); use the lazy version (I + P)/2")
    if P.shape[0] > 1 and second_singular_value(P) >= 1 - atol:
        raise GraphError("σ₂(P) must be < 1 (a connected graph)")
    return P


def mixing_matrix(graph: Graph) -> np.ndarray:
    """Metropolis–Hastings weights if PSD (the complete graph: ``J/n``), else the lazy version.

    Why not always lazy: on the complete graph MH is already ``J/n`` (σ₂ = 0, one gossip step
    averages exactly), and the paper's experiments use exactly that matrix.
    """
    P = metropolis_hastings(graph)
    if np.linalg.eigvalsh(P).min() < -1e-12:
        P = metropolis_hastings(graph, lazy=True)
    return check_mixing(P)


def theta_for(P: np.ndarray, rule: str = "paper") -> float:
    """The momentum θ of eq. (5) from σ₂(P) (see :data:`THETA_RULES`)."""
    s = math.sqrt(max(0.0, 1.0 - second_singular_value(P) ** 2))
    if rule == "paper":
        return 1.0 / (1.0 + s)
    if rule == "chebyshev":
        return (1.0 - s) / (1.0 + s)
    raise ValueError(f"unknown θ rule {rule!r}; use one of {THETA_RULES}")


def block_length(n: int, T: int, rho: float) -> int:
    """``L = ⌈4 ln(nT√(14n)) / √ρ⌉`` (eq. (7); PD-OCG's ``L′`` of eq. (10))."""
    if n < 1 or T < 1:
        raise ValueError(f"need n ≥ 1 and T ≥ 1, got n={n}, T={T}")
    if not (0 < rho <= 1):
        raise ValueError(f"spectral gap ρ must be in (0, 1], got {rho!r}")
    return max(1, math.ceil(4.0 * math.log(n * T * math.sqrt(14 * n)) / math.sqrt(rho)))


def contraction_bound(rho: float, steps: int | np.ndarray) -> np.ndarray | float:
    """``√14 (1 − (1 − 1/√2)√ρ)^L``: the stated bound on ``‖D^L − D̄‖_F / ‖D^0 − D̄‖_F``."""
    return math.sqrt(14.0) * (1.0 - (1.0 - 1.0 / math.sqrt(2.0)) * math.sqrt(rho)) ** np.asarray(
        steps, dtype=float)


def gossip_step(mixed: np.ndarray, previous: np.ndarray, theta: float) -> np.ndarray:
    """One step of eq. (5) for a batch of nodes: ``(1+θ)·mixed − θ·previous``.

    ``mixed[k] = Σ_j P_ij d_j^k`` (own term included) and ``previous[k] = d_i^{k−1}``; the
    caller forms ``mixed`` from its neighbours' messages (the relay or in-process inbox).
    """
    return (1.0 + theta) * mixed - theta * previous


def gossip(P: np.ndarray, D0: np.ndarray, steps: int, theta: float) -> np.ndarray:
    """``steps`` accelerated gossip steps on the stacked sums ``D0 [n, ...]`` (reference)."""
    P = np.asarray(P, dtype=float)
    prev, cur = D0.copy(), D0.copy()
    flat = (D0.shape[0], -1)
    for _ in range(int(steps)):
        nxt = gossip_step((P @ cur.reshape(flat)).reshape(D0.shape), prev, theta)
        prev, cur = cur, nxt
    return cur


def gossip_polynomial(P: np.ndarray, steps: int, theta: float) -> np.ndarray:
    """``M_L(P)`` with ``D^L = M_L D^0`` (``M_{−1} = M_0 = I``)."""
    P = np.asarray(P, dtype=float)
    return gossip(P, np.eye(P.shape[0]), steps, theta)
