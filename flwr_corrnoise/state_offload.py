"""A simulated learner's state kept in a file, with only a handle in ``context.state``.

Why: Flower 1.41's simulation engine keeps every virtual node's ``Context`` in the one
simulation process and ships it to a Ray actor and back on every message. A correlated-noise
learner's state holds its stream's buffers — BLT keeps 4·d float64, 32 MB at d = 10⁶ — so
with the state inside ``context.state`` the simulation process grows by one state per
learner that has trained (10⁴ learners at d = 10⁶ would need ≈ 320 GB), and every message
pickles the whole state twice. With the state offloaded, ``context.state`` holds a handle of
a few hundred bytes (:class:`OffloadHandle`: the file, the learner's identity, its
generation, the size) and the buffers live in one file per learner under a run-level
directory (run config ``state-offload-dir``), read by the actor that runs the learner's round
and written back by it; only the learners sampled in a round touch their files.

The privacy rules hold for these files as for a deployed learner's ``state-dir``
(:mod:`~flwr_corrnoise.persistence`):

* **bound to its owner**: the handle's file must lie in the learner's own folder
  (:meth:`OffloadPolicy.folder`: run, node and key) under the name its generation gives; a
  handle naming any other file — another learner's handle, one from another run — is
  refused (:class:`~flwr_corrnoise.persistence.StateIntegrityError`, code 4104) before the
  file is opened;
* **no reuse, no rollback**: every commit writes a *new* file named by the learner's
  generation and 128 random bits (``g<generation>-<tag>.state``), and the handle names it
  together with a one-time MAC of the file's bytes (a fresh 256-bit key per commit, kept in
  the handle only, never on disk). A file whose bytes are not those the handle's commit
  wrote — an older generation copied over it, another learner's file, any edit (a
  generation field rewritten) — fails the MAC and is refused before anything is released;
  so is a handle **behind** the newest file in the folder (a previous handle put back): a
  committed file counts as released, as a ``state-dir``'s committed round does
  (:mod:`~flwr_corrnoise.persistence`), so the learner refuses rather than continue an
  older state;
* **never lost silently**: a handle whose file is missing (the directory deleted while the
  run goes on, or not shared between the machines of a Ray cluster) is a
  :class:`~flwr_corrnoise.persistence.StateLostError` — the learner refuses to train rather
  than start a fresh stream. A learner's first commit in a process checks that every
  machine of the Ray cluster sees the run's folder (:func:`check_shared`: a run marker
  written once, read back on every other Ray node), so a folder that is not shared fails
  the run in round 1 instead of when a learner first moves to another machine;
* **keys at rest**: the files hold the learners' noise-generator keys, so they are written
  ``0600`` in folders ``0700``; the default folder is a per-user one
  (``<temp dir>/flwr-corrnoise-states-<uid>``, created ``0700`` and refused if another user
  owns it), never a folder every user of the machine can read.

A learner has at most two files on disk after a commit: the one it loaded (the driver's
handle names it until the reply with the new handle arrives) and the new one; the commit
removes every other (:func:`write`). If a round's new handle never reached the driver (the
actor died after the commit), the driver's handle is behind the newest file and the learner
refuses (4104): the round may have been released, and a simulation's strategies fail the
run on that code (:class:`~flwr_corrnoise.flower.monitor.RoundWatch`).

The MAC is Poly1305 (HMAC-SHA256 where the ``cryptography`` backend lacks it): at d = 10⁶
(a BLT float64 state, 32 MB) it costs ≈ 7 ms per write and per read on this project's
machine, against ≈ 22 ms for SHA-256 and ≈ 7 ms for the write itself (docs/benchmarks.md,
``benchmarks/offload_mac.py``). A one-time MAC is enough because its key is secret from
whoever can touch the files: it lives in ``context.state``, in the simulation's memory.
A torn or truncated file is refused by the size in the handle and the MAC.

(De)serialization: the state's arrays are written chunk by chunk (no joined copy), and read
into one buffer that the unpacked arrays view (no second copy).

Only simulations offload: a deployed learner keeps its state in its own ``state-dir``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import secrets
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import arraypack
from .persistence import DIR_MODE, StateIntegrityError, StateLostError, open_private

log = logging.getLogger(__name__)

#: ``state-offload`` values: offload states of at least :data:`OFFLOAD_THRESHOLD` bytes,
#: every state, or none
MODES = ("auto", "on", "off")
#: ``auto`` offloads a state this large or larger (below it the handle saves little and a
#: file per learner costs more than the bytes in ``context.state``)
OFFLOAD_THRESHOLD = 1 << 20
#: the default run-level directory: ``<temp dir>/flwr-corrnoise-states-<uid>`` (one
#: sub-folder per run), private to the user
DEFAULT_DIR = "flwr-corrnoise-states"
SUFFIX = ".state"
#: a learner's state file: ``g<generation>-<32 hex digits>.state``
FILE_NAME = re.compile(r"g(\d+)-[0-9a-f]{32}" + re.escape(SUFFIX) + r"\Z")
#: the run marker in ``<directory>/run-<run id>/`` that every machine must see
RUN_MARKER = "run.marker"
#: how long the check that every Ray node sees the run marker may take (a node starts a
#: worker process for it)
SHARED_CHECK_TIMEOUT = 180.0
#: the MACs a handle may name: Poly1305 (the default), HMAC-SHA256 (a backend without it)
POLY1305, HMAC_SHA256 = "poly1305", "hmac-sha256"


def default_directory() -> Path:
    """``<temp dir>/flwr-corrnoise-states-<uid>``: the default ``state-offload-dir``, one
    per user (created ``0700`` on first use by :func:`private_dir`)."""
    return Path(tempfile.gettempdir()) / f"{DEFAULT_DIR}-{os.getuid()}"


def private_dir(path: Path) -> None:
    """Make ``path`` a directory that only this user can enter: created ``0700``, or
    tightened to ``0700`` if it exists and is this user's. Refused (:class:`StateLostError`,
    so a learner answers 4104): a symlink or a file in its place, or a folder of another
    user — in a shared temp dir either could let another user read the learners' noise
    keys or swap their states."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StateLostError(f"the state-offload folder {path} is not a directory (a "
                             "symlink or a file in its place); refusing to keep learner "
                             "states there")
    if st.st_uid != os.getuid():
        raise StateLostError(f"the state-offload folder {path} belongs to another user "
                             f"(uid {st.st_uid}); refusing to keep learner states (their "
                             "noise keys) where another user can read or replace them. "
                             "Set state-offload-dir to a folder of your own")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


