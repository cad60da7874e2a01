"""Cost per step and state size of the banded-inverse stream against BLT's (issue 22).

    python benchmarks/banded_stream.py --dims 100000 1000000 --bands 2 4 8 --steps 4000

For each ``d`` and mechanism, a stream at horizon ``--steps`` is advanced in blocks of
``--block`` increments, each block preceded by a block of plain i.i.d. draws of ``d``
normals from the same keyed Philox (the reference: independent noise needs exactly one),
so both see the same machine load; times are medians over ``--repeats`` block pairs.
Also per learner-round: the serialized state (``to_bytes``), and the time to write it,
read it back and fork it (what a round that may fail costs: ``NoiseStream.fork``; a
checkpoint before issue 33). RMSE is at unit sensitivity for the horizon,
with its ratio to BLT's. (State handling: mean of ``--repeats`` calls.)
"""

from __future__ import annotations

import argparse

from _format import human_bytes, interleaved, time_block

from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.noise_keys import noise_generator
from flwr_corrnoise.streams import NoiseStream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--bands", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=4000, help="horizon N")
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    configs = [("blt", {}, "blt (4 buffers)")] + [
        ("banded-inverse", {"bands": w}, f"banded-inverse ({w} bands)") for w in args.bands]
    facts = {label: build_factorization(name, args.steps, **params)
             for name, params, label in configs}
    blt_rmse = facts["blt (4 buffers)"].rmse
    print(f"N = {args.steps}; per step: ms per increment, ratio to one i.i.d. draw of d "
          "normals; per round: the state a learner stores and its handling")
    print("| d | mechanism | RMSE (×blt) | ms/step | ms/draw | ×draw | state | to_bytes ms | "
          "from_bytes ms | fork ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dim in args.dims:
        for _name, _params, label in configs:
            fact = facts[label]
            stream = NoiseStream.create(fact.name, args.steps, dim, 1.0, seed=0,
                                        factorization=fact)
            gen = noise_generator(1)
            ref, ours, ratio = interleaved(lambda g=gen, d=dim: g.standard_normal(d),
                                           stream.next, args.block, args.repeats)
            blob = stream.to_bytes()
            t_write = time_block(stream.to_bytes, args.repeats)
            t_read = time_block(lambda b=blob: NoiseStream.from_bytes(b), args.repeats)
            t_ckpt = time_block(stream.fork, args.repeats)
            print(f"| {dim:,} | {label} | {fact.rmse:.3f} ({fact.rmse / blt_rmse:.2f}) | "
                  f"{1e3 * ours:.2f} | {1e3 * ref:.2f} | {ratio:.2f} | {human_bytes(len(blob))} | "
                  f"{1e3 * t_write:.2f} | {1e3 * t_read:.2f} | {1e3 * t_ckpt:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
