"""The node-algorithm interface shared by every engine (in-process and the Flower relay).

A decentralized algorithm is written **once**, as pure functions over arrays with a leading
*node axis*: the in-process engine calls them with all ``n`` nodes at once (fast sweeps), a
Flower ClientApp calls them with the one node it is (``k = 1``). Because both call the same
code on the same numbers — and neighbour messages are combined by :meth:`Inbox.mix`, a
sequential sum over neighbour slots that gives bit-identical results for any batch size — a
Flower run equals the in-process run for the same seeds.

One synchronous step ``t`` of every node is

1. ``outbox, state = algo.release(state)`` — what the node sends to its graph neighbours
   (for Chen & Wang, "Locally Differentially Private Distributed Online Learning with Guaranteed
   Optimality" an already-noised LDP release ``θ + ζ``; for Wang, Yang, Yao, Song & Wan, "Revisiting
   Differentially Private Algorithms for Decentralized Online Learning" a raw gossip sum);
2. the engine/relay delivers to each node the outboxes of exactly its neighbours
   (:class:`Inbox`, senders sorted ascending, padded to the maximum degree);
3. ``state = algo.update(state, inbox)`` — the node's local computation (gradients on its
   own data, mixing, projection, noise bookkeeping); the step counter advances.

State (``dict[str, np.ndarray]``, leading node axis) is everything a node remembers,
including its RNG words, its step and its **own privacy settings**: they are written into the
state at :meth:`NodeAlgorithm.init` from the node's own settings and never read from a
message, so neither a neighbour nor the relay can change them. States serialize with
:func:`state_to_bytes` (the project's pickle-free :mod:`flwr_corrnoise.arraypack`).

Registering: every algorithm class registers itself in :data:`ALGORITHMS` with
:func:`register` (from its own module); :func:`build_algorithm` constructs one by name from
a kebab-case config mapping (run config).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from flwr_corrnoise import arraypack
from flwr_corrnoise.cipher_noise import CipherGaussian
from flwr_corrnoise.decentralized.graphs import Graph
from flwr_corrnoise.decentralized.laplace import laplace

__all__ = [
    "ALGORITHMS",
    "Inbox",
    "NodeAlgorithm",
    "PrivacyProposalError",
    "State",
    "build_algorithm",
    "check_privacy_proposal",
    "draw_laplace",
    "node_seeds",
    "register",
    "select",
    "stack",
    "state_from_bytes",
    "state_to_bytes",
]

State = dict[str, np.ndarray]


class PrivacyProposalError(ValueError):
    """A configuration that would weaken a node's own privacy settings."""


# -- state helpers -----------------------------------------------------------------------
def state_to_bytes(state: State) -> bytes:
    return arraypack.pack(state)


def state_from_bytes(data: bytes) -> State:
    return arraypack.unpack(data)


def select(state: State, idx: Sequence[int] | np.ndarray) -> State:
    """The sub-state of the nodes at positions ``idx`` of the node axis (copies)."""
    ii = np.asarray(idx, dtype=int)
    return {k: v[ii].copy() for k, v in state.items()}


def stack(states: Sequence[State]) -> State:
    """Concatenate per-node states along the node axis (inverse of :func:`select`)."""
    keys = states[0].keys()
    if any(s.keys() != keys for s in states):
        raise ValueError("states to stack have different keys")
    return {k: np.concatenate([s[k] for s in states], axis=0) for k in keys}