class _Mac:
    """The one-time MAC of a state file: Poly1305 under a fresh 256-bit key per commit
    (HMAC-SHA256 where the ``cryptography`` backend has no Poly1305)."""

    def __init__(self, algorithm: str, key: bytes) -> None:
        self.algorithm = algorithm
        if algorithm == POLY1305:
            from cryptography.hazmat.primitives import poly1305

            self._poly: Any = poly1305.Poly1305(key)
        elif algorithm == HMAC_SHA256:
            self._poly = None
            self._hmac = hmac.new(key, digestmod="sha256")
        else:
            raise StateIntegrityError(f"unknown state-offload MAC {algorithm!r}")

    def update(self, data: bytes | memoryview) -> None:
        (self._poly or self._hmac).update(data)

    def tag(self) -> bytes:
        return self._poly.finalize() if self._poly is not None else self._hmac.digest()


def _mac_algorithm() -> str:
    """Poly1305 if the ``cryptography`` backend has it, else HMAC-SHA256."""
    try:
        _Mac(POLY1305, bytes(32))
    except Exception:  # cryptography's UnsupportedAlgorithm (OpenSSL without Poly1305)
        return HMAC_SHA256
    return POLY1305


MAC = _mac_algorithm()


@dataclass(frozen=True)
class OffloadPolicy:
    """Whether and where a simulated learner keeps its state in a file.

    ``mode``: ``auto`` (the default: states of at least ``threshold`` bytes), ``on``, ``off``.
    ``directory``: the run-level root (default :func:`default_directory`); each learner's
    files go to ``<directory>/run-<run id>/node-<node id>/<key>/``.
    """

    mode: str = "auto"
    directory: Path | None = None
    threshold: int = OFFLOAD_THRESHOLD

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"state-offload must be one of {', '.join(MODES)}, "
                             f"got {self.mode!r}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> OffloadPolicy:
        """From a learner's config: ``state-offload`` and ``state-offload-dir``."""
        mode = cfg.get("state-offload", "auto")
        if isinstance(mode, bool):  # a TOML boolean: true/false
            mode = "on" if mode else "off"
        directory = cfg.get("state-offload-dir")
        return cls(mode=str(mode).strip().lower(),
                   directory=Path(str(directory)) if directory else None)

    def wants(self, size: int) -> bool:
        """Whether a state of ``size`` bytes goes to a file."""
        return self.mode == "on" or (self.mode == "auto" and size >= self.threshold)

    def root(self) -> Path:
        """The run-level root, as this process resolves it (the default depends on the
        process's temp dir and user)."""
        return self.directory if self.directory is not None else default_directory()

    def run_folder(self, run_id: int) -> Path:
        """The folder of one run's files (and of its :data:`RUN_MARKER`)."""
        return self.root() / f"run-{int(run_id)}"

    def folder(self, run_id: int, node_id: int, key: str) -> Path:
        """The folder of one learner's files: a handle naming a file elsewhere is not
        this learner's (:func:`read`)."""
        return self.run_folder(run_id) / f"node-{int(node_id)}" / key

    def prepare(self, run_id: int, node_id: int, key: str) -> Path:
        """The learner's folder, made private (every level this library creates is
        ``0700``; the default root is the user's own) and — once per process and run —
        checked to be seen by every machine of the Ray cluster (:func:`check_shared`).
        Called before a commit writes its file."""
        root = self.root()
        if self.directory is None:
            private_dir(root)  # a shared temp dir: this user's own folder, or refused
        elif not root.is_dir():
            root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                root.mkdir(mode=DIR_MODE)
        folder = self.folder(run_id, node_id, key)
        for level in (folder.parents[1], folder.parent, folder):
            private_dir(level)
        check_shared(self, run_id)
        return folder


