"""Device noise (flwr_corrnoise/torch/device_noise.py) on CPU tensors: the torch ChaCha20
keystream bit for bit against ``cryptography``'s (OpenSSL) and RFC 8439's test vector, the
normals against a NumPy transform of the same words, rows by counter, state, keys, the law.
The same code is what runs on a CUDA device; that run is not part of this suite."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms  # noqa: E402
from scipy import stats  # noqa: E402

from flwr_corrnoise.torch import device_noise as dn  # noqa: E402
from flwr_corrnoise.torch.device_noise import DeviceGaussian  # noqa: E402

KEY = bytes(range(32))


def openssl_words(key: bytes, nonce: tuple[int, int, int], first: int, count: int) -> np.ndarray:
    """``count`` blocks from block ``first`` by cryptography's ChaCha20 (16-byte nonce:
    the 32-bit counter, then the 96-bit nonce, little-endian), as uint32 words."""
    iv = first.to_bytes(4, "little") + b"".join(w.to_bytes(4, "little") for w in nonce)
    ks = Cipher(algorithms.ChaCha20(key, iv), mode=None).encryptor().update(bytes(64 * count))
    return np.frombuffer(ks, dtype="<u4").astype(np.int64)


@pytest.mark.parametrize(("nonce", "first", "count"),
                         [((0, 0, 0), 0, 1), ((1, 5, 0), 0, 7), ((2, 2**32 - 1, 2**31), 3, 40),
                          ((0x101, 17, 9), 2**32 - 5, 5)])
def test_the_keystream_equals_openssl_bit_for_bit(nonce: tuple[int, int, int], first: int,
                                                  count: int) -> None:
    got = dn.chacha20_blocks(KEY, nonce, first, count).reshape(-1).numpy()
    np.testing.assert_array_equal(got, openssl_words(KEY, nonce, first, count))
    other = dn.chacha20_blocks(bytes(32), nonce, first, count).reshape(-1).numpy()
    assert not np.array_equal(got, other)


def test_rfc_8439_block_function_vector() -> None:
    """RFC 8439 § 2.3.2: key 00…1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, counter 1."""
    nonce = (0x09000000, 0x4A000000, 0)
    words = dn.chacha20_blocks(KEY, nonce, 1, 1)[0].tolist()
    assert [f"{w:08x}" for w in words[:4]] == ["e4e7f110", "15593bd1", "1fdd0f50", "c47120a3"]
    assert [f"{w:08x}" for w in words[12:]] == ["d19c12b5", "b94e16de", "e883d0cb", "4e3c50a2"]


def ref_normals(words: np.ndarray, d: int, dtype: type, refill: dict[int, int]) -> np.ndarray:
    """The transform in NumPy on the same words (float64 through mpmath-free formulas)."""
    m = (d + 1) // 2
    lo, hi = words[0 : 2 * m : 2], words[1 : 2 * m : 2]
    w = [int(a) | (int(b) << 32) for a, b in zip(lo, hi, strict=True)]
    r = np.empty(m)
    for j, wj in enumerate(w):
        if wj >= 1 << 32:
            r[j] = math.sqrt(-2.0 * math.log((wj >> 1) * 2.0**-63))
        else:
            u = wj * 2.0**-64 + (2.0 * float(refill[j]) + 1.0) * 2.0**-129
            r[j] = math.sqrt(-2.0 * math.log(u))
    if dtype is np.float32:
        theta = words[2 * m : 3 * m] * (2 * math.pi * 2.0**-32)
    else:
        a = [int(x) | (int(y) << 32) for x, y in zip(words[2 * m : 4 * m : 2],
                                                     words[2 * m + 1 : 4 * m : 2], strict=True)]
        theta = np.array([x >> 11 for x in a], dtype=np.float64) * (2 * math.pi * 2.0**-53)
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:d]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [1, 2, 7, 1001])
def test_rows_are_the_transform_of_the_openssl_keystream(dtype: torch.dtype, d: int) -> None:
    gen = DeviceGaussian(KEY, position=4)
    z = gen.next_row(d, dtype)
    assert z.dtype == dtype and z.shape == (d,) and gen.position == 5
    domain = dn.DOMAIN_FLOAT32 if dtype == torch.float32 else dn.DOMAIN_FLOAT64
    per_pair = 3 if dtype == torch.float32 else 4
    m = (d + 1) // 2
    words = openssl_words(KEY, (domain, 4, 0), 0, -(-per_pair * m // 16))
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    want = ref_normals(words, d, np_dtype, {})
    rtol = 2e-6 if dtype == torch.float32 else 1e-13
    np.testing.assert_allclose(z.numpy().astype(np.float64), want, rtol=rtol, atol=rtol)
    assert torch.equal(gen.row(4, d, dtype), z)  # row t by counter, whatever came before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adversarial_words_take_the_refill_path_to_the_stated_tail(dtype: torch.dtype) -> None:
    m = 8
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**32, 4 * m, dtype=np.int64)
    words[1 : 2 * m : 2][::2] = 0  # hi = 0: w < 2³² on every other pair
    words[0:2] = 0  # pair 0: w = 0
    refill = {j: (0 if j == 0 else int(rng.integers(0, 2**63)) * 2 + 1) for j in range(m)}
    asked: list[int] = []

    def fl_refill(pairs: torch.Tensor) -> torch.Tensor:
        asked.extend(pairs.tolist())
        return torch.tensor([float(refill[j]) for j in pairs.tolist()], dtype=torch.float64)

    z = dn.normals_from_words(torch.from_numpy(words), 2 * m, dtype, fl_refill)
    assert asked == list(range(0, m, 2))
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    want = ref_normals(words, 2 * m, np_dtype, refill)
    np.testing.assert_allclose(z.numpy().astype(np.float64), want, rtol=2e-6, atol=1e-6)
    radius = math.hypot(float(z[0]), float(z[m]))  # w = 0, v = 0: u = 2⁻¹²⁹
    assert radius == pytest.approx(math.sqrt(2 * 129 * math.log(2)), rel=1e-6)


def test_refill_words_come_from_their_own_nonce() -> None:
    gen = DeviceGaussian(KEY)
    want = openssl_words(KEY, (dn.DOMAIN_FLOAT32 | dn.DOMAIN_REFILL, 9, 0), 12, 1)
    v = int(want[0]) | (int(want[1]) << 32)
    assert float(gen.refill_word(dn.DOMAIN_FLOAT32, 9, 12)) == float(v)


def test_pack_unpack_continues_and_keys() -> None:
    gen = DeviceGaussian.from_seed(17)
    gen.next_row(10)
    words = gen.pack()
    assert words.dtype == np.uint64 and words.shape == (6,)
    again = DeviceGaussian.unpack(words)
    assert again.position == gen.position == 1 and again.key == gen.key
    assert torch.equal(again.next_row(33, torch.float64), gen.next_row(33, torch.float64))
    with pytest.raises(ValueError, match="device-noise"):
        DeviceGaussian.unpack(words[:5])
    assert str(gen.key) not in repr(gen)
    # seeds sharing their low 64 bits give unrelated keys; no seed: OS entropy, 256 bits
    assert DeviceGaussian.from_seed(5).key != DeviceGaussian.from_seed(5 + 2**64).key
    keys = {DeviceGaussian.from_seed(None).key for _ in range(16)}
    assert len(keys) == 16 and max(k.bit_length() for k in keys) > 248
    with pytest.raises(ValueError, match="32 bytes"):
        DeviceGaussian(bytes(16))
    with pytest.raises(ValueError, match="float32 or float64"):
        gen.row(0, 4, torch.float16)


def test_moments_and_ks_against_the_normal() -> None:
    """2·10⁵ draws of each dtype (CPU tensors are slow for the 32-bit word arithmetic: the
    suite's budget): mean, variance within 5 standard errors, KS against N(0, 1)."""
    gen = DeviceGaussian.from_seed(2024)
    for dtype in (torch.float32, torch.float64):
        z = gen.next_row(200_000, dtype).numpy().astype(np.float64)
        se = 1 / math.sqrt(z.size)
        assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
        assert stats.kstest(z, "norm").pvalue > 1e-3


_FUSED_CHECK = """
import torch
from flwr_corrnoise.torch import device_noise as dn
from flwr_corrnoise.torch import chacha_triton
key = bytes(range(32))
# (each program costs the interpreter ≈ 0.5 s: two programs, the second ragged; a counter
# ending at 2³², one crossing 2³¹; no blocks)
cases = [((1, 5, 0), 0, 300), ((2, 2**32 - 1, 2**31), 2**32 - 5, 5),
         ((9, 9, 9), 2**31 - 3, 6), ((3, 3, 3), 0, 0)]
for nonce, first, count in cases:
    fused = dn.chacha20_blocks(key, nonce, first, count, fused=True)
    ops = dn.chacha20_blocks(key, nonce, first, count, fused=False)
    assert fused.shape == (count, 16) and torch.equal(fused, ops), (nonce, first, count)
print("same words")
"""


def test_the_fused_triton_keystream_equals_the_torch_ops_bit_for_bit() -> None:
    """The CUDA path's fused kernel (torch/chacha_triton.py), run by Triton's interpreter on
    the CPU (a process of its own: the interpreter is chosen when Triton compiles), gives the
    torch ops' words — which equal OpenSSL's above — over two programs, the last one ragged,
    and counters that cross 2³¹ and end at 2³²."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "same words" in run.stdout, run.stderr[-3000:]


def test_a_fused_kernel_that_cannot_build_falls_back_to_the_same_words(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Where Triton imports but cannot build or run (no ptxas, a driver it does not know),
    the default way warns once and uses the torch ops — the same words — for the rest of
    the process; a caller who forces the fused kernel gets the error."""
    pytest.importorskip("triton")
    from flwr_corrnoise.torch import chacha_triton

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("ptxas not found")

    monkeypatch.setattr(dn, "_FUSED_FAILED", False)
    monkeypatch.setattr(dn, "fused_available", lambda device: True)
    monkeypatch.setattr(chacha_triton, "chacha20_blocks", broken)
    with caplog.at_level("WARNING"):
        got = dn.chacha20_blocks(KEY, (1, 5, 0), 3, 40).reshape(-1).numpy()
    np.testing.assert_array_equal(got, openssl_words(KEY, (1, 5, 0), 3, 40))
    assert dn._FUSED_FAILED and "ptxas not found" in caplog.text
    with pytest.raises(RuntimeError, match="ptxas"):
        dn.chacha20_blocks(KEY, (1, 5, 0), 3, 40, fused=True)


# -- the device path wired into TorchNoiseStream (torch/streams.py) ------------------------------
def device_rows(key: bytes, count: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows 0 … count − 1 as the device path must make them: the transform
    (``normals_from_words``) of OpenSSL's ChaCha20 keystream of each row's nonce, refill
    words from OpenSSL too — no torch keystream code."""
    domain = dn.DOMAIN_FLOAT32 if dtype == torch.float32 else dn.DOMAIN_FLOAT64
    m = (d + 1) // 2
    per_pair = 3 if dtype == torch.float32 else 4
    rows = []
    for t in range(count):
        words = openssl_words(key, (domain, t, 0), 0, -(-per_pair * m // 16))[: per_pair * m]

        def refill(pairs: torch.Tensor, t: int = t) -> torch.Tensor:
            out = []
            for j in pairs.tolist():
                w = openssl_words(key, (domain | dn.DOMAIN_REFILL, t, 0), j, 1)
                out.append(float(w[1]) * 2.0**32 + float(w[0]))
            return torch.tensor(out, dtype=torch.float64)

        rows.append(dn.normals_from_words(torch.from_numpy(words), d, dtype, refill))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["blt", "banded-inverse", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_device_noise_stream_on_cpu_tensors_draws_the_reference_rows(
        name: str, dtype: torch.dtype) -> None:
    """``device_noise=True`` on the CPU runs the device path's code on CPU tensors: the
    stream's ξ rows are the reference rows bit for bit (keystream from OpenSSL), and its
    increments are std·M·ξ (M the mechanism's noising matrix) — for ``banded-inverse``
    through rows regenerated by counter (the cursor goes back rows, as on the host)."""
    from flwr_corrnoise.mechanisms import build_factorization
    from flwr_corrnoise.streams import RowCursor
    from flwr_corrnoise.torch.streams import TorchNoiseStream

    n, d, std, seed = 6, 5, 0.7, 11
    key = dn.key_from_seed(seed)
    drawn = TorchNoiseStream.create(name, n, d, std, seed=seed, device_noise=True, dtype=dtype)
    assert drawn.device_noise and drawn._rng.key == int.from_bytes(key, "little")
    assert RowCursor(drawn).rows_back(0)  # rows by counter: a regenerating kernel goes back
    xi = device_rows(key, n, d, dtype)
    assert torch.equal(torch.stack([drawn._draw() for _ in range(n)]), xi)
    stream = TorchNoiseStream.create(name, n, d, std, seed=seed, device_noise=True, dtype=dtype)
    e = torch.stack([stream.next() for _ in range(n)]).double().numpy()
    fact = build_factorization(name, n)
    m = fact.noising_matrix()
    if hasattr(fact, "drawn_nodes"):  # the tree draws rows for the nodes B uses only
        full = torch.zeros(m.shape[1], d, dtype=dtype)
        full[fact.drawn_nodes()] = xi[: len(fact.drawn_nodes())]
        xi = full
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(e, std * m @ xi.double().numpy(), atol=tol)


def test_a_device_noise_stream_restores_forks_and_keys() -> None:
    """Its state is the device generator's six words (a 256-bit key, the row); a restored
    stream and a fork continue bit for bit; without a seed the key is 256 bits of OS
    entropy; on the CPU the default stays the host AES kernel."""
    from flwr_corrnoise.cipher_noise import CipherGaussian
    from flwr_corrnoise.torch.streams import TorchNoiseStream

    s = TorchNoiseStream.create("banded-inverse", 10, 7, 1.0, seed=4, device_noise=True)
    for _ in range(3):
        s.next()
    words = s.state_dict()["rng"]
    assert words.shape == (6,) and int(words[0]) == dn.STATE_TAG and int(words[5]) == 3
    restored = TorchNoiseStream.from_bytes(s.to_bytes())
    fork = s.fork()
    assert restored.device_noise and fork.device_noise
    for _ in range(4):
        x = s.next()
        assert torch.equal(x, restored.next()) and torch.equal(x, fork.next())
    keys = {TorchNoiseStream.create("blt", 4, 3, 1.0, device_noise=True)._rng.key
            for _ in range(8)}
    assert len(keys) == 8 and max(k.bit_length() for k in keys) > 248
    host = TorchNoiseStream.create("blt", 4, 3, 1.0, seed=1)
    assert not host.device_noise and isinstance(host._rng, CipherGaussian)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_noise_is_made_on_the_device() -> None:
    """On a CUDA device (the default there): the keystream equals OpenSSL's bit for bit, the
    rows are the CPU device path's to float tolerance (CUDA's log/cos/sin), 10⁷ draws of
    each dtype pass the moments, a KS test against N(0, 1) and the 4σ tail, and a stream's
    increments are CUDA tensors that restore and continue bit for bit."""
    from flwr_corrnoise.torch.streams import TorchNoiseStream

    for fused in (None, False):  # the default (fused Triton kernel where Triton is), the ops
        got = dn.chacha20_blocks(KEY, (1, 5, 0), 3, 40, "cuda", fused).reshape(-1).cpu()
        np.testing.assert_array_equal(got.numpy(), openssl_words(KEY, (1, 5, 0), 3, 40))
    if dn.fused_available("cuda"):  # many programs, a ragged last one, a counter near 2³²
        for first, count in ((0, 70_001), (2**32 - 3000, 3000), (2**31 - 5, 10)):
            assert torch.equal(dn.chacha20_blocks(KEY, (7, 1, 2), first, count, "cuda", True),
                               dn.chacha20_blocks(KEY, (7, 1, 2), first, count, "cuda", False))
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-13)):
        gpu = DeviceGaussian(KEY, device="cuda").row(2, 100_001, dtype)
        assert gpu.device.type == "cuda"
        cpu = DeviceGaussian(KEY).row(2, 100_001, dtype)
        np.testing.assert_allclose(gpu.cpu().double().numpy(), cpu.double().numpy(),
                                   rtol=tol, atol=tol)
    for dtype in (torch.float32, torch.float64):  # the law at 10⁷ draws, made on the device
        z = DeviceGaussian(KEY, device="cuda").row(7, 10_000_000, dtype).cpu().double().numpy()
        se = 1 / math.sqrt(z.size)
        assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
        assert stats.kstest(z, "norm").pvalue > 1e-3
        tail = float(np.mean(np.abs(z) > 4.0))  # P(|Z| > 4) = 6.33·10⁻⁵: ≈ 633 of 10⁷
        expected = 2 * stats.norm.sf(4.0)
        assert abs(tail - expected) < 5 * math.sqrt(expected / z.size)
    # BLT adopts its restored rows as its buffer; the others take them row by row
    for name in ("blt", "tree", "banded-inverse"):
        s = TorchNoiseStream.create(name, 8, 1000, 1.0, seed=3, device="cuda")
        assert s.device_noise and s.next().device.type == "cuda"
        s.next()
        again = TorchNoiseStream.from_bytes(s.to_bytes())
        assert again.device.type == "cuda"
        for _ in range(3):
            assert torch.equal(s.next(), again.next())
