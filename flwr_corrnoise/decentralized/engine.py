"""The fast in-process engine: all nodes of a graph, vectorized over the node axis.

It calls exactly the functions a Flower node calls (:mod:`.protocol`): ``release`` for every
node, gather each node's neighbours' outboxes, ``update``. Sweeps over seeds and settings run
here; :mod:`flwr_corrnoise.flower.relay` runs the same algorithm over Flower and a test checks
the two agree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flwr_corrnoise.decentralized.graphs import Graph, make_graph
from flwr_corrnoise.decentralized.protocol import (
    ALGORITHMS,
    Inbox,
    NodeAlgorithm,
    State,
    _import_builtin,
    build_algorithm,
)
from flwr_corrnoise.decentralized.tasks import Task, build_task

__all__ = ["ALGORITHMS", "RunResult", "algorithm_names", "run", "run_from_config"]

#: called after each step: (t, state after the step, outboxes released at step t)
Observer = Callable[[int, State, Mapping[str, np.ndarray]], None]


@dataclass
class RunResult:
    """What a run produced: decisions per step (``[T+1, n, dim]``, index 0 the initial
    decision), optionally every outbox, the final state and the wall time."""

    decisions: np.ndarray
    state: State
    outboxes: list[dict[str, np.ndarray]] = field(default_factory=list)
    seconds: float = 0.0

    def epsilon(self, algorithm: NodeAlgorithm, steps: int | None = None
                ) -> dict[str, np.ndarray]:
        t = self.decisions.shape[0] - 1 if steps is None else steps
        return algorithm.epsilon(self.state, t)


def algorithm_names() -> list[str]:
    """Every registered algorithm (built-in modules imported first)."""
    _import_builtin()
    return sorted(ALGORITHMS)


def run(
    algorithm: NodeAlgorithm,
    steps: int,
    run_seed: int = 0,
    privacy: Mapping[str, Sequence[float] | np.ndarray] | None = None,
    *,
    keep_outboxes: bool = False,
    observer: Observer | None = None,
    progress: bool = False,
    label: str = "",
) -> RunResult:
    """Run ``steps`` synchronous steps of ``algorithm`` on all nodes of its graph.

    ``privacy`` gives each node's own settings (``name → one value per node``); by default the
    algorithm's :meth:`~NodeAlgorithm.default_privacy`.
    """
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be an integer ≥ 0, got {steps!r}")
    graph: Graph = algorithm.graph
    nodes = np.arange(graph.num_nodes)
    priv = algorithm.default_privacy(nodes) if privacy is None else {
        k: np.asarray(v, dtype=float) for k, v in privacy.items()
    }
    for name in algorithm.privacy_fields:
        if name not in priv and name in algorithm.bound_fields:
            continue  # a declared bound: init records the one the algorithm enforces
        if name not in priv or np.shape(priv[name]) != (graph.num_nodes,):
            raise ValueError(f"privacy setting {name!r} needs one value per node")
    state = algorithm.init(nodes, run_seed, priv)
    decisions = np.empty((steps + 1, graph.num_nodes, algorithm.dim))
    decisions[0] = algorithm.decision(state)
    kept: list[dict[str, np.ndarray]] = []
    start = last = time.perf_counter()
    for t in range(steps):
        outbox, state = algorithm.release(state)
        inbox = Inbox.gather(graph, nodes, outbox)
        state = algorithm.update(state, inbox)
        decisions[t + 1] = algorithm.decision(state)
        if keep_outboxes:
            kept.append({k: v.copy() for k, v in outbox.items()})
        if observer is not None:
            observer(t, state, outbox)
        if progress and time.perf_counter() - last > 5:
            last = time.perf_counter()
            print(f"  {label or algorithm.name}: step {t + 1}/{steps} "
                  f"({last - start:.0f} s)", file=sys.stderr, flush=True)
    return RunResult(decisions, state, kept, time.perf_counter() - start)


def run_from_config(config: Mapping[str, Any], *, keep_outboxes: bool = False
                    ) -> tuple[NodeAlgorithm, RunResult]:
    """Build graph, task and algorithm from one kebab-case config and run it (the CLI and the
    Flower relay test use the same keys: ``algorithm``, ``graph``, ``num-nodes``, ``steps``,
    ``seed``, ``task`` and the algorithm's own keys)."""
    _graph, algo = build_from_config(config)
    return algo, run(algo, int(config.get("steps", 100)), int(config.get("seed", 0)),
                     keep_outboxes=keep_outboxes)


def build_from_config(config: Mapping[str, Any]) -> tuple[Graph, NodeAlgorithm]:
    """Graph, task and algorithm from a kebab-case config (what every engine shares)."""
    n = int(config.get("num-nodes", 5))
    graph = make_graph(str(config.get("graph", "ring")), n,
                       k=int(config.get("ws-degree", 6)), p=float(config.get("ws-rewire", 0.5)),
                       seed=int(config.get("graph-seed", 0)))
    task_cfg = dict(config)
    task_cfg.setdefault("horizon", int(config.get("steps", 100)))
    task: Task = build_task(str(config.get("task", "synthetic-logreg")), task_cfg)
    algo = build_algorithm(str(config.get("algorithm", "chen-wang")), graph, task, config)
    return graph, algo
