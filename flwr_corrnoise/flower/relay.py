"""Peer-to-peer learning over Flower's hub-and-spoke transport: a relay-only ServerApp and
a node ClientApp that run any registered decentralized algorithm.

Flower connects every SuperNode to the SuperLink only, so neighbours cannot talk directly. The
ServerApp here is a **relay**: each communication round it forwards to every node the latest
outboxes of *that node's graph neighbours* (an ``ArrayRecord`` keyed ``"<sender>/<key>"``)
plus the step, and collects each node's new outbox. It never sums, averages or otherwise
computes on messages. The nodes are :class:`~flwr.clientapp.ClientApp`\\ s that call exactly
the update functions of the in-process engine (:mod:`flwr_corrnoise.decentralized.protocol`)
with one node, so a simulation equals the in-process run for the same seeds.

Round ``r = 0..T``: the node absorbs the inbox of step ``r − 1`` (``update``) when ``r ≥ 1``,
then releases its step-``r`` outbox when ``r < T``. Its state lives in ``context.state``
(and in ``state-dir`` on disk when deployed, written before the reply leaves, via
:class:`flwr_corrnoise.persistence.StateStore`).

What a node refuses (an ``Error`` reply, state unchanged):

* an inbox whose senders differ from its neighbour set (a relay that drops, adds or swaps
  senders), non-finite messages, or a step that is not the next one (replay, skip, reorder);
* a run config whose ``privacy-*`` keys would weaken its own privacy settings — those come
  from the node's own settings (node config; in simulations also the run config's plain
  keys, as the rest of the project does), are written into its state at the first round and
  are never read from a message.

Threat model in one paragraph (``docs/decentralized.md`` has the full one): for paper 003
every message is already an ε-LDP release, so the relay learns nothing the neighbours do not;
it can still drop, delay, reorder or replace messages — nodes detect missing or extra senders
and out-of-order steps, but not a forged *value* (no authentication beyond Flower's transport).
For paper 004 the gossip messages are **raw sums of clipped gradients**: 004 is (ε, 0)-DP of
the decisions only with trusted neighbours and a trusted relay — not local DP.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from flwr_corrnoise.decentralized.engine import build_from_config
from flwr_corrnoise.decentralized.graphs import Graph, make_graph
from flwr_corrnoise.decentralized.protocol import (
    Inbox,
    NodeAlgorithm,
    PrivacyProposalError,
    State,
    check_privacy_proposal,
    state_from_bytes,
    state_to_bytes,
)
from flwr_corrnoise.flower.session import LearnerSession, deployed, learner_config
from flwr_corrnoise.persistence import StateLostError, StateStore

__all__ = [
    "InboxError",
    "StepError",
    "make_relay_client_app",
    "make_relay_server_app",
    "relay_apps",
]

log = logging.getLogger(__name__)
STATE_KEY = "decentralized-node"


class InboxError(ValueError):
    """An inbox whose senders are not exactly the node's neighbours, or malformed."""


class StepError(RuntimeError):
    """A message for a step that is not the node's next one (replay, skip, reorder)."""


def _graph_from_config(cfg: Mapping[str, Any]) -> Graph:
    return make_graph(str(cfg.get("graph", "ring")), int(cfg.get("num-nodes", 5)),
                      k=int(cfg.get("ws-degree", 6)), p=float(cfg.get("ws-rewire", 0.5)),
                      seed=int(cfg.get("graph-seed", 0)))


# -- server: the relay --------------------------------------------------------------------
def _wait(grid: Grid, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(ids := list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ids)} of {count} nodes connected")
        time.sleep(0.2)
    return ids


def _check_replies(replies: list[Message], what: str) -> None:
    errors = [m.error.reason for m in replies if m.has_error()]
    if errors:
        raise RuntimeError(f"{what}: {len(errors)} node(s) refused: {errors[0]}")