@dataclass(frozen=True)
class OffloadHandle:
    """What stays in ``context.state`` for an offloaded state (a few hundred bytes): the
    file, the learner's identity and generation, the size, and the file's one-time MAC
    (``mac`` algorithm, ``key`` and ``tag``, hex)."""

    path: str
    identity: str
    generation: int
    size: int
    mac: str = ""
    key: str = ""
    tag: str = ""

    def to_record(self) -> dict[str, Any]:
        """The values of the ``ConfigRecord`` that holds it."""
        return {"offloaded": self.path, "identity": self.identity,
                "generation": int(self.generation), "size": int(self.size),
                "mac": self.mac, "mac-key": self.key, "mac-tag": self.tag}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> OffloadHandle | None:
        """The handle in a ``context.state`` record, or ``None`` if the record holds the
        state's bytes themselves."""
        if "offloaded" not in record:
            return None
        return cls(path=str(record["offloaded"]), identity=str(record["identity"]),
                   generation=int(record["generation"]), size=int(record["size"]),
                   mac=str(record.get("mac", "")), key=str(record.get("mac-key", "")),
                   tag=str(record.get("mac-tag", "")))


def _generation_of(name: str) -> int | None:
    match = FILE_NAME.match(name)
    return int(match.group(1)) if match else None


