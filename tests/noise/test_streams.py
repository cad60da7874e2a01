"""Noise streams: exact increments, covariance of prefix sums, restore, horizon, memory."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.cipher_noise import CipherGaussian
from flwr_corrnoise.mechanisms import MECHANISMS, build_factorization
from flwr_corrnoise.mechanisms.tree import BinaryTree
from flwr_corrnoise.streams import HorizonExhaustedError, NoiseStream


def reference_generator(seed: int) -> CipherGaussian:
    """ξ's generator as cipher_noise.py documents it, keyed here from NumPy directly: the
    AES-128-CTR kernel under the 128 bits SeedSequence(seed) hashes the seed into (since
    noise-state format 3; Philox before, whose streams tests/noise/test_noise_keys.py restores)."""
    key = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    return CipherGaussian(key.astype("<u8").tobytes())


def xi_matrix(seed: int, rows: int, dim: int) -> np.ndarray:
    """ξ as the stream defines it: rows 0, 1, … of the keyed kernel, in draw order."""
    return reference_generator(seed).rows(0, rows, dim)


def draw_all(stream: NoiseStream) -> np.ndarray:
    return np.array([stream.next() for _ in range(stream.remaining)])


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("n", [1, 2, 5, 16, 23])
def test_increments_are_noising_matrix_times_xi(name: str, n: int) -> None:
    """e[k] = V·(b_k − b_{k−1})·ξ exactly, with ξ the documented draw order."""
    std, dim, seed = 0.7, 3, 11
    stream = NoiseStream.create(name, n, dim, std, seed=seed)
    E = draw_all(stream)
    fact = build_factorization(name, n)
    M = fact.noising_matrix()
    xi = xi_matrix(seed, M.shape[1], dim)
    if isinstance(fact, BinaryTree):  # rows of ξ are drawn only for the nodes B uses
        used = fact.drawn_nodes()
        xi = np.zeros((M.shape[1], dim))
        xi[used] = xi_matrix(seed, len(used), dim)
    np.testing.assert_allclose(E, std * M @ xi, atol=1e-12)
    # prefix sums are V·B·ξ
    B, _ = fact.matrices()
    np.testing.assert_allclose(np.cumsum(E, axis=0), std * B @ xi, atol=1e-11)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 23, 64])
def test_vanilla_tree_skips_only_nodes_no_prefix_sum_uses(n: int) -> None:
    """The skipped nodes have zero columns in B (never released); the drawn ones do not."""
    tree = BinaryTree(n)
    B, _ = tree.matrices()
    used = np.zeros(B.shape[1], dtype=bool)
    used[tree.drawn_nodes()] = True
    assert len(tree.drawn_nodes()) == n  # one draw per step
    np.testing.assert_array_equal(B[:, ~used], 0.0)
    assert np.all(np.any(B[:, used] != 0.0, axis=0))
    assert np.array_equal(BinaryTree(n, efficient=True).drawn_nodes(), np.arange(B.shape[1]))


def test_row_by_row_draws_equal_block_draw() -> None:
    """The stream's draws (one row a step) are the kernel's rows 0, 1, … drawn at once."""
    stream = NoiseStream.create("independent", 9, 7, 1.0, seed=5)
    rows = np.array([stream.next() for _ in range(9)])
    np.testing.assert_array_equal(rows, xi_matrix(5, 9, 7))
    rng = reference_generator(5)
    np.testing.assert_array_equal(np.array([rng.next_row(7) for _ in range(9)]), rows)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_prefix_sum_covariance(name: str) -> None:
    """Statistical: Cov(prefix sums) = V²·B·Bᵀ, using the d coordinates as samples.

    The empirical second moment Ŝ_ij = (1/d)Σ P_i P_j of zero-mean Gaussians has variance
    (Σ_ii Σ_jj + Σ_ij²)/d; we allow 5 standard deviations per entry (fixed seed).
    """
    n, dim, std = 12, 40_000, 1.5
    assert_prefix_covariance(draw_all(NoiseStream.create(name, n, dim, std, seed=2024)),
                             name, std)


def assert_prefix_covariance(increments: np.ndarray, name: str, std: float) -> None:
    """The prefix sums of ``increments`` (N × d) have covariance V²·B·Bᵀ, using the d
    coordinates as samples, to 5 standard deviations per entry; and the check has power:
    independent noise's covariance (V²·A·Aᵀ) is rejected for the other mechanisms."""
    n, dim = increments.shape
    P = np.cumsum(increments, axis=0)
    emp = P @ P.T / dim
    B, _ = build_factorization(name, n).matrices()
    sigma = std**2 * B @ B.T
    tol = 5 * np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / dim)
    assert np.all(np.abs(emp - sigma) <= tol)
    if name != "independent":
        A = np.tril(np.ones((n, n)))
        assert np.any(np.abs(emp - std**2 * A @ A.T) > tol)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("cut", [0, 1, 6, 13])
def test_restore_continues_bit_for_bit(name: str, cut: int) -> None:
    n = 20
    original = NoiseStream.create(name, n, [(2, 3), (4,)], 2.0, seed=99)
    for _ in range(cut):
        original.next()
    restored = NoiseStream.from_bytes(original.to_bytes())
    assert restored.step == cut
    rest_a, rest_b = draw_all(original), draw_all(restored)
    assert rest_a.shape == (n - cut, 10)
    assert np.array_equal(rest_a, rest_b)  # bit for bit, not approximately
    # and an uninterrupted stream produced the same values
    fresh = NoiseStream.create(name, n, [(2, 3), (4,)], 2.0, seed=99)
    all_fresh = draw_all(fresh)
    assert np.array_equal(all_fresh[cut:], rest_a)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_horizon_is_an_error_not_a_wrap(name: str) -> None:
    stream = NoiseStream.create(name, 4, 2, 1.0, seed=0)
    draw_all(stream)
    with pytest.raises(HorizonExhaustedError, match="4 steps"):
        stream.next()
    restored = NoiseStream.from_bytes(stream.to_bytes())
    with pytest.raises(HorizonExhaustedError):
        restored.next()


