"""Produce the table of docs/mechanisms.md: error, build time and stream state per mechanism.

Usage:  python benchmarks/mechanisms_table.py --steps 256 1024 4000 [--fresh]

Every registered mechanism (``flwr_corrnoise.mechanisms.MECHANISMS``) gets a row: those of
``ORDER`` first, best first, then any other in registration order. RMSE and max error are
at unit sensitivity (noise std proportional to the sensitivity), with ratios to
``optimized``. Build time is wall-clock for building the factorization in this process;
for ``optimized`` the solve time is also reported (from the on-disk cache if it was
loaded; ``--fresh`` solves every solved kind anew, in an empty cache). Stream state is the
*measured* peak number of floats a stream holds over the whole horizon, times 8 bytes, for
d = 10⁶ parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _format import human_bytes

from flwr_corrnoise.mechanisms import build_factorization, mechanism_names
from flwr_corrnoise.streams import NoiseStream

#: the table's order (best first); mechanisms registered later follow
ORDER = ["optimized", "blt", "toeplitz", "efficient-tree", "tree", "independent"]
REFERENCE = "optimized"  # the ratios' denominator, and the certified lower bound's source
D_MODEL = 1_000_000


def peak_state_floats(name: str, n: int) -> int:
    """Run a d = 1 stream over the horizon and record its largest buffer."""
    stream = NoiseStream.create(name, n, 1, 1.0, seed=0)
    peak = 0
    for _ in range(n):
        stream.next()
        peak = max(peak, stream.state_floats)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[256, 1024, 4000])
    parser.add_argument("--fresh", action="store_true",
                        help="re-solve the solved kinds (optimized, blt) in an empty cache")
    args = parser.parse_args()
    if args.fresh:
        os.environ["FLWR_CORRNOISE_CACHE"] = tempfile.mkdtemp(prefix="mechanisms-table-")
    names = mechanism_names(ORDER)
    print("| N | mechanism | sensitivity | RMSE | ×opt | max error | ×opt | build s | "
          "stream state, d = 10⁶ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.steps:
        rows = {}
        for name in names:
            print(f"  building {name} at N = {n} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            fact = build_factorization(name, n)
            _ = fact.rmse  # force the lazy row errors into the build time
            seconds = time.perf_counter() - start
            note = ""
            report = getattr(fact, "report", {})
            if "gap" in report:  # a certified solve
                solve = report.get("seconds", 0.0)
                cached = "loaded_from" in report
                note = f" (solve {solve:.1f}{', cached' if cached else ''}; gap " \
                       f"{100 * report['gap']:.3f} %)"
            state = peak_state_floats(name, n) * 8 * D_MODEL
            rows[name] = (fact, seconds, note, state)
        best = rows[REFERENCE][0]
        for name in names:
            fact, seconds, note, state = rows[name]
            print(
                f"| {n} | {name} | {fact.sensitivity:.3f} | {fact.rmse:.3f} | "
                f"{fact.rmse / best.rmse:.2f} | {fact.max_error:.3f} | "
                f"{fact.max_error / best.max_error:.2f} | {seconds:.2f}{note} | "
                f"{human_bytes(state)} |",
                flush=True,
            )
        print(f"| {n} | *lower bound (certified)* | 1 | {best.lower_bound_rmse:.3f} | "
              f"{best.lower_bound_rmse / best.rmse:.3f} | | | | |")


if __name__ == "__main__":
    main()
