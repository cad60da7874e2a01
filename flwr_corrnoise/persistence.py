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

**Rollback, clone and wipe** (:meth:`StateStore.verify`). A state is bound to its learner:
it records the learner's *identity* (128 bits of OS entropy, drawn when the learner is
created) and its *generation* (how many rounds it committed). Every commit
(:meth:`StateStore.commit`) writes, in this order and each fsynced:

1. a ``ledger.jsonl`` line naming the identity and the new generation (the round's intent);
2. the state (and, on the first commit, the marker, which names the identity too);
3. a ``commits.jsonl`` line naming the identity and the generation (the round is stored);

and only then may the reply leave. So a round whose commit line is missing was never
released. On every load the state must name the ledger's identity and its last generation —
or be exactly one generation behind a ledger line that has no commit line (a crash between
steps 1 and 3: nothing of that round left, so it is redone with the same noise indices).
Anything else is refused with :class:`StateIntegrityError` before anything is released:

* a state **behind** its ledger (an older copy restored: *rolled back*) — continuing it would
  add noise that was already released to new data;
* a state naming **another identity** than the ledger or the marker (*cloned* from another
  learner's directory), or a committed state with **no ledger** beside it (copied into an
  empty directory, or the ledger deleted);
* a ledger with **no state and no marker** (*wiped*): :meth:`load` refuses rather than
  start a new learner at step 0 that reports ε spent from zero.

What a local check cannot see: the *whole* directory copied or restored together (state,
marker, ledger and commits consistent with each other). That needs a counter outside the
directory's reach; ``docs/threat-model.md`` says so.

**Keys at rest.** The state holds the learner's noise-generator key (128 bits, or the
ChaCha20 key of secure noise): whoever reads it can subtract the learner's noise from its
releases. Every file here is created ``0600`` (:func:`open_private`, whatever the umask;
an older, looser file is tightened when it is next written) and the state directory is
``0700`` (tightened if it exists and is this user's; a directory of another user is left
as it is, with a warning).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

STATE_FILE = "learner.state"
MARKER_FILE = "learner.started"
LEDGER_FILE = "ledger.jsonl"
COMMITS_FILE = "commits.jsonl"
DIAGNOSTICS_FILE = "diagnostics.jsonl"
LOCK_FILE = "learner.lock"
#: modes of the files and directories that hold noise keys: the owner's only
FILE_MODE, DIR_MODE = 0o600, 0o700

log = logging.getLogger(__name__)


class StateLostError(RuntimeError):
    """The learner trained before but its state is missing or unreadable."""


class StateIntegrityError(StateLostError):
    """The stored state is not this learner's latest: rolled back, cloned, or its ledger
    lost. A subclass of :class:`StateLostError`, so it is refused with the same code (4104):
    for the learner the effect is the same — it has no state it may continue."""


