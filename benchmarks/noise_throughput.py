"""Cost of one noise increment for a large model, as a ratio to one i.i.d. Gaussian draw.

    python benchmarks/noise_throughput.py --dim 1000000 --steps 4000

For every mechanism a stream with horizon ``--steps`` and ``--dim`` parameters hands out
increments; each timed block of ``--block`` increments is preceded by a block of plain
``Generator.standard_normal(dim)`` draws (the reference: independent noise needs exactly
one), so both sides see the same machine load, and the ratio is the median over
``--repeats`` block pairs. Blocks start at step 0 and are consecutive, so the tree's
amortized cost (two node draws per step on average) is what is measured; its worst single
step draws ``⌊log₂N⌋ + 1`` nodes. The mechanisms streamed by the dense history kernel
(the Toeplitz square root and the optimized factorization) combine every past ``ξ`` row,
so their cost grows with the step: they are measured over their first ``--dense-steps``
steps only (memory: that many ``d``-vectors) and the ratio is reported at that point.
Every registered mechanism is measured unless ``--mechanisms`` names some.
"""

from __future__ import annotations

import argparse

import numpy as np
from _format import interleaved

from flwr_corrnoise.mechanisms import build_factorization, mechanism_names
from flwr_corrnoise.mechanisms.streaming import HistoryKernel
from flwr_corrnoise.streams import NoiseStream

#: the table's order; mechanisms registered later follow
ORDER = ["independent", "tree", "efficient-tree", "blt", "toeplitz", "optimized"]


def measure(name: str, n: int, dim: int, block: int, repeats: int) -> tuple[float, float, float]:
    """(seconds per increment, seconds per i.i.d. draw, median ratio)."""
    stream = NoiseStream.create(name, n, dim, 1.0, seed=0)
    rng = np.random.default_rng(0)
    repeats = min(repeats, (stream.remaining - 1) // block)  # one step goes to the warm-up
    ref, ours, ratio = interleaved(lambda: rng.standard_normal(dim), stream.next, block, repeats)
    return ours, ref, ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=4000, help="horizon N of the streams")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--dense-steps", type=int, default=32)
    p.add_argument("--mechanisms", nargs="+", default=mechanism_names(ORDER),
                   choices=mechanism_names(ORDER))
    args = p.parse_args()
    print(f"d = {args.dim:,}, N = {args.steps}; ratio = increment / one i.i.d. draw")
    print("| mechanism | ms per increment | ms per i.i.d. draw | ratio | state after the "
          "measured steps |")
    print("|---|---|---|---|---|")
    for name in args.mechanisms:
        fact = build_factorization(name, args.steps)  # solve outside the timing
        dense = isinstance(fact.stream_kernel(), HistoryKernel)  # cost grows with the step
        block = max(1, args.dense_steps // args.repeats) if dense else args.block
        ours, ref, ratio = measure(name, args.steps, args.dim, block, args.repeats)
        measured = min(args.steps, block * args.repeats + 1)  # incl. the warm-up step
        note = f" (grows with the step: steps 1–{measured})" if dense else ""
        probe = NoiseStream.create(name, args.steps, 1, 1.0, seed=0)
        for _ in range(measured):
            probe.next()
        state_mb = probe.state_floats * args.dim * 8 / 1e6
        print(f"| {name} | {1e3 * ours:.1f} | {1e3 * ref:.1f} | {ratio:.2f}{note} | "
              f"{state_mb:,.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
