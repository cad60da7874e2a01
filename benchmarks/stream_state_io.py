"""A noise stream's state I/O: ``to_bytes`` and ``from_bytes`` of a BLT stream (4 buffers of
``d`` floats), NumPy float64 and float32 and torch float32 on the CPU, now and (``--before
DIR``) as an earlier copy of the package did it, side by side in one run.

    python benchmarks/stream_state_io.py --dims 100000 1000000 --repeats 15 \
        --before /tmp/before --cpu-time

(``/tmp/before``: ``git archive <commit> flwr_corrnoise | tar -x -C /tmp/before``, loaded
under another name.) Why: a learner's state is written and read every round; the bytes
themselves are one copy each way, and anything more — a copy of the buffers before packing,
a stack of torch rows, a copy per row on restore, torch's elementwise ``isfinite`` on the
restored buffers — is overhead this measures. Each repeat times every candidate once
(round-robin, the same machine load); the figure is the median in ms, "× before" divides
by the earlier copy's in the same run. One torch thread. ``--cpu-time``: the thread's CPU
time instead of the wall clock (on a machine loaded far beyond its cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
from _before import import_before


def load(path: str | None) -> object:
    """The package: this checkout's, or the copy at ``path`` as ``flwr_corrnoise_before``."""
    if path is None:
        import flwr_corrnoise

        return flwr_corrnoise
    return import_before(path)


def candidates(pkg: object, d: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """``(to_bytes, from_bytes)`` of a stream two steps in, per stream kind."""
    import importlib

    import torch

    name = pkg.__name__  # type: ignore[attr-defined]
    streams = importlib.import_module(f"{name}.streams")
    tstreams = importlib.import_module(f"{name}.torch.streams")
    out = {}
    for label, make in [
        ("NumPy float64", lambda: streams.NoiseStream.create("blt", 100, d, 1.0, 1)),
        ("NumPy float32", lambda: streams.NoiseStream.create("blt", 100, d, 1.0, 1,
                                                             dtype=np.float32)),
        ("torch float32 (CPU)", lambda: tstreams.TorchNoiseStream.create(
            "blt", 100, d, 1.0, 1, dtype=torch.float32)),
    ]:
        s = make()
        s.next()
        s.next()
        data = s.to_bytes()
        cls = type(s)
        out[label] = (s.to_bytes, lambda cls=cls, data=data: cls.from_bytes(data))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--before", metavar="DIR", help="an earlier copy of the package")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the thread's CPU time (a loaded machine) instead of the wall")
    args = p.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    import torch

    torch.set_num_threads(1)
    pkgs = {"now": load(None)}
    if args.before:
        pkgs["before"] = load(args.before)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; median of {args.repeats}; "
          f"clock: {'thread CPU time' if args.cpu_time else 'wall'}")
    print()
    print("| d | stream (BLT, 4 buffers) | version | to_bytes ms | from_bytes ms | "
          "× before (to / from) |")
    print("|---|---|---|---|---|---|")
    for d in args.dims:
        fns = {(label, v): pair for v, pkg in pkgs.items()
               for label, pair in candidates(pkg, d).items()}
        times: dict[tuple, list[list[float]]] = {k: [[], []] for k in fns}
        for _ in range(args.repeats):
            for key, pair in fns.items():
                for i, fn in enumerate(pair):
                    start = clock()
                    fn()
                    times[key][i].append(clock() - start)
        for (label, version), (t_to, t_from) in times.items():
            to_ms, from_ms = 1e3 * statistics.median(t_to), 1e3 * statistics.median(t_from)
            ratio = ""
            if version == "now" and (label, "before") in times:
                b_to, b_from = (1e3 * statistics.median(x) for x in times[(label, "before")])
                ratio = f"{to_ms / b_to:.2f}× / {from_ms / b_from:.2f}×"
            print(f"| {d:,} | {label} | {version} | {to_ms:.1f} | {from_ms:.1f} | {ratio} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
