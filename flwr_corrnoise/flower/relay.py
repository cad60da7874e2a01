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
(and in ``state-dir`` on disk when deployed, via :class:`flwr_corrnoise.persistence.StateStore`
exactly as every other learner keeps it: the directory's lock held for the whole message, and
each round committed — a ``ledger.jsonl`` line (one released step, or none in round ``T``),
the state, a ``commits.jsonl`` line — before the reply leaves).

A node is a learner like any other (``flower/session.py``'s rules, ``docs/threat-model.md``):

* **its noise seed** is, in Flower's simulation engine, the node config's ``noise-seed``,
  else the run's ``seed`` (the algorithm derives node ``i``'s 128-bit generator key from
  ``(seed, i)``, as the in-process engine does, so a simulation equals the in-process run);
  **anywhere else it is 128 bits of OS entropy**, with or without a ``state-dir``, and a
  ``noise-seed`` in the node config or the app's defaults is refused (code 4101): the relay
  can never know a node's seed, and a wiped state can never replay its noise;
* **its state is bound** to its node index, its algorithm and its identity (128 bits of OS
  entropy drawn when it starts, with a commit counter), and records its own privacy
  settings; a state of another node, weaker settings than the state was started with, and —
  checked by :meth:`StateStore.verify` as for every learner — a state behind its ledger
  (rolled back), one of another identity (cloned) or a ledger without a state (wiped) are
  refused.

