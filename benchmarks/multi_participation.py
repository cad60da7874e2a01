"""Multiple participations: every mechanism's RMSE when one datum is used k times, b apart,
and our BLT optimized for (k, b) beside jax_privacy's ``buffered_toeplitz.optimize``.

Two parts, one run:

1. **RMSE vs (k, b)** (fixed-epoch: ``N = k·b``): ``participation_rmse`` — the
   sensitivity under the participation (:mod:`flwr_corrnoise.mechanisms.participation`)
   times ``√(mean_k ‖b_k‖²)`` — of every registered mechanism, with ``blt`` built twice:
   optimized for one use (``blt``) and for the run's (k, b) (``blt-kb``), and the dense
   reference ``toeplitz-opt``: the best Toeplitz encoder with all ``N`` coefficients free
   (:func:`~flwr_corrnoise.mechanisms.toeplitz.optimize_toeplitz`, N ≤ 2000). Ratios are
   to ``blt-kb``.
2. **Ours vs jax_privacy** (``--jax-python``: the interpreter of a venv with
   ``jax-privacy`` installed; it is not a dependency): for each (n, b, k), jax_privacy's
   ``buffered_toeplitz.optimize(n=n, min_sep=b, max_participations=k, error="mean")`` runs
   in that venv, its ``(θ, ω)`` come back as JSON, and both BLTs are scored by the *same*
   code (ours: exact Toeplitz min-sep sensitivity × the closed-form ``‖B‖_F``). Times are
   wall-clock seconds of each optimizer (jax's include its JIT compilation).

Usage::

    python benchmarks/multi_participation.py                   # part 1, N = 1000
    python -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax-privacy
    python benchmarks/multi_participation.py --jax-python /tmp/jaxvenv/bin/python

Writes ``benchmarks/results/multi_participation.csv`` and prints Markdown tables
(``docs/benchmarks.md`` §8 shows them).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from flwr_corrnoise.mechanisms import BLTParams, build_factorization, mechanism_names
from flwr_corrnoise.mechanisms.blt import optimize_blt, participation_sensitivity_squared
from flwr_corrnoise.mechanisms.participation import Participation, toeplitz_sensitivity
from flwr_corrnoise.mechanisms.toeplitz import optimize_toeplitz, toeplitz_rmse_squared


def machine_load() -> str:
    """The 1-minute load average beside the core count: the timings' context."""
    return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"

OUT = Path(__file__).resolve().parent / "results"

JAX_SNIPPET = r"""
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
import numpy as np
from jax_privacy.matrix_factorization import buffered_toeplitz as bt
n, b, k = (int(v) for v in sys.argv[1:4])
t = time.perf_counter()
blt = bt.optimize(n=n, min_sep=b, max_participations=k, error="mean")
print(json.dumps({"theta": np.asarray(blt.buf_decay).tolist(),
                  "omega": np.asarray(blt.output_scale).tolist(),
                  "seconds": time.perf_counter() - t}))
"""


def rmse_table(n: int, epochs: list[int]) -> list[dict[str, object]]:
    """Part 1: every mechanism's RMSE under fixed-epoch (k, b = n/k)."""
    rows = []
    for k in epochs:
        if n % k:
            continue
        b = n // k
        p = Participation.epochs(k, b)
        kb = build_factorization("blt", n, min_sep=b, max_participations=k)
        best = kb.participation_rmse(p)
        entries = {"blt-kb": (best, kb.participation_sensitivity(p))}
        if n <= 2000:  # the dense reference: every Toeplitz coefficient free, O(N²) a step
            c = optimize_toeplitz(n, p, init=kb.c)
            entries["toeplitz-opt"] = (math.sqrt(toeplitz_rmse_squared(c, n, p)),
                                       toeplitz_sensitivity(c, n, p))
        for name in mechanism_names():
            if name == "optimized" and n > 2048:
                continue  # the dense solve is minutes beyond this
            f = build_factorization(name, n)
            entries[name] = (f.participation_rmse(p), f.participation_sensitivity(p))
        for name, (rmse, sens) in entries.items():
            rows.append({"part": "rmse", "n": n, "k": k, "b": b, "mechanism": name,
                         "rmse": rmse, "ratio": rmse / best, "sensitivity": sens.value,
                         "exact": sens.exact})
        print(f"  k = {k:3d}, b = {b:5d}: done", file=sys.stderr, flush=True)
    return rows


