"""Cost of a standard normal: the AES-128-CTR kernel against NumPy's Philox ziggurat.

    python benchmarks/cipher_noise.py --dims 100000 1000000 --repeats 30 --floor --ks 10000000

Every generator draws a row of ``d`` normals into a preallocated array, in the same run and
round-robin (each repeat times every candidate once, so all see the same machine load); the
figure is the best of ``--repeats`` in ns per normal, and "× Philox" divides it by NumPy's
Philox ziggurat of the same dtype in the same run:

* ``Philox ziggurat``: ``Generator(Philox).standard_normal(out=…, dtype=…)`` (the noise of
  the streams before issue 34);
* ``ChaCha20Gaussian``: :mod:`flwr_corrnoise.secure_noise`'s sampler (float64);
* ``cipher row``: :meth:`flwr_corrnoise.cipher_noise.CipherGaussian.row` (the kernel:
  Box–Muller on the AES-128-CTR keystream);
* ``ziggurat (candidate)``: a vectorized ziggurat on 32-bit (float32) or 64-bit (float64)
  words of an AES-128-CTR row, its rare fallbacks from counters of their own included
  (``benchmarks/ziggurat_candidate.py``, beside this script) — measured, not adopted;
* ``--before DIR``: ``CipherGaussian.row`` of an earlier copy of the package (for example
  ``git archive 8fbfb73 flwr_corrnoise | tar -x -C /tmp/before``: float64 rows by
  Box–Muller), loaded under another name and timed in the same round-robin.

``--cpu-time`` times each call by its thread's CPU time instead of the wall clock (on a
shared machine whose load is far above its cores, the wall clock counts other processes'
time slices; CPU time does not, though caches are still shared).

``--floor`` adds where a kernel normal's time goes, on hot buffers of one chunk: the
keystream per pair (AES-128-CTR and ChaCha20, the bytes the kernel reads), the transforms
(Box–Muller float32, the ziggurat's main path in both dtypes and each of its NumPy passes,
its fallback per pending normal), and the elementary functions a transform could use —
NumPy's and torch's (SLEEF-vectorized) ``log``, ``sin``, ``cos`` in both dtypes — with
torch's ``randn`` (Mersenne Twister: neither keyed nor secure) for scale.

``--stream-dims D …`` adds a stream's whole step, ``NoiseStream.next()`` of a ``blt`` stream
(N = 4000) at small ``d`` — where a row is short and a transform's fixed ≈ 35 NumPy calls
dominate — side by side in one run: a Philox stream (noise-state format 2, still loaded and
continued), the AES stream drawing one row a kernel call (``ROW_CACHE_FLOATS = 0``: the
streams before rows were computed ahead) and the AES stream as it is (small rows several a
kernel call, :meth:`~flwr_corrnoise.cipher_noise.CipherGaussian.next_row`'s ``ahead``).
Each repeat times ``--stream-steps`` consecutive steps of each candidate (a fresh stream,
untimed, when one runs out); the figure is the best repeat's mean µs per step::

    python benchmarks/cipher_noise.py --dims 1000 --repeats 30 --stream-dims 2 20 100 1000

``--grid-dims D …`` measures the floating-point defence (Mironov 2012; the secure mode's
power-of-two grid, :mod:`flwr_corrnoise.secure_noise`) against a learner's message: a step
of an AES ``blt`` stream (N = 4000, float64), ``value + noise`` and the release's bytes
(``tobytes``: the copy a message makes — a lower bound on a message's cost, so the ratio is
an upper bound on the grid's share), side by side with the grid alone (``round_to_grid`` of
the increment, ``add_on_grid``'s exact sum with its checks), each of ``--stream-steps``
steps a repeat::

    python benchmarks/cipher_noise.py --dims 1000 --repeats 10 --grid-dims 100000 1000000

``--ks N`` draws ``N`` normals of each dtype once and prints their moments and a
Kolmogorov–Smirnov test against ``scipy.stats.norm`` (the issue's 10⁷-draw check; the test
suite keeps to 10⁶).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import cryptography
import numpy as np
import ziggurat_candidate as zg  # beside this script (python benchmarks/cipher_noise.py)
from _before import import_before
from cryptography.hazmat.backends.openssl.backend import backend as openssl_backend
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from flwr_corrnoise import cipher_noise as cn
from flwr_corrnoise import compiled_kernel
from flwr_corrnoise.secure_noise import ChaCha20Gaussian

CLOCK: Callable[[], float] = time.perf_counter


def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds per call, the best of ``repeats`` round-robin rounds (each round calls every
    function once; a first call of each warms caches and cipher contexts)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = CLOCK()
            fn()
            best[name] = min(best[name], CLOCK() - start)
    return best


def load_before(path: str) -> object:
    """``CipherGaussian`` of an earlier copy of the package at ``path`` (its directory
    ``flwr_corrnoise``), imported as ``flwr_corrnoise_before``."""
    import_before(path)
    from flwr_corrnoise_before import cipher_noise as before  # type: ignore[import-not-found]
    return before.CipherGaussian


def numpy_row(gen: cn.CipherGaussian, d: int, out: np.ndarray) -> None:
    """The kernel's NumPy path (a learner without a C compiler): the same floats."""
    with compiled_kernel.numpy_path():
        gen.row(1, d, out.dtype, out=out)


