"""Graphs and mixing matrices against closed forms (and networkx where installed)."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.decentralized import graphs as G  # noqa: N812


@pytest.mark.parametrize("n", [3, 4, 5, 8, 13])
def test_ring_mh_eigenvalues_closed_form(n: int) -> None:
    P = G.metropolis_hastings(G.ring(n))
    assert G.is_doubly_stochastic(P)
    assert np.allclose(P, P.T)
    k = np.arange(n)
    expected = np.sort(1 / 3 + 2 / 3 * np.cos(2 * np.pi * k / n))[::-1]
    assert np.allclose(G.eigenvalues(P), expected, atol=1e-12)
    sigma2 = max(abs(1 / 3 + 2 / 3 * np.cos(2 * np.pi * kk / n)) for kk in range(1, n))
    assert G.second_singular_value(P) == pytest.approx(sigma2, abs=1e-12)
    assert G.spectral_gap(P) == pytest.approx(1 - sigma2, abs=1e-12)


@pytest.mark.parametrize("n", [4, 7, 10])
def test_lazy_ring_gap_is_one_minus_cos_form(n: int) -> None:
    """Lazy MH on a ring: eigenvalues 2/3 + 1/3 cos(2πk/n) ≥ 1/3, so ρ = (1 − cos(2π/n))/3."""
    P = G.metropolis_hastings(G.ring(n), lazy=True)
    assert G.is_doubly_stochastic(P)
    assert np.all(G.eigenvalues(P) >= -1e-12)  # PSD, as Wang et al.'s gossip needs
    assert G.spectral_gap(P) == pytest.approx((1 - np.cos(2 * np.pi / n)) / 3, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_complete_graph_mh_is_uniform_averaging(n: int) -> None:
    P = G.metropolis_hastings(G.complete(n))
    assert np.allclose(P, np.full((n, n), 1 / n))
    assert G.spectral_gap(P) == pytest.approx(1.0)


def test_mh_doubly_stochastic_on_irregular_graphs() -> None:
    star = G.from_edges(6, [(0, j) for j in range(1, 6)])
    for graph in (star, G.watts_strogatz(20, 6, 0.5, seed=3)):
        for lazy in (False, True):
            P = G.metropolis_hastings(graph, lazy=lazy)
            assert G.is_doubly_stochastic(P)
            assert np.all(P[~graph.adjacency & ~np.eye(graph.num_nodes, dtype=bool)] == 0)
            assert 0 < G.spectral_gap(P) <= 1
    # star: MH weights 1/6 on every edge; centre keeps 1/6, leaves 5/6
    P = G.metropolis_hastings(star)
    assert P[0, 0] == pytest.approx(1 / 6) and P[1, 1] == pytest.approx(5 / 6)


def test_laplacian_weights_paper_ring() -> None:
    W = G.laplacian_weights(G.ring(5), 0.3)
    assert np.allclose(W.sum(axis=1), 0) and np.allclose(W, W.T)
    assert np.allclose(np.diag(W), -0.6)
    A = np.eye(5) + W
    assert np.allclose(np.diag(A), 0.4) and G.is_doubly_stochastic(A)
    # eigenvalues of W: 0.6 (cos(2πk/5) − 1)
    expected = np.sort(0.6 * (np.cos(2 * np.pi * np.arange(5) / 5) - 1))[::-1]
    assert np.allclose(G.eigenvalues(W), expected)
    with pytest.raises(G.GraphError):
        G.laplacian_weights(G.ring(5), -0.1)


def test_neighbors_and_validation() -> None:
    g = G.ring(5)
    assert g.neighbors(0) == (1, 4) and g.neighbors(2) == (1, 3)
    assert g.edges == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(G.GraphError, match="symmetric"):
        G.from_adjacency([[0, 1], [0, 0]])
    with pytest.raises(G.GraphError, match="connected"):
        G.from_adjacency(np.zeros((3, 3)))
    with pytest.raises(G.GraphError, match="self-loops"):
        G.from_adjacency(np.ones((2, 2)))
    with pytest.raises(G.GraphError, match="square"):
        G.from_adjacency(np.zeros((2, 3)))
    with pytest.raises(G.GraphError):
        g.neighbors(5)
    with pytest.raises(G.GraphError):
        G.make_graph("torus", 4)
    with pytest.raises(G.GraphError, match="non-finite"):
        G.second_singular_value(np.array([[np.nan]]))


def test_watts_strogatz_reproducible_and_like_networkx() -> None:
    a = G.watts_strogatz(30, 6, 0.5, seed=1)
    b = G.watts_strogatz(30, 6, 0.5, seed=1)
    assert np.array_equal(a.adjacency, b.adjacency)
    assert len(a.edges) == 30 * 3  # rewiring keeps the edge count
    assert not np.array_equal(a.adjacency, G.watts_strogatz(30, 6, 0.5, seed=2).adjacency)
    lattice = G.watts_strogatz(30, 6, 0.0)
    assert np.all(lattice.degrees == 6)
    nx = pytest.importorskip("networkx")
    ref = G.Graph.from_networkx(nx.watts_strogatz_graph(30, 6, 0.0))
    assert np.array_equal(ref.adjacency, lattice.adjacency)
    ours = np.mean([G.watts_strogatz(30, 6, 0.5, seed=s).degrees.std() for s in range(20)])
    theirs = np.mean(
        [np.std([d for _, d in nx.connected_watts_strogatz_graph(30, 6, 0.5, seed=s).degree()])
         for s in range(20)]
    )
    assert abs(ours - theirs) < 0.35  # same rewiring law → similar degree spread
