"""Communication graphs and mixing matrices for decentralized (peer-to-peer) learning.

Both decentralized papers run learners on an undirected, connected graph and mix neighbours'
messages with a fixed matrix:

* Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized
  Online Learning" uses a symmetric, doubly stochastic ``P`` and its spectral gap ``ρ = 1 − σ₂(P)``
  (σ₂ the second largest singular value); we build ``P`` with Metropolis–Hastings weights, which are
  doubly stochastic on *any* undirected graph using only the two endpoint degrees (each node can
  compute its row from what its neighbours tell it);
* Chen & Wang, "Locally Differentially Private Distributed Online Learning with Guaranteed
  Optimality" uses a Laplacian-form ``W``: ``w_ij > 0`` on edges and ``w_ii = −Σ_{j≠i} w_ij`` (zero
  row sums); its ring experiments use ``w_ij = 0.3``; the classical mixing matrix of its baselines
  is ``A = I + W``.

Why no networkx in this module: the core must stay a dependency-light NumPy/SciPy layer (it is
imported by every Flower node), and the four topologies need a dozen lines each. networkx is the
better-kept tool for *exotic* graphs, so :meth:`Graph.from_networkx` accepts any networkx graph a
user built (duck-typed, networkx is not imported here), and our Watts–Strogatz generator follows
networkx's ``watts_strogatz_graph`` definition (ring lattice, then rewire each lattice edge
``(u, u+j)`` with probability ``p`` to a uniform non-neighbour), retrying with derived seeds until
the graph is connected, like ``connected_watts_strogatz_graph``; the tests compare degree
sequences and edge counts with networkx when it is installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Graph",
    "GraphError",
    "complete",
    "cycle",
    "eigenvalues",
    "from_adjacency",
    "from_edges",
    "is_doubly_stochastic",
    "laplacian_weights",
    "make_graph",
    "metropolis_hastings",
    "ring",
    "second_singular_value",
    "spectral_gap",
    "watts_strogatz",
]


class GraphError(ValueError):
    """A graph or mixing matrix that cannot be used (not symmetric, not connected, ...)."""


def _connected(adj: np.ndarray) -> bool:
    n = adj.shape[0]
    seen = np.zeros(n, dtype=bool)
    seen[0] = True
    frontier = [0]
    while frontier:
        nxt = np.flatnonzero(adj[frontier].any(axis=0) & ~seen)
        seen[nxt] = True
        frontier = list(nxt)
    return bool(seen.all())


@dataclass(frozen=True)
class Graph:
    """An undirected, connected, simple graph on nodes ``0..n−1``.

    ``adjacency`` is a read-only boolean ``n × n`` matrix, symmetric with an empty diagonal;
    construction validates it so that every consumer (mixing matrices, the relay's neighbour
    checks) can rely on it.
    """

    adjacency: np.ndarray
    name: str = "custom"
    _neighbors: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        adj = np.asarray(self.adjacency)
        if adj.ndim != 2 or adj.shape[0] != adj.shape[1]:
            raise GraphError(f"adjacency must be a square matrix, got shape {adj.shape}")
        if adj.shape[0] < 1:
            raise GraphError("a graph needs at least one node")
        if adj.dtype != bool:
            if not np.all(np.isfinite(adj.astype(float))):
                raise GraphError("adjacency has non-finite entries")
            if not np.all(np.isin(adj, (0, 1))):
                raise GraphError("adjacency must be 0/1 (use laplacian_weights for weights)")
            adj = adj.astype(bool)
        if not np.array_equal(adj, adj.T):
            raise GraphError("adjacency must be symmetric (the graph is undirected)")
        if adj.diagonal().any():
            raise GraphError("adjacency must have an empty diagonal (no self-loops)")
        if not _connected(adj):
            raise GraphError("graph is not connected: its learners cannot reach consensus")
        adj = adj.copy()
        adj.flags.writeable = False
        object.__setattr__(self, "adjacency", adj)
        object.__setattr__(
            self, "_neighbors", tuple(tuple(int(j) for j in np.flatnonzero(r)) for r in adj)
        )

    @property
    def num_nodes(self) -> int:
        return int(self.adjacency.shape[0])

    def neighbors(self, i: int) -> tuple[int, ...]:
        """The neighbours of node ``i`` (excluding ``i``), sorted ascending."""
        if not 0 <= int(i) < self.num_nodes:
            raise GraphError(f"node {i} is not in a graph of {self.num_nodes} nodes")
        return self._neighbors[int(i)]

    @property
    def degrees(self) -> np.ndarray:
        return self.adjacency.sum(axis=1).astype(int)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """Undirected edges ``(i, j)`` with ``i < j``."""
        i, j = np.nonzero(np.triu(self.adjacency, 1))
        return [(int(a), int(b)) for a, b in zip(i, j, strict=True)]

    @classmethod
    def from_networkx(cls, g: object, name: str = "networkx") -> Graph:
        """Build from a networkx graph (nodes relabelled ``0..n−1`` in sorted order)."""
        nodes = sorted(g.nodes())  # type: ignore[attr-defined]
        index = {v: k for k, v in enumerate(nodes)}
        adj = np.zeros((len(nodes), len(nodes)), dtype=bool)
        for u, v in g.edges():  # type: ignore[attr-defined]
            if u != v:
                adj[index[u], index[v]] = adj[index[v], index[u]] = True
        return cls(adj, name)


def from_adjacency(adjacency: np.ndarray | Sequence[Sequence[int]], name: str = "custom") -> Graph:
    """Any user adjacency (0/1 or bool, symmetric, connected)."""
    return Graph(np.asarray(adjacency), name)


def from_edges(num_nodes: int, edges: Iterable[tuple[int, int]], name: str = "custom") -> Graph:
    """A graph from an edge list on ``num_nodes`` nodes."""
    adj = np.zeros((num_nodes, num_nodes), dtype=bool)
    for i, j in edges:
        if not (0 <= i < num_nodes and 0 <= j < num_nodes):
            raise GraphError(f"edge ({i}, {j}) has a node outside 0..{num_nodes - 1}")
        if i != j:
            adj[i, j] = adj[j, i] = True
    return Graph(adj, name)


def _check_n(n: int, minimum: int = 1) -> int:
    if int(n) != n or n < minimum:
        raise GraphError(f"number of nodes must be an integer ≥ {minimum}, got {n}")
    return int(n)


def complete(n: int) -> Graph:
    """Every node talks to every other node."""
    n = _check_n(n)
    return Graph(~np.eye(n, dtype=bool), f"complete-{n}")


def ring(n: int) -> Graph:
    """The cycle ``0 − 1 − … − (n−1) − 0`` (for ``n = 2`` a single edge)."""
    n = _check_n(n, 2)
    adj = np.zeros((n, n), dtype=bool)
    idx = np.arange(n)
    adj[idx, (idx + 1) % n] = True
    adj[(idx + 1) % n, idx] = True
    np.fill_diagonal(adj, False)
    return Graph(adj, f"ring-{n}")


cycle = ring


def watts_strogatz(n: int, k: int, p: float, seed: int = 0, tries: int = 100) -> Graph:
    """A connected Watts–Strogatz small-world graph.

    Start from the ring lattice where each node links to its ``k // 2`` nearest neighbours on
    each side, then, for each lattice offset ``j = 1..k//2`` and each node ``u``, rewire the edge
    ``(u, u+j)`` with probability ``p`` to ``(u, w)``, ``w`` uniform among the nodes not yet
    adjacent to ``u`` (networkx's definition). Draws are repeated with seeds derived from
    ``seed`` until the graph is connected (the paper's Appendix B uses ``k = 6, p = 0.5``).
    """
    n = _check_n(n, 2)
    if int(k) != k or k < 2 or k >= n:
        raise GraphError(f"Watts–Strogatz degree k must be an integer in [2, n), got {k}")
    if not 0.0 <= p <= 1.0:
        raise GraphError(f"rewiring probability must be in [0, 1], got {p}")
    for attempt in range(tries):
        rng = np.random.default_rng([int(seed), attempt])
        adj = np.zeros((n, n), dtype=bool)
        for j in range(1, k // 2 + 1):
            for u in range(n):
                adj[u, (u + j) % n] = adj[(u + j) % n, u] = True
        for j in range(1, k // 2 + 1):
            for u in range(n):
                v = (u + j) % n
                if rng.random() < p and adj[u, v]:
                    candidates = np.flatnonzero(~adj[u])
                    candidates = candidates[candidates != u]
                    if candidates.size == 0:
                        continue
                    w = int(rng.choice(candidates))
                    adj[u, v] = adj[v, u] = False
                    adj[u, w] = adj[w, u] = True
        if _connected(adj):
            return Graph(adj, f"watts-strogatz-{n}-{k}-{p:g}")
    raise GraphError(f"no connected Watts–Strogatz graph in {tries} tries (n={n}, k={k}, p={p})")


def make_graph(kind: str, n: int, *, k: int = 6, p: float = 0.5, seed: int = 0) -> Graph:
    """Topology by name: ``complete``, ``ring``/``cycle``, ``watts-strogatz``."""
    kind = kind.lower().replace("_", "-")
    if kind == "complete":
        return complete(n)
    if kind in ("ring", "cycle"):
        return ring(n)
    if kind in ("watts-strogatz", "ws", "small-world"):
        if n <= 3:  # too small to rewire: the ring is the only connected 2-regular graph
            return ring(n)
        return watts_strogatz(n, min(k, n - 1), p, seed)
    raise GraphError(f"unknown graph {kind!r}; use complete, ring, cycle or watts-strogatz")


def metropolis_hastings(graph: Graph, lazy: bool = False) -> np.ndarray:
    """Metropolis–Hastings mixing matrix ``P``; ``lazy=True`` gives ``(I + P)/2``.

    ``P_ij = 1/(1 + max(d_i, d_j))`` on edges and ``P_ii = 1 − Σ_j P_ij``: symmetric and doubly
    stochastic on any undirected graph. The lazy version is also positive semidefinite, which
    Wang et al.'s accelerated gossip assumes (eigenvalues in [0, 1]).
    """
    deg = graph.degrees
    adj = graph.adjacency
    P = np.where(adj, 1.0 / (1.0 + np.maximum(deg[:, None], deg[None, :])), 0.0)
    np.fill_diagonal(P, 1.0 - P.sum(axis=1))
    if lazy:
        P = 0.5 * (np.eye(graph.num_nodes) + P)
    return P


def laplacian_weights(graph: Graph, weight: float | np.ndarray = 0.3) -> np.ndarray:
    """Chen & Wang's ``W``: ``w_ij = weight`` on edges, ``w_ii = −Σ_j w_ij`` (zero row sums).

    ``weight`` is a scalar or a symmetric ``n × n`` matrix of positive edge weights (entries
    off the edges are ignored). The classical mixing matrix of the baselines is ``I + W``
    (Chen & Wang's ring: 0.4 on the diagonal, 0.3 to each neighbour).
    """
    n = graph.num_nodes
    w = np.broadcast_to(np.asarray(weight, dtype=float), (n, n))
    if not np.all(np.isfinite(w)):
        raise GraphError("edge weights must be finite")
    if not np.allclose(w, w.T):
        raise GraphError("edge weights must be symmetric")
    if np.any(w[graph.adjacency] <= 0):
        raise GraphError("edge weights must be > 0 on every edge")
    W = np.where(graph.adjacency, w, 0.0)
    np.fill_diagonal(W, -W.sum(axis=1))
    return W


def _check_square(P: np.ndarray) -> np.ndarray:
    P = np.asarray(P, dtype=float)
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise GraphError(f"expected a square matrix, got shape {P.shape}")
    if not np.all(np.isfinite(P)):
        raise GraphError("matrix has non-finite entries")
    return P


def eigenvalues(P: np.ndarray) -> np.ndarray:
    """Eigenvalues of a symmetric matrix, descending."""
    P = _check_square(P)
    if not np.allclose(P, P.T, atol=1e-12):
        raise GraphError("eigenvalues() expects a symmetric matrix")
    return np.linalg.eigvalsh(P)[::-1]


def second_singular_value(P: np.ndarray) -> float:
    """σ₂(P): the second largest singular value (``0`` for a 1 × 1 matrix).

    For a symmetric doubly stochastic ``P`` the largest is 1 (the all-ones vector) and σ₂ is the
    largest ``|λ|`` over the other eigenvalues: the rate at which plain gossip ``x ← P x``
    contracts the disagreement ``x − mean(x)``.
    """
    P = _check_square(P)
    if P.shape[0] == 1:
        return 0.0
    return float(np.linalg.svd(P, compute_uv=False)[1])


def spectral_gap(P: np.ndarray) -> float:
    """ρ = 1 − σ₂(P), the quantity in Wang et al.'s bounds and in its block length ``L ∝ 1/√ρ``."""
    return 1.0 - second_singular_value(P)


def is_doubly_stochastic(P: np.ndarray, atol: float = 1e-12) -> bool:
    """Non-negative entries, rows and columns summing to one."""
    P = _check_square(P)
    return bool(
        np.all(-atol <= P)
        and np.allclose(P.sum(axis=0), 1.0, atol=atol)
        and np.allclose(P.sum(axis=1), 1.0, atol=atol)
    )
