"""Constraint sets of Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for
Decentralized Online Learning": LMO value, projection feasible, idempotent, optimal."""

import numpy as np
import pytest

from flwr_corrnoise.decentralized.sets import L2Ball, NuclearBall, make_set, project_simplex_capped

SETS = [L2Ball(12, 2.0), NuclearBall((4, 3), 2.0), NuclearBall((3, 5), 10.0)]


@pytest.mark.parametrize("K", SETS, ids=lambda K: type(K).__name__ + str(K.dim))
def test_lmo_value_and_optimality(K):
    rng = np.random.default_rng(0)
    g = rng.normal(size=(5, K.dim))
    v = K.lmo(g)
    assert np.all(K.contains(v))
    value = np.einsum("kd,kd->k", g, v)
    if isinstance(K, NuclearBall):
        smax = np.linalg.svd(g.reshape(-1, *K.shape), compute_uv=False)[:, 0]
        np.testing.assert_allclose(value, -K.tau * smax, rtol=1e-12)
    else:
        np.testing.assert_allclose(value, -K.r * np.linalg.norm(g, axis=1), rtol=1e-12)
    # no feasible point does better (random feasible points via projection)
    for _ in range(20):
        u = K.project(rng.normal(scale=5, size=(5, K.dim)))
        assert np.all(np.einsum("kd,kd->k", g, u) >= value - 1e-9)


@pytest.mark.parametrize("K", SETS, ids=lambda K: type(K).__name__ + str(K.dim))
def test_projection_feasible_idempotent_variational(K):
    rng = np.random.default_rng(1)
    x = rng.normal(scale=3, size=(6, K.dim))
    p = K.project(x)
    assert np.all(K.contains(p))
    np.testing.assert_allclose(K.project(p), p, atol=1e-10)
    inside = p * 0.5
    np.testing.assert_array_equal(K.project(inside), inside)
    # variational inequality: ⟨x − p, u − p⟩ ≤ 0 for every u ∈ K
    for _ in range(30):
        u = K.project(rng.normal(scale=3, size=(6, K.dim)))
        assert np.all(np.einsum("kd,kd->k", x - p, u - p) <= 1e-8)
    # and the projection is the closest point among many feasible candidates
    cand = K.project(p + rng.normal(scale=0.1, size=p.shape))
    assert np.all(np.linalg.norm(x - p, axis=1) <= np.linalg.norm(x - cand, axis=1) + 1e-10)


def test_simplex_projection_against_brute_force():
    rng = np.random.default_rng(2)
    s = np.abs(rng.normal(size=(50, 4))) * 3
    out = project_simplex_capped(s, 2.0)
    assert np.all(out >= 0) and np.all(out.sum(axis=1) <= 2.0 + 1e-12)
    # brute force: the answer is max(s − μ, 0) with μ ≥ 0 solving Σ = τ (or μ = 0); bisection
    for row, got in zip(s, out, strict=True):
        if row.sum() <= 2.0:
            np.testing.assert_array_equal(got, row)
            continue
        lo, hi = 0.0, row.max()
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.maximum(row - mid, 0).sum() > 2.0 else (lo, mid)
        np.testing.assert_allclose(got, np.maximum(row - lo, 0), atol=1e-9)


def test_bad_inputs():
    with pytest.raises(ValueError):
        L2Ball(3, 0.0)
    with pytest.raises(ValueError):
        NuclearBall((2, 2), float("inf"))
    with pytest.raises(ValueError, match="non-finite"):
        L2Ball(2, 1.0).project(np.array([[np.nan, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        NuclearBall((2, 2), 1.0).project(np.zeros((1, 5)))
    with pytest.raises(ValueError):
        make_set("nuclear", 6, 1.0)
    assert isinstance(make_set("nuclear", 6, 1.0, (2, 3)), NuclearBall)
