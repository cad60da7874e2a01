"""BLT's recurrence, a step at a time and a round's block of steps: the library's compiled
pass against the other ways to run it, side by side in one run.

    python benchmarks/blt_recurrence.py --dims 100000 305194 --buffers 4 --taus 1 4 32
    python benchmarks/blt_recurrence.py --before /tmp/before ...   # an earlier package too

A BLT stream (Dvijotham et al., "Efficient and Near-Optimal Noise Generation for Streaming
Differential Privacy") steps ``k`` buffers of ``d`` floats a step:
``e −= Σᵢ ωᵢ·rᵢ``, ``rᵢ ← θᵢ·rᵢ + e``. A learner's round runs ``τ`` of them at once
(``NumpyOps.blt_steps``: the compiled ``cn_blt_steps32/64``). Rows, per (d, k, τ), each
the median over ``--repeats`` rotations (every row once a rotation, so a load swing hits
all alike) of µs per step, and its ratio to the library's:

* ``library (compiled)``: ``NumpyOps.blt_steps`` with the kernel built;
* ``library (NumPy path)``: the same call with ``FLWR_CORRNOISE_KERNEL=numpy`` (no C
  compiler: cache-sized column chunks, step by step — the same floats);
* ``torch addmv + addcmul`` (τ = 1 only, when torch is installed, one thread): what the
  torch stream ran on the CPU before 2026-11-29 (``TorchOps.blt_step``), a BLAS gemv and a
  fused multiply-add, in torch's own order;
* ``before (compiled)`` with ``--before DIR``: the earlier package's compiled pass (its
  own kernel source, built into its own cache file).

Every row is checked against the library's floats first (bit for bit; torch's, to float
tolerance, as its order is its own): the script exits non-zero on a mismatch. The buffers
are float32 (a float32 model's stream) unless ``--dtype float64``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
from _format import ratio_rows, rotated_medians

from flwr_corrnoise import compiled_kernel
from flwr_corrnoise.mechanisms.streaming import numpy_ops

Step = Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # (r, rows, out)


def library(dtype: np.dtype, theta: np.ndarray, omega: np.ndarray, path: str) -> Step:
    ops = numpy_ops(dtype)

    def run(r: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        if path == "compiled":
            ops.blt_steps(r, theta, omega, rows, out)
            return
        with compiled_kernel.numpy_path():  # no rebuild: the loaded library comes back
            ops.blt_steps(r, theta, omega, rows, out)
    return run


def before_kernel(path: str, dtype: np.dtype, theta: np.ndarray, omega: np.ndarray) -> Step:
    from _before import import_before

    import_before(path)
    from flwr_corrnoise_before.mechanisms.streaming import (  # type: ignore[import-not-found]
        numpy_ops as before_ops,
    )
    ops = before_ops(dtype)

    def run(r: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        ops.blt_steps(r, theta, omega, rows, out)
    return run


def torch_step(theta: np.ndarray, omega: np.ndarray) -> Step | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    th, om = torch.from_numpy(theta), torch.from_numpy(omega)

    def run(r: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        e = torch.from_numpy(rows[0])
        rt = torch.from_numpy(r)
        torch.addmv(e, rt.t(), om, alpha=-1, out=e)
        torch.addcmul(e, rt, th, out=torch.from_numpy(out))
    return run


def table(dims: list[int], buffers: list[int], taus: list[int], dtype: np.dtype,
          repeats: int, before: str | None) -> tuple[str, bool]:
    lines = [f"BLT recurrence, {dtype}, µs per step (median of {repeats} rotations); "
             f"kernel: {compiled_kernel.status()}", "",
             "| d | k | τ | way | µs per step | × library (compiled) |",
             "|---|---|---|---|---|---|"]
    ok = True
    rng = np.random.default_rng(0)
    for d in dims:
        for k in buffers:
            r = rng.standard_normal((k, d)).astype(dtype)
            theta = rng.uniform(0.5, 1.0, (k, 1)).astype(dtype)
            omega = (rng.standard_normal(k) / k).astype(dtype)
            for tau in taus:
                rows0 = rng.standard_normal((tau, d)).astype(dtype)
                ways: dict[str, Step] = {
                    "library (compiled)": library(dtype, theta, omega, "compiled"),
                    "library (NumPy path)": library(dtype, theta, omega, "numpy")}
                t_step = torch_step(theta, omega) if tau == 1 else None
                if t_step is not None:
                    ways["torch addmv + addcmul"] = t_step
                if before:
                    ways["before (compiled)"] = before_kernel(before, dtype, theta, omega)
                ref_rows, ref_out = rows0.copy(), np.empty((k, d), dtype=dtype)
                ways["library (compiled)"](r, ref_rows, ref_out)
                for name, fn in ways.items():
                    got_rows, got_out = rows0.copy(), np.empty((k, d), dtype=dtype)
                    fn(r, got_rows, got_out)
                    if name.startswith("torch"):
                        same = (np.allclose(got_rows, ref_rows, rtol=1e-4, atol=1e-5)
                                and np.allclose(got_out, ref_out, rtol=1e-4, atol=1e-5))
                    else:
                        same = (np.array_equal(got_rows, ref_rows)
                                and np.array_equal(got_out, ref_out))
                    if not same:
                        print(f"{name} gave other floats at d={d}, k={k}, τ={tau}",
                              file=sys.stderr)
                        ok = False
                # rows and outputs apart per way (a fresh out each call would time the
                # allocator, and a shared one would couple the ways' caches)
                bufs = {name: (rows0.copy(), np.empty((k, d), dtype=dtype))
                        for name in ways}
                calls = max(1, int(2e7 // (d * k * tau)))
                medians = rotated_medians(
                    {name: partial(fn, r, *bufs[name]) for name, fn in ways.items()},
                    repeats, calls)
                lines += ratio_rows(f"{d:,} | {k} | {tau}", medians, "library (compiled)",
                                    1e6 / tau)
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 305_194])
    p.add_argument("--buffers", type=int, nargs="+", default=[4])
    p.add_argument("--taus", type=int, nargs="+", default=[1, 4, 32])
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--before", default=None, help="a directory holding an earlier "
                   "flwr_corrnoise/ (git archive REV flwr_corrnoise | tar -x -C DIR)")
    args = p.parse_args(argv)
    if compiled_kernel.kernel() is None:
        print(f"no compiled kernel here ({compiled_kernel.status()}): nothing to compare",
              file=sys.stderr)
        return 1
    text, ok = table(args.dims, args.buffers, args.taus, np.dtype(args.dtype), args.repeats,
                     args.before)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