def score(params: BLTParams, n: int, p: Participation) -> float:
    return math.sqrt(participation_sensitivity_squared(params, n, p) * params.total_error(n) / n)


def versus_jax(jax_python: str, cases: list[tuple[int, int, int]]) -> list[dict[str, object]]:
    """Part 2: our optimizer and jax_privacy's on the same (n, b, k), scored alike."""
    rows = []
    for n, b, k in cases:
        p = Participation.min_separation(b, k)
        t = time.perf_counter()
        ours, _ = optimize_blt(n, participation=p)
        ours_s = time.perf_counter() - t
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([jax_python, "-c", JAX_SNIPPET, str(n), str(b), str(k)],
                             capture_output=True, text=True, env=env, check=True)
        theirs = json.loads(out.stdout.strip().splitlines()[-1])
        jp = BLTParams(theirs["theta"], theirs["omega"])
        r_ours, r_jax = score(ours, n, p), score(jp, n, p)
        rows.append({"part": "jax", "n": n, "k": k, "b": b, "ours_rmse": r_ours,
                     "jax_rmse": r_jax, "ratio": r_ours / r_jax, "ours_seconds": ours_s,
                     "jax_seconds": theirs["seconds"], "ours_buffers": ours.buffers,
                     "jax_buffers": jp.buffers})
        print(f"  n = {n}, b = {b}, k = {k}: ours {r_ours:.4f} ({ours_s:.1f} s), "
              f"jax_privacy {r_jax:.4f} ({theirs['seconds']:.1f} s)", file=sys.stderr,
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="horizon of part 1")
    ap.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4, 10, 20, 50])
    ap.add_argument("--jax-python", default="", help="python of a venv with jax-privacy")
    ap.add_argument("--cases", default="240:40:6,1000:100:10,1000:50:20,4000:400:10",
                    help="part 2's n:b:k triples")
    args = ap.parse_args(argv)
    print(f"# machine: {machine_load()}", flush=True)
    rows = rmse_table(args.n, args.epochs)
    print(f"\n## RMSE at unit sensitivity under k epochs of b = N/k steps (N = {args.n})\n")
    names = list(dict.fromkeys(str(r["mechanism"]) for r in rows))
    print("| k | b | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for k in dict.fromkeys(int(r["k"]) for r in rows):  # type: ignore[call-overload]
        sub = {r["mechanism"]: r for r in rows if r["k"] == k}
        cells = [f"{sub[m]['rmse']:.3g} ({sub[m]['ratio']:.2f}×)"
                 + ("" if sub[m]["exact"] else "†") for m in names]
        print(f"| {k} | {args.n // k} | " + " | ".join(cells) + " |")
    print("\n† certified upper bound on the sensitivity (not shown exact)")
    if args.jax_python:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        jrows = versus_jax(args.jax_python, cases)  # type: ignore[arg-type]
        rows += jrows
        print("\n## BLT optimized for (k, b): ours vs jax_privacy, scored by the same code\n")
        print("| n | b | k | ours RMSE | jax_privacy RMSE | ours / jax | ours s | jax s | "
              "buffers (ours, jax) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in jrows:
            print(f"| {r['n']} | {r['b']} | {r['k']} | {r['ours_rmse']:.4f} | "
                  f"{r['jax_rmse']:.4f} | {r['ratio']:.3f} | {r['ours_seconds']:.1f} | "
                  f"{r['jax_seconds']:.1f} | {r['ours_buffers']}, {r['jax_buffers']} |")
    OUT.mkdir(exist_ok=True)
    keys = sorted({key for r in rows for key in r})
    with open(OUT / "multi_participation.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {OUT / 'multi_participation.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
