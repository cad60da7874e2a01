"""One release per learner per round in Flower's simulation engine: a ledger beside
``context.state``.

Why a file and not ``context.state``: Flower's simulation engine (flwr 1.42,
``vce_api.worker``) hands every message for a node the node's context *as it is when the
message is taken from the queue* and writes the updated context back when the ClientApp
returns. Two train messages for one node that overlap both load the same learner state —
the same step counter, the same noise generator position — and both released the same
noise with different data (measured: the two replies' noise differed by 8.9e-16). The
state cannot protect itself, since each copy looks like the latest; something outside it
must.

The ledger is one small file per learner (run, node, front end) that records the identity
and commit generation of the learner's latest committed state. A message holds an
exclusive ``flock`` on it from before the state is loaded until after the state is
committed, so concurrent messages to one learner are **serialized** (across the Ray
actors of one machine), and a message whose loaded state is not the one the ledger names
— a copy loaded before another message committed, or a fresh state for a learner that
already trained — is **refused** before it takes a step (:class:`RoundReplayError`, code
4107): whatever the server sends, no noise is released twice.

A learner with a ``state-dir`` (a real SuperNode) has this from its
:class:`~flwr_corrnoise.persistence.StateStore` (a lock on the directory, a ledger and a
commit log): the simulation ledger is for learners without one.

Scope: one machine. On a multi-node Ray cluster a node's messages may run on actors of
different machines; the folder must then be shared (run config ``state-offload-dir`` on a
shared file system), as for offloaded states.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..state_offload import default_directory, private_dir


class RoundReplayError(PermissionError):
    """A train message for a round this learner already released (or an older one), or a
    message that loaded a learner state another message has since committed past: its
    steps would release noise that already left the learner."""


def ledger_root() -> Path:
    """``<offload root>/releases``: the ledgers live in the same per-user ``0700`` folder as
    offloaded states (:func:`~flwr_corrnoise.state_offload.default_directory`, checked by
    :func:`~flwr_corrnoise.state_offload.private_dir`): they are learner records that no
    other account on the machine may read or plant."""
    root = default_directory()
    private_dir(root)
    releases = root / "releases"
    private_dir(releases)
    return releases


@dataclass(frozen=True)
class LedgerEntry:
    """The latest committed state of one learner, as the ledger records it."""

    identity: str
    generation: int
    step: int
    server_round: int


class SimulationReleaseLedger:
    """The ledger file of one learner in one simulated run (see the module docstring)."""

    def __init__(self, run_id: int, node_id: int, key: str, root: Path | None = None) -> None:
        base = (root if root is not None else ledger_root()) / f"run-{run_id}"
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = base / f"node-{int(node_id)}-{key}.json"
        self._fd: int | None = None

    @contextmanager
    def locked(self) -> Iterator[SimulationReleaseLedger]:
        """Hold the learner's ledger exclusively (blocking: a concurrent message to the
        same learner waits until this one has committed or aborted)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
            yield self
        finally:
            self._fd = None
            os.close(fd)  # closing releases the lock

    def _read(self) -> LedgerEntry | None:
        assert self._fd is not None, "the ledger is read under its lock"
        os.lseek(self._fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(self._fd, 65536):
            data += chunk
        if not data.strip():
            return None
        try:
            d: dict[str, Any] = json.loads(data)
            return LedgerEntry(str(d["identity"]), int(d["generation"]), int(d["step"]),
                               int(d["server-round"]))
        except (ValueError, KeyError, TypeError) as err:
            raise RoundReplayError(f"the release ledger {self.path} is unreadable ({err}); "
                                   "refusing to release") from err

    def check(self, identity: str | None, generation: int) -> None:
        """Refuse a loaded state that is not the learner's latest committed one."""
        entry = self._read()
        if entry is None:
            return
        if identity != entry.identity or generation != entry.generation:
            raise RoundReplayError(
                f"this message loaded a learner state (generation {generation}) that is not "
                f"the learner's latest (generation {entry.generation}, committed for server "
                f"round {entry.server_round}): another message to this learner committed "
                "first (Flower's simulation engine ran two messages for one node at once). "
                "Its steps would release noise that already left the learner, so it is "
                "refused")

    def record(self, identity: str, generation: int, step: int, server_round: int) -> None:
        """Record a committed state (before its reply leaves)."""
        assert self._fd is not None, "the ledger is written under its lock"
        data = json.dumps({"identity": identity, "generation": int(generation),
                           "step": int(step), "server-round": int(server_round)}).encode()
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, data)