def node_seeds(run_seed: int, nodes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Initial noise-generator words per node, derived from ``(run_seed, node)``: every engine
    gives node ``i`` the same random numbers for the same ``run_seed``.

    The generator is the library's noise kernel (:class:`~flwr_corrnoise.cipher_noise.
    CipherGaussian`, AES-128-CTR; five words: tag, 128-bit key, row counter, sequential
    position): its key is a hash of every bit of ``(run_seed, node)``, and its outputs (a
    node's released noise) do not reveal the key short of breaking AES, so a neighbour or
    the relay cannot predict later noise from earlier releases. A node outside a simulation
    passes a ``run_seed`` of 128 bits of OS entropy (``flower/relay.py``), known to no one
    else."""
    return np.stack(
        [CipherGaussian.from_seed([int(run_seed), int(i), 0xDEC]).pack() for i in nodes]
    )


def draw_laplace(rng_words: np.ndarray, scales: np.ndarray, dim: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    """Per node ``k``: ``Lap(scales[k])^dim`` from that node's own generator (its next
    Laplace row).

    Returns ``(noise [k, dim], new rng words)``. Each node's draw depends only on its own
    RNG words, so drawing for all nodes at once equals drawing node by node.
    """
    noise = np.empty((rng_words.shape[0], dim))
    words = rng_words.copy()
    for k in range(rng_words.shape[0]):
        gen = CipherGaussian.unpack(rng_words[k])
        noise[k] = laplace(gen, np.asarray(scales[k]), dim)
        words[k] = gen.pack()
    return noise, words


# -- inbox -------------------------------------------------------------------------------
class Inbox:
    """Neighbour messages for a batch of ``k`` receiving nodes.

    ``senders[k, s]`` is the id of the ``s``-th neighbour of receiver ``k`` (ascending, ``-1``
    for padding); ``messages[key][k, s]`` its message (zeros where padded).
    """

    def __init__(self, receivers: np.ndarray, senders: np.ndarray,
                 messages: Mapping[str, np.ndarray]) -> None:
        self.receivers = np.asarray(receivers, dtype=int)
        self.senders = np.asarray(senders, dtype=int)
        if self.senders.ndim != 2 or self.senders.shape[0] != self.receivers.shape[0]:
            raise ValueError("senders must be [receivers, slots]")
        self.messages = dict(messages)
        for key, m in self.messages.items():
            if m.shape[:2] != self.senders.shape:
                raise ValueError(f"message {key!r} has shape {m.shape}, expected "
                                 f"{self.senders.shape} + payload")
            if not np.all(np.isfinite(m)):
                raise ValueError(f"message {key!r} has non-finite values")

    @classmethod
    def gather(cls, graph: Graph, receivers: Sequence[int] | np.ndarray,
               outboxes: Mapping[str, np.ndarray]) -> Inbox:
        """Build the inbox of ``receivers`` from all ``n`` nodes' outboxes (in-process)."""
        recv = np.asarray(receivers, dtype=int)
        width = max((len(graph.neighbors(int(r))) for r in recv), default=0)
        senders = np.full((recv.size, width), -1, dtype=int)
        for k, r in enumerate(recv):
            nb = graph.neighbors(int(r))
            senders[k, : len(nb)] = nb
        messages = {}
        for key, out in outboxes.items():
            m = np.zeros((recv.size, width, *out.shape[1:]), dtype=float)
            valid = senders >= 0
            m[valid] = out[senders[valid]]
            messages[key] = m
        return cls(recv, senders, messages)

    def weights(self, matrix: np.ndarray) -> np.ndarray:
        """``matrix[receiver, sender]`` per slot (0 for padding): the mixing weights."""
        w = np.zeros(self.senders.shape)
        valid = self.senders >= 0
        rows = np.broadcast_to(self.receivers[:, None], self.senders.shape)
        w[valid] = np.asarray(matrix)[rows[valid], self.senders[valid]]
        return w

    def mix(self, key: str, weights: np.ndarray) -> np.ndarray:
        """``Σ_s weights[k, s] · messages[key][k, s]`` summed slot by slot, left to right.

        Element-wise operations in a fixed order are exact whatever the batch size, which is
        what makes one node's Flower computation equal its row of the vectorized engine.
        """
        m = self.messages[key]
        acc = np.zeros((m.shape[0], *m.shape[2:]))
        extra = (1,) * (m.ndim - 2)
        for s in range(m.shape[1]):
            acc = acc + weights[:, s].reshape(-1, *extra) * m[:, s]
        return acc


# -- privacy proposals -------------------------------------------------------------------
def check_privacy_proposal(
    fields: Mapping[str, int], mine: Mapping[str, float], proposal: Mapping[str, Any],
    node: int | None = None,
) -> None:
    """Refuse a proposal that weakens a node's privacy.

    ``fields[name] = +1`` when a *larger* value is more private (a noise scale), ``−1`` when a
    smaller one is (an ε). ``proposal`` may use the field names or ``privacy-<name>`` keys;
    missing keys are not checked (the node uses its own values regardless).
    """
    problems = []
    for name, direction in fields.items():
        raw = proposal.get(f"privacy-{name}", proposal.get(name))
        if raw is None:
            continue
        try:
            theirs = float(raw)
        except (TypeError, ValueError):
            problems.append(f"{name} is not a number: {raw!r}")
            continue
        ours = float(mine[name])
        if math.isnan(theirs) or (theirs - ours) * direction < -1e-12 * max(1.0, abs(ours)):
            problems.append(f"{name} {theirs:g} is weaker than this node's {ours:g}")
    if problems:
        who = "this node" if node is None else f"node {node}"
        raise PrivacyProposalError(
            f"refusing a configuration that would weaken {who}'s privacy: " + "; ".join(problems)
        )


# -- the interface -----------------------------------------------------------------------
class NodeAlgorithm(ABC):
    """A decentralized algorithm as per-node update rules (see the module docstring).

    Subclasses set :attr:`name`, :attr:`local_dp` (``True`` when every outbox is itself a
    local-DP release, as in Chen & Wang; ``False`` for Wang et al., whose gossip messages are raw
    sums that neighbours and relay must be trusted with) and :attr:`privacy_fields`.
    """

    name: ClassVar[str] = ""
    local_dp: ClassVar[bool] = True
    #: privacy settings a node owns: name → +1 (larger is more private) or −1
    privacy_fields: ClassVar[dict[str, int]] = {}
    #: those of :attr:`privacy_fields` that are **declared data bounds** the accountant reads
    #: and the algorithm enforces (Chen & Wang's ``feature-bound`` and ``clip``): a node owns
    #: them like its noise (its own config; a run-config value is a proposal, refused if
    #: larger), its state records them, their default is what the algorithm enforces, they
    #: may be ``inf`` (no clip), and ``init`` fills them in when a caller gives none
    bound_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, graph: Graph, dim: int) -> None:
        self.graph = graph
        self.dim = int(dim)

    @property
    def num_nodes(self) -> int:
        return self.graph.num_nodes

    @abstractmethod
    def init(self, nodes: np.ndarray, run_seed: int,
             privacy: Mapping[str, np.ndarray]) -> State:
        """Initial state of ``nodes``; ``privacy[name][k]`` the node's own settings."""

    @abstractmethod
    def release(self, state: State) -> tuple[dict[str, np.ndarray], State]:
        """What each node sends its neighbours at its current step."""

    @abstractmethod
    def update(self, state: State, inbox: Inbox) -> State:
        """The local step after receiving the neighbours' outboxes; advances ``step``."""

    @abstractmethod
    def decision(self, state: State) -> np.ndarray:
        """The parameters each node currently plays, ``[k, dim]``."""

    def epsilon(self, state: State, steps: int) -> dict[str, np.ndarray]:
        """ε spent by each node after ``steps`` steps, per labelled accountant."""
        return {}

    def privacy_of(self, state: State) -> dict[str, np.ndarray]:
        """The privacy settings recorded in the state (one value per node). A declared bound
        that a state written before bounds were recorded lacks is left out (the accountant
        then charges the enforced one)."""
        return {name: state[f"privacy_{name}"].copy() for name in self.privacy_fields
                if name not in self.bound_fields or f"privacy_{name}" in state}

    def default_privacy(self, nodes: np.ndarray) -> dict[str, np.ndarray]:
        """Privacy settings used when a node has none of its own (simulations)."""
        raise NotImplementedError(f"{self.name} needs explicit privacy settings")

    def privacy_from_config(self, node: int, cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A node's own settings from its (kebab-case) node config, defaults otherwise.

        Only the plain keys (``noise-scale``) are read: ``privacy-<name>`` keys are what a
        server *proposes* and are checked with :func:`check_privacy_proposal`, never used."""
        base = self.default_privacy(np.array([node]))
        out = {}
        for name in self.privacy_fields:
            raw = cfg.get(name)
            out[name] = base[name] if raw is None else np.array([self.privacy_value(name, raw)])
            finite = np.isfinite(out[name]) | ((out[name] == np.inf) & (name in self.bound_fields))
            if not np.all(finite):
                raise PrivacyProposalError(f"node {node}: privacy setting {name} is not finite")
        return out

    def privacy_value(self, name: str, raw: Any) -> float:
        """A privacy setting's value as a config (or a proposal) writes it: a number, and
        for a bound that can be off (a clip of ``0``/``""``: none) ``inf`` — so that a
        proposal to turn it off compares as the weakest value, not the strongest."""
        return float(raw)


#: registry of node algorithms by name; a builder takes (graph, task, config mapping)
ALGORITHMS: dict[str, Callable[..., NodeAlgorithm]] = {}


def register(name: str) -> Callable[[Callable[..., NodeAlgorithm]], Callable[..., NodeAlgorithm]]:
    """Class/factory decorator: ``@register("chen-wang")``. The factory is called as
    ``factory(graph=..., task=..., config=...)``."""

    def deco(factory: Callable[..., NodeAlgorithm]) -> Callable[..., NodeAlgorithm]:
        if name in ALGORITHMS and ALGORITHMS[name] is not factory:
            raise ValueError(f"algorithm {name!r} is already registered")
        ALGORITHMS[name] = factory
        return factory

    return deco


def build_algorithm(name: str, graph: Graph, task: Any,
                    config: Mapping[str, Any] | None = None) -> NodeAlgorithm:
    """Construct a registered algorithm by name (imports the built-in modules first)."""
    _import_builtin()
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; registered: {sorted(ALGORITHMS)}")
    factory = ALGORITHMS[name]
    if hasattr(factory, "from_config"):
        return factory.from_config(graph=graph, task=task, config=dict(config or {}))  # type: ignore[attr-defined]
    return factory(graph=graph, task=task, config=dict(config or {}))


#: modules that register algorithms when imported (others may register from their own)
BUILTIN_MODULES: list[str] = [
    "flwr_corrnoise.decentralized.chen_wang",
    "flwr_corrnoise.decentralized.baselines",
    # Wang et al. (the other module's name is whichever exists)
    "flwr_corrnoise.decentralized.wang",
    "flwr_corrnoise.decentralized.pd_ftgl",
]


def _import_builtin() -> None:
    import importlib

    for mod in BUILTIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as err:  # a module not written yet must not break others
            if err.name != mod:
                raise
