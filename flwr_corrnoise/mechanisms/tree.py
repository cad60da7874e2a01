"""Binary-tree factorizations (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online
Federated Learning With Correlated Noise", Example i and Fig. 2) and Honaker's efficient tree.

The tree's nodes are the dyadic intervals ``[m·2^h, (m+1)·2^h)`` that lie inside
``[0, N)``; node ``(h, m)`` holds the sum of the inputs in its interval plus its own
Gaussian noise. ``C`` (``W×N``) maps inputs to node sums; each input is in at most
``⌊log₂N⌋ + 1`` nodes, which is the sensitivity² (paper eq. (6)).

Nodes are numbered in *completion order*: at step ``k`` the leaf ``k`` completes first,
then every ancestor whose interval ends at ``k``, from the bottom up. A stream draws one
noise vector per node in exactly this order, so ``ξ`` row ``w`` always belongs to node ``w``.

* **vanilla** (Dwork et al.; Chan et al.): prefix sum ``k`` is the sum of the noisy nodes of
  the dyadic cover of ``[0, k+1)`` (one node per set bit of ``k+1``), so
  ``‖b_k‖² = popcount(k+1)``.
* **efficient** (Honaker 2015, tensorflow_privacy's ``EfficientTreeAggregator``): every
  completed node is re-estimated as the inverse-variance weighted mean of its own noisy sum
  and the sum of its two children's estimates. A level-``h`` estimate has variance
  ``v_h = 1 / (1 + 1/(2·v_{h−1}))``, ``v_0 = 1`` (unit noise std); prefix ``k``'s variance is
  the sum of ``v_h`` over its cover. Same ``C``, same sensitivity, smaller error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .base import Factorization
from .registry import register
from .streaming import Array, ArrayOps, Draw, Saved, StreamKernel, shared_base


def node_list(n: int) -> list[tuple[int, int]]:
    """All tree nodes ``(level, end_step)`` in completion order for horizon ``n``.

    ``end_step`` is the last leaf of the node's interval; node ``(h, k)`` covers
    ``[k + 1 − 2^h, k]``.
    """
    nodes: list[tuple[int, int]] = []
    for k in range(n):
        h = 0
        while True:
            nodes.append((h, k))
            if (k + 1) % (2 ** (h + 1)) != 0:
                break
            h += 1
    return nodes


def num_nodes(n: int) -> int:
    """``W = Σ_h ⌊N / 2^h⌋``: the number of noise vectors a tree stream draws in total."""
    total, size = 0, 1
    while size <= n:
        total += n // size
        size *= 2
    return total


def cover_levels(m: int) -> list[int]:
    """Levels of the dyadic cover of the prefix ``[0, m)``, from the largest node down."""
    return [h for h in range(m.bit_length() - 1, -1, -1) if (m >> h) & 1]


def efficient_weights(max_level: int) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, var)`` per level for Honaker's estimator at unit noise std.

    ``alpha[h]`` is the weight of a level-``h`` node's own noisy value in its estimate
    (``1 − alpha[h]`` goes to the sum of the children's estimates); ``var[h]`` the
    estimate's variance. Inverse-variance weighting of two independent unbiased estimates
    (own: variance 1; children: ``2·var[h−1]``) gives ``var[h] = 1/(1 + 1/(2·var[h−1]))`` and
    ``alpha[h] = var[h]``.
    """
    var = np.ones(max_level + 1)
    for h in range(1, max_level + 1):
        var[h] = 1.0 / (1.0 + 1.0 / (2.0 * var[h - 1]))
    return var.copy(), var


class BinaryTree(Factorization):
    """The binary tree, vanilla or efficient (Honaker)."""

    stream_kind = "tree"

    def __init__(self, n: int, efficient: bool = False) -> None:
        super().__init__(n)
        self.efficient = efficient
        self.name = "efficient-tree" if efficient else "tree"
        self.max_level = self.n.bit_length() - 1
        if efficient:
            self.alpha, self.level_var = efficient_weights(self.max_level)
        else:
            self.alpha = np.ones(self.max_level + 1)
            self.level_var = np.ones(self.max_level + 1)

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"alpha": self.alpha}

    def column_norms(self) -> np.ndarray:
        return self._column_norms(self.n)

    def _column_norms(self, k: int) -> np.ndarray:
        # leaf j lies in node (h, m = j >> h), which has completed by step k − 1 (and fits
        # inside the horizon) iff (m + 1)·2^h ≤ k
        j = np.arange(k)
        count = np.zeros(k)
        for h in range(k.bit_length()):
            count += (((j >> h) + 1) << h) <= k
        return np.sqrt(count)

    def prefix_sensitivity(self, k: int) -> float:
        return float(np.max(self._column_norms(self._check_prefix(k))))

    def encoder_gram(self, steps: int) -> np.ndarray:
        # X_st = the number of nodes released by ``steps`` that hold both leaves s and t:
        # node (h, m) holds leaves [m·2^h, (m+1)·2^h) and is released once (m+1)·2^h ≤ steps
        steps = self._check_prefix(steps)
        j = np.arange(steps)
        X = np.zeros((steps, steps))
        for h in range(steps.bit_length()):
            m = j >> h
            done = ((m + 1) << h) <= steps
            X += (m[:, None] == m[None, :]) & done[:, None]
        return X

    def row_errors(self) -> np.ndarray:
        return np.array(
            [sum(self.level_var[h] for h in cover_levels(k + 1)) for k in range(self.n)]
        )

    def drawn_nodes(self) -> np.ndarray:
        """Rows of ``ξ`` (node indices, completion order) that a stream actually draws.

        Why not all of them: in the *vanilla* tree a prefix sum only uses the nodes of its
        dyadic cover, and a node enters a cover only if it is the largest node completing
        at its step; the leaf and the smaller ancestors completing at the same step have
        zero weight in every row of ``B``. Their noise could never be released, so the
        stream skips drawing it: one draw per step instead of two on average, the same
        distribution of everything released (and the sensitivity, computed on all of
        ``C``, is unchanged or conservative). The efficient tree re-estimates every node
        from its children, so it draws them all.
        """
        nodes = node_list(self.n)
        if self.efficient:
            return np.arange(len(nodes))
        last = {k: w for w, (_, k) in enumerate(nodes)}  # the top node completing at k
        return np.array([last[k] for k in range(self.n)])

    def node_index(self) -> dict[tuple[int, int], int]:
        """Map ``(level, end_step)`` to the node's row in ``C`` / ``ξ``."""
        return {node: w for w, node in enumerate(node_list(self.n))}

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        nodes = node_list(self.n)
        index = {node: w for w, node in enumerate(nodes)}
        W = len(nodes)
        C = np.zeros((W, self.n))
        # coefficient of every node's own noise in that node's estimate
        est = np.zeros((W, W))
        for w, (h, k) in enumerate(nodes):
            C[w, k + 1 - 2**h : k + 1] = 1.0
            est[w, w] = self.alpha[h]
            if h > 0:
                left = index[(h - 1, k - 2 ** (h - 1))]
                right = index[(h - 1, k)]
                est[w] += (1.0 - self.alpha[h]) * (est[left] + est[right])
        B = np.zeros((self.n, W))
        for k in range(self.n):
            start = 0
            for h in cover_levels(k + 1):
                end = start + 2**h - 1
                B[k] += est[index[(h, end)]]
                start = end + 1
        return B, C

    def _make_stream_kernel(self) -> StreamKernel:
        return TreeKernel(self.efficient, self.alpha)


