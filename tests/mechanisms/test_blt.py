"""BLT: closed forms against materialized matrices and a plain recursion, optimality,
constant-size stream state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.mechanisms import BLTParams, build_factorization, rmse_lower_bound
from flwr_corrnoise.mechanisms.base import prefix_sum_matrix, prefix_sum_singular_values
from flwr_corrnoise.mechanisms.blt import BufferedToeplitz, optimize_blt, rmse_squared
from flwr_corrnoise.mechanisms.optimized import evaluate_dual, workload_gram
from flwr_corrnoise.mechanisms.toeplitz import ToeplitzSqrt
from flwr_corrnoise.streams import NoiseStream

RANDOM = BLTParams(np.array([0.3, 0.8, 0.97]), np.array([0.2, 0.1, 0.05]))


def recursion_noising(params: BLTParams, n: int) -> np.ndarray:
    """g = C⁻¹·δ by the stream's own recursion, one step at a time (independent of the
    vectorized implementation)."""
    r = np.zeros(params.buffers)
    out = np.empty(n)
    for t in range(n):
        e = (1.0 if t == 0 else 0.0) - params.omega @ r
        r = params.theta * r + e
        out[t] = e
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 7, 37, 100])
@pytest.mark.parametrize("params", [RANDOM, None], ids=["random", "optimized"])
def test_closed_forms_match_materialized_matrices(n: int, params: BLTParams | None) -> None:
    blt = BufferedToeplitz(n, params=params) if params else BufferedToeplitz(n, use_cache=False)
    B, C = blt.matrices()
    np.testing.assert_allclose(B @ C, prefix_sum_matrix(n), atol=1e-10)
    # C is the BLT encoder: c(0) = 1, c(t) = Σ ω θ^(t−1), Toeplitz
    t = np.arange(1, n)
    expected = [1.0] + [float(np.sum(blt.omega * blt.theta ** (s - 1))) for s in t]
    np.testing.assert_allclose(C[:, 0], expected, rtol=1e-12)
    assert blt.sensitivity == pytest.approx(np.linalg.norm(C, axis=0).max(), rel=1e-12)
    assert blt.total_error == pytest.approx(np.sum(B * B), rel=1e-9)
    np.testing.assert_allclose(blt.row_errors(), np.sum(B * B, axis=1), rtol=1e-9)
    assert blt.rmse == pytest.approx(
        np.linalg.norm(C, axis=0).max() * math.sqrt(np.sum(B * B) / n), rel=1e-9
    )
    np.testing.assert_allclose(blt.noising_matrix(), np.linalg.inv(C), atol=1e-10)


@pytest.mark.parametrize("n", [5_000, 100_000])
def test_closed_forms_at_long_horizons_match_the_recursion(n: int) -> None:
    params, _ = optimize_blt(n, 4)
    g = recursion_noising(params, n)
    np.testing.assert_allclose(params.noising_coefficients(n), g, atol=1e-13)
    b = np.cumsum(g)
    direct = float(np.sum((n - np.arange(n)) * b * b))
    assert params.total_error(n) == pytest.approx(direct, rel=1e-9)
    c = params.encoder_coefficients(n)
    assert params.sensitivity_squared(n) == pytest.approx(float(c @ c), rel=1e-12)


@pytest.mark.slow
def test_optimized_blt_beats_toeplitz_and_is_near_optimal() -> None:
    for n in (64, 256, 1024):
        blt = BufferedToeplitz(n, use_cache=False)
        assert blt.rmse < ToeplitzSqrt(n).rmse
        assert blt.rmse >= rmse_lower_bound(n)
        if n >= 256:
            dense = build_factorization("optimized", n)  # the session's solve
            assert blt.rmse <= 1.04 * dense.rmse  # measured ≈ 1.03
    # more buffers never hurt (the optimizer finds the nested solutions)
    n = 4000
    errs = [math.sqrt(optimize_blt(n, k)[1]["rmse"] ** 2) for k in (1, 2, 4)]
    assert errs[0] > errs[1] > errs[2]


def test_stream_state_is_constant_and_independent_of_the_horizon() -> None:
    sizes = []
    for n in (50, 5000):
        stream = NoiseStream.create("blt", n, 1000, 1.0, seed=1)
        k = build_factorization("blt", n).buffers
        floats = set()
        for _ in range(30):
            stream.next()
            floats.add(stream.state_floats)
        assert floats == {k * 1000}
        sizes.append(len(stream.to_bytes()))
    assert abs(sizes[0] - sizes[1]) < 64  # only the header differs


def test_invalid_and_unstable_parameters_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"θ must lie in \(0, 1\)"):
        BLTParams(np.array([1.2]), np.array([0.1]))
    with pytest.raises(ValueError, match="ω must be > 0"):
        BLTParams(np.array([0.5]), np.array([-0.1]))
    with pytest.raises(ValueError, match="same length"):
        BLTParams(np.array([0.5, 0.6]), np.array([0.1]))
    # ω = 3 puts the inverse's decay at θ − ω = −2.5: C⁻¹ diverges
    unstable = BLTParams(np.array([0.5]), np.array([3.0]))
    assert rmse_squared(unstable, 200) == math.inf
    with pytest.raises(ValueError, match="unstable"):
        BufferedToeplitz(200, params=unstable)


def test_blt_cache_roundtrip(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    first = BufferedToeplitz(300)
    assert first.report.get("loaded") is None
    second = BufferedToeplitz(300)
    assert second.report["loaded"] is True
    np.testing.assert_array_equal(second.theta, first.theta)
    (path,) = tmp_path.glob("blt-*N300.npz")
    path.write_bytes(b"corrupt")
    third = BufferedToeplitz(300)
    assert third.report.get("loaded") is None and third.rmse == pytest.approx(first.rmse)


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_prefix_sum_singular_values_closed_form(n: int) -> None:
    np.testing.assert_allclose(
        np.sort(prefix_sum_singular_values(n)),
        np.sort(np.linalg.svd(prefix_sum_matrix(n), compute_uv=False)),
        rtol=1e-12,
    )


def test_lower_bound_is_the_dual_bound_at_v_equal_one_and_below_everything() -> None:
    n = 200
    dual = evaluate_dual(workload_gram(n), np.ones(n)).lower_bound  # on ‖B‖_F²
    assert rmse_lower_bound(n) == pytest.approx(math.sqrt(dual / n), rel=1e-10)
    for name in ("independent", "tree", "efficient-tree", "toeplitz", "optimized", "blt"):
        assert build_factorization(name, n).rmse >= rmse_lower_bound(n)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_step_writes_the_new_buffers_to_a_new_array_and_keeps_the_old(dtype) -> None:
    """The pure kernel (``BLTKernel.next`` writes ``θ⊙r + e`` straight into a fresh,
    uninitialised array, chunk by chunk): the increments and the buffers equal, bit for
    bit, those of a stream never forked; the kept state's buffers stay as they were, so
    stepping it again replays the same increments, twice. d spans two full column chunks
    and a partial one, so every chunk of the fresh array is written."""
    dim = 2 * (1 << 15) + 1234
    plain = NoiseStream.create("blt", 16, dim, 1.5, seed=7, dtype=dtype)
    cow = NoiseStream.create("blt", 16, dim, 1.5, seed=7, dtype=dtype)
    for _ in range(2):  # buffers away from zero first
        assert np.array_equal(plain.next(), cow.next())
    before = cow._state.buf.copy()
    kept = cow.fork()
    first = [plain.next() for _ in range(3)]
    for _ in range(2):
        again = [cow.next() for _ in range(3)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
        assert np.array_equal(cow._state.buf, plain._state.buf)
        assert np.array_equal(kept._state.buf, before)  # the kept buffers never moved
        cow = kept.fork()
    assert np.array_equal(cow._state.buf, before)
