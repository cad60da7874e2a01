"""Cost of the keyed noise generator (issue 20, attack 1) against the draws it replaced.

    python benchmarks/noise_keys.py --dims 100 10000 305194 1000000 --repeats 7

One row of ``d`` standard normals, the unit of every noise stream, drawn

* by the library's generator today, Philox4x64-10 under a 128-bit key
  (:mod:`flwr_corrnoise.noise_keys`), in float64 (NumPy streams) and float32 (the torch
  stream's host draw, ``torch.from_numpy`` on a CPU model);
* by what it replaced: NumPy's PCG64 (NumPy streams; its state is recoverable from its
  outputs) and ``torch.randn`` on torch's CPU generator (Mersenne Twister, 32-bit seed);
* by the opt-in secure generator (ChaCha20 + Box–Muller, :mod:`~flwr_corrnoise.secure_noise`),
  for scale.

Blocks of ``--block`` draws run in rotation (each candidate's block right after the
reference's), and each ratio is the median over ``--repeats`` rotations of the candidate's
block over the reference's block of the same rotation: the machines are shared.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import numpy as np
from _format import time_block

from flwr_corrnoise.noise_keys import noise_generator
from flwr_corrnoise.secure_noise import ChaCha20Gaussian


def candidates(dim: int) -> dict[str, object]:
    philox, pcg = noise_generator(1), np.random.Generator(np.random.PCG64(1))
    chacha = ChaCha20Gaussian.from_os_entropy()
    out = {
        "PCG64 float64 (replaced)": lambda: pcg.standard_normal(dim),
        "keyed Philox float64 (NumPy streams)": lambda: philox.standard_normal(dim),
        "keyed Philox float32 (torch stream, CPU)": lambda: philox.standard_normal(
            dim, dtype=np.float32),
        "ChaCha20 Box–Muller float64 (secure, opt-in)": lambda: chacha.standard_normal(dim),
    }
    try:
        import torch
    except ImportError:
        return out
    gen = torch.Generator()
    gen.manual_seed(1)
    out["torch.randn float32, CPU generator (replaced)"] = lambda: torch.randn(
        dim, generator=gen)
    out["keyed Philox float32 → torch tensor"] = lambda: torch.from_numpy(
        philox.standard_normal(dim, dtype=np.float32))
    return out


def measure(dim: int, block: int, repeats: int) -> list[tuple[str, float, float]]:
    """(name, ms per row, median ratio to the PCG64 reference of the same rotation)."""
    fns = candidates(dim)
    names = list(fns)
    for fn in fns.values():
        fn()  # warm-up: allocations, the first cipher context
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        ref = time_block(fns[names[0]], block)  # type: ignore[arg-type]
        for n in names:
            t = time_block(fns[n], block)  # type: ignore[arg-type]
            times[n].append(t)
            ratios[n].append(t / ref)
    return [(n, 1e3 * statistics.median(times[n]), statistics.median(ratios[n]))
            for n in names]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100, 10_000, 305_194, 1_000_000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--block-elements", type=int, default=4_000_000,
                   help="about this many normals per timed block")
    args = p.parse_args()
    try:
        import torch
        torch.set_num_threads(1)
        tv = f", torch {torch.__version__} (1 thread)"
    except ImportError:
        tv = ""
    print(f"one row of d standard normals; NumPy {np.__version__}{tv}, {platform.machine()}")
    print("| d | generator | ms per row | ÷ PCG64 |")
    print("|---|---|---|---|")
    for dim in args.dims:
        block = max(1, args.block_elements // dim)
        for name, ms, ratio in measure(dim, block, args.repeats):
            print(f"| {dim:,} | {name} | {ms:.4g} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