class StateBusyError(RuntimeError):
    """Another execution holds this learner's state directory."""


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` that creates the file ``0600`` and tightens an existing looser one to
    ``0600``: the files hold noise keys (module docstring)."""
    fd = os.open(path, flags, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_directory(path: Path) -> None:
    """Create ``path`` (and missing parents) with ``path`` itself ``0700``, or tighten it
    to ``0700`` if it exists and is this user's (an operator's folder of another owner,
    e.g. a mounted volume, is left as it is, with a warning: its files are ``0600``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with suppress(FileExistsError):
        path.mkdir(mode=DIR_MODE)
    st = path.stat()
    if st.st_mode & 0o777 == DIR_MODE:
        return
    try:
        os.chmod(path, DIR_MODE)
    except PermissionError:
        log.warning("cannot make the learner state directory %s private (0700): it belongs "
                    "to uid %d; its files are 0600", path, st.st_uid)


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
    with open(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _read_jsonl(path: Path) -> list[dict[str, object]]:
    """The JSON objects of an append-only log, one per line.

    A last line without its newline whose JSON does not parse is an append a crash cut
    short: it was never complete, and what it would have announced never happened (every
    later write waits for its fsync), so it is skipped. Any other unreadable line is a
    corrupt log: :class:`StateIntegrityError`."""
    if not path.exists():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise StateIntegrityError(f"cannot read {path}: {err}") from err
    *complete, tail = text.split("\n")
    out: list[dict[str, object]] = []
    for number, line in enumerate([*complete, tail], start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as err:
            if number == len(complete) + 1:  # the torn tail of a crashed append
                log.warning("%s: ignoring an incomplete last line (a crash while appending)",
                            path)
                continue
            raise StateIntegrityError(f"{path} line {number} is corrupt: {err}") from err
        if not isinstance(entry, dict):
            raise StateIntegrityError(f"{path} line {number} is not a JSON object")
        out.append(entry)
    return out


def _generation(entry: Mapping[str, object], path: Path) -> int:
    """A log line's ``generation``; a line without a valid one is a corrupt log."""
    value = entry.get("generation")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StateIntegrityError(f"{path} is corrupt: a line has no valid 'generation'")
    return value


def _append_jsonl(path: Path, entry: Mapping[str, object]) -> None:
    """Append one line and fsync it (and the directory when the file is new): once this
    returns, the line survives a crash. A tail left by an earlier crashed append is mended
    first: completed with its newline if its JSON is whole, else cut off (it was never
    complete, so nothing it announced happened), so that every line stays readable."""
    line = (json.dumps(dict(entry), sort_keys=True) + "\n").encode()
    new = not path.exists()
    with open(open_private(path, os.O_RDWR | os.O_CREAT | os.O_APPEND), "ab+") as fh:
        fh.seek(0)
        data = fh.read()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            try:
                json.loads(data[cut:])
                line = b"\n" + line
            except ValueError:
                log.warning("%s: removing an incomplete last line (a crash while appending)",
                            path)
                fh.truncate(cut)
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())
    if new:
        _fsync_dir(path.parent)


class StateStore:
    """The state directory of one learner."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        private_directory(self.directory)
        self.state_path = self.directory / STATE_FILE
        self.marker_path = self.directory / MARKER_FILE
        self.ledger_path = self.directory / LEDGER_FILE
        self.commits_path = self.directory / COMMITS_FILE
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
        lock = open_private(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_APPEND)
        with open(lock, "a+") as fh:  # closing the file releases the lock
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
        with open(open_private(self.diagnostics_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                  "a") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")

    @property
    def started(self) -> bool:
        """Whether this learner has ever saved a state (released noise)."""
        return self.marker_path.exists()

    def load(self) -> bytes | None:
        """The stored state bytes; ``None`` for a learner that never trained.

        Raises :class:`StateLostError` if it trained before — the marker exists, or the
        ledger records rounds — and the state file is gone: a learner whose state was
        deleted (or the state and the marker) must not start over at step 0.
        """
        if not self.state_path.exists():
            if self.started:
                raise StateLostError(
                    f"this learner has trained before ({self.marker_path} exists) but its "
                    f"state {self.state_path} is missing; refusing to train, because starting "
                    f"a fresh noise stream would reuse noise or data"
                )
            lines = [e for e in _read_jsonl(self.ledger_path) if "first-step" in e]
            if lines:
                committed = bool(_read_jsonl(self.commits_path)) or any(
                    "identity" not in e for e in lines)  # older ledgers: every line released
                raise StateIntegrityError(
                    f"the ledger {self.ledger_path} records {len(lines)} round(s) of this "
                    f"learner but its state {self.state_path} and marker {self.marker_path} "
                    f"are missing (wiped); refusing to start over at step 0, which would "
                    f"reuse noise or data and report the privacy spent from zero. "
                    + ("Restore the learner's latest state, or move the whole directory "
                       "away to start a new learner (its released rounds stay spent)."
                       if committed else
                       "No round was ever committed (a crash during the first round?): "
                       "nothing was released; move the directory away to start a new "
                       "learner.")
                )
            return None
        try:
            return self.state_path.read_bytes()
        except OSError as err:
            raise StateLostError(f"cannot read the learner state {self.state_path}: {err}") from err

    def marker(self) -> dict[str, object]:
        """The started-marker's record (``{}`` without one; older markers hold no
        identity)."""
        try:
            entry = json.loads(self.marker_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            raise StateIntegrityError(f"the marker {self.marker_path} is unreadable: "
                                      f"{err}") from err
        return entry if isinstance(entry, dict) else {}

    def verify(self, identity: str | None, generation: int, step: int) -> None:
        """Check a loaded state — its ``identity``, ``generation`` and ``step`` — against
        the marker, the ledger and the commit log; raise :class:`StateIntegrityError` if it
        is not this learner's latest. Reads only: a refused load changes nothing on disk.

        A state without identity (written before identities existed) is checked by its
        step against the older ledger lines; it is refused in a directory whose ledger
        already records identities.
        """
        where = self.state_path
        ledger = _read_jsonl(self.ledger_path)
        bound = [e for e in ledger if "identity" in e and "first-step" in e]
        if identity is None:
            self._verify_unbound(step, ledger, bound)
            return
        marked = self.marker().get("identity")
        head = bound[-1] if bound else None
        commits = [e for e in _read_jsonl(self.commits_path) if "identity" in e]
        last_commit = commits[-1] if commits else None
        foreign = [(what, e.get("identity")) for what, e in (
            (f"the marker {self.marker_path}", {"identity": marked} if marked else None),
            (f"the ledger {self.ledger_path}", head),
            (f"the commit log {self.commits_path}", last_commit)) if e is not None]
        for what, other in foreign:
            if other != identity:
                log.error("state %s names learner %s, %s names %s", where, identity, what,
                          other)
                raise StateIntegrityError(
                    f"the learner state {where} belongs to another learner than this state "
                    f"directory ({what} names another identity): it was copied in from "
                    f"another learner's directory. Two learners continuing one noise stream "
                    f"release the same noise with different data; refusing to train. "
                    f"Restore this learner's own state.")
        if head is None:
            if generation > 0:
                raise StateIntegrityError(
                    f"the learner state {where} records {generation} committed round(s) but "
                    f"the ledger {self.ledger_path} records none: the state was copied in "
                    f"from another learner's directory, or this learner's ledger was "
                    f"deleted; refusing to train (a copied state would reuse another "
                    f"learner's noise)")
            return
        logged = _generation(head, self.ledger_path)
        committed = _generation(last_commit, self.commits_path) if last_commit else 0
        if committed > logged:
            raise StateIntegrityError(
                f"the commit log {self.commits_path} (round {committed}) is ahead of the "
                f"ledger {self.ledger_path} (round {logged}): the ledger was truncated or "
                f"replaced; refusing to train")
        if logged == generation:
            return
        if logged == generation + 1 and committed < logged:
            # a crash after the ledger line, before the state (or its commit line) was
            # written: the reply leaves only after the commit line, so nothing of round
            # ``logged`` was released; it is redone with the same noise indices
            log.warning("%s: round %d was logged but never committed (a crash); redoing it "
                        "from the stored state", self.ledger_path, logged)
            return
        if logged > generation:
            raise StateIntegrityError(
                f"the learner state {where} was rolled back: it is at round {generation} of "
                f"this learner, but the ledger {self.ledger_path} records round {logged} — "
                f"an older copy of the state was restored. Continuing it would add noise "
                f"that was already released to new data; refusing to train. Restore "
                f"the learner's latest state (round {logged}).")
        raise StateIntegrityError(
            f"the learner state {where} is at round {generation} but the ledger "
            f"{self.ledger_path} records only {logged}: the ledger was truncated or "
            f"replaced; refusing to train")

    def _verify_unbound(self, step: int, ledger: list[dict[str, object]],
                        bound: list[dict[str, object]]) -> None:
        """A state written before identities existed: accepted only in a directory whose
        ledger has no identities either, and only if its step ends the ledger's last round
        (or starts it: a crash before the state was written, redone). Such a state gets an
        identity at its next commit."""
        if bound:
            raise StateIntegrityError(
                f"the learner state {self.state_path} carries no learner identity, but the "
                f"ledger {self.ledger_path} records rounds of an identified learner: an "
                f"older copy of the state was restored (rolled back); refusing to train")
        rounds = self.ledger()
        if not rounds:
            if step > 0:
                raise StateIntegrityError(
                    f"the learner state {self.state_path} records {step} steps but the "
                    f"ledger {self.ledger_path} records no round: it was copied in from "
                    f"another learner's directory or the ledger was deleted; refusing to "
                    f"train")
            return
        first = int(rounds[-1]["first-step"])  # type: ignore[call-overload]
        end = first + int(rounds[-1].get("steps", 0))  # type: ignore[call-overload]
        if step not in (first, end):
            raise StateIntegrityError(
                f"the learner state {self.state_path} is at step {step} but the ledger "
                f"{self.ledger_path} records steps up to {end}: the state was rolled back "
                f"or copied in; refusing to train")

    def log_round(self, entry: dict[str, object]) -> None:
        """Append one line to ``ledger.jsonl``, the learner's audit log of released steps.

        Written (and fsynced) just *before* the state, so every committed round has a
        line; a line whose ``first-step`` a later line repeats is a round that crashed
        before its state was written and was redone with the same, never released, noise
        indices. The effective lines' step ranges tile ``0..step`` without overlap.
        """
        _append_jsonl(self.ledger_path, entry)

    def ledger(self) -> list[dict[str, object]]:
        """The ledger's effective lines (the last line for each ``first-step``), in order."""
        lines = [e for e in _read_jsonl(self.ledger_path) if "first-step" in e]
        last = {int(e["first-step"]): e for e in lines}  # type: ignore[call-overload]
        return [last[k] for k in sorted(last)]

    def save(self, data: bytes, identity: str | None = None) -> None:
        """Store ``data`` atomically; the first save also writes the started-marker (naming
        the learner's ``identity``, when it has one)."""
        if not self.started:
            marker: dict[str, object] = {"started": time.time()}
            if identity is not None:
                marker["identity"] = identity
            atomic_write(self.marker_path, json.dumps(marker).encode())
        atomic_write(self.state_path, data)

    def commit(
        self,
        data: bytes,
        *,
        identity: str,
        generation: int,
        entry: Mapping[str, object],
        diagnostics: Mapping[str, object] | None = None,
    ) -> None:
        """Commit one round: the ledger line (``entry`` with the ``identity`` and the new
        ``generation``), the local diagnostics, the state, then the commit line — each
        durable before the next. The caller sends its reply only after this returns, so
        :meth:`verify` can tell a crashed round (never released) from a rolled-back state.
        """
        stamp = {"identity": identity, "generation": int(generation)}
        self.log_round({**dict(entry), **stamp})
        if diagnostics is not None:
            self.log_diagnostics(dict(diagnostics))
        self.save(data, identity=identity)
        _append_jsonl(self.commits_path, {**stamp, "time": time.time()})
