"""PD-OCG's linear-minimization oracle by the top singular pair (issue 24): power iteration
and Lanczos (``scipy.sparse.linalg.svds``, k = 1) against the full-SVD LMO, and the LMO's
value against nuclear-norm duality (an independent check: ``min_{‖V‖_*≤τ} ⟨G, V⟩ = −τ‖G‖₂``)."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.decentralized.sets import (
    NuclearBall,
    make_set,
    top_singular_pair,
    top_singular_pair_lanczos,
)
from flwr_corrnoise.decentralized.wang import conditional_gradient

SHAPES = [(26, 16), (16, 26), (10, 10), (3, 5), (7, 2), (1, 6), (6, 1), (40, 33)]


@pytest.mark.parametrize("method", ["power", "lanczos"])
@pytest.mark.parametrize("shape", SHAPES)
def test_lmo_equals_full_svd_lmo(method: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(hash(shape) % 2**32)
    q, p = shape
    g = rng.normal(size=(6, q * p)) * rng.uniform(0.1, 10.0, size=(6, 1))
    ref = NuclearBall(shape, 3.0, lmo="svd").lmo(g)
    got = NuclearBall(shape, 3.0, lmo=method).lmo(g)
    assert np.max(np.abs(got - ref)) <= 1e-8
    # value: ⟨g, v⟩ = −τ σ₁(g), σ₁ from numpy's singular values (no vectors involved)
    sigma1 = np.linalg.svd(g.reshape(-1, q, p), compute_uv=False)[:, 0]
    assert np.einsum("kd,kd->k", g, got) == pytest.approx(-3.0 * sigma1, rel=1e-10)
    # and the result is in the ball (rank one: nuclear norm = Frobenius norm = τ)
    assert np.allclose(np.linalg.norm(got, axis=1), 3.0, rtol=1e-10)


def test_warm_start_and_singular_values() -> None:
    rng = np.random.default_rng(7)
    G = rng.normal(size=(5, 12, 9))
    u, s, v, _iters = top_singular_pair(G)
    assert s == pytest.approx(np.linalg.svd(G, compute_uv=False)[:, 0], rel=1e-12)
    assert np.allclose(np.einsum("kqp,kp->kq", G, v), s[:, None] * u, atol=1e-9)
    # a nearby matrix from the previous right vectors converges in fewer iterations
    G2 = G + 1e-3 * rng.normal(size=G.shape)
    cold = top_singular_pair(G2)[3]
    _u2, s2, v2, warm = top_singular_pair(G2, v)
    assert warm < cold
    assert s2 == pytest.approx(np.linalg.svd(G2, compute_uv=False)[:, 0], rel=1e-12)
    _ul, sl, vl = top_singular_pair_lanczos(G2, v)
    assert sl == pytest.approx(s2, rel=1e-12)
    assert np.allclose(np.abs(np.einsum("kp,kp->k", vl, v2)), 1.0, atol=1e-10)


def test_zero_gradient_and_bad_method() -> None:
    for method in ("power", "lanczos", "svd"):
        K = NuclearBall((4, 3), 2.0, lmo=method)
        g = np.zeros((2, 12))
        g[1, 0] = 1.0
        v = K.lmo(g)
        assert np.all(v[0] == 0)  # ⟨0, v⟩ is minimal everywhere: the centre
        assert v[1, 0] == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="LMO method"):
        NuclearBall((2, 2), 1.0, lmo="qr")
    assert make_set("nuclear", 6, 1.0, (2, 3), lmo="lanczos").lmo_method == "lanczos"


@pytest.mark.slow
def test_frank_wolfe_same_with_every_lmo() -> None:
    """Algorithm 4 (the warm-started loop PD-OCG runs) ends at the same point whichever way
    the top pair is found. Ten iterations, not thirty: the warm-started loop nears its end
    by then (the power method already needs ≈ 2 s of CPU for them, its top singular values
    close together), and iterations 10 to 30 cost the power method another ≈ 10 s."""
    rng = np.random.default_rng(3)
    zhat = rng.normal(size=(4, 26 * 16))
    x0 = NuclearBall((26, 16), 10.0).project(rng.normal(size=(4, 26 * 16)))
    ends = [conditional_gradient(NuclearBall((26, 16), 10.0, lmo=m), zhat, 0.5, x0, 10)
            for m in ("svd", "power", "lanczos")]
    assert np.max(np.abs(ends[0] - x0)) > 1.0  # the loop moved: agreement is not trivial
    assert np.max(np.abs(ends[1] - ends[0])) <= 1e-8
    assert np.max(np.abs(ends[2] - ends[0])) <= 1e-8


def test_benchmark_script_toy() -> None:
    """benchmarks/pd_ocg_lmo.py runs at toy size and its LMOs agree with the full SVD."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "pd_ocg_lmo.py"),
                           "--shapes", "12x7", "--round-shapes", "5x4", "--horizon", "64",
                           "--blocks", "3", "--repeats", "1", "--samples", "200"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in proc.stdout.splitlines() if line.startswith("| ")]
    lmo_rows = [r for r in rows if r[0] == "12 × 7" and r[5] != "–"]
    assert len(lmo_rows) == 10 and all(float(r[5]) <= 1e-8 for r in lmo_rows)
    assert {r[1] for r in lmo_rows} == {"rank one + noise", "noise only"}
    algos = [(r[1], r[2]) for r in rows if r[0] == "5 × 4"]
    assert algos == [("PD-FTGL", "–"), ("PD-OCG", "svd"), ("PD-OCG", "power"),
                     ("PD-OCG", "lanczos")]