def write(folder: Path, arrays: Mapping[str, np.ndarray], *, identity: str,
          generation: int, keep: str | None = None) -> OffloadHandle:
    """Write a state's ``arrays`` (:meth:`~flwr_corrnoise.learner_state.LearnerState.state_dict`)
    to a new file in ``folder`` (``0600``), chunk by chunk, MAC'd as it is written under a
    fresh key, and return its handle. ``folder`` must exist (:meth:`OffloadPolicy.prepare`
    makes it). ``keep``: the file the round was loaded from (the handle the driver holds
    until it gets the new one), which stays; every other state file in the folder is
    removed — the generation before ``keep`` (the driver's handle moved past it: the load
    proved it) and an orphan of a round whose new handle never reached the driver (module
    docstring); one of them is renamed out of the way and overwritten as the new file (its
    pages reused, not freed and allocated again).

    No ``fsync``: a simulation's files serve one run on one machine, and what the rules
    above need is the order of operations within the run (the file is complete under its
    final name before its handle leaves, ``os.replace``); a machine that crashes ends the
    simulation, and with it every ``context.state`` that names these files. A deployed
    learner's ``state-dir`` does fsync (:func:`~flwr_corrnoise.persistence.atomic_write`)."""
    name = f"g{int(generation)}-{secrets.token_hex(16)}{SUFFIX}"
    path = folder / name
    tmp = path.with_name(f".{path.name}.tmp")
    kept = Path(keep).name if keep else None
    with os.scandir(folder) as entries:  # one scan of the folder (no glob pattern)
        stale = [e.path for e in entries if e.name.startswith("g") and e.name.endswith(SUFFIX)
                 and e.name != kept]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if stale:  # overwrite a stale file's pages instead of freeing them and allocating new
        # ones (2.5× faster for a 32 MB state); it is renamed out of reach first, so no
        # handle can name it while it is rewritten
        with contextlib.suppress(FileNotFoundError):
            os.replace(stale.pop(), tmp)
            flags = os.O_WRONLY  # truncated after the write, below
    key = secrets.token_bytes(32)  # one key per file: Poly1305 is a one-time MAC
    mac = _Mac(MAC, key)
    size = 0
    with open(open_private(tmp, flags), "wb", closefd=True) as fh:
        for chunk in arraypack.pack_chunks(arrays):
            mac.update(chunk)
            size += fh.write(chunk)
        fh.truncate()
    os.replace(tmp, path)  # a reader never sees a half-written file under the final name
    for other in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(other)
    return OffloadHandle(str(path), identity, int(generation), size, MAC, key.hex(),
                         mac.tag().hex())


def _owned_path(handle: OffloadHandle, folder: Path) -> Path:
    """The handle's file, if it is this learner's: in ``folder`` (symlinks resolved) under
    a state file's name of the handle's generation; else :class:`StateIntegrityError`."""
    path = Path(handle.path)
    # the handle names the folder as write() spelled it (folder / name): equal text is the
    # same folder, with no resolve() (an lstat per path component) on every message
    if (not path.is_absolute()
            or (path.parent != folder and path.parent.resolve() != folder.resolve())
            or _generation_of(path.name) != int(handle.generation)):
        raise StateIntegrityError(
            f"this learner's handle in context.state names {path}, which is not a state "
            f"file of generation {handle.generation} in the learner's own folder {folder}: "
            "another learner's handle, or one from another run, was put in its place; "
            "refusing to train")
    return path


def _check_latest(handle: OffloadHandle, path: Path) -> None:
    """Refuse a handle behind the newest state file in its folder: that file was committed
    after the handle's, so its round may have been released (a previous handle put back,
    or a reply whose new handle never reached the driver)."""
    try:
        with os.scandir(path.parent) as entries:
            newer = max((g for e in entries if (g := _generation_of(e.name)) is not None),
                        default=-1)
    except FileNotFoundError:
        return  # the folder is gone: the read below says the state is missing
    if newer > handle.generation:
        raise StateIntegrityError(
            f"the offloaded learner state {path} is at generation {handle.generation}, but "
            f"this learner's folder {path.parent} holds generation {newer}, committed after "
            "it: the handle in context.state was rolled back (an older handle put back, or "
            "the reply of that commit never reached the driver). The later round may have "
            "been released; continuing the older state would reuse its noise with new "
            "data. Refusing to train")


