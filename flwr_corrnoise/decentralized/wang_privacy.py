"""Paper 004's (ε, 0) calibration and the ε each calibration spends, labelled.

Neighbouring inputs: one loss ``f_{t,j}`` replaced (Definition 3.5); the output is *every*
learner's decisions over all ``T`` rounds. Conditioned on all earlier tree releases, the
decisions of block ``z`` are fixed, so the replaced loss changes only learner ``j``'s block sum
``d_j(z)``, by at most ``2G`` in ℓ2 (clipped gradients, ``G = C``; the ``−αx`` term is the same on
both sides) and ``2G√d`` in ℓ1. Block-decoupled gossip makes every learner's leaf a fixed linear
map of the block sums, ``D^L = M_L D^0`` (:mod:`.gossip`), so learner ``i``'s leaf moves by
``|M_L[i, j]|·2G√d`` in ℓ1 and, over the tree position shared by all learners,

    Δ_tot = 2G√d · max_j ‖M_L e_j‖₁            (exact, any L)

The leaf enters at most ``⌊log₂N⌋ + 1`` noisy nodes (``N = T/L − 1`` leaves), each ``Lap(b)^d``
per learner, so ``ε = (⌊log₂N⌋ + 1) Δ_tot / b`` — label :data:`EXACT`.

The paper's Theorem 3.6 / 3.9 calibration ``b = 6√d (G + αR)(2 + log₂T)/ε`` (its proof's
reading of a garbled print) bounds ``Δ_tot`` by ``6√d(G+αR)`` via Lemma D.3, valid only for
``L`` at least eq. (7)'s value, and the node count by ``2 + log₂T`` — label :data:`PAPER`. It is
roughly 3× more noise than needed; both are reported.

Heterogeneous scales: learner ``j``'s data reaches every learner's tree, so its guarantee is
``(⌊log₂N⌋+1)·2G√d·Σ_i |M_L[i, j]|/b_i`` — the *network* accountant (:func:`network_epsilon`);
with equal scales it equals the exact one. This is why 004 is DP of the decisions with
*trusted* neighbours and relay — not local DP: the gossip messages themselves are raw sums.

PD-OGD (Li et al. 2018, the paper's baseline): learner ``i`` releases ``ŵ = w + Lap(μ_t)^d``,
where ``w`` came from one clipped step of size ``a`` (ℓ1 sensitivity ``2aC√d``, projection is
non-expansive). The paper calibrates it by basic composition over all ``T`` rounds,
``μ_t = 2a√dCT/ε`` (:data:`OGD_COMPOSITION`). Conditioned on past releases a datum changes
exactly one release, so ``μ_t = 2a√dC/ε`` is already (ε, 0) over all rounds
(:data:`OGD_PER_DATUM`) — both are offered and labelled.
"""

from __future__ import annotations

import math

import numpy as np

from flwr_corrnoise.decentralized.gossip import gossip_polynomial
from flwr_corrnoise.decentralized.tree_laplace import max_nodes_per_leaf

__all__ = [
    "EXACT",
    "OGD_COMPOSITION",
    "OGD_PER_DATUM",
    "PAPER",
    "exact_epsilon",
    "exact_scale",
    "exact_sensitivity",
    "network_epsilon",
    "ogd_epsilon",
    "ogd_scale_factor",
    "paper_epsilon",
    "paper_scale",
]

PAPER = "paper-thm-3.6"
EXACT = "exact-gossip-sensitivity"
NETWORK = "exact-network"
OGD_COMPOSITION = "paper-basic-composition"
OGD_PER_DATUM = "per-datum"


def _check_eps(eps: float) -> float:
    if not (eps > 0) or math.isnan(eps):
        raise ValueError(f"ε must be > 0 (inf turns noise off), got {eps!r}")
    return float(eps)