def draws(dims: list[int], repeats: int, before: object = None) -> None:
    cn.CipherGaussian.from_seed(0).row(0, 4)  # load (or build) the compiled kernel first
    print(f"kernel: {compiled_kernel.status()}")
    print("| d | generator | dtype | ns per normal | × Philox (same dtype) |")
    print("|---|---|---|---|---|")
    for d in dims:
        out32, out64 = np.empty(d, dtype=np.float32), np.empty(d)
        philox = np.random.Generator(np.random.Philox(key=0x5EED))
        cipher = cn.CipherGaussian.from_os_entropy()
        chacha = ChaCha20Gaussian.from_os_entropy()
        zig = zg.Rows(cn.os_entropy_key())
        fns = {
            ("Philox ziggurat", "float32"):
                lambda: philox.standard_normal(out=out32, dtype=np.float32),  # noqa: B023
            ("Philox ziggurat", "float64"): lambda: philox.standard_normal(out=out64),  # noqa: B023
            ("ChaCha20Gaussian (secure_noise)", "float64"):
                lambda: chacha.standard_normal(d),  # noqa: B023
            ("cipher row (AES-128-CTR)", "float32"):
                lambda: cipher.row(1, d, np.float32, out=out32),  # noqa: B023
            ("cipher row (AES-128-CTR)", "float64"):
                lambda: cipher.row(1, d, np.float64, out=out64),  # noqa: B023
            ("cipher row, NumPy path", "float32"):
                lambda: numpy_row(cipher, d, out32),  # noqa: B023
            ("cipher row, NumPy path", "float64"):
                lambda: numpy_row(cipher, d, out64),  # noqa: B023
            ("ziggurat (candidate, AES-128-CTR)", "float32"):
                lambda: zig.row(1, out32),  # noqa: B023
            ("ziggurat (candidate, AES-128-CTR)", "float64"):
                lambda: zig.row(1, out64),  # noqa: B023
        }
        if before is not None:
            old = before.from_os_entropy()  # type: ignore[attr-defined]
            fns[("cipher row before (--before)", "float32")] = \
                lambda: old.row(1, d, np.float32, out=out32)  # noqa: B023
            fns[("cipher row before (--before)", "float64")] = \
                lambda: old.row(1, d, np.float64, out=out64)  # noqa: B023
        best = best_of({f"{k[0]}|{k[1]}": fn for k, fn in fns.items()}, repeats)
        for (name, dtype) in fns:
            ns = 1e9 * best[f"{name}|{dtype}"] / d
            ref = 1e9 * best[f"Philox ziggurat|{dtype}"] / d
            print(f"| {d:,} | {name} | {dtype} | {ns:.2f} | {ns / ref:.2f}× |", flush=True)


