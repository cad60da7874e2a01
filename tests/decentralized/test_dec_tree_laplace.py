"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") Algorithm 2: the Laplace tree sum's noise law and its ε accounting."""

import math

import numpy as np
import pytest
from scipy import stats

from flwr_corrnoise.decentralized.gossip import gossip, mixing_matrix, theta_for
from flwr_corrnoise.decentralized.graphs import complete, ring, watts_strogatz
from flwr_corrnoise.decentralized.protocol import node_seeds, state_from_bytes, state_to_bytes
from flwr_corrnoise.decentralized.tree_laplace import (
    leaf_node_counts,
    max_nodes_per_leaf,
    tree_init,
    tree_insert,
)
from flwr_corrnoise.decentralized.wang_privacy import (
    exact_epsilon,
    exact_scale,
    exact_sensitivity,
    network_epsilon,
    ogd_epsilon,
    ogd_scale_factor,
    paper_epsilon,
    paper_scale,
)


def _run_tree(N, dim, b, k=2, seed=0, serialize=False):
    rng = np.random.default_rng(seed)
    leaves = rng.normal(size=(N, k, dim))
    state = tree_init(k, N, dim)
    words = node_seeds(seed, range(k))
    outs, noises = [], []
    for t in range(N):
        if serialize:
            state = state_from_bytes(state_to_bytes(state))
        out, state, words, noise = tree_insert(state, leaves[t], np.full(k, b), words)
        outs.append(out)
        noises.append(noise)
    return leaves, np.array(outs), np.array(noises)


def test_error_is_exactly_the_cover_nodes_noise():
    N, dim = 13, 3
    leaves, outs, noises = _run_tree(N, dim, b=0.7, serialize=True)
    prefix = np.cumsum(leaves, axis=0)
    for t in range(1, N + 1):
        # the cover of [1, t]: one node per set bit; the node of bit h completed at leaf t_h
        expected = np.zeros_like(prefix[0])
        for h in range(t.bit_length()):
            if (t >> h) & 1:
                t_h = (t >> h) << h
                expected = expected + noises[t_h - 1]
        np.testing.assert_allclose(outs[t - 1] - prefix[t - 1], expected, atol=1e-12)


def test_noise_law_ks():
    b = 1.3
    # t = 8 (popcount 1): Lap(b); t = 3 (popcount 2): sum of two independent Lap(b)
    errs1, errs2 = [], []
    for seed in range(60):
        leaves, outs, _ = _run_tree(8, 50, b, k=1, seed=seed)
        prefix = np.cumsum(leaves, axis=0)
        errs1.append((outs[7] - prefix[7]).ravel())
        errs2.append((outs[2] - prefix[2]).ravel())
    e1, e2 = np.concatenate(errs1), np.concatenate(errs2)
    assert stats.kstest(e1, stats.laplace(scale=b).cdf).pvalue > 0.01

    def cdf2(x):  # closed form of Lap(b) + Lap(b): density (1 + |x|/b) e^{−|x|/b} / (4b)
        a = np.abs(x) / b
        tail = 0.5 * np.exp(-a) * (1 + a / 2)
        return np.where(x < 0, tail, 1 - tail)

    assert stats.kstest(e2, cdf2).pvalue > 0.01
    assert stats.kstest(e2, stats.laplace(scale=b).cdf).pvalue < 1e-6  # the test can fail
    np.testing.assert_allclose(e2.var(), 4 * b * b, rtol=0.1)


def test_noise_off_is_exact_and_full_tree_refused():
    leaves, outs, _ = _run_tree(7, 2, b=0.0)
    np.testing.assert_allclose(outs, np.cumsum(leaves, axis=0), atol=1e-12)
    state = tree_init(1, 3, 2)
    words = node_seeds(0, [0])
    for _ in range(3):
        _, state, words, _ = tree_insert(state, np.ones((1, 2)), np.ones(1), words)
    with pytest.raises(ValueError, match="full"):
        tree_insert(state, np.ones((1, 2)), np.ones(1), words)
    with pytest.raises(ValueError, match="finite"):
        tree_insert(tree_init(1, 3, 2), np.full((1, 2), np.inf), np.ones(1), words)


