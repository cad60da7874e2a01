"""Cost of one private local step of the paper's CNN, as a ratio to its bare SGD step.

    python benchmarks/torch_step.py --batch-size 1 --steps 60 --repeats 5

For each mechanism, blocks of ``--steps`` private steps (``torch_local_round`` with τ =
``--steps``: gradient through ``ModuleGradient``, clip over all 305,194 parameters, one
noise increment, the float64 step) alternate with blocks of plain PyTorch SGD steps on the
same batches (forward, backward, ``p -= η·grad`` in float32) — the reference a user would
otherwise run — so both see the same machine load; the ratio is the median over
``--repeats`` block pairs. Reported: ms per step for both and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from flwr_corrnoise.cnn import PaperCNN
from flwr_corrnoise.learner import LearnerState, PrivacySettings
from flwr_corrnoise.pytorch import torch_local_round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mechanisms", nargs="+", default=["none", "independent", "tree", "blt"])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = PaperCNN()
    g = torch.Generator().manual_seed(1)
    x = torch.rand(args.steps * args.batch_size, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.steps * args.batch_size,), generator=g)
    b = args.batch_size

    def batches(pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x[pos * b : (pos + 1) * b], y[pos * b : (pos + 1) * b]

    def bare() -> float:
        start = time.perf_counter()
        for pos in range(args.steps):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(batches(pos)[0]), batches(pos)[1]).backward()
            with torch.no_grad():
                for prm in model.parameters():
                    prm -= 0.01 * prm.grad
        return (time.perf_counter() - start) / args.steps

    shapes = [tuple(q.shape) for q in model.parameters()]
    rows = []
    for mech in args.mechanisms:
        settings = PrivacySettings(mechanism=mech, horizon=args.steps * (args.repeats + 1))
        state = LearnerState.create(settings, shapes, seed=0)
        ours, ref = [], []
        for _ in range(args.repeats):
            ref.append(bare())
            start = time.perf_counter()
            torch_local_round(model, torch.nn.functional.cross_entropy,
                              lambda pos: batches(pos % args.steps), state, settings,
                              args.steps, 0.01)
            ours.append((time.perf_counter() - start) / args.steps)
        ratio = statistics.median(o / r for o, r in zip(ours, ref, strict=True))
        rows.append([mech, f"{1e3 * statistics.median(ref):.2f}",
                     f"{1e3 * statistics.median(ours):.2f}", f"{ratio:.1f}×"])
    d = sum(int(np.prod(s)) for s in shapes)
    print(f"paper CNN, d = {d:,}, batch {b}, {args.threads} thread(s)")
    print("| mechanism | bare SGD step (ms) | private step (ms) | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
