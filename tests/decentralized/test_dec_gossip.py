"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") accelerated gossip: mean preserved exactly, contraction at the stated rate."""

import math

import numpy as np
import pytest

from flwr_corrnoise.decentralized.gossip import (
    block_length,
    check_mixing,
    contraction_bound,
    gossip,
    gossip_polynomial,
    mixing_matrix,
    theta_for,
)
from flwr_corrnoise.decentralized.graphs import (
    GraphError,
    complete,
    metropolis_hastings,
    ring,
    spectral_gap,
    watts_strogatz,
)

GRAPHS = [complete(9), ring(8), ring(25), watts_strogatz(16, 6, 0.5, seed=1)]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: f"{g.name}{g.num_nodes}")
def test_mean_preserved_and_contraction_rate(graph):
    P = mixing_matrix(graph)
    rho = spectral_gap(P)
    theta = theta_for(P)
    rng = np.random.default_rng(0)
    D0 = rng.normal(size=(graph.num_nodes, 7))
    mean = D0.mean(axis=0)
    err0 = np.linalg.norm(D0 - mean)
    for L in (1, 2, 5, 10, 30, 80):
        DL = gossip(P, D0, L, theta)
        np.testing.assert_allclose(DL.mean(axis=0), mean, rtol=0, atol=1e-12)
        assert np.linalg.norm(DL - mean) <= contraction_bound(rho, L) * err0 * (1 + 1e-9)
    # and it actually contracts geometrically (the bound is not vacuous)
    assert np.linalg.norm(gossip(P, D0, 200, theta) - mean) < 1e-3 * err0


def test_polynomial_columns_sum_to_one_and_match_recursion():
    P = mixing_matrix(ring(6))
    theta = theta_for(P)
    M = gossip_polynomial(P, 7, theta)
    np.testing.assert_allclose(M.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(M.sum(axis=1), 1.0, atol=1e-12)
    # independent closed form: M_k = Σ over eigenvalues of the scalar recursion
    lam, V = np.linalg.eigh(P)
    m_prev, m_cur = np.ones_like(lam), np.ones_like(lam)
    for _ in range(7):
        m_prev, m_cur = m_cur, (1 + theta) * lam * m_cur - theta * m_prev
    np.testing.assert_allclose(M, (V * m_cur) @ V.T, atol=1e-12)


def test_complete_graph_theta_half_rate_sqrt_half():
    P = mixing_matrix(complete(5))
    np.testing.assert_allclose(P, np.full((5, 5), 0.2))
    theta = theta_for(P)
    assert theta == pytest.approx(0.5)
    # disagreement evolves as e_{k+1} = −θ e_{k−1}: exactly √θ per step on average
    D0 = np.arange(5.0)[:, None]
    e = [np.linalg.norm(gossip(P, D0, k, theta) - 2.0) for k in (0, 2, 4)]
    np.testing.assert_allclose(e[1] / e[0], 0.5, rtol=1e-12)
    np.testing.assert_allclose(e[2] / e[1], 0.5, rtol=1e-12)


def test_block_length_eq7_and_chebyshev_faster():
    assert block_length(9, 150000, 1.0) == math.ceil(4 * math.log(9 * 150000 * math.sqrt(126)))
    P = mixing_matrix(ring(20))
    rho = spectral_gap(P)
    assert block_length(20, 1000, rho) > block_length(20, 1000, 1.0)
    D0 = np.random.default_rng(1).normal(size=(20, 3))
    err_paper = np.linalg.norm(gossip(P, D0, 40, theta_for(P)) - D0.mean(0))
    err_cheb = np.linalg.norm(gossip(P, D0, 40, theta_for(P, "chebyshev")) - D0.mean(0))
    assert err_cheb < err_paper


def test_check_mixing_refuses_bad_matrices():
    P = metropolis_hastings(ring(4))  # eigenvalue −1/3: not PSD
    with pytest.raises(GraphError, match="semidefinite"):
        check_mixing(P)
    with pytest.raises(GraphError, match="doubly stochastic"):
        check_mixing(np.array([[0.6, 0.6], [0.6, 0.6]]))
    with pytest.raises(GraphError, match="non-finite"):
        check_mixing(np.array([[np.nan, 0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError):
        block_length(9, 100, 0.0)
    with pytest.raises(ValueError):
        theta_for(mixing_matrix(ring(5)), "nope")
