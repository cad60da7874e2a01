"""Produce the table of docs/mechanisms.md: error, build time and stream state per mechanism.

Usage:  python benchmarks/mechanisms_table.py --steps 256 1024 4000 [--fresh]

RMSE and max error are at unit sensitivity (noise std proportional to the sensitivity).
Build time is wall-clock for building the factorization in this process; for
``optimized`` the solve time is also reported (from the on-disk cache if it was loaded;
``--fresh`` forces a new solve). Stream state is the *measured* peak number of floats a
stream holds over the whole horizon, times 8 bytes, for d = 10⁶ parameters.
"""

from __future__ import annotations

import argparse
import sys
import time

from _format import human_bytes

from flwr_corrnoise.mechanisms import Optimized, build_factorization
from flwr_corrnoise.streams import NoiseStream

ORDER = ["optimized", "blt", "toeplitz", "efficient-tree", "tree", "independent"]
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
    parser.add_argument("--fresh", action="store_true", help="re-solve optimized, no cache")
    args = parser.parse_args()
    print("| N | mechanism | sensitivity | RMSE | ×opt | max error | ×opt | build s | "
          "stream state, d = 10⁶ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.steps:
        rows = {}
        for name in ORDER:
            print(f"  building {name} at N = {n} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            if name == "optimized":
                fact = Optimized(n, use_cache=not args.fresh)
            else:
                fact = build_factorization(name, n)
            _ = fact.rmse  # force the lazy row errors into the build time
            seconds = time.perf_counter() - start
            note = ""
            if name == "optimized":
                solve = fact.report.get("seconds", 0.0)
                cached = "loaded_from" in fact.report
                note = f" (solve {solve:.1f}{', cached' if cached else ''}; gap " \
                       f"{100 * fact.report['gap']:.3f} %)"
            state = peak_state_floats(name, n) * 8 * D_MODEL
            rows[name] = (fact, seconds, note, state)
        best = rows["optimized"][0]
        for name in ORDER:
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
