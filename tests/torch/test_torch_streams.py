"""Device-resident torch noise streams: the same kernels as NumPy, the same law, the
covariance V²·B·Bᵀ, bit-for-bit restore, the horizon, dtypes."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_corrnoise.mechanisms import MECHANISMS, build_factorization  # noqa: E402
from flwr_corrnoise.mechanisms.streaming import NUMPY_OPS  # noqa: E402
from flwr_corrnoise.streams import HorizonExhaustedError, NoiseStream  # noqa: E402
from flwr_corrnoise.torch.streams import TorchNoiseStream, TorchOps  # noqa: E402


def draw_all(stream: NoiseStream) -> np.ndarray:
    out = [stream.next() for _ in range(stream.remaining)]
    return np.array([e.cpu().double().numpy() if torch.is_tensor(e) else e for e in out])


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_same_normals_give_the_same_increments_in_numpy_and_torch(name: str) -> None:
    """One kernel per mechanism serves both namespaces: fed the same ξ rows (the rows the
    NumPy stream's generator would give), NumPy float64 and torch float64/float32 kernels
    return the same increments — which are also the noising matrix times ξ."""
    n, dim = 23, 5
    fact = build_factorization(name, n)
    kernel = fact.stream_kernel()
    xi = np.random.default_rng(7).standard_normal((2 * n + 8, dim))

    def run(ops, to_row, to_numpy) -> np.ndarray:
        rows = iter(xi)
        state = kernel.init(ops, dim, [], [])
        out = []
        for k in range(n):
            e, state = kernel.next(state, k, lambda: to_row(next(rows)), ops)
            out.append(to_numpy(e))
        return np.array(out)

    ref = run(NUMPY_OPS, np.array, np.asarray)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        got = run(TorchOps(dtype, torch.device("cpu")),
                  lambda r, dt=dtype: torch.tensor(r, dtype=dt),
                  lambda e: e.double().numpy())
        np.testing.assert_allclose(got, ref, atol=tol * (1 + np.abs(ref).max()))
    # and both are e = M·ξ on the rows the mechanism draws (one per step unless a tree)
    if fact.stream_kind in ("independent", "toeplitz", "dense", "blt"):
        np.testing.assert_allclose(ref, fact.noising_matrix() @ xi[:n], atol=1e-11)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_torch_prefix_sum_covariance(name: str) -> None:
    """Statistical (fixed seed): Cov(prefix sums of the torch stream) = V²·B·Bᵀ, with the
    d coordinates as samples; 5 standard deviations per entry, as for the NumPy stream."""
    n, dim, std = 12, 40_000, 1.5
    P = np.cumsum(draw_all(TorchNoiseStream.create(name, n, dim, std, seed=2024)), axis=0)
    emp = P @ P.T / dim
    B, _ = build_factorization(name, n).matrices()
    sigma = std**2 * B @ B.T
    tol = 5 * np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / dim)
    assert np.all(np.abs(emp - sigma) <= tol)
    if name != "independent":  # the test has power
        A = np.tril(np.ones((n, n)))
        assert np.any(np.abs(emp - std**2 * A @ A.T) > tol)


@pytest.mark.parametrize("name", ["independent", "tree", "blt"])
def test_torch_and_numpy_streams_release_the_same_law(name: str) -> None:
    """Two-sample check of the whole prefix-sum law: the NumPy and torch streams' empirical
    covariances agree within sampling error (each within 5σ of the other)."""
    n, dim, std = 10, 40_000, 0.8
    P_np = np.cumsum(draw_all(NoiseStream.create(name, n, dim, std, seed=1)), axis=0)
    P_t = np.cumsum(draw_all(TorchNoiseStream.create(name, n, dim, std, seed=1)), axis=0)
    e_np, e_t = P_np @ P_np.T / dim, P_t @ P_t.T / dim
    var = (np.outer(np.diag(e_np), np.diag(e_np)) + e_np**2) / dim
    assert np.all(np.abs(e_np - e_t) <= 5 * np.sqrt(2 * var))
    assert abs(P_t.mean()) < 5 * np.sqrt(np.diag(e_np).max() / dim)


@pytest.mark.parametrize("name", ["independent", "blt", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_torch_stream_releases_the_numpy_streams_floats(name: str, dtype) -> None:
    """On the CPU a torch stream draws the NumPy stream's rows, scales them by the same
    factor (a float32 stream: V's nearest float32 from above, never below it) and runs the
    same recurrence (BLT: the host kernel on the tensors' memory): the same floats, bit for
    bit, at a std that float32 rounds down (1.3 → 1.29999995 to nearest)."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    n, std = 12, 1.3
    t = TorchNoiseStream.create(name, n, [(300,), (7,)], std, seed=5, dtype=dtype)
    h = NoiseStream.create(name, n, [(300,), (7,)], std, seed=5, dtype=np_dtype)
    for _ in range(n):
        np.testing.assert_array_equal(t.next().numpy(), h.next())
    if dtype == torch.float32:
        assert t._std_factor() >= std > float(np.float32(std))


def test_adaptive_noise_scale_rounds_up_in_the_noise_dtype() -> None:
    """The torch optimizer's adaptive step multiplies unit noise by ``C_t``; in float32 (or
    a half type) that factor is ``C_t`` rounded up, never to nearest below it."""
    from flwr_corrnoise.torch.optimizer import _at_least

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for value in (1.3, 0.1, 1e-3, 2.0):
            up = _at_least(value, dtype)
            t = torch.tensor(up, dtype=dtype)
            assert float(t) == up >= value
            assert float(torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype))) < value


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cut", [0, 5, 13])
def test_restored_torch_stream_continues_bit_for_bit(name: str, dtype, cut: int) -> None:
    n = 20
    original = TorchNoiseStream.create(name, n, [(2, 3), (4,)], 2.0, seed=99, dtype=dtype)
    for _ in range(cut):
        original.next()
    restored = TorchNoiseStream.from_bytes(original.to_bytes())
    assert restored.step == cut and restored.dtype == dtype
    rest_a = [original.next() for _ in range(n - cut)]
    rest_b = [restored.next() for _ in range(n - cut)]
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(rest_a, rest_b,
                                                                      strict=True))
    fresh = TorchNoiseStream.create(name, n, [(2, 3), (4,)], 2.0, seed=99, dtype=dtype)
    all_fresh = [fresh.next() for _ in range(n)]
    assert all(torch.equal(a, b) for a, b in zip(all_fresh[cut:], rest_a, strict=True))


