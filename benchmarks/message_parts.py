"""Where a learner's train message spends its CPU, timed in place, by a learner's round.

    python benchmarks/message_parts.py --learners 1000 --dims 100000 --dtype float32

``--learners`` learners (``flower_scale.LearnerMessages``: BLT, τ = 4, the state offloaded,
the simulation rules, in this process) each answer three train messages, round by round, so
that every learner's state is cold (out of the CPU's caches) when its message comes, as in
a simulation of many learners. Round 1 is a learner's first message (it creates its state
and a new folder and file), round 2 its second (a new file: the one it loaded stays until
the driver has the new handle), round 3 one from its third on (the stale file's pages are
reused). Plain Flower's message (its ClientApp, the same task) is timed the same way.

Each part is the thread CPU time inside one library function, wrapped in a timer for the
run (nested parts include their inner ones; cProfile inflates the many small calls 3–6×, a
timer around a few large ones does not), then unwrapped. Prints a markdown table: ms a
message of each part in each round.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flower_scale import LearnerMessages

#: (label, module, attribute path): the parts timed, outermost first
PARTS: tuple[tuple[str, str, str], ...] = (
    ("load: lock, read, check, rebuild", "flwr_corrnoise.flower.session",
     "LearnerTransaction.open"),
    ("  the offloaded file's read and MAC", "flwr_corrnoise.state_offload", "read"),
    ("  the state rebuilt from its arrays", "flwr_corrnoise.learner_state",
     "LearnerState.from_state_dict"),
    ("  a fresh state (first message)", "flwr_corrnoise.learner_state", "LearnerState.create"),
    ("the local round", "flwr_corrnoise.learner", "local_rounds"),
    ("  the noise block: draws and BLT", "flwr_corrnoise.learner", "BlockNoise.__init__"),
    ("  the private steps (the task's gradient in them)", "flwr_corrnoise.learner",
     "private_steps"),
    ("commit: pack, MAC, write", "flwr_corrnoise.flower.session",
     "LearnerTransaction.commit"),
    ("  the offloaded file's write and MAC", "flwr_corrnoise.state_offload", "write"),
    ("  the learner's folders made private", "flwr_corrnoise.state_offload",
     "OffloadPolicy.prepare"),
    ("the reply (arrays into Flower's records)", "flwr_corrnoise.flower.session",
     "LearnerSession.reply"),
    ("the session's set-up (config, settings)", "flwr_corrnoise.flower.session",
     "LearnerSession.__init__"),
)


@contextlib.contextmanager
def timed(totals: collections.Counter) -> Iterator[None]:
    """Every part of :data:`PARTS` wrapped in a thread-CPU timer adding to ``totals`` (by
    label), for the block; the originals put back after it."""
    import importlib

    saved: list[tuple[Any, str, Any]] = []
    try:
        for label, module, path in PARTS:
            owner: Any = importlib.import_module(module)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            kind = type(original) if isinstance(original, (classmethod, staticmethod)) else None
            inner = original.__func__ if kind else original

            def wrapper(*args: Any, _f: Any = inner, _label: str = label,
                        **kwargs: Any) -> Any:
                start = time.thread_time()
                try:
                    return _f(*args, **kwargs)
                finally:
                    totals[_label] += time.thread_time() - start

            functools.update_wrapper(wrapper, inner)
            saved.append((owner, name, original))
            setattr(owner, name, kind(wrapper) if kind else wrapper)
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def measure(learners: int, dim: int, dtype: str) -> dict[str, list[float]]:
    """ms a message of every part (and the whole message, ours and plain's) per round."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    with (LearnerMessages(dim, dtype, 8, learners=learners) as ours,
          LearnerMessages(dim, dtype, 8, learners=learners, plain=True) as plain):
        ours.send(1, 0)  # the factorization and the kernel built before any round is timed
        plain.send(1, 0)
        for r in (1, 2, 3):
            totals: collections.Counter = collections.Counter()
            whole = plain_s = 0.0
            with timed(totals):
                for i in range(learners):
                    if r == 1 and i == 0:
                        continue  # sent above
                    start = time.thread_time()
                    ours.send(r, i)
                    whole += time.thread_time() - start
                    start = time.thread_time()
                    plain.send(r, i)
                    plain_s += time.thread_time() - start
            count = learners - (r == 1)
            out["the whole message"].append(1e3 * whole / count)
            out["plain Flower's message"].append(1e3 * plain_s / count)
            for label, _, _ in PARTS:
                out[label].append(1e3 * totals[label] / count)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, default=1000)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000])
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.learners} learners, {args.dtype}, "
          f"τ = {LearnerMessages.tau}; thread CPU ms a message\n")
    for dim in args.dims:
        parts = measure(args.learners, dim, args.dtype)
        print(f"d = {dim:,}\n\n| part | round 1 (first) | round 2 | round 3 (third on) |\n"
              "|---|---|---|---|")
        for label in ("the whole message", "plain Flower's message",
                      *[label for label, _, _ in PARTS]):
            print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in parts[label]) + " |")
        print()


if __name__ == "__main__":
    main()