def stream_steps(dims: list[int], repeats: int, steps: int, horizon: int = 4000) -> None:
    """µs per ``NoiseStream.next()``: Philox (format 2) against AES, one row a kernel call
    and rows ahead, round-robin in one run."""
    from flwr_corrnoise.noise_keys import noise_generator
    from flwr_corrnoise.streams import NoiseStream, normalize_shapes

    def philox(d: int, dtype: type) -> NoiseStream:
        return NoiseStream("blt", horizon, normalize_shapes(d), 1.0, noise_generator(1),
                           dtype=dtype)

    def aes(d: int, dtype: type) -> NoiseStream:
        return NoiseStream.create("blt", horizon, d, 1.0, 1, dtype=dtype)

    cache = cn.ROW_CACHE_FLOATS
    candidates = [("Philox stream (format 2)", philox, cache),
                  ("AES stream, one row a kernel call (before)", aes, 0),
                  ("AES stream, rows ahead (now)", aes, cache)]
    print()
    print("| d | stream (blt, N = 4000) | dtype | µs per step | × Philox stream (same dtype) |")
    print("|---|---|---|---|---|")
    for d in dims:
        for dtype in (np.float64, np.float32):
            streams = [make(d, dtype) for _, make, _ in candidates]
            best = [math.inf] * len(candidates)
            for rep in range(repeats + 1):  # round 0 warms up (tables, contexts)
                for i, (_, make, floats) in enumerate(candidates):
                    if streams[i].remaining < steps:
                        streams[i] = make(d, dtype)
                    s = streams[i]
                    cn.ROW_CACHE_FLOATS = floats
                    try:
                        start = time.perf_counter()
                        for _ in range(steps):
                            s.next()
                        elapsed = time.perf_counter() - start
                    finally:
                        cn.ROW_CACHE_FLOATS = cache
                    if rep:
                        best[i] = min(best[i], elapsed / steps)
            for (name, _, _), t in zip(candidates, best, strict=True):
                print(f"| {d:,} | {name} | {np.dtype(dtype).name} | {1e6 * t:.1f} | "
                      f"{t / best[0]:.2f}× |", flush=True)


def grid_cost(dims: list[int], repeats: int, steps: int) -> None:
    """ms per learner step, plain and with the grid, and the grid's share of it; then the
    share of a whole learner message (the issue's measure: ≤ 10 % of a learner message)."""
    from flower_scale import LearnerMessages  # beside this script

    print()
    print("| d | learner step (AES blt stream + value + noise + bytes), ms | grid alone "
          "(round + exact add), ms | grid ÷ step | learner message (τ = 4), ms | "
          "grid × τ ÷ message |")
    print("|---|---|---|---|---|---|")
    for d in dims:
        t_step, t_grid, t_msg = _grid_row(d, repeats, steps)
        print(f"| {d:,} | {1e3 * t_step:.2f} | {1e3 * t_grid:.2f} | "
              f"{100 * t_grid / t_step:.0f} % | {1e3 * t_msg:.2f} | "
              f"{100 * LearnerMessages.tau * t_grid / t_msg:.0f} % |", flush=True)


def _grid_row(d: int, repeats: int, steps: int, std: float = 1.3
              ) -> tuple[float, float, float]:
    """Seconds per noise-only step, per grid (round + exact add) and per learner message:
    a train message through ``make_client_app`` (``benchmarks/flower_scale.py``'s
    :class:`LearnerMessages`: float64 model, BLT, τ = 4, the state offloaded), timed in
    the same round-robin. A message whose release were on the grid would add τ grids."""
    from flower_scale import LearnerMessages  # beside this script

    from flwr_corrnoise.secure_noise import add_on_grid, granularity, round_to_grid
    from flwr_corrnoise.streams import NoiseStream

    streams = [NoiseStream.create("blt", 4000, d, std, 1)]
    value = np.random.default_rng(0).standard_normal(d)
    g = granularity(std)
    noise = streams[0].next()
    buf = np.empty(d)

    def step() -> None:
        if streams[0].remaining < 1:
            streams[0] = NoiseStream.create("blt", 4000, d, std, 1)
        (value + streams[0].next()).tobytes()

    def grid() -> None:
        add_on_grid(value, round_to_grid(noise, g, out=buf), g)

    with LearnerMessages(d, "float64", repeats + 4) as messages:
        rounds = iter(range(1, repeats + 4))
        messages.send(next(rounds))  # the learner's first message creates its stream
        best = best_of({"step": lambda: [step() for _ in range(steps)],
                        "grid": lambda: [grid() for _ in range(steps)],
                        "message": lambda: messages.send(next(rounds))}, repeats)
    return best["step"] / steps, best["grid"] / steps, best["message"]