def make_relay_server_app(config: Mapping[str, Any] | None = None) -> ServerApp:
    """The relay. Run-config keys (over ``config``): ``num-nodes``, ``graph`` (+ ``ws-degree``,
    ``ws-rewire``, ``graph-seed``), ``steps``, ``round-timeout``; ``results-dir`` to write
    ``relay.npz`` (every relayed array, ``<key>`` → ``[steps, n, ...]``) and ``summary.json``
    (per-node ε reported by the nodes at the end)."""
    app = ServerApp()
    base = dict(config or {})

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = {**base, **dict(context.run_config)}
        graph = _graph_from_config(cfg)
        n, steps = graph.num_nodes, int(cfg.get("steps", 10))
        timeout = float(cfg.get("round-timeout", 600.0))
        ids = _wait(grid, n, timeout)
        # which graph node is each SuperNode? (they say so themselves)
        hello = [Message(RecordDict({"config": ConfigRecord({"hello": 1})}),
                         dst_node_id=nid, message_type="query") for nid in ids]
        replies = list(grid.send_and_receive(hello, timeout=timeout))
        _check_replies(replies, "hello")
        index = {int(m.content["metrics"]["node-index"]): m.metadata.src_node_id  # type: ignore[index]
                 for m in replies}
        if sorted(index) != list(range(n)):
            raise RuntimeError(f"nodes announced indices {sorted(index)}, expected 0..{n - 1}")
        latest: dict[int, dict[str, np.ndarray]] = {}
        relayed: dict[str, list[np.ndarray]] = {}
        final_metrics: dict[int, dict[str, float]] = {}
        for r in range(steps + 1):
            msgs = []
            for i in range(n):
                inbox = ArrayRecord()
                if r > 0:
                    for j in graph.neighbors(i):
                        for key, arr in latest[j].items():
                            inbox[f"{j}/{key}"] = Array(arr)  # forwarded as received
                content = RecordDict({"inbox": inbox,
                                      "config": ConfigRecord({"step": r, "steps": steps})})
                msgs.append(Message(content, dst_node_id=index[i], message_type="train"))
            replies = list(grid.send_and_receive(msgs, timeout=timeout))
            _check_replies(replies, f"round {r}")
            by_node = {next(i for i, nid in index.items() if nid == m.metadata.src_node_id): m
                       for m in replies}
            if len(by_node) != n:
                raise RuntimeError(f"round {r}: {len(by_node)} of {n} nodes answered")
            if r < steps:
                for i in range(n):
                    out = by_node[i].content["outbox"]
                    latest[i] = {k: out[k].numpy() for k in out}  # type: ignore[union-attr]
                for key in latest[0]:
                    relayed.setdefault(key, []).append(np.stack([latest[i][key]
                                                                  for i in range(n)]))
            else:
                for i in range(n):
                    final_metrics[i] = dict(by_node[i].content["metrics"])  # type: ignore[arg-type]
            log.info("relay round %d/%d done", r, steps)
        out_dir = cfg.get("results-dir")
        if out_dir:
            path = Path(str(out_dir))
            path.mkdir(parents=True, exist_ok=True)
            np.savez(path / "relay.npz", **{k: np.stack(v) for k, v in relayed.items()})
            (path / "summary.json").write_text(json.dumps(
                {"steps": steps, "num-nodes": n, "graph": graph.name,
                 "nodes": {str(i): final_metrics[i] for i in range(n)}}, indent=2))

    return app


# -- client: a node -----------------------------------------------------------------------
@lru_cache(maxsize=8)
def _build_cached(frozen: tuple[tuple[str, Any], ...]) -> tuple[Graph, NodeAlgorithm]:
    return build_from_config(dict(frozen))


def _node_index(cfg: Mapping[str, Any]) -> int:
    raw = cfg.get("node-index", cfg.get("partition-id"))
    if raw is None:
        raise ValueError("a decentralized node needs 'node-index' (or 'partition-id') in its "
                         "node config: its position in the graph")
    return int(raw)


def _privacy_keys(algo: NodeAlgorithm) -> set[str]:
    return {k for f in algo.privacy_fields for k in (f, f"privacy-{f}")}


