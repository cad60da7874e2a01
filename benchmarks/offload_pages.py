"""What an offloaded learner's commit costs when its file is new against when it reuses one.

    python benchmarks/offload_pages.py --dims 100000 --learners 1000 --writers 1 2
    python benchmarks/offload_pages.py --dims 100000 --learners 1000 --writers 2 --pretouch-gib 4

A simulated learner's commit (``flwr_corrnoise.state_offload.write``) writes its state to a
new file in its own folder; from its third commit on it overwrites the pages of its stale
file (the generation before the one it loaded), while its first two commits put the whole
state into pages the file system has to allocate. In a Flower run of 1000 learners with
10 % sampled a round, a learner's third message comes after ≈ 20 rounds on average, so a
short run is nearly all first and second commits.

For ``--learners`` learners, three rounds of one commit each (a float32 BLT state of 4·d
floats, the library's chunks, Poly1305 and rename, as a learner does them): the median ms
of a commit in round 1 (new file, new folder), round 2 (new file) and round 3 (the stale
file's pages reused), with ``--writers`` processes committing at the same time (a
simulation's two actors do), optionally after touching ``--pretouch-gib`` GiB of memory
and freeing it (on a virtual machine whose host backs guest memory on first touch, the
allocation is what costs; memory touched once and freed is cheap to allocate again).

Prints a markdown table: each round's ms a commit and its ratio to round 3's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from flwr_corrnoise import state_offload

ROUNDS = ("1: new folder and file", "2: new file (the loaded one kept)",
          "3: the stale file's pages reused")


def commits(dim: int, learners: int, pretouch_gib: float, start: object | None = None
            ) -> list[float]:
    """Median thread-CPU ms of a commit in each of the three rounds (one process)."""
    if pretouch_gib > 0:  # touch the memory once, then give it back
        block = np.ones(int(pretouch_gib * 2**30) // 8)
        del block
    rng = np.random.default_rng(0)
    # four buffers in turn (their values are not the point), each file's identity and
    # generation those of its handle, as a learner's state_dict holds them
    buffers = [rng.standard_normal(4 * dim).astype(np.float32) for _ in range(4)]
    with tempfile.TemporaryDirectory(prefix="offload-pages-") as tmp:
        folders = [Path(tmp) / f"node-{i}" / "k" for i in range(learners)]
        kept: list[str | None] = [None] * learners
        if start is not None:
            start.wait()  # type: ignore[attr-defined]  # every writer starts together
        out = []
        for generation in (1, 2, 3):
            times = []
            for i, folder in enumerate(folders):
                state = {"blt": buffers[i % 4], "identity": np.array(f"learner-{i}"),
                         "generation": np.array(generation)}
                c0 = time.thread_time()
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                handle = state_offload.write(folder, state, identity=f"learner-{i}",
                                             generation=generation, keep=kept[i])
                times.append(time.thread_time() - c0)
                kept[i] = handle.path
            out.append(1e3 * statistics.median(times))
        return out


def _worker(args: tuple[int, int, float, object], queue: object) -> None:
    queue.put(commits(*args))  # type: ignore[attr-defined]


def run(dim: int, learners: int, writers: int, pretouch_gib: float) -> list[float]:
    """Each round's median ms, over ``writers`` processes committing at once."""
    if writers == 1:
        return commits(dim, learners, pretouch_gib)
    ctx = mp.get_context("spawn")
    start, queue = ctx.Barrier(writers), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=((dim, learners, pretouch_gib, start), queue))
             for _ in range(writers)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a writer failed (exit {p.exitcode})")
    return [statistics.median(r[k] for r in results) for k in range(3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000])
    p.add_argument("--learners", type=int, default=1000)
    p.add_argument("--writers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pretouch-gib", type=float, default=0.0)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.learners} learners a process; "
          f"memory touched first: {args.pretouch_gib:g} GiB\n")
    print("| d | writers | commit | ms | × reuse |\n|---|---|---|---|---|")
    for dim in args.dims:
        for writers in args.writers:
            ms = run(dim, args.learners, writers, args.pretouch_gib)
            for label, value in zip(ROUNDS, ms, strict=True):
                print(f"| {dim:,} | {writers} | {label} | {value:.3f} | {value / ms[2]:.2f}× |")


if __name__ == "__main__":
    main()
