"""Can the Toeplitz square root's noise stream run at the CNN's size? Memory vs time.

    python benchmarks/toeplitz_stream.py --dim 305194 --horizon 5000 --ks 50 200 800 \\
        --learners 10 --repeats 3

The Toeplitz square root (Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online
Federated Learning With Correlated Noise", Example iii) adds ``e[k] = Σ_{j≤k} g(k−j)·ξ_j`` at step
``k``: every past draw ``ξ_j`` enters every later increment (``g`` decays like ``k^(−3/2)`` but is
never 0), so a stream either **stores** the ``k`` past draws (``k·d`` floats: at ``N = 5000`` and
the CNN's ``d = 305,194``, 6.1 GB per learner in float32, 61 GB for the 10 learners of Fig. 4 on a
24 GiB machine) or **regenerates** them at every step from a counter-based generator (``ξ_j =
randn(d)`` from a generator seeded by ``(key, j)``: ``d`` floats of memory, ``k`` draws of ``d``
Gaussians at step ``k``, ``O(N²·d)`` for the run). This script measures, on one core's worth of
torch CPU kernels, float32:

* ``stored`` — one step at step ``k`` with the history in memory (``g·buf[:k]``, a
  ``1×k @ k×d`` product, plus the new draw), for the ``k`` whose history fits in
  ``--max-stored-gb``;
* ``regenerated`` — the same increment recomputed from the counter-seeded draws;
* ``blt`` and ``independent`` — one step of the BLT stream (4 buffers,
  :class:`~flwr_corrnoise.torch.TorchNoiseStream`) and one ``randn(d)``;

checks that the regenerated increment equals the stored one (same draws) and extrapolates
each to the whole run (per-step time linear in ``k``, fitted on ``--ks``; summed over
``k < N`` and the learners). Prints a markdown table and the extrapolation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from _format import human_bytes

from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.torch import TorchNoiseStream


def draw(key: int, j: int, d: int) -> torch.Tensor:
    """ξ_j: a pure function of (key, j), as a counter-based generator gives."""
    gen = torch.Generator().manual_seed(key * 1_000_003 + j)
    return torch.randn(d, generator=gen)


def regenerated(g: np.ndarray, k: int, key: int, d: int) -> torch.Tensor:
    e = torch.zeros(d)
    for j in range(k + 1):
        e.add_(draw(key, j, d), alpha=float(g[k - j]))
    return e


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=305_194, help="d (the paper CNN's)")
    p.add_argument("--horizon", type=int, default=5000, help="N = R·τ")
    p.add_argument("--ks", type=int, nargs="+", default=[50, 200, 800],
                   help="steps k at which one step is timed")
    p.add_argument("--learners", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-stored-gb", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    d, n = args.dim, args.horizon
    g = build_factorization("toeplitz", n).g  # e[k] = Σ_j g(k−j) ξ_j (the stream's kernel)

    # the regenerated increment is the stored one (same draws), to float32 rounding
    k0 = min(args.ks[0], 20)
    buf = torch.stack([draw(7, j, d) for j in range(k0 + 1)])
    stored_e = torch.from_numpy(g[k0::-1].astype(np.float32).copy()) @ buf
    regen_e = regenerated(g, k0, 7, d)
    err = float((stored_e - regen_e).abs().max() / stored_e.abs().max())
    if err > 1e-5:
        raise SystemExit(f"regenerated increment differs from the stored one: {err:.2e}")
    del buf

    rows = []
    fit_stored, fit_regen = [], []
    for k in args.ks:
        coef = torch.from_numpy(g[k::-1].astype(np.float32).copy())
        stored_s = float("nan")
        if (k + 1) * d * 4 <= args.max_stored_gb * 1e9:
            hist = torch.randn(k + 1, d)
            stored_s = timed(lambda c=coef, h=hist: (c @ h, torch.randn(d)), args.repeats)
            fit_stored.append((k, stored_s))
            del hist
        regen_s = timed(lambda k=k: regenerated(g, k, 3, d), max(1, args.repeats // 2))
        fit_regen.append((k, regen_s))
        rows.append((k, stored_s, regen_s))

    stream = TorchNoiseStream.create("blt", n, [(d,)], 1.0, 0, device=torch.device("cpu"),
                                     dtype=torch.float32)
    stream.next()
    blt_s = timed(lambda: [stream.next() for _ in range(20)], args.repeats) / 20
    ind_s = timed(lambda: [torch.randn(d) for _ in range(20)], args.repeats) / 20

    def total(points: list[tuple[int, float]]) -> float:
        """Σ_{k<N} (a + b·k) over the run, a + b·k fitted to the timed steps."""
        if not points:
            return float("nan")
        if len(points) == 1:
            b, a = points[0][1] / max(points[0][0], 1), 0.0
        else:
            b, a = np.polyfit([k for k, _ in points], [s for _, s in points], 1)
        return float(n * a + b * n * (n - 1) / 2)

    print(f"d = {d:,}, N = {n}, float32, {args.threads} thread(s); regenerated = stored "
          f"to {err:.1e}\n")
    print("| step k | stored history: s/step | regenerated: s/step | regenerated / stored "
          "| Gaussians regenerated / step |")
    print("|---|---|---|---|---|")
    for k, s, r in rows:
        # (k + 1)·d: the regenerated stream's work at step k, the count the timing reflects
        draws = f"{(k + 1) * d:,}"
        print(f"| {k} | {s:.3g} | {r:.3g} | {r / s:.0f}× | {draws} |" if s == s
              else f"| {k} | (history > {args.max_stored_gb:g} GB) | {r:.3g} | | {draws} |")
    per_learner = {"stored": total(fit_stored), "regenerated": total(fit_regen),
                   "blt": n * blt_s, "independent": n * ind_s}
    memory = {"stored": n * d * 4, "regenerated": d * 4, "blt": 4 * d * 4,
              "independent": 0}
    print(f"\nWhole run, N = {n} steps × {args.learners} learners (noise only, extrapolated "
          "linearly in k):\n")
    print("| stream | noise memory per learner | noise time per learner | for all learners |")
    print("|---|---|---|---|")
    for name in ("independent", "blt", "stored", "regenerated"):
        t = per_learner[name]
        label = {"stored": "Toeplitz, stored history", "regenerated":
                 "Toeplitz, regenerated (counter-based)", "blt": "BLT, 4 buffers",
                 "independent": "independent"}[name]
        print(f"| {label} | {human_bytes(memory[name])} | {duration(t)} | "
              f"{duration(t * args.learners)} |")


if __name__ == "__main__":
    main()