def paper_scale(d: int, G: float, alpha: float, R: float, T: int, eps: float) -> float:
    """``b = 6√d (G + αR)(2 + log₂T)/ε`` (Theorems 3.6/3.9); 0 when ``ε = ∞``."""
    eps = _check_eps(eps)
    return 0.0 if math.isinf(eps) else 6 * math.sqrt(d) * (G + alpha * R) * (2 + math.log2(T)) / eps


def paper_epsilon(d: int, G: float, alpha: float, R: float, T: int, b: float) -> float:
    """The ε Theorem 3.6 claims for scale ``b``."""
    return math.inf if b == 0 else 6 * math.sqrt(d) * (G + alpha * R) * (2 + math.log2(T)) / b


def exact_sensitivity(P: np.ndarray, steps: int, theta: float, G: float, d: int) -> float:
    """``Δ_tot = 2G√d · max_j ‖M_L e_j‖₁`` (ℓ1 change over one tree position of all learners)."""
    M = gossip_polynomial(P, steps, theta)
    return 2 * G * math.sqrt(d) * float(np.abs(M).sum(axis=0).max())


def exact_epsilon(delta_tot: float, leaves: int, b: float) -> float:
    """``(⌊log₂N⌋ + 1) Δ_tot / b`` for a tree of ``N`` leaves."""
    if b == 0:
        return math.inf
    return max_nodes_per_leaf(max(1, leaves)) * delta_tot / b


def exact_scale(delta_tot: float, leaves: int, eps: float) -> float:
    """The scale making :func:`exact_epsilon` equal ``ε``."""
    eps = _check_eps(eps)
    return 0.0 if math.isinf(eps) else max_nodes_per_leaf(max(1, leaves)) * delta_tot / eps


def network_epsilon(P: np.ndarray, steps: int, theta: float, G: float, d: int, leaves: int,
                    scales: np.ndarray) -> np.ndarray:
    """Per data owner ``j``: ``(⌊log₂N⌋+1)·2G√d·Σ_i |M_L[i, j]| / b_i`` (heterogeneous scales)."""
    M = np.abs(gossip_polynomial(P, steps, theta))
    b = np.asarray(scales, dtype=float)
    with np.errstate(divide="ignore"):
        inv = np.where(b > 0, 1.0 / np.where(b > 0, b, 1.0), np.inf)
    contrib = np.where(M > 0, M * inv[:, None], 0.0)
    return max_nodes_per_leaf(max(1, leaves)) * 2 * G * math.sqrt(d) * contrib.sum(axis=0)


def ogd_scale_factor(accounting: str, T: int) -> float:
    """Multiplier of ``2a√dC/ε`` in PD-OGD's per-round Laplace scale."""
    if accounting == OGD_COMPOSITION:
        return float(T)
    if accounting == OGD_PER_DATUM:
        return 1.0
    raise ValueError(f"unknown PD-OGD accounting {accounting!r}; "
                     f"use {OGD_COMPOSITION!r} or {OGD_PER_DATUM!r}")


def ogd_epsilon(steps_sizes: np.ndarray, scales: np.ndarray, C: float, d: int
                ) -> dict[str, float]:
    """ε of PD-OGD releases ``1..`` (release ``t`` has sensitivity ``2 a_{t−1} C√d`` and scale
    ``scales[t−1]``): the sum over releases (basic composition) and the max (per datum)."""
    a = np.asarray(steps_sizes, dtype=float)
    mu = np.asarray(scales, dtype=float)
    if a.size == 0:
        return {OGD_COMPOSITION: 0.0, OGD_PER_DATUM: 0.0}
    with np.errstate(divide="ignore", invalid="ignore"):
        per = np.where(mu > 0, 2 * a * C * math.sqrt(d) / np.where(mu > 0, mu, 1.0), np.inf)
    per = np.where(a == 0, 0.0, per)
    return {OGD_COMPOSITION: float(per.sum()), OGD_PER_DATUM: float(per.max())}