def floor(repeats: int) -> None:
    """Where the time goes, per normal, on one chunk's hot buffers."""
    k = cn.CHUNK_PAIRS
    ws = cn._workspace()
    key = cn.os_entropy_key()
    zeros = bytes(16 * k)
    ks = np.empty(16 * k + 16, dtype=np.uint8)
    aes = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    chacha = Cipher(algorithms.ChaCha20(key * 2, bytes(16)), mode=None).encryptor()
    aes.update_into(zeros, ks)
    out32, out64 = np.empty(2 * k, dtype=np.float32), np.empty(2 * k)
    x64 = np.random.default_rng(0).random(k) + 1e-3
    x32, y32, y64 = x64.astype(np.float32), np.empty(k, dtype=np.float32), np.empty(k)
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    zc = zg.CHUNK
    w32, w64 = ks[: 4 * zc].view("<u4"), ks[: 8 * zc].view("<u8")
    zws = zg.Workspace(zc)
    t = zg.tables()
    index, ok = zws.index[:zc], zws.ok[:zc]
    pending = zg.main_path(w64, out64[:zc], zws)
    pend_words = w64[pending] if pending is not None else w64[:0]
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    cos_t, sin_t = cn.direction_table()
    index_t = np.random.default_rng(1).integers(0, 1 << cn.TABLE_BITS, k)

    def fallback() -> None:  # every pending normal of a chunk, AES blocks included
        js = np.arange(len(pend_words), dtype=np.uint64)
        zg.finish(pend_words, f64, lambda p, step: zg.fallback_blocks(
            ecb, 0, np.zeros(len(p), dtype=np.uint64), js[p], step))

    pieces: dict[str, tuple[Callable[[], object], int]] = {
        "AES-128-CTR keystream, 4 B a normal (float32 ziggurat)":
            (lambda: aes.update_into(memoryview(zeros)[:4 * zc], ks), zc),
        "AES-128-CTR keystream, 6 B a normal (float32 Box–Muller, the kernel)":
            (lambda: aes.update_into(memoryview(zeros)[:12 * k], ks), 2 * k),
        "AES-128-CTR keystream, 8 B a normal (float64 Box–Muller and ziggurat)":
            (lambda: aes.update_into(memoryview(zeros)[:8 * zc], ks), zc),
        "ChaCha20 keystream, 6 B a normal":
            (lambda: chacha.update_into(memoryview(zeros)[:12 * k], ks), 2 * k),
        "ChaCha20 keystream, 8 B a normal":
            (lambda: chacha.update_into(memoryview(zeros)[:16 * k], ks), 2 * k),
        "NumPy float32 log (one a pair)": (lambda: np.log(x32, out=y32), 2 * k),
        "NumPy float64 log (one a pair)": (lambda: np.log(x64, out=y64), 2 * k),
        "NumPy float32 sin + cos (a pair)":
            (lambda: (np.sin(x32, out=y32), np.cos(x32, out=y32)), 2 * k),
        "NumPy float64 sin + cos (a pair)":
            (lambda: (np.sin(x64, out=y64), np.cos(x64, out=y64)), 2 * k),
        "Box–Muller transform, float32 (the kernel's)": (
            lambda: cn.pairs_from_keystream(ks, k, f32, lambda i, j: 0, out32[:k],
                                            out32[k:], ws), 2 * k),
        "Box–Muller transform, float64 (the kernel's: log, table rotation)": (
            lambda: cn.pairs_from_keystream(ks, k, f64, lambda i, j: 0, out64[:k],
                                            out64[k:], ws), 2 * k),
        "float64 table gathers (cos, sin; a pair)": (lambda: (
            np.take(cos_t, index_t, out=y64), np.take(sin_t, index_t, out=y64)), 2 * k),
        "float32 table rotation instead of sin + cos (a pair; not the kernel's)":
            (_table_rotation32(k), 2 * k),
        "ziggurat main path, float32 (candidate)":
            (lambda: zg.main_path(w32, out32[:zc], zws), zc),
        "ziggurat main path, float64 (candidate)":
            (lambda: zg.main_path(w64, out64[:zc], zws), zc),
        "  its pass: layer + sign bits → index (and, to intp)":
            (lambda: np.bitwise_and(w64, np.uint64(0x1FF), out=index.view(np.uint64)), zc),
        "  its pass: gather of K (np.take, 512 entries)":
            (lambda: np.take(t.accept[f64], index, out=zws.limit[:zc], mode="clip"), zc),
        "  its pass: gather of ±X·2⁻⁵² (np.take)":
            (lambda: np.take(t.scale[f64], index, out=out64[:zc], mode="clip"), zc),
        "  its pass: mantissa < K (compare)":
            (lambda: np.less(zws.mant[:zc], zws.limit[:zc], out=ok), zc),
        "  its pass: all accepted? (reduce)": (lambda: ok.all(), zc),
        f"ziggurat fallback (candidate), float64: its {len(pend_words)} pending normals, "
        "per chunk normal":
            (fallback, zc),
    }
    try:
        import torch

        torch.set_num_threads(1)
        tx32, tx64 = torch.from_numpy(x32), torch.from_numpy(x64)
        ty32, ty64 = torch.from_numpy(y32), torch.from_numpy(y64)
        big32, big64 = torch.empty(2 * k), torch.empty(2 * k, dtype=torch.float64)
        pieces.update({
            "torch float32 log (one a pair)": (lambda: torch.log(tx32, out=ty32), 2 * k),
            "torch float64 log (one a pair)": (lambda: torch.log(tx64, out=ty64), 2 * k),
            "torch float32 sin + cos (a pair)":
                (lambda: (torch.sin(tx32, out=ty32), torch.cos(tx32, out=ty32)), 2 * k),
            "torch float64 sin + cos (a pair)":
                (lambda: (torch.sin(tx64, out=ty64), torch.cos(tx64, out=ty64)), 2 * k),
            "torch randn float32 (Mersenne Twister, unkeyed)":
                (lambda: torch.randn(2 * k, out=big32), 2 * k),
            "torch randn float64 (Mersenne Twister, unkeyed)":
                (lambda: torch.randn(2 * k, out=big64), 2 * k),
        })
    except ImportError:
        pass
    best = best_of({name: fn for name, (fn, _) in pieces.items()}, repeats)
    print()
    print("| piece (hot buffers) | ns per normal |")
    print("|---|---|")
    for name, (_, normals) in pieces.items():
        print(f"| {name} | {1e9 * best[name] / normals:.2f} |")