What a node refuses (an ``Error`` reply, state unchanged, nothing released), with the codes
of :data:`RELAY_ERROR_CODES` and the learner's (:data:`flwr_corrnoise.flower.session.
ERROR_CODES`):

* an inbox whose senders differ from its neighbour set (a relay that drops, adds or swaps
  senders), non-finite or malformed messages (4111), or a step that is not the next one —
  replay, skip, reorder (4110);
* a run config whose ``privacy-*`` keys (and, outside simulations, plain privacy keys) would
  weaken its own privacy settings (4101) — those come from the node's own settings (node
  config and the app's defaults; in simulations also the run config's plain keys, as the rest
  of the project does), are written into its state at the first round and are never read
  from a message;
* a lost, wiped, rolled-back or foreign state (4104), a state directory in use (4105).

Every reason is a function of the node's configuration, its state and the relay's message.
Anything else that fails — the task's constructor, data loading, a numeric overflow in the
algorithm, a non-finite release — is answered with a fixed reason (code 4100); the details
stay in the node's log. A **datum** whose gradient cannot be computed (a row of the wrong
length, a non-finite value, a label out of range, a task that raises on it) is not a
failure: it counts as a zero gradient (:func:`flwr_corrnoise.decentralized.tasks.
data_gradient`), so a node's replies — kind, codes, reasons, metrics — do not depend on
it; the count goes to the node's log and ``state-dir/diagnostics.jsonl`` only.

The **declared data bounds** Chen & Wang's ("Locally Differentially Private Distributed Online
Learning with Guaranteed Optimality") ε is computed from (``feature-bound``, ``clip``: the
algorithm's ``bound_fields``) are the node's own privacy settings like its noise: from its node
config and the app's defaults, recorded in its state, and a run-config value larger than its own (a
``clip`` of 0 is none: the largest) is a refused proposal (4101).

Threat model in one paragraph (``docs/decentralized.md`` has the full one): for Chen & Wang
every message is already an ε-LDP release, so the relay learns nothing the neighbours do not;
it can still drop, delay, reorder or replace messages — nodes detect missing or extra senders
and out-of-order steps, but not a forged *value* (no authentication beyond Flower's transport).
For Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized
Online Learning" the gossip messages are **raw sums of clipped gradients**: Wang et al.'s
algorithms are (ε, 0)-DP of the decisions only with trusted neighbours and a trusted relay — not
local DP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from flwr_corrnoise.decentralized.engine import build_from_config
from flwr_corrnoise.decentralized.graphs import Graph, make_graph
from flwr_corrnoise.decentralized.protocol import (
    Inbox,
    NodeAlgorithm,
    PrivacyProposalError,
    check_privacy_proposal,
)
from flwr_corrnoise.flower import session as _session
from flwr_corrnoise.flower.session import (
    LearnerSession,
    LearnerStorage,
    answer,
    deployed,
    learner_config,
    learner_seed,
)
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import StateLostError, StateStore
from flwr_corrnoise.state_offload import OffloadPolicy
from flwr_corrnoise.streams import new_seed

__all__ = [
    "RELAY_ERROR_CODES",
    "InboxError",
    "RelayResult",
    "StepError",
    "make_relay_client_app",
    "make_relay_server_app",
    "relay_apps",
    "relay_error_reply",
    "relay_seed",
]

log = logging.getLogger(__name__)
STATE_KEY = "decentralized-node"
#: the front end a relay node's :class:`~flwr_corrnoise.learner_state.LearnerState` is bound to
#: (its ``binding``, with the node index and the algorithm)
FRONT_END = "relay-node"


class InboxError(ValueError):
    """An inbox whose senders are not exactly the node's neighbours, or malformed."""


class StepError(RuntimeError):
    """A message for a step that is not the node's next one (replay, skip, reorder)."""


#: the relay node's own refusals, and their error codes. Each is raised only with a text
#: that is a function of the node's configuration, its state and the relay's message (the
#: inbox's senders, keys, shapes and finiteness; step numbers; privacy settings), so it may
#: leave the node. The learner's refusals keep their codes (``session.ERROR_CODES``).
RELAY_ERROR_CODES: dict[type[Exception], int] = {
    PrivacyProposalError: 4101,
    StepError: 4110,
    InboxError: 4111,
}


def relay_error_reply(msg: Message, err: BaseException) -> Message:
    """The ``Error`` reply of a relay node: the learner's gate
    (:meth:`LearnerSession.error_reply`) with the node's own refusals
    (:data:`RELAY_ERROR_CODES`); any other exception — the task's constructor, data
    loading, a numeric overflow — gets the gate's fixed reason, its details stay in the
    node's log."""
    return LearnerSession.error_reply(msg, err, RELAY_ERROR_CODES)


def relay_seed(context: Context, defaults: Mapping[str, Any] | None = None) -> int:
    """A relay node's noise seed, by the learners' policy (:func:`~flwr_corrnoise.flower.
    session.learner_seed`).

    Outside Flower's simulation engine: 128 bits of OS entropy, always — whether or not the
    node has a ``state-dir`` — and a ``noise-seed`` in its node config or the app's defaults
    is refused (:class:`~flwr_corrnoise.settings.PrivacyConfigError`, code 4101). Why: a seed
    from the run config is the relay's to know (ε = ∞ against it), and a fixed node seed
    replays the same noise after a wiped state.

    In a simulation: the node config's ``noise-seed``, else the run's ``seed``, else OS
    entropy. The run's seed is passed as is because the algorithm's ``init`` derives node
    ``i``'s generator from ``(seed, i)`` (:func:`~flwr_corrnoise.decentralized.protocol.
    node_seeds`) exactly as the in-process engine does — which is what makes a Flower
    simulation equal the in-process run.
    """
    seed = learner_seed(context, defaults)  # raises for a fixed seed on a real SuperNode
    if _session.in_simulation():
        cfg = learner_config(context, defaults)
        if cfg.get("noise-seed") is None and cfg.get("seed") is not None:
            seed = int(cfg["seed"])
    return new_seed() if seed is None else int(seed)


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


@dataclass(frozen=True)
class RelayResult:
    """What the relay saw in one run, handed to ``on_result`` when the run ends.

    Why a value and not files: writing results is the caller's choice (the repository's
    ``experiments/relay.py`` writes ``relay.npz`` and ``summary.json`` from it); the library
    app writes nothing."""

    #: the relay's configuration (``config`` < run config)
    config: dict[str, Any]
    graph: Graph
    steps: int
    #: every relayed array, ``<key>`` → ``[steps, n, ...]``
    relayed: dict[str, np.ndarray]
    #: per node, the metrics of its last reply (its ε under each labelled accountant)
    node_metrics: dict[int, dict[str, float]]


def make_relay_server_app(config: Mapping[str, Any] | None = None,
                          on_result: Callable[[RelayResult], None] | None = None) -> ServerApp:
    """The relay. Run-config keys (over ``config``): ``num-nodes``, ``graph`` (+ ``ws-degree``,
    ``ws-rewire``, ``graph-seed``), ``steps``, ``round-timeout``. ``on_result``, if given, is
    called with the run's :class:`RelayResult` at the end (in the ServerApp's process)."""
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
        if on_result is not None:
            on_result(RelayResult(cfg, graph, steps,
                                  {k: np.stack(v) for k, v in relayed.items()}, final_metrics))

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


def _proposed(algo: NodeAlgorithm, key: str, raw: Any) -> Any:
    """A run-config privacy value as the algorithm reads it (a ``clip`` of 0: none, ``inf``,
    the weakest); left as it is if it is not a number, which the check then refuses."""
    try:
        return algo.privacy_value(key.removeprefix("privacy-"), raw)
    except (TypeError, ValueError):
        return raw


class RelayNode:
    """One node bound to a Flower ``Context``: own settings and seed, one round. Its state is
    a :class:`~flwr_corrnoise.learner_state.LearnerState` (the algorithm's arrays its ``payload``)
    kept by the learners' own :class:`~flwr_corrnoise.flower.session.LearnerStorage`: the
    same lock, load, ledger/state/commit checks and commit as every other learner; only the
    privacy policy — the proposal check and the binding — is the algorithm's. Use
    :meth:`locked` around :meth:`round` (the ClientApp does) so that no second execution
    can use the same state directory at the same time."""

    def __init__(self, context: Context, defaults: Mapping[str, Any] | None = None) -> None:
        self.context = context
        self.simulation = _session.in_simulation()
        cfg = learner_config(context, defaults)
        self.index = _node_index(cfg)
        # the seed first: a refused seed writes nothing, builds nothing
        self.seed = relay_seed(context, defaults)
        frozen = tuple(sorted((k, v) for k, v in cfg.items()
                              if k not in ("partition-id", "num-partitions", "node-index",
                                           "state-dir", "noise-seed", "state-offload",
                                           "state-offload-dir")))
        self.graph, self.algo = _build_cached(frozen)
        if not 0 <= self.index < self.graph.num_nodes:
            raise ValueError(f"node index {self.index} outside the graph's "
                             f"0..{self.graph.num_nodes - 1}")
        # own privacy settings: node config and app defaults (in simulations also the run
        # config's plain keys, which are then the node's own)
        self.privacy = self.algo.privacy_from_config(self.index, cfg)
        # outside simulations the run config is the server's: its privacy keys, plain or
        # ``privacy-*``, are a proposal to check, never settings to use
        rc = dict(context.run_config)
        proposal = {k: _proposed(self.algo, k, v) for k, v in rc.items()
                    if k in _privacy_keys(self.algo)}
        if not self.simulation or any(k.startswith("privacy-") for k in proposal):
            check_privacy_proposal(self.algo.privacy_fields,
                                   {k: float(v[0]) for k, v in self.privacy.items()},
                                   proposal, self.index)
        self.store = StateStore(str(context.node_config["state-dir"])) if deployed(
            context) else None
        self.storage = LearnerStorage(
            context, STATE_KEY, self.store,
            OffloadPolicy.from_config(cfg) if self.simulation else None)
        # ``record-dir`` (simulations only): write each node's state after every round, so a
        # test can check that every relayed array is the node's θ + ζ. Never elsewhere.
        self.record_dir = cfg.get("record-dir") if self.simulation else None

    def locked(self) -> AbstractContextManager[None]:
        """Hold the state directory's lock for the whole message (:meth:`LearnerStorage.
        locked`): two executions that both load step ``t`` would release the same noise
        with different θ, and the noise cancels in the difference."""
        return self.storage.locked()

    def binding(self) -> dict[str, Any]:
        """What a node's state is bound to besides its identity: this node and algorithm."""
        return {"front-end": FRONT_END, "node-index": self.index, "algorithm": self.algo.name}

    def load(self) -> LearnerState | None:
        """The stored state (:meth:`LearnerStorage.read`: with a ``state-dir`` checked
        against its ledger, marker and commit log, as for every learner), checked against
        this node (index, algorithm) and its settings (only ever stronger); ``None`` for a
        node that has never committed a round. A lost, wiped, rolled-back, cloned or
        foreign state is a :class:`StateLostError` (4104), never a fresh start."""
        stored = self.storage.read()
        if stored is None:
            return None
        where, binding = self.storage.where, dict(stored.binding or {})
        if stored.payload is None or binding.get("front-end") != FRONT_END:
            raise StateLostError(
                f"node {self.index}: state {where} is not a relay node's learner state "
                f"(another front end's); refusing to train")
        owner, algorithm = binding.get("node-index"), binding.get("algorithm")
        if owner != self.index or algorithm != self.algo.name:
            raise StateLostError(
                f"node {self.index} ({self.algo.name}): state {where} belongs to node "
                f"{owner} ({algorithm}); refusing to continue another node's noise stream")
        mine = self.algo.privacy_of(stored.payload)
        for name, value in self.privacy.items():  # settings only ever get stronger
            if name in mine and value[0] != mine[name][0] and (
                    value[0] - mine[name][0]) * self.algo.privacy_fields[name] < -1e-12:
                raise PrivacyProposalError(
                    f"node {self.index}: its settings now say {name}={value[0]:g}, weaker "
                    f"than the {mine[name][0]:g} its state was started with")
        return stored

    def commit(self, stored: LearnerState, step: int, steps: int,
               diagnostics: Mapping[str, Any] | None = None) -> None:
        """Store the state one generation on (:meth:`LearnerStorage.write`: ledger line,
        ``diagnostics`` — local only —, state, commit line, each durable before the next;
        then ``context.state``) — before the reply leaves. Round ``steps`` releases nothing:
        its ledger line counts 0 steps."""
        self.storage.write(stored, {"server-round": step, "first-step": step,
                                    "steps": int(step < steps), "position": step,
                                    "node-index": self.index}, diagnostics)

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
        try:
            messages = {k: np.stack([grouped[j][k] for j in neighbours])[None]
                        for k in keys.pop()}
            return Inbox(np.array([self.index]), np.array([list(neighbours)]), messages)
        except ValueError as err:  # shapes and finiteness of the relay's message only
            raise InboxError(f"node {self.index}: {err}") from err

    def round(self, step: int, steps: int, record: ArrayRecord
              ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        stored = self.load()
        if stored is None:
            if step != 0:
                raise StepError(f"node {self.index} has no state but the relay is at step {step}")
            stored = LearnerState(
                payload=self.algo.init(np.array([self.index]), self.seed, self.privacy),
                binding=self.binding(), learner_id=LearnerState.new_id())
        # ``rounds`` counts the node's releases: its current step was released iff it is
        # ahead of the algorithm's step counter
        state, released = dict(stored.payload or {}), stored.rounds > stored.step
        have = int(state["step"][0])
        if step == 0 and not (have == 0 and not released):
            raise StepError(f"node {self.index}: step 0 again (a replay?)")
        if step > 0 and not (released and have == step - 1):
            raise StepError(f"node {self.index} is at step {have}, the relay sent step {step}")
        diagnostics = None
        if step > 0:
            before = int(state.get("zeroed-data", np.zeros(1, dtype=np.int64))[0])
            state = self.algo.update(state, self.inbox(record))
            zeroed = int(state.get("zeroed-data", np.zeros(1, dtype=np.int64))[0]) - before
            # data whose gradient could not be computed counted as zero: the node's own log
            # and state-dir/diagnostics.jsonl, never the reply
            diagnostics = {"server-round": step, "node-index": self.index,
                           "zeroed-data": zeroed, "time": time.time()}
            if zeroed:
                log.info("relay node %d, step %d: %d datum gradient(s) counted as zero "
                         "(local only, never sent)", self.index, step - 1, zeroed)
        outbox: dict[str, np.ndarray] = {}
        if step < steps:
            out, state = self.algo.release(state)
            outbox = {k: v[0] for k, v in out.items()}
            if not all(np.all(np.isfinite(v)) for v in outbox.values()):
                # a data-dependent overflow: never released, and no text about it leaves
                raise FloatingPointError("non-finite release withheld")
        metrics: dict[str, float] = {"step": float(step), "node-index": float(self.index)}
        if step == steps:
            for label, eps in self.algo.epsilon(state, steps).items():
                metrics[f"epsilon {label}"] = float(eps[0])
        record_dir = self.record_dir
        if record_dir:  # simulations only (see __init__): a test and debugging hook
            path = Path(str(record_dir))
            path.mkdir(parents=True, exist_ok=True)
            np.savez(path / f"node{self.index}-step{step}.npz",
                     decision=self.algo.decision(state)[0], released=np.array([step < steps]),
                     **state)
        stored.payload = state
        stored.step = stored.position = int(state["step"][0])
        stored.rounds = stored.step + int(step < steps)
        self.commit(stored, step, steps, diagnostics)
        return outbox, metrics


def make_relay_client_app(config_defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The node ClientApp. Its configuration is ``config_defaults`` < run config (simulations
    only) < node config (``node-index``/``partition-id``, ``state-dir``, its own privacy keys,
    e.g. ``noise-scale``/``noise-exponent`` for Chen & Wang; ``noise-seed`` in simulations
    only)."""
    app = ClientApp()
    defaults = dict(config_defaults or {})

    def _hello(msg: Message, context: Context) -> Message:
        idx = _node_index(learner_config(context, defaults))
        return Message(RecordDict({"metrics": MetricRecord({"node-index": idx})}),
                       reply_to=msg)

    def _step(msg: Message, context: Context) -> Message:
        node = RelayNode(context, defaults)
        cfg = msg.content["config"]
        with node.locked():  # the whole round: load, ledger, save
            outbox, metrics = node.round(
                int(cfg["step"]), int(cfg["steps"]),  # type: ignore[index]
                msg.content["inbox"])  # type: ignore[arg-type]
        out = ArrayRecord()
        for key, arr in outbox.items():
            out[key] = Array(np.ascontiguousarray(arr))
        return Message(RecordDict({"outbox": out, "metrics": MetricRecord(metrics)}),
                       reply_to=msg)

    # every refusal is an Error reply through the learners' gate, state unchanged
    @app.query()
    def hello(msg: Message, context: Context) -> Message:
        return answer(msg, _hello, msg, context, codes=RELAY_ERROR_CODES)

    @app.train()
    def step(msg: Message, context: Context) -> Message:
        return answer(msg, _step, msg, context, codes=RELAY_ERROR_CODES)

    return app


def relay_apps(config: Mapping[str, Any],
               on_result: Callable[[RelayResult], None] | None = None
               ) -> tuple[ServerApp, ClientApp]:
    """Both apps around one config, for ``flwr.simulation.run_simulation`` (no run config)."""
    return make_relay_server_app(config, on_result), make_relay_client_app(config)


#: module-level apps for ``flwr run`` (components ``flwr_corrnoise.flower.relay:server_app``
#: and ``:client_app``); everything comes from the run config and each node's node config
server_app = make_relay_server_app()
client_app = make_relay_client_app()
