"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") Algorithm 2 (PrivateSum, Smith & Thakurta 2013): the binary-tree private prefix
sum with *Laplace* node noise, kept as per-node arrays so that it lives in a learner's state
(in-process engine and Flower ``context.state`` alike).

The tree's nodes are the dyadic intervals of the project's binary tree
(:mod:`flwr_corrnoise.mechanisms.tree`: :func:`~flwr_corrnoise.mechanisms.tree.node_list`,
:func:`~flwr_corrnoise.mechanisms.tree.cover_levels`). When leaf ``t`` (1-based) arrives, the
nodes whose interval ends at ``t`` complete — the path from the leaf up to the first left
child Λ (Algorithm 2, lines 3–7). Only the *largest* of them (level ``v₂(t)``, the number of
trailing zero bits of ``t``) can ever be released: the smaller ones are covered by it in every
later prefix. So, as in the project's Gaussian tree streams, one Laplace vector is drawn per
leaf, for that node; every released quantity has the law of Algorithm 2, which draws (and
never uses) noise for the smaller ones too. Each node's noise is drawn once, when it completes.

The output for ``t`` is the sum of the noisy nodes of the dyadic cover of ``[1, t]`` — one
per set bit of ``t`` (``popcount(t)`` nodes) — so ``ẑ_t − Σ_{s≤t} w_s`` is a sum of exactly
``popcount(t)`` independent ``Lap(b)^d`` vectors. Each leaf lies in at most ``⌊log₂N⌋ + 1``
nodes of a tree with ``N`` leaves: the factor in the ε accounting (:mod:`.wang_privacy`).

State per learner (leading node axis ``k``): ``count [k]`` leaves inserted, ``partial [k, H, d]``
the raw running sum of the in-progress node at each level, ``noisy [k, H, d]`` the noisy value of
the latest completed node at each level, ``H = ⌊log₂N⌋ + 1``.
"""

from __future__ import annotations

import numpy as np

from flwr_corrnoise.decentralized.protocol import State, draw_laplace
from flwr_corrnoise.mechanisms.tree import cover_levels, node_list

__all__ = [
    "leaf_node_counts",
    "max_nodes_per_leaf",
    "tree_capacity",
    "tree_init",
    "tree_insert",
    "tree_levels",
]


def tree_levels(capacity: int) -> int:
    """``H = ⌊log₂N⌋ + 1`` levels for ``N`` leaves."""
    if int(capacity) < 1:
        raise ValueError(f"a tree needs at least one leaf, got capacity {capacity!r}")
    return int(capacity).bit_length()


def max_nodes_per_leaf(capacity: int) -> int:
    """Closed form: a leaf lies in at most ``⌊log₂N⌋ + 1`` nodes (one per level)."""
    return tree_levels(capacity)


def leaf_node_counts(capacity: int, released_only: bool = True) -> np.ndarray:
    """Brute force: for every leaf, the number of tree nodes (dyadic intervals completed
    within ``N`` leaves) containing it. ``released_only`` counts only the nodes this stream
    draws noise for and can release (the top node completing at each step)."""
    nodes = node_list(int(capacity))
    if released_only:
        top: dict[int, int] = {}
        for h, k in nodes:
            top[k] = max(top.get(k, -1), h)
        nodes = [(h, k) for k, h in top.items()]
    counts = np.zeros(int(capacity), dtype=int)
    for h, k in nodes:
        counts[k + 1 - 2**h : k + 1] += 1
    return counts


def tree_capacity(state: State, prefix: str = "tree_") -> int:
    """Largest ``N`` the state's tree accepts (``2^H − 1``: every count with ``H`` bits)."""
    return 2 ** state[prefix + "partial"].shape[1] - 1


def tree_init(k: int, capacity: int, dim: int, prefix: str = "tree_") -> State:
    """Empty trees for ``k`` learners, ``capacity`` leaves of ``dim`` coordinates each."""
    H = tree_levels(capacity)
    return {
        prefix + "count": np.zeros(k, dtype=np.int64),
        prefix + "partial": np.zeros((k, H, dim)),
        prefix + "noisy": np.zeros((k, H, dim)),
    }


def tree_insert(
    state: State, leaf: np.ndarray, scale: np.ndarray, rng_words: np.ndarray,
    prefix: str = "tree_",
) -> tuple[np.ndarray, State, np.ndarray, np.ndarray]:
    """Insert one leaf per learner and return the private prefix sums.

    ``leaf [k, d]``, ``scale [k]`` the learner's own Laplace scale per coordinate,
    ``rng_words`` its generator. Returns ``(ẑ [k, d], new tree state, new rng words, the noise
    drawn for the completed node [k, d])``. All learners of a batch must hold the same count
    (they insert synchronously, once per block).
    """
    count = state[prefix + "count"]
    t = int(count[0]) + 1
    if np.any(count != count[0]):
        raise ValueError("learners in one batch must have inserted the same number of leaves")
    partial, noisy = state[prefix + "partial"].copy(), state[prefix + "noisy"].copy()
    H = partial.shape[1]
    if t.bit_length() > H:
        raise ValueError(f"tree is full: leaf {t} exceeds its capacity of {2**H - 1} leaves")
    leaf = np.asarray(leaf, dtype=float)
    if leaf.shape != (partial.shape[0], partial.shape[2]) or not np.all(np.isfinite(leaf)):
        raise ValueError(f"leaf must be finite with shape {(partial.shape[0], partial.shape[2])}")
    partial += leaf[:, None, :]
    top = (t & -t).bit_length() - 1  # v₂(t): level of the largest node completing now
    noise, words = draw_laplace(rng_words, np.asarray(scale, dtype=float), partial.shape[2])
    noisy[:, top] = partial[:, top] + noise
    partial[:, : top + 1] = 0.0
    out = np.zeros_like(leaf)
    for h in cover_levels(t):  # largest node first, a fixed summation order
        out = out + noisy[:, h]
    new = {prefix + "count": count + 1, prefix + "partial": partial, prefix + "noisy": noisy}
    return out, new, words, noise