@pytest.mark.parametrize("N", [1, 2, 3, 7, 8, 13, 64, 100])
def test_leaf_in_at_most_floor_log2_plus_one_nodes(N):
    assert leaf_node_counts(N).max() == max_nodes_per_leaf(N) == math.floor(math.log2(N)) + 1
    assert leaf_node_counts(N, released_only=False).max() == max_nodes_per_leaf(N)


@pytest.mark.parametrize("graph", [complete(5), ring(6), watts_strogatz(10, 4, 0.5, seed=2)],
                         ids=lambda g: g.name)
def test_exact_sensitivity_matches_brute_force(graph):
    P = mixing_matrix(graph)
    theta = theta_for(P)
    G, d, L = 0.8, 3, 6
    delta = exact_sensitivity(P, L, theta, G, d)
    # brute force: perturb learner j's block sum by every ℓ2-≤-2G direction that maximizes ℓ1
    # (±2G/√d on each coordinate), gossip, measure the ℓ1 change over all learners' leaves
    rng = np.random.default_rng(0)
    D0 = rng.normal(size=(graph.num_nodes, d))
    base = gossip(P, D0, L, theta)
    worst = 0.0
    for j in range(graph.num_nodes):
        for signs in np.array(np.meshgrid(*[[-1, 1]] * d)).T.reshape(-1, d):
            D1 = D0.copy()
            D1[j] += 2 * G / math.sqrt(d) * signs
            worst = max(worst, np.abs(gossip(P, D1, L, theta) - base).sum())
    np.testing.assert_allclose(worst, delta, rtol=1e-10)
    # with enough gossip steps M_L → J/n and Δ_tot → 2G√d, 3× below the paper's 6√dG
    assert exact_sensitivity(P, 400, theta, G, d) == pytest.approx(2 * G * math.sqrt(d), rel=1e-6)


def test_epsilon_calibrations_round_trip_and_labels():
    d, G, T, eps = 416, 1.0, 150000, 10.0
    b = paper_scale(d, G, 0.0, 10.0, T, eps)
    assert b == pytest.approx(6 * math.sqrt(d) * G * (2 + math.log2(T)) / eps)
    assert paper_epsilon(d, G, 0.0, 10.0, T, b) == pytest.approx(eps)
    P = mixing_matrix(complete(9))
    L = 67
    delta = exact_sensitivity(P, L, theta_for(P), G, d)
    leaves = T // L - 1
    be = exact_scale(delta, leaves, eps)
    assert exact_epsilon(delta, leaves, be) == pytest.approx(eps)
    assert be < b / 2  # the exact calibration needs much less noise
    assert exact_epsilon(delta, leaves, b) < eps  # the paper's scale is valid (conservative)
    net = network_epsilon(P, L, theta_for(P), G, d, leaves, np.full(9, be))
    np.testing.assert_allclose(net, eps, rtol=1e-9)
    # a learner with less noise weakens every learner's guarantee
    scales = np.full(9, be)
    scales[0] /= 2
    assert np.all(network_epsilon(P, L, theta_for(P), G, d, leaves, scales) > eps)
    assert paper_scale(d, G, 0.0, 10.0, T, math.inf) == 0.0
    with pytest.raises(ValueError):
        paper_scale(d, G, 0.0, 10.0, T, 0.0)


def test_ogd_accounting_both_labels():
    a = 0.1 / np.sqrt(np.arange(1, 101))
    C, d, T, eps = 1.0, 4, 100, 2.0
    for label, factor in (("paper-basic-composition", T), ("per-datum", 1)):
        assert ogd_scale_factor(label, T) == factor
        mu = 2 * a * math.sqrt(d) * C * factor / eps
        out = ogd_epsilon(a, mu, C, d)
        if factor == T:
            assert out[label] == pytest.approx(eps)
        else:
            assert out[label] == pytest.approx(eps)
            assert out["paper-basic-composition"] == pytest.approx(T * eps)
    with pytest.raises(ValueError):
        ogd_scale_factor("nope", T)
