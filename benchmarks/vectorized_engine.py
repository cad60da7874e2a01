"""One run of the Fig. 3 sweep (simulations/logreg.py) on the reference and the vectorized
in-process engine, interleaved so that both see the same machine load.

    python benchmarks/vectorized_engine.py --rounds 1000 --repeats 2

Per mechanism: seconds per run of the reference driver as the sweep ran it before issue 22
(``run_logreg_inprocess`` and a fresh ``LogRegEvaluator``, which solves every round's
optimum) and of the sweep's driver now (``run_vectorized_logreg`` and ``SweepEvaluator``,
whose round optima are solved once per data seed: warm after the first run), the median
per-pair ratio, and the largest difference of the final models (the engines agree to
1e-12). The paper's n = 20, d = 100, τ = 4; one BLAS thread (as the sweep's workers).
"""

from __future__ import annotations

import os

# one BLAS thread, as the sweep's worker processes run (simulations/logreg.py)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/, simulations/

from experiments.logreg import run_logreg_inprocess  # noqa: E402
from flwr_corrnoise.apps.logreg_task import LogRegEvaluator, LogRegSetup  # noqa: E402
from simulations.logreg import SweepEvaluator, run_vectorized_logreg  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mechanisms", nargs="+",
                   default=["none", "independent", "tree", "blt", "toeplitz", "optimized"])
    args = p.parse_args()
    print(f"R = {args.rounds}, n = 20, d = 100, τ = 4; s per run (engine + evaluation)")
    print("| mechanism | reference s | vectorized s | ratio | max |Δx| |")
    print("|---|---|---|---|---|")
    for name in args.mechanisms:
        setup = LogRegSetup(mechanism=name, rounds=args.rounds, eta=0.05)
        run_vectorized_logreg(setup, evaluate=SweepEvaluator(setup))  # warm: build, optima
        ref, vec, ratios, diff = [], [], [], 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            a = run_logreg_inprocess(setup, evaluate=LogRegEvaluator(setup)).params[0]
            ref.append(time.perf_counter() - start)
            start = time.perf_counter()
            b = run_vectorized_logreg(setup, evaluate=SweepEvaluator(setup)).params[0]
            vec.append(time.perf_counter() - start)
            ratios.append(ref[-1] / vec[-1])
            diff = max(diff, float(np.max(np.abs(a - b))))
        print(f"| {name} | {statistics.median(ref):.2f} | {statistics.median(vec):.2f} | "
              f"{statistics.median(ratios):.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