def read(handle: OffloadHandle, folder: Path) -> dict[str, np.ndarray]:
    """The arrays of the file ``handle`` names, read into one buffer they view (not
    zero-filled first: every byte is read over), refused (4104) unless it is this
    learner's latest committed file: in ``folder`` (:meth:`OffloadPolicy.folder`), not
    behind a newer file there, its size and MAC those of the handle, its identity and
    generation the handle's. Only reads: the files the handle proves stale are removed by
    the next :func:`write` (module docstring)."""
    path = _owned_path(handle, folder)
    if not (handle.mac and handle.key and handle.tag):
        raise StateIntegrityError(
            f"this learner's handle for {path} carries no MAC (written by an older version "
            "of the library, or edited): its file cannot be authenticated; refusing to train")
    _check_latest(handle, path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != handle.size:
                raise StateIntegrityError(
                    f"the offloaded learner state {path} has {size} bytes, its handle in "
                    f"context.state says {handle.size}: it is not the state this learner "
                    "committed; refusing to train")
            buffer = np.empty(size, dtype=np.uint8)  # aligned; arraypack aligns big arrays
            if fh.readinto(memoryview(buffer)) != size:
                raise StateLostError(f"the offloaded learner state {path} is truncated")
    except FileNotFoundError as err:
        raise StateLostError(
            f"the offloaded learner state {path} is missing (its state-offload-dir was "
            "deleted while the run went on, or is not shared by every machine of the Ray "
            "cluster); refusing to train rather than start a fresh noise stream") from err
    mac = _Mac(handle.mac, bytes.fromhex(handle.key))
    mac.update(memoryview(buffer))
    if not hmac.compare_digest(mac.tag().hex(), handle.tag):
        raise StateIntegrityError(
            f"the offloaded learner state {path} is not the file this learner committed "
            "(its bytes fail the MAC in the handle): an older copy put back (rolled back), "
            "another learner's file, or an edited one; refusing to train")
    try:
        arrays = arraypack.unpack(buffer, copy=False)
    except ValueError as err:
        raise StateLostError(f"the offloaded learner state {path} is corrupt: {err}") from err
    identity = str(arrays["identity"]) if "identity" in arrays else None
    generation = int(arrays["generation"]) if "generation" in arrays else None
    if identity != handle.identity or generation != handle.generation:
        raise StateIntegrityError(
            f"the offloaded learner state {path} belongs to learner {identity} at generation "
            f"{generation}, but this learner's handle names {handle.identity} at generation "
            f"{handle.generation}: an older copy (rolled back) or another learner's state; "
            "refusing to train")
    return arrays


# -- every machine of a Ray cluster must see the run's folder -------------------------------

#: run folders this process has checked (:func:`check_shared`)
_CHECKED: set[Path] = set()

#: ``peers(policy, run_id)``: ``{node: marker token there, or None}`` for every other
#: machine the learners of this run may run on
Peers = Callable[[OffloadPolicy, int], dict[str, str | None]]


def _read_marker(path: Path) -> str | None:
    """A run marker's token, or ``None`` without one (retried briefly while empty: another
    process may be writing it where ``os.link`` is not supported)."""
    for _ in range(50):
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            return None
        if token:
            return token
        time.sleep(0.02)
    return None


def run_marker(run_folder: Path) -> str:
    """The token of the run's :data:`RUN_MARKER` in ``run_folder``, written by the first
    learner that gets here (128 random bits, ``0600``, complete before it appears:
    ``os.link`` of a written file, which fails if another process was first)."""
    path = run_folder / RUN_MARKER
    token = _read_marker(path)
    if token is not None:
        return token
    mine = secrets.token_hex(16)
    tmp = run_folder / f".{RUN_MARKER}.{mine}.tmp"
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with open(fd, "w") as fh:
        fh.write(mine + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another learner was first: its token is the run's
    except OSError:  # a file system without hard links: create it in place
        with contextlib.suppress(FileExistsError):
            fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with open(fd, "w") as fh:
                fh.write(mine + "\n")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    token = _read_marker(path)
    if token is None:
        raise StateLostError(f"cannot write the run marker {path}")
    return token


def marker_here(policy: OffloadPolicy, run_id: int) -> str | None:
    """The run marker's token in the run folder *as this machine resolves it* (its own
    temp dir for the default folder), or ``None``: what :func:`ray_peers` asks every
    other Ray node. Only reads."""
    return _read_marker(policy.run_folder(run_id) / RUN_MARKER)


def ray_peers(policy: OffloadPolicy, run_id: int) -> dict[str, str | None]:
    """``{"<node id> (<address>)": token}`` from every other live node of the Ray cluster
    this process runs in (``{}`` outside Ray or on a one-node cluster): a zero-CPU task
    pinned to each node runs :func:`marker_here` there (zero CPUs, so it never waits for
    the ClientApp actors that hold the node's CPUs)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    from ray.exceptions import GetTimeoutError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()
             if n.get("Alive") and n["NodeID"] != here}
    if not nodes:
        return {}
    task = ray.remote(num_cpus=0, max_retries=0)(marker_here)
    refs = {f"{node} ({address})": task.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            policy, run_id) for node, address in nodes.items()}
    try:
        tokens = ray.get(list(refs.values()), timeout=SHARED_CHECK_TIMEOUT)
    except GetTimeoutError as err:
        raise StateLostError(
            f"could not check within {SHARED_CHECK_TIMEOUT:.0f} s that every machine of the "
            f"Ray cluster sees the state-offload folder {policy.run_folder(run_id)}; "
            "refusing to offload learner states to a folder that may not be shared") from err
    except Exception as err:  # a node could not run the check (the library not there?)
        raise StateLostError(
            f"could not check that every machine of the Ray cluster sees the state-offload "
            f"folder {policy.run_folder(run_id)} ({type(err).__name__}); refusing to "
            "offload learner states to a folder that may not be shared") from err
    return dict(zip(refs, tokens, strict=True))


def check_shared(policy: OffloadPolicy, run_id: int, peers: Peers | None = None) -> None:
    """Refuse (:class:`StateLostError`, 4104) to offload into a run folder that some
    machine of the Ray cluster does not see: the run's marker (:func:`run_marker`) must be
    the same on every node (``peers``, default :func:`ray_peers`). Why in round 1: a
    learner's next round may run on any machine; with a folder each machine keeps for
    itself its file would be missing there, and that would show only when it first moves
    — maybe rounds later. Once per process and run folder."""
    run_folder = policy.run_folder(run_id)
    if run_folder in _CHECKED:
        return
    token = run_marker(run_folder)
    seen = (peers or ray_peers)(policy, run_id)
    blind = sorted(node for node, other in seen.items() if other != token)
    if blind:
        raise StateLostError(
            f"the state-offload folder {run_folder} is not shared by every machine of the "
            f"Ray cluster: {len(blind)} node(s) do not see this run's marker "
            f"{run_folder / RUN_MARKER} there ({', '.join(blind[:3])}). A learner whose "
            "next round runs on another machine would not find its state. Set "
            "state-offload-dir to a folder every machine mounts at the same path (the "
            "default, in each machine's temp dir, never is), or state-offload = \"off\"")
    if seen:
        log.info("state-offload folder %s: seen by %d other Ray node(s)", run_folder,
                 len(seen))
    _CHECKED.add(run_folder)
