"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") (ε, 0) calibration and the ε each calibration spends, labelled.

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
with equal scales it equals the exact one. This is why Wang et al.'s algorithms are DP of the
decisions with *trusted* neighbours and relay — not local DP: the gossip messages themselves are
raw sums.

PD-OGD (Li et al. 2018, the paper's baseline): learner ``i`` releases ``ŵ = w + Lap(μ_t)^d``,
where ``w`` came from one clipped step of size ``a`` (ℓ1 sensitivity ``2aC√d``, projection is
non-expansive). The paper calibrates it by basic composition over all ``T`` rounds,
``μ_t = 2a√dCT/ε`` (:data:`OGD_COMPOSITION`). Conditioned on past releases a datum changes
exactly one release, so ``μ_t = 2a√dC/ε`` is already (ε, 0) over all rounds
(:data:`OGD_PER_DATUM`) — both are offered and labelled.

Every label is a release *description* (``*_release(s)``: the sensitivity bound, the node
count, the neighbouring relation), composed by one accountant,
:class:`~flwr_corrnoise.accounting.BasicComposition`; calibrations ask it for the scale
factor that makes the description's ε exactly the learner's own.
"""

from __future__ import annotations

import math

import numpy as np

from flwr_corrnoise.accounting import (
    BasicComposition,
    LaplaceRelease,
    LaplaceSeries,
    NoRelease,
    PerDatumLaplace,
    Release,
    SelfComposed,
)
from flwr_corrnoise.decentralized.gossip import gossip_polynomial
from flwr_corrnoise.decentralized.tree_laplace import max_nodes_per_leaf

__all__ = [
    "EXACT",
    "OGD_COMPOSITION",
    "OGD_PER_DATUM",
    "PAPER",
    "exact_epsilon",
    "exact_release",
    "exact_scale",
    "exact_sensitivity",
    "network_epsilon",
    "network_releases",
    "ogd_epsilon",
    "ogd_releases",
    "ogd_scale_factor",
    "paper_epsilon",
    "paper_release",
    "paper_scale",
]

PAPER = "paper-thm-3.6"
EXACT = "exact-gossip-sensitivity"
NETWORK = "exact-network"
OGD_COMPOSITION = "paper-basic-composition"
OGD_PER_DATUM = "per-datum"

#: every label here is pure ε by basic composition; they differ in the description
ACCOUNTANT = BasicComposition()


def _check_eps(eps: float) -> float:
    if not (eps > 0) or math.isnan(eps):
        raise ValueError(f"ε must be > 0 (inf turns noise off), got {eps!r}")
    return float(eps)


def paper_release(d: int, G: float, alpha: float, R: float, T: int, b: float) -> LaplaceRelease:
    """Theorem 3.6's description: the learner's whole tree output as one Laplace release of
    ℓ1 sensitivity ``6√d (G + αR)(2 + log₂T)`` (Lemma D.3's ``Δ_tot`` bound times its node
    count bound) and scale ``b``."""
    return LaplaceRelease(6 * math.sqrt(d) * (G + alpha * R) * (2 + math.log2(T)), b)


def paper_scale(d: int, G: float, alpha: float, R: float, T: int, eps: float) -> float:
    """``b = 6√d (G + αR)(2 + log₂T)/ε`` (Theorems 3.6/3.9); 0 when ``ε = ∞``."""
    eps = _check_eps(eps)
    if math.isinf(eps):
        return 0.0
    return ACCOUNTANT.scale_for(paper_release(d, G, alpha, R, T, 1.0), eps)


def paper_epsilon(d: int, G: float, alpha: float, R: float, T: int, b: float) -> float:
    """The ε Theorem 3.6 claims for scale ``b``."""
    return math.inf if b == 0 else ACCOUNTANT.epsilon(paper_release(d, G, alpha, R, T, b))


def exact_sensitivity(P: np.ndarray, steps: int, theta: float, G: float, d: int) -> float:
    """``Δ_tot = 2G√d · max_j ‖M_L e_j‖₁`` (ℓ1 change over one tree position of all learners)."""
    M = gossip_polynomial(P, steps, theta)
    return 2 * G * math.sqrt(d) * float(np.abs(M).sum(axis=0).max())


def exact_release(delta_tot: float, leaves: int, b: float) -> SelfComposed:
    """The exact description: a leaf lies in ``⌊log₂N⌋ + 1`` noisy nodes of a tree of ``N``
    leaves, each a Laplace release of ``Δ_tot`` at scale ``b``."""
    return SelfComposed(LaplaceRelease(delta_tot, b), max_nodes_per_leaf(max(1, leaves)))


def exact_epsilon(delta_tot: float, leaves: int, b: float) -> float:
    """``(⌊log₂N⌋ + 1) Δ_tot / b`` for a tree of ``N`` leaves."""
    if b == 0:
        return math.inf
    return ACCOUNTANT.epsilon(exact_release(delta_tot, leaves, b))


def exact_scale(delta_tot: float, leaves: int, eps: float) -> float:
    """The scale making :func:`exact_epsilon` equal ``ε``."""
    eps = _check_eps(eps)
    if math.isinf(eps):
        return 0.0
    return ACCOUNTANT.scale_for(exact_release(delta_tot, leaves, 1.0), eps)


def network_releases(P: np.ndarray, steps: int, theta: float, G: float, d: int, leaves: int,
                     scales: np.ndarray) -> list[Release]:
    """Per data owner ``j``: its leaf reaches learner ``i``'s tree moved by
    ``2G√d·|M_L[i, j]|`` (ℓ1), released there at ``b_i`` — in ``⌊log₂N⌋+1`` nodes."""
    M = np.abs(gossip_polynomial(P, steps, theta))
    b = np.asarray(scales, dtype=float)
    count = max_nodes_per_leaf(max(1, leaves))
    return [SelfComposed(LaplaceSeries(2 * G * math.sqrt(d) * M[:, j], b), count)
            for j in range(M.shape[1])]


def network_epsilon(P: np.ndarray, steps: int, theta: float, G: float, d: int, leaves: int,
                    scales: np.ndarray) -> np.ndarray:
    """Per data owner ``j``: ``(⌊log₂N⌋+1)·2G√d·Σ_i |M_L[i, j]| / b_i`` (heterogeneous scales)."""
    return np.array([ACCOUNTANT.epsilon(r)
                     for r in network_releases(P, steps, theta, G, d, leaves, scales)])


def ogd_scale_factor(accounting: str, T: int) -> float:
    """Multiplier of ``2a√dC/ε`` in PD-OGD's per-round Laplace scale."""
    if accounting == OGD_COMPOSITION:
        return float(T)
    if accounting == OGD_PER_DATUM:
        return 1.0
    raise ValueError(f"unknown PD-OGD accounting {accounting!r}; "
                     f"use {OGD_COMPOSITION!r} or {OGD_PER_DATUM!r}")


def ogd_releases(steps_sizes: np.ndarray, scales: np.ndarray, C: float, d: int
                 ) -> dict[str, Release]:
    """PD-OGD's releases ``0..n`` (release ``t ≥ 1`` has sensitivity ``2 a_{t−1} C√d`` and
    scale ``scales[t−1]``; release 0 is data-independent and drawn at ``scales[0]``), both
    labelled ways: every release charged (composition), or a datum — which enters one
    update and shows in the next release only, since the learner mixes released values —
    charged where it shows (per datum)."""
    a = np.asarray(steps_sizes, dtype=float).reshape(-1)
    mu = np.asarray(scales, dtype=float).reshape(-1)
    if a.size == 0:
        return {OGD_COMPOSITION: NoRelease(), OGD_PER_DATUM: NoRelease()}
    sens = 2 * a * C * math.sqrt(d)
    first = mu[:1]
    return {
        OGD_COMPOSITION: LaplaceSeries(np.concatenate([[0.0], sens]),
                                       np.concatenate([first, mu])),
        OGD_PER_DATUM: PerDatumLaplace(np.concatenate([sens, [0.0]]), np.zeros(a.size + 1),
                                       np.concatenate([first, mu])),
    }


def ogd_epsilon(steps_sizes: np.ndarray, scales: np.ndarray, C: float, d: int
                ) -> dict[str, float]:
    """ε of PD-OGD releases ``1..`` (release ``t`` has sensitivity ``2 a_{t−1} C√d`` and scale
    ``scales[t−1]``): the sum over releases (basic composition) and the max (per datum)."""
    return {label: ACCOUNTANT.epsilon(release)
            for label, release in ogd_releases(steps_sizes, scales, C, d).items()}
