"""The private step's norms and scaling: ``learner.row_norms`` and ``learner.scale_rows``
compiled and on their NumPy paths, against what each replaced, side by side in one run.

    python benchmarks/clip_norms.py --shapes 1x100000 1x1000 1000x10 1000x200 64x4768 --repeats 15

Every private NumPy step clips each learner's gradient row to its norm, summed in float64
(the clip margin's bound, ``learner.clip_margin``). Since 2026-11-29 the sum has one defined
order (``learner.row_sums_of_squares``: 64 float64 lanes, then the lanes left to right),
run by the compiled kernel's ``cn_sumsq32/64`` straight from a float32 row, or by NumPy
the same way without a compiler. Rows, per shape (rows × d) and dtype, each the median over
``--repeats`` rotations (every row once a rotation) of µs per call and its ratio to the
compiled one:

* ``compiled``: ``row_norms`` with the kernel built;
* ``NumPy path``: the same call under ``compiled_kernel.numpy_path()`` (no compiler);
* ``einsum over a float64 copy (before)``: ``sqrt(einsum("ij,ij->i", g64, g64))`` with
  ``g64 = g.astype(float64)``, what ``row_norms`` ran before.

The two library paths are checked to give the same floats first, and the einsum to agree
within the clip margin's float64 bound (it sums in its own order); the script exits
non-zero otherwise.

A second table times the clip's scaling (every row to its norm: each float32 element
widened, times the row's float64 factor, rounded back), since 2026-11-29
``learner.scale_rows`` (``cn_scale32/64``): ``compiled``; its ``NumPy path`` (the masked
multiply, under ``compiled_kernel.numpy_path()``); and ``masked multiply (before)``,
``g[over] *= (target / norms)[over][:, None]`` called directly. Each way runs on its own
copy with every row over its norm, and the floats are checked equal first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial

import numpy as np
from _format import ratio_rows, rotated_medians

from flwr_corrnoise import compiled_kernel
from flwr_corrnoise.learner import row_norms, scale_rows


def einsum_norms(g: np.ndarray) -> np.ndarray:
    g64 = np.asarray(g, dtype=np.float64)
    return np.sqrt(np.einsum("ij,ij->i", g64, g64))


def numpy_norms(g: np.ndarray) -> np.ndarray:
    with compiled_kernel.numpy_path():
        return row_norms(g)


def table(shapes: list[tuple[int, int]], dtypes: list[str], repeats: int) -> tuple[str, bool]:
    ways: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "compiled": row_norms, "NumPy path": numpy_norms,
        "einsum over a float64 copy (before)": einsum_norms}
    lines = [f"row_norms, µs per call (median of {repeats} rotations); kernel: "
             f"{compiled_kernel.status()}", "",
             "| rows × d | dtype | way | µs per call | × compiled |", "|---|---|---|---|---|"]
    ok = True
    rng = np.random.default_rng(0)
    for rows, d in shapes:
        for dtype in dtypes:
            g = rng.standard_normal((rows, d)).astype(dtype)
            want = row_norms(g)
            if not np.array_equal(numpy_norms(g), want):
                print(f"the NumPy path gave other floats at {rows}×{d} {dtype}",
                      file=sys.stderr)
                ok = False
            bound = (d + 8) * 2.0**-52  # the sum's relative error in any order (γ_d)
            if not np.allclose(einsum_norms(g), want, rtol=bound, atol=0):
                print(f"einsum disagrees beyond the bound at {rows}×{d} {dtype}",
                      file=sys.stderr)
                ok = False
            calls = max(1, int(2e6 // max(rows * d, 1)))
            medians = rotated_medians({name: partial(fn, g) for name, fn in ways.items()},
                                      repeats, calls)
            lines += ratio_rows(f"{rows:,} × {d:,} | {dtype}", medians, "compiled")
    return "\n".join(lines), ok


def masked_scale(g: np.ndarray, factors: np.ndarray) -> None:
    over = factors != 1.0
    g[over] *= factors[over][:, None]


def numpy_scale(g: np.ndarray, factors: np.ndarray) -> None:
    with compiled_kernel.numpy_path():
        scale_rows(g, factors)


def scale_table(shapes: list[tuple[int, int]], dtypes: list[str], repeats: int
                ) -> tuple[str, bool]:
    ways: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        "compiled": scale_rows, "NumPy path": numpy_scale,
        "masked multiply (before)": masked_scale}
    lines = [f"the clip's scaling, µs per call (median of {repeats} rotations), every row "
             "scaled", "", "| rows × d | dtype | way | µs per call | × compiled |",
             "|---|---|---|---|---|"]
    ok = True
    rng = np.random.default_rng(1)
    for rows, d in shapes:
        for dtype in dtypes:
            g = rng.standard_normal((rows, d)).astype(dtype)
            # factors just below 1: repeated calls keep the rows' values normal floats
            factors = 1.0 - rng.uniform(1e-7, 1e-6, rows)
            copies = {name: g.copy() for name in ways}
            for name, fn in ways.items():
                fn(copies[name], factors)
            if any(not np.array_equal(c, copies["masked multiply (before)"])
                   for c in copies.values()):
                print(f"the scaling ways gave other floats at {rows}×{d} {dtype}",
                      file=sys.stderr)
                ok = False
            calls = max(1, int(2e6 // max(rows * d, 1)))
            medians = rotated_medians(
                {name: partial(fn, copies[name], factors) for name, fn in ways.items()},
                repeats, calls)
            lines += ratio_rows(f"{rows:,} × {d:,} | {dtype}", medians, "compiled")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x100000", "1x1000", "1000x10",
                                                   "1000x200", "64x4768"],
                   help="rows x d")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"],
                   choices=("float32", "float64"))
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    if compiled_kernel.kernel() is None:
        print(f"no compiled kernel here ({compiled_kernel.status()}): nothing to compare",
              file=sys.stderr)
        return 1
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    text, ok = table(shapes, args.dtypes, args.repeats)  # type: ignore[arg-type]
    scaled, scale_ok = scale_table(shapes, args.dtypes, args.repeats)  # type: ignore[arg-type]
    print(text + "\n\n" + scaled)
    return 0 if ok and scale_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