def _table_rotation32(k: int) -> Callable[[], None]:
    """What float32 ``sin`` + ``cos`` would cost as a table rotation (the float64 Box–Muller
    computes them so): the
    angle word's top 11 bits pick ``(cos, sin)`` of a sector from float32 tables, the rest
    is a small angle φ whose ``sin φ ≈ φ − φ³/6`` and ``cos φ − 1 ≈ −φ²/2`` rotate it, times
    the radius — about fifteen float32 passes and two gathers, to set beside the two
    ufuncs (a candidate for a new kernel format, not what the kernel does)."""
    angles = np.random.default_rng(2).integers(0, 1 << 32, k, dtype=np.uint64).astype(np.uint32)
    cos_t, sin_t = (t.astype(np.float32) for t in cn.direction_table())
    r = np.random.default_rng(3).random(k).astype(np.float32)
    idx = np.empty(k, dtype=np.intp)
    c, s, phi, t, u, z1, z2 = (np.empty(k, dtype=np.float32) for _ in range(7))
    bits = np.empty(k, dtype=np.uint32)
    scale = np.float32(2 * math.pi * 2.0**-32)

    def run() -> None:
        mul, add, sub = np.multiply, np.add, np.subtract
        np.right_shift(angles, np.uint32(32 - cn.TABLE_BITS), out=bits)
        np.copyto(idx, bits, casting="unsafe")
        np.take(cos_t, idx, out=c, mode="clip")
        np.take(sin_t, idx, out=s, mode="clip")
        np.bitwise_and(angles, np.uint32((1 << (32 - cn.TABLE_BITS)) - 1), out=bits)
        np.copyto(phi, bits, casting="unsafe")
        mul(phi, scale, out=phi)
        mul(phi, phi, out=t)
        mul(t, np.float32(-1 / 6), out=u)  # sin φ = φ + φ·(−φ²/6)
        mul(u, phi, out=u)
        add(u, phi, out=u)
        mul(t, np.float32(-0.5), out=t)  # cos φ − 1
        mul(c, r, out=c)
        mul(s, r, out=s)
        mul(c, t, out=z1)  # z₁ = Rc + (Rc·(cos φ − 1) − Rs·sin φ)
        mul(s, u, out=phi)
        sub(z1, phi, out=z1)
        add(z1, c, out=z1)
        mul(s, t, out=z2)  # z₂ = Rs + (Rs·(cos φ − 1) + Rc·sin φ)
        mul(c, u, out=phi)
        add(z2, phi, out=z2)
        add(z2, s, out=z2)

    return run