class RelayNode:
    """One node bound to a Flower ``Context``: own settings, state load/save, one round."""

    def __init__(self, context: Context, defaults: Mapping[str, Any] | None = None) -> None:
        self.context = context
        cfg = learner_config(context, defaults)
        self.index = _node_index(cfg)
        frozen = tuple(sorted((k, v) for k, v in cfg.items()
                              if k not in ("partition-id", "num-partitions", "node-index",
                                           "state-dir", "noise-seed")))
        self.graph, self.algo = _build_cached(frozen)
        if not 0 <= self.index < self.graph.num_nodes:
            raise ValueError(f"node index {self.index} outside the graph's "
                             f"0..{self.graph.num_nodes - 1}")
        # own privacy settings: node config (and, in simulations, the run config's plain keys)
        self.privacy = self.algo.privacy_from_config(self.index, cfg)
        # a deployed node treats run-config privacy keys as a proposal to check, never to use
        rc = dict(context.run_config)
        proposal = {k: v for k, v in rc.items() if k in _privacy_keys(self.algo)}
        if deployed(context) or any(k.startswith("privacy-") for k in proposal):
            check_privacy_proposal(self.algo.privacy_fields,
                                   {k: float(v[0]) for k, v in self.privacy.items()},
                                   proposal, self.index)
        self.store = StateStore(str(context.node_config["state-dir"])) if deployed(
            context) else None
        seed = cfg.get("noise-seed")
        if seed is None and not deployed(context):
            seed = cfg.get("seed", 0)
        self.seed = int(np.random.SeedSequence().entropy) if seed is None else int(seed)
        # ``record-dir`` (simulations only): write each node's state after every round, so a
        # test can check that every relayed array is the node's θ + ζ. Never when deployed.
        self.record_dir = None if deployed(context) else cfg.get("record-dir")

    def load(self) -> State | None:
        if self.store is not None:
            data = self.store.load()
        elif STATE_KEY in self.context.state:
            data = bytes(self.context.state[STATE_KEY]["state"])  # type: ignore[index]
        else:
            data = None
        if data is None:
            return None
        try:
            return state_from_bytes(data)
        except ValueError as err:
            raise StateLostError(f"node {self.index}: state is corrupt: {err}") from err

    def save(self, state: State) -> None:
        data = state_to_bytes(state)
        if self.store is not None:
            self.store.save(data)
        self.context.state[STATE_KEY] = ConfigRecord({"state": data})

    def inbox(self, record: ArrayRecord) -> Inbox:
        neighbours = self.graph.neighbors(self.index)
        grouped: dict[int, dict[str, np.ndarray]] = {}
        for name in record:
            sender, _, key = name.partition("/")
            try:
                grouped.setdefault(int(sender), {})[key] = record[name].numpy()
            except ValueError as err:
                raise InboxError(f"malformed inbox entry {name!r}") from err
        if sorted(grouped) != list(neighbours):
            raise InboxError(f"node {self.index}: inbox senders {sorted(grouped)} differ from "
                             f"its neighbours {list(neighbours)}")
        keys = {tuple(sorted(v)) for v in grouped.values()}
        if len(keys) != 1:
            raise InboxError(f"node {self.index}: senders sent different message keys")
        messages = {k: np.stack([grouped[j][k] for j in neighbours])[None]
                    for k in keys.pop()}
        try:
            return Inbox(np.array([self.index]), np.array([list(neighbours)]), messages)
        except ValueError as err:
            raise InboxError(f"node {self.index}: {err}") from err

    def round(self, step: int, steps: int, record: ArrayRecord
              ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        state = self.load()
        if state is None:
            if step != 0:
                raise StepError(f"node {self.index} has no state but the relay is at step {step}")
            state = self.algo.init(np.array([self.index]), self.seed, self.privacy)
        else:
            mine = self.algo.privacy_of(state)
            for name, value in self.privacy.items():  # settings only ever get stronger
                if (value[0] - mine[name][0]) * self.algo.privacy_fields[name] < -1e-12:
                    raise PrivacyProposalError(
                        f"node {self.index}: its settings now say {name}={value[0]:g}, weaker "
                        f"than the {mine[name][0]:g} its state was started with")
        have = int(state["step"][0])
        released = bool(state.get("released", np.array([False]))[0])
        if step == 0 and not (have == 0 and not released):
            raise StepError(f"node {self.index}: step 0 again (a replay?)")
        if step > 0 and not (released and have == step - 1):
            raise StepError(f"node {self.index} is at step {have}, the relay sent step {step}")
        state = {k: v for k, v in state.items() if k != "released"}
        if step > 0:
            state = self.algo.update(state, self.inbox(record))
        outbox: dict[str, np.ndarray] = {}
        if step < steps:
            out, state = self.algo.release(state)
            outbox = {k: v[0] for k, v in out.items()}
        state["released"] = np.array([step < steps])
        metrics: dict[str, float] = {"step": float(step), "node-index": float(self.index)}
        if step == steps:
            for label, eps in self.algo.epsilon(state, steps).items():
                metrics[f"epsilon {label}"] = float(eps[0])
        record_dir = self.record_dir
        if record_dir:  # simulations only (see __init__): a test and debugging hook
            path = Path(str(record_dir))
            path.mkdir(parents=True, exist_ok=True)
            np.savez(path / f"node{self.index}-step{step}.npz",
                     decision=self.algo.decision(state)[0], **state)
        self.save(state)
        return outbox, metrics


def make_relay_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The node ClientApp. Its configuration is ``config_defaults`` < run config (simulations
    only) < node config (``node-index``/``partition-id``, ``state-dir``, ``noise-seed`` and
    its own privacy keys, e.g. ``noise-scale``/``noise-exponent`` for paper 003)."""
    app = ClientApp()
    defaults = dict(config_defaults or {})

    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        try:
            idx = _node_index(learner_config(context, defaults))
        except Exception as err:
            return LearnerSession.error_reply(msg, err)
        return Message(RecordDict({"metrics": MetricRecord({"node-index": idx})}),
                       reply_to=msg)

    @app.train()
    def step(msg: Message, context: Context) -> Message:
        try:
            node = RelayNode(context, defaults)
            cfg = msg.content["config"]
            outbox, metrics = node.round(int(cfg["step"]), int(cfg["steps"]),  # type: ignore[index]
                                         msg.content["inbox"])  # type: ignore[arg-type]
        except Exception as err:  # every refusal is a clear Error reply, state unchanged
            return LearnerSession.error_reply(msg, err)
        out = ArrayRecord()
        for key, arr in outbox.items():
            out[key] = Array(np.ascontiguousarray(arr))
        return Message(RecordDict({"outbox": out, "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    return app


def relay_apps(config: Mapping[str, Any]) -> tuple[ServerApp, ClientApp]:
    """Both apps around one config, for ``flwr.simulation.run_simulation`` (no run config)."""
    return make_relay_server_app(config), make_relay_client_app(config)


#: module-level apps for ``flwr run`` (components ``flwr_corrnoise.flower.relay:server_app``
#: and ``:client_app``); everything comes from the run config and each node's node config
server_app = make_relay_server_app()
client_app = make_relay_client_app()
