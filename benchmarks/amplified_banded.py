"""Amplified banded MF against DP-SGD: noise multipliers and prefix-sum noise RMSE.

For a learner that takes ``s`` steps per epoch over ``epochs`` epochs (``N = epochs·s``
steps, the multi-epoch setting of ``docs/results-multi-epoch.md``: 5 rounds × 2 epochs),
at ``(ε, δ)`` under one neighbouring relation, every band count ``b`` from 1 (DP-SGD,
Poisson sampling at rate ``1/s``) to ``s`` (one fixed batch per group, rate 1) is
calibrated by the PLD and its banded encoder optimized
(:func:`flwr_corrnoise.amplification.choose_bands`): rate ``q_b = b/s``, ``⌈N/b⌉``
compositions, noise multiplier ``σ_b``, the encoder's RMSE at unit sensitivity
``ζ·‖B‖_F/√N`` and the prefix-sum noise RMSE ``σ_b·ζ·‖B‖_F/√N`` (clip norm 1; dividing by
the expected batch size, the same for every ``b``, gives the mean gradient's).

Usage::

    python benchmarks/amplified_banded.py               # the table of docs/privacy.md
    python benchmarks/amplified_banded.py --epsilons 8 --steps-per-epoch 16 --grid 1e-3

Writes every candidate to ``--out`` (default ``docs/results-amplified-noise.csv``; the
chosen band is marked ``best``) and prints the Markdown table of ``docs/privacy.md``.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

from flwr_corrnoise.accounting.pld import DEFAULT_GRID, RELATIONS, REPLACE_ONE
from flwr_corrnoise.amplification import choose_bands

DOCS = Path(__file__).resolve().parent.parent / "docs"
FIELDS = ["epsilon", "delta", "relation", "steps_per_epoch", "horizon", "bands",
          "sampling_rate", "cycles", "noise_multiplier", "column_norm", "unit_rmse", "rmse",
          "best", "grid", "seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--steps-per-epoch", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--relation", choices=RELATIONS, default=REPLACE_ONE)
    parser.add_argument("--grid", type=float, default=DEFAULT_GRID)
    parser.add_argument("--out", type=Path, default=DOCS / "results-amplified-noise.csv")
    args = parser.parse_args(argv)
    rows = []
    print(f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; δ = {args.delta}, "
          f"{args.relation}, {args.epochs} epochs, PLD grid {args.grid}\n")
    print("| ε | steps/epoch s | N | DP-SGD σ (q = 1/s) | DP-SGD RMSE | best b | q_b | σ_b "
          "| RMSE_b | DP-SGD / best | fixed partition (b = s, q = 1) RMSE |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for eps in args.epsilons:
        for s in args.steps_per_epoch:
            n = args.epochs * s
            start = time.perf_counter()
            best, table = choose_bands(eps, args.delta, n, s, args.relation, grid=args.grid)
            seconds = time.perf_counter() - start
            for c in table:
                rows.append({"epsilon": eps, "delta": args.delta, "relation": args.relation,
                             "steps_per_epoch": s, "horizon": n, **c.as_dict(),
                             "best": c is best, "grid": args.grid,
                             "seconds": round(seconds, 1)})
            dpsgd, fixed = table[0], table[-1]
            print(f"| {eps:g} | {s} | {n} | {dpsgd.noise_multiplier:.4f} | {dpsgd.rmse:.2f} | "
                  f"{best.bands} | {best.sampling_rate:.4g} | {best.noise_multiplier:.4f} | "
                  f"{best.rmse:.2f} | {dpsgd.rmse / best.rmse:.2f}× | {fixed.rmse:.2f} |",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row[k] for k in FIELDS})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
