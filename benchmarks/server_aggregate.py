"""The server's aggregation of a round's replies: time and peak memory.

    python benchmarks/server_aggregate.py --dim 1000000 --replies 100 --repeats 3

``CorrNoiseFedAvg.aggregate_train`` on ``--replies`` train replies of one float64 array of
``--dim`` values each (the learners' ``ĝ``, built as Flower messages before the clock
starts). It reads each reply's arrays, checks them and adds them to the sum in learner
order (:class:`flwr_corrnoise.aggregation.UpdateSum`), so it holds one update at a time;
before issue 22's last pass it read all of them first, then summed. "peak" is the largest
memory NumPy and Python allocated during the call (``tracemalloc``), over what the replies
themselves already hold. Medians over ``--repeats``; prints one markdown row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from flwr_corrnoise.flower import CorrNoiseFedAvg
from flwr_corrnoise.settings import PrivacySettings


class _Grid:
    """The one Grid method ``configure_train`` needs: the connected nodes."""

    def __init__(self, nodes: int) -> None:
        self.nodes = list(range(1, nodes + 1))

    def get_node_ids(self) -> list[int]:
        return self.nodes


def replies(dim: int, count: int, seed: int = 0) -> list[Message]:
    """``count`` train replies, learner ``i`` from node ``i + 1``, one random array each."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        md = Metadata(run_id=1, message_id=f"m{i}", src_node_id=i + 1, dst_node_id=0,
                      reply_to_message_id="x", group_id="1", created_at=time.time(),
                      ttl=3600.0, message_type=MessageType.TRAIN)
        content = RecordDict({"arrays": ArrayRecord([rng.standard_normal(dim)]),
                              "metrics": MetricRecord({"num-examples": 4, "learner-id": i})})
        out.append(Message(content=content, metadata=md))
    return out


def measure(dim: int, count: int) -> tuple[float, float]:
    """Seconds and peak MiB of one ``aggregate_train`` over ``count`` replies."""
    x = [np.zeros(dim)]
    strategy = CorrNoiseFedAvg(local_steps=4, learning_rate=0.1,
                               privacy=PrivacySettings("blt", horizon=40))
    strategy.configure_train(1, ArrayRecord(x), ConfigRecord({}), _Grid(count))
    msgs = replies(dim, count)
    tracemalloc.start()
    start = time.perf_counter()
    strategy.aggregate_train(1, msgs)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1_000_000)
    p.add_argument("--replies", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    # outside a running ServerApp, Flower needs a task identity to build messages
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    runs = [measure(args.dim, args.replies) for _ in range(args.repeats)]
    seconds = statistics.median(r[0] for r in runs)
    peak = statistics.median(r[1] for r in runs)
    print("| replies × d | aggregate_train s | peak MiB (tracemalloc) | update MiB | load |")
    print("|---|---|---|---|---|")
    print(f"| {args.replies:,} × {args.dim:,} | {seconds:.2f} | {peak:.0f} | "
          f"{args.dim * 8 / 2**20:.1f} | {os.getloadavg()[0]:.1f} |")


if __name__ == "__main__":
    main()
