"""Issue 34's draw floor, measured with a compiled transform beside the library's kernel.

    python benchmarks/compiled_noise_floor.py --dims 100000 1000000 --repeats 30 --cpu-time

The third pass (docs/benchmarks.md) measured the floor of a normal with NumPy's and
torch's elementary functions and called the 2.5 / 5 ns targets blocked on this machine's
SIMD. This script measures it another way: Box–Muller compiled in one fused C loop
(``compiled_box_muller.c`` beside this script; GCC ``-O3 -mavx2 -mfma -ffast-math``, its
``log``/``sin``/``cos`` vectorized by glibc's libmvec), on the same AES-128-CTR keystream
bytes per pair as the kernel (8 + 4 a float32 pair, 8 + 8 a float64 one), side by side
and round-robin with the library's kernel (:meth:`flwr_corrnoise.cipher_noise.
CipherGaussian.row`) and NumPy's Philox ziggurat:

* ``transform (hot)``: the compiled transform alone on one chunk's hot buffers;
* ``compiled row``: a whole row of ``d`` normals — AES-128-CTR keystream by
  ``cryptography``'s ``update_into`` into a preallocated buffer, chunk by chunk (16,384
  pairs), then the compiled transform into the row — what a compiled kernel would cost;
* ``C row``: the same in C alone — OpenSSL's EVP AES-128-CTR a chunk at a time into a
  buffer that stays in cache, then the transform, no interpreter between chunks (links
  ``-lcrypto``: the system's OpenSSL);
* ``cipher row``: the library's kernel — since the fifth pass itself compiled
  (:mod:`flwr_corrnoise.compiled_kernel`; this column was its NumPy passes before), and
  ``cipher row, NumPy path``: the same floats without a compiler; ``Philox``: NumPy's ziggurat.

It is a measurement, not a kernel: no refill of the rare small radius words, rows not
addressable by counter, results rounded by libmvec (≤ 4 ulp) rather than by NumPy. The
compiled rows' (both paths') mean, variance and a Kolmogorov–Smirnov test against N(0, 1)
are printed, and the run fails below p = 10⁻⁴, so that the floor is of a correct transform.
Needs ``gcc``, OpenSSL's headers and an AVX2 CPU; says so and exits 0 without them
(nothing is timed).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cipher_noise  # beside this script: its round-robin best_of and clock
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from flwr_corrnoise import cipher_noise as cn

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "compiled_box_muller.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffast-math", "-fPIC", "-shared"]
CHUNK = 1 << 14  # pairs a chunk: the kernel's order of size, hot in L2
VECTOR_SYMBOLS = ("_ZGVdN8v_logf", "_ZGVdN8v_cosf", "_ZGVdN4v_log", "_ZGVdN4v_cos")
_P = ctypes.c_void_p


def build(folder: Path) -> ctypes.CDLL:
    """Compile the transform into ``folder`` and load it; raise if GCC did not vectorize
    its elementary functions (then it would not be the floor this script claims)."""
    lib = folder / "libbm.so"
    subprocess.run(["gcc", *FLAGS, str(SOURCE), "-o", str(lib), "-lcrypto", "-lmvec", "-lm"],
                   check=True, capture_output=True, text=True)
    symbols = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    missing = [s for s in VECTOR_SYMBOLS if s not in symbols]
    if missing:
        raise RuntimeError(f"the transform was not vectorized (no {', '.join(missing)})")
    dll = ctypes.CDLL(str(lib))
    dll.bm32.restype = dll.bm64.restype = None
    dll.row_c.restype = ctypes.c_int
    return dll


class CompiledRows:
    """Rows of ``d`` normals: AES-128-CTR keystream per chunk, then the compiled transform
    (the cosines then the sines of a chunk's pairs, as the kernel lays a chunk out)."""

    def __init__(self, dll: ctypes.CDLL, key: bytes) -> None:
        self.dll, self.key = dll, key
        self.ks = bytearray(16 * CHUNK + 16)
        self.zeros = bytes(16 * CHUNK)
        self.r = np.empty(CHUNK)
        self.t = np.empty(CHUNK)

    def fill(self, out: np.ndarray, row: int = 1) -> None:
        f32 = out.dtype == np.float32
        word = 12 if f32 else 16  # keystream bytes a pair
        enc = Cipher(algorithms.AES(self.key), modes.CTR(row.to_bytes(16, "little"))).encryptor()
        ks = np.frombuffer(self.ks, dtype=np.uint8)
        d, lo = out.size, 0
        while lo < d:
            m = min(CHUNK, (d - lo + 1) // 2)
            n = word * m
            enc.update_into(memoryview(self.zeros)[:n], self.ks)
            rw = ks[: 8 * m]
            sin_n = min(m, d - lo - m)
            oc, os_ = out[lo : lo + m], out[lo + m : lo + m + sin_n]
            if sin_n < m:  # an odd tail: the last pair's sine is dropped
                os_ = np.empty(m, dtype=out.dtype)
            args = [rw.ctypes.data, ks[8 * m : n].ctypes.data, oc.ctypes.data,
                    os_.ctypes.data, self.r.ctypes.data]
            if f32:
                self.dll.bm32(*[_P(a) for a in args], ctypes.c_size_t(m))
            else:
                self.dll.bm64(*[_P(a) for a in args], _P(self.t.ctypes.data),
                              ctypes.c_size_t(m))
            if sin_n < m:
                out[lo + m : lo + m + sin_n] = os_[:sin_n]
            lo += m + sin_n

    def fill_c(self, out: np.ndarray, row: int = 1) -> None:
        """The whole row in C (``row_c``: OpenSSL's EVP AES-128-CTR a chunk at a time into
        a buffer in cache, then the transform), with no Python between chunks."""
        iv = row.to_bytes(16, "little")
        rc = self.dll.row_c(ctypes.c_char_p(self.key), ctypes.c_char_p(iv),
                            _P(out.ctypes.data), ctypes.c_size_t(out.size),
                            ctypes.c_int(out.dtype == np.float32))
        if rc:
            raise RuntimeError("OpenSSL's AES-128-CTR failed in the C row")


def transform_hot(dll: ctypes.CDLL, dtype: type, repeats: int) -> float:
    """ns per normal of the compiled transform alone, one chunk of hot buffers."""
    rng = np.random.default_rng(0)
    rw = rng.integers(0, 2**64, CHUNK, dtype=np.uint64)
    aw = rng.integers(0, 2**64 if dtype == np.float64 else 2**32, CHUNK,
                      dtype=np.uint64 if dtype == np.float64 else np.uint32)
    oc, os_, r, t = (np.empty(CHUNK, dtype=dtype) for _ in range(4))
    ptrs = [_P(a.ctypes.data) for a in (rw, aw, oc, os_, r)]
    if dtype == np.float32:
        def fn() -> None:
            dll.bm32(*ptrs, ctypes.c_size_t(CHUNK))
    else:
        def fn() -> None:
            dll.bm64(*ptrs, _P(t.ctypes.data), ctypes.c_size_t(CHUNK))
    return 1e9 * cipher_noise.best_of({"t": fn}, repeats * 10)["t"] / (2 * CHUNK)


#: below this KS p-value the compiled rows are not N(0, 1) and the script fails
MIN_P = 1e-4


def check(rows: CompiledRows, n: int) -> str:
    """Both compiled paths' moments and KS test against N(0, 1); raise below
    :data:`MIN_P` (a floor of a wrong transform would be no floor)."""
    from scipy import stats

    lines = []
    for path, fill in (("compiled row", rows.fill), ("C row", rows.fill_c)):
        for dtype in (np.float32, np.float64):
            z = np.empty(n, dtype=dtype)
            fill(z)
            ks = stats.kstest(z.astype(np.float64), "norm")
            if not ks.pvalue >= MIN_P:
                raise SystemExit(f"the {path}'s {np.dtype(dtype).name} normals are not "
                                 f"N(0, 1): KS p = {ks.pvalue:.2e}")
            lines.append(f"| {path} | {np.dtype(dtype).name} | {n:,} | {z.mean():+.2e} | "
                         f"{z.var():.5f} | {np.abs(z).max():.2f} | {ks.statistic:.2e} | "
                         f"{ks.pvalue:.3f} |")
    return ("| path | dtype | draws | mean | variance | max abs | KS statistic | KS p-value |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the thread's CPU time instead of the wall clock")
    p.add_argument("--check", type=int, default=1_000_000, metavar="N",
                   help="moments and KS test of N compiled normals per dtype (0: none)")
    args = p.parse_args()
    cipher_noise.CLOCK = time.thread_time if args.cpu_time else time.perf_counter
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    if shutil.which("gcc") is None or " avx2" not in flags:
        print("no gcc or no AVX2 here: nothing measured")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dll = build(Path(tmp))
        except (subprocess.CalledProcessError, RuntimeError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            print(f"no vectorized compiled transform here ({detail.strip()[-300:]}): "
                  "nothing measured")
            return 0
        print(f"load average {os.getloadavg()[0]:.1f}; gcc {' '.join(FLAGS)} -lcrypto -lmvec; "
              f"{'thread CPU time' if args.cpu_time else 'wall clock'}, best of "
              f"{args.repeats}\n")
        print("| d | path | float32 ns | float64 ns | float32 × kernel | float64 × kernel |")
        print("|---|---|---|---|---|---|")
        hot = {dt: transform_hot(dll, dt, args.repeats) for dt in (np.float32, np.float64)}
        print(f"| one chunk ({CHUNK:,} pairs) | compiled transform alone (hot buffers) | "
              f"{hot[np.float32]:.2f} | {hot[np.float64]:.2f} | – | – |")
        key = cn.os_entropy_key()
        compiled = CompiledRows(dll, key)
        kernel = cn.CipherGaussian.from_os_entropy()
        for d in args.dims:
            outs = {dt: np.empty(d, dtype=dt) for dt in (np.float32, np.float64)}
            philox = np.random.Generator(np.random.Philox(key=0x5EED))
            fns: dict[str, Callable[[], object]] = {}
            for dt, out in outs.items():
                name = np.dtype(dt).name
                fns[f"compiled row (AES-128-CTR + compiled Box–Muller)|{name}"] = \
                    lambda out=out: compiled.fill(out)
                fns[f"C row (OpenSSL AES-128-CTR + compiled Box–Muller, no Python)|{name}"] = \
                    lambda out=out: compiled.fill_c(out)
                fns[f"cipher row (the library's kernel)|{name}"] = \
                    lambda out=out, dt=dt: kernel.row(1, d, dt, out=out)  # noqa: B023
                fns[f"cipher row, NumPy path|{name}"] = \
                    lambda out=out: cipher_noise.numpy_row(kernel, d, out)  # noqa: B023
                fns[f"Philox ziggurat (NumPy)|{name}"] = \
                    lambda out=out, dt=dt: philox.standard_normal(out=out, dtype=dt)  # noqa: B023
            best = cipher_noise.best_of(fns, args.repeats)
            for path in dict.fromkeys(k.split("|")[0] for k in fns):
                ns = [1e9 * best[f"{path}|{n}"] / d for n in ("float32", "float64")]
                ref = [1e9 * best[f"cipher row (the library's kernel)|{n}"]
                       / d for n in ("float32", "float64")]
                print(f"| {d:,} | {path} | {ns[0]:.2f} | {ns[1]:.2f} | {ns[0] / ref[0]:.2f}× | "
                      f"{ns[1] / ref[1]:.2f}× |", flush=True)
        if args.check:
            print()
            print(check(compiled, args.check))
        print(f"\nload average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
