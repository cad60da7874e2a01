"""One run of the Fig. 3 sweep (simulations/logreg.py) on the reference and the vectorized
in-process engine, interleaved so that both see the same machine load.

    python benchmarks/vectorized_engine.py --rounds 1000 --repeats 2
    python benchmarks/vectorized_engine.py --driver-only --root /path/to/other/checkout

Per mechanism: seconds per run of the reference driver as the sweep ran it before issue 22
(``run_logreg_inprocess`` and a fresh ``LogRegEvaluator``, which solves every round's
optimum) and of the sweep's driver now (``run_vectorized_logreg`` and ``SweepEvaluator``,
whose round optima are solved once per data seed: warm after the first run), the median
per-pair ratio, and the largest difference of the final models (the engines agree to
1e-12). The paper's n = 20, d = 100, τ = 4; one BLAS thread (as the sweep's workers).
A run's time includes reading its evaluator's summary (the sweep's evaluator computes its
rows when they are read).

``--driver-only``: the sweep's driver alone (one warm-up run, then the median of
``--repeats``), wall and CPU seconds per run, with the library and driver of ``--root``
(another checkout, e.g. the previous commit's): run it for two roots, interleaved, to
compare them under the same load.
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

_ROOT = (sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv
         else str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, _ROOT)  # the library, experiments/ and simulations/ of that checkout

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
    p.add_argument("--driver-only", action="store_true",
                   help="time the sweep's driver only (wall and CPU s per run)")
    p.add_argument("--root", default=_ROOT,
                   help="the checkout whose library and driver to run (default: this one)")
    args = p.parse_args()
    if args.driver_only:
        driver_only(args)
        return
    print(f"R = {args.rounds}, n = 20, d = 100, τ = 4; s per run (engine + evaluation)")
    print("| mechanism | reference s | vectorized s | ratio | max |Δx| |")
    print("|---|---|---|---|---|")
    for name in args.mechanisms:
        setup = LogRegSetup(mechanism=name, rounds=args.rounds, eta=0.05)
        run_vectorized_logreg(setup, evaluate=SweepEvaluator(setup))  # warm: build, optima
        ref, vec, ratios, diff = [], [], [], 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            ev = LogRegEvaluator(setup)
            a = run_logreg_inprocess(setup, evaluate=ev).params[0]
            ev.summary()
            ref.append(time.perf_counter() - start)
            start = time.perf_counter()
            ev = SweepEvaluator(setup)
            b = run_vectorized_logreg(setup, evaluate=ev).params[0]
            ev.summary()
            vec.append(time.perf_counter() - start)
            ratios.append(ref[-1] / vec[-1])
            diff = max(diff, float(np.max(np.abs(a - b))))
        print(f"| {name} | {statistics.median(ref):.2f} | {statistics.median(vec):.2f} | "
              f"{statistics.median(ratios):.2f} | {diff:.1e} |", flush=True)


def driver_only(args: argparse.Namespace) -> None:
    """One line per mechanism: median wall and CPU seconds of the sweep's run (the
    driver, its evaluator's summary included) and the load average."""
    for name in args.mechanisms:
        setup = LogRegSetup(mechanism=name, rounds=args.rounds, eta=0.05)

        def run(setup: LogRegSetup = setup) -> np.ndarray:
            ev = SweepEvaluator(setup)
            x = run_vectorized_logreg(setup, evaluate=ev).params[0]
            ev.summary()
            return x

        x = run()  # warm: factorization, data, round optima
        wall, cpu = [], []
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        print(f"{name} wall {statistics.median(wall):.3f} cpu {statistics.median(cpu):.3f} "
              f"load {os.getloadavg()[0]:.1f} x0 {x[0]!r}", flush=True)


if __name__ == "__main__":
    main()