@dataclass
class TreeState:
    """The dyadic cover of the steps so far: its ``levels`` (largest first) and the node
    estimates ``rows`` (one ``d``-vector each)."""

    levels: list[int] = field(default_factory=list)
    rows: list[Array] = field(default_factory=list)
    #: the stacked state whose columns ``rows`` are (``streaming.shared_base``)
    shared: tuple[TreeState, int, int] | None = None


class TreeKernel(StreamKernel):
    """The binary tree's dyadic cover (vanilla or Honaker's efficient estimator).

    Leaf ``step`` completes, then every ancestor whose interval ends there. The efficient
    tree draws each one's own noise in that order (the node order of
    ``BinaryTree.matrices()``); the vanilla tree draws only the largest, the one node that
    enters the dyadic cover (``BinaryTree.drawn_nodes`` says why). State: at most
    ``⌊log₂N⌋ + 1`` node estimates, serialized as ``levels`` and ``rows``.
    """

    kind = "tree"

    def __init__(self, efficient: bool, alpha: np.ndarray) -> None:
        self.efficient = efficient
        self.alpha = [float(a) for a in alpha]

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> TreeState:
        return TreeState(levels=list(levels), rows=list(rows))

    def next(self, state: TreeState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, TreeState]:
        # the new cover: the lists copied (O(log N)), the estimates shared — they are
        # replaced, never written in place, so ``state`` stays as it was
        levels, rows = list(state.levels), list(state.rows)
        est = draw() if self.efficient else None
        level = 0
        removed: Array = None
        while levels and levels[-1] == level:
            levels.pop()
            left = rows.pop()
            if removed is None:
                removed = ops.copy(left)
            else:
                removed += left
            if self.efficient:
                own = draw()
                alpha = self.alpha[level + 1]
                est += left
                est *= 1.0 - alpha
                own *= alpha
                est += own
            level += 1
        if est is None:
            est = draw()
        levels.append(level)
        rows.append(est)
        # a fresh array: the caller scales it in place, and `est` is kept as state
        e = ops.copy(est) if removed is None else ops.subtract(est, removed, out=removed)
        return e, TreeState(levels=levels, rows=rows)

    def save(self, state: TreeState) -> Saved:
        return list(state.levels), list(state.rows)

    def check(self, state: TreeState, step: int, dim: int) -> None:
        if state.levels != cover_levels(step) or len(state.rows) != len(state.levels):
            raise ValueError("tree noise state does not match its step")

    def peak_rows(self, horizon: int) -> int:
        # the cover after step k − 1 is that of [0, k): popcount(k) nodes
        return max(bin(k).count("1") for k in range(horizon + 1))

    def stack(self, ops: ArrayOps, states: list[TreeState], dim: int) -> TreeState:
        """No copy when ``states`` are the column views :meth:`unstack` handed out and
        none has moved since (estimates are replaced, never written in place, so views
        are safe); else the default copy."""
        base = shared_base(states)
        return base if base is not None else super().stack(ops, states, dim)

    def unstack(self, ops: ArrayOps, state: TreeState, count: int, dim: int) -> list[TreeState]:
        return [TreeState(levels=list(state.levels),
                          rows=[r[i * dim:(i + 1) * dim] for r in state.rows],
                          shared=(state, i, count)) for i in range(count)]


register("tree", "binary tree (Zhang et al., Example i, Fig. 2)",
         build=lambda n: BinaryTree(n, efficient=False))
register("efficient-tree", "binary tree with Honaker's efficient estimator",
         build=lambda n: BinaryTree(n, efficient=True))
