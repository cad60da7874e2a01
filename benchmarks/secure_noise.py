"""Cost of secure noise: standard (PCG64) vs secure (ChaCha20 + grid) draws and steps.

    python benchmarks/secure_noise.py --dims 100000 1000000 --block 8 --repeats 7

Two comparisons per dimension ``d``, each as interleaved blocks (standard, then secure,
``--block`` calls each, ``--repeats`` pairs) so both sides see the same machine load; the
ratio is the median of the per-pair ratios:

* **draws**: ``Generator.standard_normal(d)`` on PCG64 (NumPy's ziggurat) against
  ``ChaCha20Gaussian.standard_normal(d)`` (ChaCha20 keystream from ``cryptography`` +
  Box–Muller on 53-bit uniforms);
* **a NoiseStream step** ``next()`` for each mechanism in ``--mechanisms``: standard
  (``seed=0``) against ``secure=True`` (the secure step also rounds the increment to the
  power-of-two grid).
"""

from __future__ import annotations

import argparse
import os

import cryptography
import numpy as np
from _format import interleaved
from cryptography.hazmat.backends.openssl.backend import backend as openssl_backend

from flwr_corrnoise.mechanisms import build_factorization, check_mechanism, mechanism_names
from flwr_corrnoise.secure_noise import ChaCha20Gaussian
from flwr_corrnoise.streams import NoiseStream

#: the default subset, one per kind of stream state (checked against the registry)
DEFAULT = [check_mechanism(name) for name in ("independent", "tree", "blt")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--mechanisms", nargs="+", default=DEFAULT, choices=mechanism_names())
    args = p.parse_args()
    horizon = 2 * (args.block * args.repeats + 2)
    print(f"numpy {np.__version__}, cryptography {cryptography.__version__} "
          f"({openssl_backend.openssl_version_text()}), {os.cpu_count()} CPUs; "
          f"blocks of {args.block} calls, median of {args.repeats} interleaved pairs")
    print("| d | what | standard (ms) | secure (ms) | secure / standard | "
          "secure M draws/s |")
    print("|---|---|---|---|---|---|")
    for dim in args.dims:
        pcg = np.random.default_rng(0)
        chacha = ChaCha20Gaussian.from_os_entropy()
        ta, tb, ratio = interleaved(lambda: pcg.standard_normal(dim),  # noqa: B023
                               lambda: chacha.standard_normal(dim),  # noqa: B023
                               args.block, args.repeats)
        print(f"| {dim:,} | draws (N(0,1) × d) | {1e3 * ta:.2f} | {1e3 * tb:.2f} | "
              f"{ratio:.2f}× | {dim / tb / 1e6:.0f} |", flush=True)
        # where the secure draw's time goes: the keystream alone (8 bytes per draw)
        blocks = -(-16 * ((dim + 1) // 2) // 64)
        ta, tb, ratio = interleaved(lambda: pcg.standard_normal(dim),  # noqa: B023
                               lambda: chacha._fill(blocks),  # noqa: B023
                               args.block, args.repeats)
        print(f"| {dim:,} | of which ChaCha20 keystream ({8 * dim / 1e6:g} MB) | "
              f"{1e3 * ta:.2f} | {1e3 * tb:.2f} | {ratio:.2f}× | |", flush=True)
        for name in args.mechanisms:
            build_factorization(name, horizon)  # outside the timing
            std_stream = NoiseStream.create(name, horizon, dim, 1.3, seed=0)
            sec_stream = NoiseStream.create(name, horizon, dim, 1.3, secure=True)
            ta, tb, ratio = interleaved(std_stream.next, sec_stream.next, args.block, args.repeats)
            print(f"| {dim:,} | {name} step | {1e3 * ta:.2f} | {1e3 * tb:.2f} | "
                  f"{ratio:.2f}× | |", flush=True)


if __name__ == "__main__":
    main()