def test_tree_memory_is_logarithmic() -> None:
    n, dim = 1000, 5
    for name in ("tree", "efficient-tree"):
        stream = NoiseStream.create(name, n, dim, 1.0, seed=1)
        peak = 0
        for _ in range(n):
            stream.next()
            peak = max(peak, stream.state_floats)
        assert peak <= (math.floor(math.log2(n)) + 1) * dim
        assert peak == 9 * dim  # popcount of 1..1000 peaks at 9 (e.g. 511)


def test_independent_stream_holds_no_buffers() -> None:
    stream = NoiseStream.create("independent", 100, 1000, 1.0, seed=1)
    for _ in range(50):
        stream.next()
    assert stream.state_floats == 0
    assert len(stream.to_bytes()) < 4000


def test_next_arrays_shapes() -> None:
    stream = NoiseStream.create("toeplitz", 3, [(2, 2), (3,), ()], 1.0, seed=3)
    arrays = stream.next_arrays()
    assert [a.shape for a in arrays] == [(2, 2), (3,), ()]


def test_seed_from_os_entropy_differs() -> None:
    a = NoiseStream.create("independent", 3, 4, 1.0).next()
    b = NoiseStream.create("independent", 3, 4, 1.0).next()
    assert not np.array_equal(a, b)


def test_corrupt_state_is_rejected() -> None:
    stream = NoiseStream.create("tree", 16, 3, 1.0, seed=4)
    for _ in range(5):
        stream.next()
    with pytest.raises(ValueError, match="unreadable"):
        NoiseStream.from_bytes(b"garbage")
    state = stream.state_dict()
    state["step"] = np.array(6)  # buffers no longer match the step
    with pytest.raises(ValueError, match="does not match"):
        NoiseStream.from_state_dict(state)
    state = stream.state_dict()
    del state["rng"]
    with pytest.raises(ValueError, match="malformed"):
        NoiseStream.from_state_dict(state)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_std(bad: float) -> None:
    with pytest.raises(ValueError, match="std"):
        NoiseStream.create("tree", 4, 2, bad, seed=0)


def test_other_backends_restore_only_through_their_registered_module() -> None:
    """The core restores NumPy streams itself and hands other backends to the module that
    registered them (streams.py imports no backend: no import cycle)."""
    from flwr_corrnoise.streams import register_stream_backend, restore_stream

    state = NoiseStream.create("blt", 6, 3, 1.0, seed=2).state_dict()
    assert isinstance(restore_stream(state), NoiseStream)
    state["backend"] = np.array("quantum")
    with pytest.raises(ValueError, match="no quantum backend is loaded"):
        NoiseStream.from_state_dict(state)
    seen = []
    register_stream_backend("quantum", lambda st, dev: seen.append(dev) or "restored")
    try:
        assert restore_stream(state, device="qpu") == "restored" and seen == ["qpu"]
    finally:
        from flwr_corrnoise import streams

        streams._BACKENDS.pop("quantum")
    with pytest.raises(ValueError, match="built-in"):
        register_stream_backend("numpy", restore_stream)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rows_drawn_ahead_change_no_released_value(name: str, dtype: type,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream computes small rows several per kernel call (CipherGaussian.next_row's
    ``ahead``): its increments, its states and what a kept fork re-serves are those of a
    stream drawing one row a call, bit for bit."""
    from flwr_corrnoise import cipher_noise as cn

    def run() -> tuple[list[np.ndarray], list[bytes]]:
        s = NoiseStream.create(name, 24, [(2, 3), (5,)], 1.5, seed=8, dtype=dtype)
        out, states = [s.next() for _ in range(5)], [s.to_bytes()]
        kept = s.fork()
        out += [s.next() for _ in range(4)]
        s = kept  # the round not written: the same rows again, by design
        states.append(s.to_bytes())
        out += [s.next() for _ in range(6)]
        restored = NoiseStream.from_bytes(s.to_bytes())  # the state is the row counter
        states.append(restored.to_bytes())
        out += [restored.next() for _ in range(restored.remaining)]
        return out, states

    cached = run()
    monkeypatch.setattr(cn, "ROW_CACHE_FLOATS", 0)  # no row computed ahead
    plain = run()
    for a, b in zip(cached[0], plain[0], strict=True):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b)
    assert cached[1] == plain[1]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [[np.nan], [np.inf], [np.inf, -np.inf]])
def test_a_blt_state_with_non_finite_buffers_is_refused(backend: str, bad: list[float]) -> None:
    """A restored BLT state whose buffers hold NaN or ±∞ (both at once: a sum of NaN) is
    refused, from the NumPy and the torch stream (whose check sums its buffer tensor)."""
    from flwr_corrnoise import arraypack

    if backend == "torch":
        pytest.importorskip("torch")
        from flwr_corrnoise.torch import TorchNoiseStream

        cls: type[NoiseStream] = TorchNoiseStream
    else:
        cls = NoiseStream
    s = cls.create("blt", 6, 50, 1.0, seed=2)
    s.next()
    state = arraypack.unpack(s.to_bytes())
    state["rows"][1, 7 : 7 + len(bad)] = bad
    with pytest.raises(ValueError, match="non-finite"):
        cls.from_bytes(arraypack.pack(state))
    assert cls.from_bytes(s.to_bytes()).step == 1  # the intact state restores
