"""Is PD-OCG projection-free in cost, not just in name? Its LMO by the top singular pair
vs PD-FTGL's projection (Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms
for Decentralized Online Learning", Sec. 3.3; issue 24).

    python benchmarks/pd_ocg_lmo.py --shapes 26x16 100x100 300x300 --round-shapes 26x16 \\
        100x100 --horizon 10000 --blocks 3 --repeats 3

On the nuclear-norm ball ``‖X‖_* ≤ τ`` (q × p matrices) the projection needs a full SVD
(``O(qp·min(q,p))``), the LMO only the top singular pair — ``O(qp)`` per Krylov or power
step. Two tables, CPU time (``time.process_time``; BLAS pinned to one thread, so the numbers
are one core's):

1. **per call**, one q × p matrix of two kinds: a rank-one signal plus Laplace noise (a
   clear top pair) and Laplace noise only (``σ₂/σ₁`` close to 1 — the hard case for power
   iteration; the paper-calibrated private block sums are noise-dominated): the full-SVD
   LMO (reference; what the code did before), power iteration (cold and warm-started from
   the previous call's vector on a 1e-3-perturbed matrix, as inside a Frank–Wolfe loop),
   Lanczos (``scipy.sparse.linalg.
   svds``, k = 1, cold and warm) and the Euclidean projection (full SVD + capped simplex).
   Every LMO is checked against the full-SVD one (max |difference|).
2. **per round**, 9 learners on a complete graph, ε = 10, horizon ``--horizon`` (the block
   lengths: PD-FTGL ``L = ⌈4 ln(nT√(14n))/√ρ⌉`` projects once per block, PD-OCG runs
   ``L_OCG = ⌈√T⌉`` Frank–Wolfe steps — one LMO each — per block of ``L_OCG`` rounds, i.e.
   one LMO per round), over whole blocks of each algorithm covering at least ``--blocks``
   PD-OCG blocks: PD-FTGL vs PD-OCG with each LMO.
   Tasks: ``synthetic-multiclass`` with ``classes × features`` = the shape (samples
   generated; the cost does not depend on what they are).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import numpy as np  # noqa: E402

from flwr_corrnoise.decentralized.engine import build_from_config  # noqa: E402
from flwr_corrnoise.decentralized.protocol import Inbox  # noqa: E402
from flwr_corrnoise.decentralized.sets import (  # noqa: E402
    NuclearBall,
    top_singular_pair,
    top_singular_pair_lanczos,
)


def shape_arg(s: str) -> tuple[int, int]:
    q, p = s.lower().split("x")
    return int(q), int(p)


def cpu(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Median CPU seconds of ``fn()`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return statistics.median(out)


def per_call(shapes: list[tuple[int, int]], repeats: int) -> list[str]:
    lines = ["| q × p | matrix | method | CPU ms per call | ÷ full-SVD LMO | "
             "max \\|LMO − full-SVD LMO\\| | σ₂/σ₁ |", "|---|---|---|---|---|---|---|"]
    for (q, p), kind in ((sh, k) for sh in shapes for k in ("rank one + noise", "noise only")):
        rng = np.random.default_rng(q * 1000 + p)
        signal = np.outer(rng.normal(size=q), rng.normal(size=p))
        noise = rng.laplace(size=(q, p))
        G = signal + 3.0 * noise / np.sqrt(max(q, p)) if kind != "noise only" else noise
        G2 = G + 1e-3 * rng.normal(size=G.shape)
        s = np.linalg.svd(G, compute_uv=False)
        K = {m: NuclearBall((q, p), 10.0, lmo=m) for m in ("svd", "power", "lanczos")}
        g, g2 = G.reshape(1, -1), G2.reshape(1, -1)
        ref = K["svd"].lmo(g2)
        _u, _s, v_prev, _it = top_singular_pair(G[None])
        _ul, _sl, vl_prev = top_singular_pair_lanczos(G[None])
        svd, power, lanczos = K["svd"], K["power"], K["lanczos"]
        cases = [
            ("full-SVD LMO (reference)", partial(svd.lmo, g2)),
            ("power iteration, cold", partial(power.lmo, g2)),
            ("power iteration, warm", lambda k=power, a=g2, w=v_prev: k.lmo_warm(a, w)[0]),
            ("Lanczos (svds k=1), cold", partial(lanczos.lmo, g2)),
            ("Lanczos (svds k=1), warm",
             lambda k=lanczos, a=g2, w=vl_prev: k.lmo_warm(a, w)[0]),
            ("projection (full SVD + simplex)", partial(svd.project, 10 * g)),
        ]
        base = None
        for name, fn in cases:
            sec = cpu(fn, repeats)
            base = base or sec
            diff = "–" if name.startswith("projection") else f"{np.max(np.abs(fn() - ref)):.1e}"
            lines.append(f"| {q} × {p} | {kind} | {name} | {1000 * sec:.3f} | "
                         f"{sec / base:.2f}× | {diff} | {s[1] / s[0]:.3f} |")
    return lines


def per_round(shapes: list[tuple[int, int]], horizon: int, blocks: int,
              samples: int) -> list[str]:
    lines = ["| q × p | algorithm | LMO | L | rounds | CPU ms per round (9 learners) "
             "| ÷ PD-FTGL |", "|---|---|---|---|---|---|---|"]
    for q, p in shapes:
        base = None
        for alg, lmo in (("pd-ftgl", "–"), ("pd-ocg", "svd"), ("pd-ocg", "power"),
                         ("pd-ocg", "lanczos")):
            cfg = {"algorithm": alg, "graph": "complete", "num-nodes": 9, "epsilon": 10.0,
                   "set": "nuclear", "set-size": 10.0, "alpha": 0.0, "seed": 0,
                   "task": "synthetic-multiclass", "classes": q, "dim": p,
                   "samples": samples, "horizon": horizon, "clip": 1.0,
                   **({} if lmo == "–" else {"lmo": lmo})}
            algo = build_from_config(cfg)[1]
            ocg_L = int(np.ceil(np.sqrt(horizon)))
            # whole blocks of this algorithm (block-end work included), ≥ blocks × L_OCG
            rounds = algo.L * int(np.ceil(blocks * ocg_L / algo.L))
            nodes = np.arange(algo.num_nodes)
            state = algo.init(nodes, 0, algo.default_privacy(nodes))
            spent = 0.0
            for _ in range(rounds):
                t0 = time.process_time()
                out, state = algo.release(state)
                state = algo.update(state, Inbox.gather(algo.graph, nodes, out))
                spent += time.process_time() - t0
            ms = 1000 * spent / rounds
            base = base or ms
            lines.append(f"| {q} × {p} | {alg.upper()} | {lmo} | {algo.L} | {rounds} | "
                         f"{ms:.3f} | {ms / base:.2f}× |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=shape_arg,
                    default=[(26, 16), (100, 100), (300, 300)])
    ap.add_argument("--round-shapes", nargs="+", type=shape_arg,
                    default=[(26, 16), (100, 100), (200, 200)])
    ap.add_argument("--horizon", type=int, default=60000)
    ap.add_argument("--blocks", type=int, default=3,
                    help="PD-OCG blocks timed per run (≥ 3: the first block's Frank–Wolfe "
                         "loop runs on a zero sum)")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"```text\nCPU time, BLAS threads = {os.environ['OPENBLAS_NUM_THREADS']}, "
          f"numpy {np.__version__}, horizon {args.horizon}\n```\n")
    print("\n".join(per_call(args.shapes, args.repeats)))
    print()
    print("\n".join(per_round(args.round_shapes, args.horizon, args.blocks, args.samples)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
