"""A deployed learner's state on disk: written atomically after every round, never lost
silently.

Why it matters for privacy: a learner that restarts and begins a *fresh* noise stream —
or the old stream from its start — while its data stream goes on (or starts over) adds
noise that was already used, or uses data twice; reused Gaussian noise with new data leaks
the data. So a SuperNode keeps its noise-stream state, step index and data position in a
state directory (node config ``state-dir``), and:

* :meth:`StateStore.save` writes ``learner.state`` atomically — a temporary file in the
  same directory, ``fsync``, ``os.replace``, ``fsync`` of the directory — so a crash leaves
  either the old or the new state, never a torn one;
* the first save also writes ``learner.started``, a marker that this learner has
  released noise. :meth:`StateStore.load` returns ``None`` only for a learner that has
  never trained; if the marker exists but the state is missing it raises
  :class:`StateLostError`, and an unreadable state raises it too: the learner refuses to
  train rather than start over with the same (or any) seed.

Deleting the whole directory makes a *new* learner (with a new OS-entropy seed); that is
the operator's explicit choice and the documentation says what it costs
(``docs/threat-model.md``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STATE_FILE = "learner.state"
MARKER_FILE = "learner.started"
LEDGER_FILE = "ledger.jsonl"
DIAGNOSTICS_FILE = "diagnostics.jsonl"
LOCK_FILE = "learner.lock"


class StateLostError(RuntimeError):
    """The learner trained before but its state is missing or unreadable."""


class StateBusyError(RuntimeError):
    """Another execution holds this learner's state directory."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new bytes, never a
    mix, even across a crash (write a temporary file, fsync it, rename, fsync the dir)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class StateStore:
    """The state directory of one learner."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.state_path = self.directory / STATE_FILE
        self.marker_path = self.directory / MARKER_FILE
        self.ledger_path = self.directory / LEDGER_FILE
        self.diagnostics_path = self.directory / DIAGNOSTICS_FILE
        self.lock_path = self.directory / LOCK_FILE

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's exclusive lock, or refuse at once.

        Why: two executions on one state directory would both load step ``k`` and release
        the same noise indices with different data — the noise cancels in the difference
        of the two releases. ``flock`` is released by the kernel when a process dies, so a
        crash never leaves a stale lock.
        """
        with open(self.lock_path, "a+") as fh:  # closing the file releases the lock
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as err:
                fh.seek(0)
                owner = fh.read().strip() or "unknown"
                raise StateBusyError(
                    f"the learner state directory {self.directory} is in use by another "
                    f"execution ({owner}); one state directory serves one learner at a time"
                ) from err
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
            fh.flush()
            yield

    def log_diagnostics(self, entry: dict[str, object]) -> None:
        """Append the round's data-dependent diagnostics (clipping, non-finite steps):
        the operator's to read, never sent anywhere."""
        with open(self.diagnostics_path, "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")

    @property
    def started(self) -> bool:
        """Whether this learner has ever saved a state (released noise)."""
        return self.marker_path.exists()

    def load(self) -> bytes | None:
        """The stored state bytes; ``None`` for a learner that never trained.

        Raises :class:`StateLostError` if it trained before and the state file is gone.
        """
        if not self.state_path.exists():
            if self.started:
                raise StateLostError(
                    f"this learner has trained before ({self.marker_path} exists) but its "
                    f"state {self.state_path} is missing; refusing to train, because starting "
                    f"a fresh noise stream would reuse noise or data"
                )
            return None
        try:
            return self.state_path.read_bytes()
        except OSError as err:
            raise StateLostError(f"cannot read the learner state {self.state_path}: {err}") from err

    def log_round(self, entry: dict[str, object]) -> None:
        """Append one line to ``ledger.jsonl``, the learner's audit log of released steps.

        Written (and fsynced) just *before* the state, so every committed round has a
        line; a line whose ``first-step`` a later line repeats is a round that crashed
        before its state was written and was redone with the same, never released, noise
        indices. The effective lines' step ranges tile ``0..step`` without overlap.
        """
        with open(self.ledger_path, "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def ledger(self) -> list[dict[str, object]]:
        """The ledger's effective lines (the last line for each ``first-step``), in order."""
        if not self.ledger_path.exists():
            return []
        lines = [json.loads(line) for line in self.ledger_path.read_text().splitlines()
                 if line.strip()]
        last = {int(e["first-step"]): e for e in lines}  # type: ignore[call-overload]
        return [last[k] for k in sorted(last)]

    def save(self, data: bytes) -> None:
        """Store ``data`` atomically; the first save also writes the started-marker."""
        if not self.started:
            atomic_write(self.marker_path, json.dumps({"started": time.time()}).encode())
        atomic_write(self.state_path, data)
