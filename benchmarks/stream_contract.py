"""A stream's step before and after the pure stream contract (issue 33), side by side.

    python benchmarks/stream_contract.py --before 052ca9c --repeats 3

Before: the kernels updated their state in place and took checkpoint tokens (BLT's copy on
write); after: ``next`` returns a new state and never changes its input (BLT writes its new
buffers to a new array each step, the dense history appends past the state's count). The
``--before`` commit is exported with ``git archive`` into a temporary folder, and each
repeat runs the same timing code once on it and once on this checkout, each in a fresh
process, alternating, so both see the same machine load; the figures are medians over the
repeats of the mean ms per ``NoiseStream.next()`` (N = 4000, after 3 warm-up steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (mechanism, d, steps timed)
CASES = (("blt", 100_000, 300), ("blt", 1_000_000, 40), ("tree", 100_000, 300),
         ("toeplitz", 100_000, 200), ("banded-inverse", 100_000, 200))
#: ``--toy``: every other case at d = 50, N = 16, a few steps (the test's size)
TOY = tuple((name, 50, 3) for name, _, _ in CASES[::2])

TIMING = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from flwr_corrnoise.streams import NoiseStream
out = {}
horizon, cases = json.loads(sys.argv[2])
for name, d, n in cases:
    s = NoiseStream.create(name, horizon, d, 1.0, seed=1)
    for _ in range(3):
        s.next()
    t = time.perf_counter()
    for _ in range(n):
        s.next()
    out[f"{name} | {d:,}"] = (time.perf_counter() - t) / n * 1e3
print(json.dumps(out))
"""


def run(path: Path, horizon: int, cases: tuple) -> dict[str, float]:
    """One fresh process timing every case on the package at ``path``."""
    done = subprocess.run([sys.executable, "-c", TIMING, str(path),
                           json.dumps([horizon, cases])],
                          capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="052ca9c", help="the commit to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--toy", action="store_true", help="d = 50, N = 16, a few steps (tests)")
    args = parser.parse_args()
    horizon, cases = (16, TOY) if args.toy else (4000, CASES)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before,
                                  "flwr_corrnoise"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        times: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            times["before"].append(run(Path(tmp), horizon, cases))
            times["after"].append(run(ROOT, horizon, cases))
    print(f"before = {args.before}, after = this checkout; median of {args.repeats} "
          "alternating runs, ms per step")
    print("| mechanism | d | before ms | after ms | after / before |")
    print("|---|---|---|---|---|")
    for key in times["before"][0]:
        b = statistics.median(t[key] for t in times["before"])
        a = statistics.median(t[key] for t in times["after"])
        print(f"| {key} | {b:.2f} | {a:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
