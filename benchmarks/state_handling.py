"""A simulated learner's state handling per round: inside ``context.state`` vs offloaded.

    python benchmarks/state_handling.py --dims 100000 1000000 --repeats 5

One learner-round's state work, as Flower's simulation engine and the learner session do
it, for a BLT learner (4 buffers of d float64): ``commit`` (serialize and store: into the
``ConfigRecord`` in ``context.state``, or to the learner's file with a handle in
``context.state``), ``ship`` (pickle the ``Context`` and unpickle it: Flower sends it to the
Ray actor and back on every message, so twice per round — counted once here and doubled in
the total), and ``load`` (read and check the state). The driver's share is what the
simulation process keeps per learner that has trained: the pickled ``Context``'s size.
Medians over ``--repeats``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from _format import human_bytes
from flwr.app import Context, RecordDict

from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner import LearnerState, PrivacySettings
from flwr_corrnoise.state_offload import OffloadPolicy


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def measure(dim: int, mode: str, repeats: int, root: Path) -> dict[str, float]:
    settings = PrivacySettings("blt", 2.0, 1e-3, 1.0, 400)
    ctx = Context(run_id=1, node_id=dim, node_config={}, state=RecordDict(), run_config={})
    storage = LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy(mode, root))
    state = LearnerState.create(settings, [(dim,)], seed=1)
    commit, ship, load, size = [], [], [], 0
    for _ in range(repeats):
        state.noise.next()
        state.advance()
        t0 = time.perf_counter()
        storage.write(state, {})
        t1 = time.perf_counter()
        blob = pickle.dumps(ctx, protocol=pickle.HIGHEST_PROTOCOL)
        storage.context = ctx = pickle.loads(blob)
        t2 = time.perf_counter()
        state = storage.read()
        t3 = time.perf_counter()
        commit.append(t1 - t0)
        ship.append(t2 - t1)
        load.append(t3 - t2)
        size = len(blob)
    out = {"commit": median_ms(commit), "ship": median_ms(ship), "load": median_ms(load),
           "driver": float(size)}
    out["total"] = out["commit"] + 2 * out["ship"] + out["load"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print("| d | state | commit ms | ship Context ms (×2 per round) | load ms "
          "| per round ms | kept in the driver per learner |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for dim in args.dims:
            for mode, label in (("off", "in context.state"), ("on", "offloaded to a file")):
                r = measure(dim, mode, args.repeats, Path(tmp))
                print(f"| {dim:,} | {label} | {r['commit']:.1f} | {r['ship']:.1f} | "
                      f"{r['load']:.1f} | {r['total']:.1f} | {human_bytes(r['driver'])} |",
                      flush=True)


if __name__ == "__main__":
    main()