@pytest.mark.parametrize("name", ["tree", "blt", "toeplitz"])
def test_a_kept_fork_repeats_the_same_increments(name: str) -> None:
    s = TorchNoiseStream.create(name, 12, 6, 1.0, seed=4)
    s.next()
    kept = s.fork()
    first = [s.next() for _ in range(4)]
    again = [kept.next() for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_horizon_and_backend_mixups_are_errors() -> None:
    s = TorchNoiseStream.create("blt", 3, 4, 1.0, seed=0)
    for _ in range(3):
        s.next()
    with pytest.raises(HorizonExhaustedError):
        s.next()
    with pytest.raises(HorizonExhaustedError):
        TorchNoiseStream.from_bytes(s.to_bytes()).next()
    # NoiseStream.from_bytes reads any learner's stream: a torch state comes back as one
    restored = NoiseStream.from_bytes(s.to_bytes())
    assert isinstance(restored, TorchNoiseStream) and restored.step == 3
    with pytest.raises(ValueError, match="NumPy"):
        TorchNoiseStream.from_state_dict(NoiseStream.create("blt", 3, 4, 1.0, 0).state_dict())
    with pytest.raises(ValueError, match="NumPy-only"):
        TorchNoiseStream.create("blt", 3, 4, 1.0, secure=True)
    # a state written with a torch generator (format 1: 32/64-bit seeds) is not continued
    old = s.state_dict()
    old["rng"] = np.zeros(5056, dtype=np.uint8)  # torch's CPU generator state: 5056 bytes
    with pytest.raises(ValueError, match="predictable"):
        TorchNoiseStream.from_state_dict(old)


def test_different_seeds_differ_and_std_scales() -> None:
    a = TorchNoiseStream.create("independent", 2, 1000, 1.0, seed=1).next()
    b = TorchNoiseStream.create("independent", 2, 1000, 1.0, seed=2).next()
    c = TorchNoiseStream.create("independent", 2, 1000, 3.0, seed=1).next()
    assert not torch.equal(a, b)
    torch.testing.assert_close(c, 3.0 * a)


def test_restored_rows_may_be_tensors_and_cuda_is_cuda_0() -> None:
    """A restored stream's rows may arrive as tensors already on a device (a CUDA BLT state:
    from_bytes moves the rows there first); they are taken as rows of the stream's dtype (a
    wrong dtype is refused), and a device named without an index is the current one — a
    tensor made on ``cuda`` reports ``cuda:0``, which torch compares unequal to ``cuda``
    (on a GPU this failed the restore of every BLT device stream)."""
    from flwr_corrnoise.torch.streams import TorchNoiseStream, _same_device

    s = TorchNoiseStream.create("blt", 8, 5, 1.0, seed=2)
    for _ in range(3):
        s.next()
    rows = torch.stack([torch.as_tensor(r) for r in s.state_dict()["rows"]])
    again = TorchNoiseStream.from_state_dict({**s.state_dict(), "rows": rows.numpy()})
    as_tensors = TorchNoiseStream(s.mechanism, s.horizon, s.shapes, s.std,
                                  TorchNoiseStream.from_bytes(s.to_bytes())._rng,
                                  step=s.step, rows=list(rows))
    for _ in range(3):
        x = s.next()
        assert torch.equal(x, again.next()) and torch.equal(x, as_tensors.next())
    with pytest.raises(ValueError, match="state row"):
        TorchNoiseStream(s.mechanism, s.horizon, s.shapes, s.std, s._rng, step=3,
                         rows=list(rows.double()))
    assert _same_device(torch.device("cpu"), torch.device("cpu"))
    assert not _same_device(torch.device("cpu"), torch.device("meta"))
    if torch.cuda.is_available():
        assert _same_device(torch.device("cuda"), torch.device("cuda", 0))