def ks_check(n: int) -> None:
    from scipy import stats

    print()
    print("| dtype | draws | mean | variance | skewness | excess kurtosis | max abs | "
          "KS statistic | KS p-value |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = cn.CipherGaussian.from_os_entropy()
    for dtype in (np.float32, np.float64):
        z = gen.standard_normal(n, dtype=dtype).astype(np.float64)
        ks = stats.kstest(z, "norm")
        print(f"| {np.dtype(dtype).name} | {n:,} | {z.mean():+.2e} | {z.var():.5f} | "
              f"{stats.skew(z):+.2e} | {stats.kurtosis(z):+.2e} | {np.abs(z).max():.2f} | "
              f"{ks.statistic:.2e} | {ks.pvalue:.3f} |", flush=True)


def simd() -> str:
    """The widest SIMD NumPy dispatches to here: its float32 ``log``/``sin``/``cos`` are
    vectorized with AVX-512 and much slower without, so the figures depend on it."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy < 2
        return "SIMD unknown"
    for name in ("AVX512_SKX", "AVX512F", "AVX2", "SSE42"):
        if features.get(name):
            return name
    return "no AVX"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--floor", action="store_true", help="where a normal's time goes")
    p.add_argument("--stream-dims", type=int, nargs="*", default=[], metavar="D",
                   help="also time NoiseStream.next() at these d (Philox vs AES)")
    p.add_argument("--stream-steps", type=int, default=100, metavar="K",
                   help="steps a repeat times (--stream-dims)")
    p.add_argument("--grid-dims", type=int, nargs="*", default=[], metavar="D",
                   help="the floating-point defence's cost against a learner step at these d")
    p.add_argument("--before", metavar="DIR",
                   help="also time CipherGaussian.row of the package copy DIR/flwr_corrnoise")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the thread's CPU time instead of the wall clock")
    p.add_argument("--ks", type=int, default=0, metavar="N",
                   help="moments and a KS test of N draws of each dtype")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    print(f"numpy {np.__version__} ({simd()}), cryptography {cryptography.__version__} "
          f"({openssl_backend.openssl_version_text()}), {os.cpu_count()} CPUs; "
          f"best of {args.repeats} round-robin repeats; one thread")
    if args.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    before = load_before(args.before) if args.before else None
    print(f"clock: {'thread CPU time' if args.cpu_time else 'wall'}; load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    draws(args.dims, args.repeats, before)
    if args.stream_dims:
        if not 1 <= args.stream_steps <= 4000:
            p.error("--stream-steps must be in [1, 4000]")
        stream_steps(args.stream_dims, args.repeats, args.stream_steps)
    if args.grid_dims:
        grid_cost(args.grid_dims, args.repeats, args.stream_steps)
    if args.floor:
        floor(args.repeats)
    if args.ks:
        ks_check(args.ks)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
