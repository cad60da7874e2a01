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

* **no reuse, no rollback**: every commit writes a *new* file named by the learner's
  generation and 128 random bits (``g<generation>-<tag>.state``), and the handle names it. A
  file from an older generation, or another learner's file, does not match the handle's
  identity and generation and is refused (:class:`~flwr_corrnoise.persistence.
  StateIntegrityError`) before anything is released;
* **never lost silently**: a handle whose file is missing (the directory deleted while the
  run goes on, or not shared between the machines of a Ray cluster) is a
  :class:`~flwr_corrnoise.persistence.StateLostError` — the learner refuses to train rather
  than start a fresh stream;
* **a round that released nothing is redone from the state it started from**: the file of
  the previous generation is kept until a load proves the handle moved past it (the driver
  received the new handle with the reply). If a round's new handle never reached the driver
  (the actor died after writing), the next load finds the old handle and reads the old file
  — exactly what happens with the state inside ``context.state``. The commit after a load
  removes every file but the loaded one and its own (:func:`write`): the previous
  generation and any orphan. So a learner has at most two files on disk after a commit
  (three while an orphan waits for the learner's next round).

The check is by identity and generation (both inside the file and in the handle), not by a
content hash: SHA-256 of a 32 MB state costs ≈ 37 ms on this project's machine, read and
write ≈ 28 % of a learner-round at d = 10⁶, while identity and generation already tell the
learner's latest state from an older or another learner's copy. A torn or truncated file is
refused by :mod:`~flwr_corrnoise.arraypack`'s length checks and the size in the handle.

(De)serialization: the state's arrays are written chunk by chunk (no joined copy), and read
into one buffer that the unpacked arrays view (no second copy).

Only simulations offload: a deployed learner keeps its state in its own ``state-dir``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import arraypack
from .persistence import StateIntegrityError, StateLostError

#: ``state-offload`` values: offload states of at least :data:`OFFLOAD_THRESHOLD` bytes,
#: every state, or none
MODES = ("auto", "on", "off")
#: ``auto`` offloads a state this large or larger (below it the handle saves little and a
#: file per learner costs more than the bytes in ``context.state``)
OFFLOAD_THRESHOLD = 1 << 20
#: the default run-level directory: a folder in the temp dir (one sub-folder per run)
DEFAULT_DIR = "flwr-corrnoise-states"
SUFFIX = ".state"


def default_directory() -> Path:
    """``<temp dir>/flwr-corrnoise-states``: the default ``state-offload-dir``."""
    return Path(tempfile.gettempdir()) / DEFAULT_DIR


@dataclass(frozen=True)
class OffloadPolicy:
    """Whether and where a simulated learner keeps its state in a file.

    ``mode``: ``auto`` (the default: states of at least ``threshold`` bytes), ``on``, ``off``.
    ``directory``: the run-level root; each learner's files go to
    ``<directory>/run-<run id>/node-<node id>/<key>/``.
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

    def folder(self, run_id: int, node_id: int, key: str) -> Path:
        """The folder of one learner's files."""
        root = self.directory if self.directory is not None else default_directory()
        return root / f"run-{int(run_id)}" / f"node-{int(node_id)}" / key


@dataclass(frozen=True)
class OffloadHandle:
    """What stays in ``context.state`` for an offloaded state (a few hundred bytes)."""

    path: str
    identity: str
    generation: int
    size: int

    def to_record(self) -> dict[str, Any]:
        """The values of the ``ConfigRecord`` that holds it."""
        return {"offloaded": self.path, "identity": self.identity,
                "generation": int(self.generation), "size": int(self.size)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> OffloadHandle | None:
        """The handle in a ``context.state`` record, or ``None`` if the record holds the
        state's bytes themselves."""
        if "offloaded" not in record:
            return None
        return cls(path=str(record["offloaded"]), identity=str(record["identity"]),
                   generation=int(record["generation"]), size=int(record["size"]))


def write(folder: Path, arrays: Mapping[str, np.ndarray], *, identity: str,
          generation: int, keep: str | None = None) -> OffloadHandle:
    """Write a state's ``arrays`` (:meth:`~flwr_corrnoise.learner.LearnerState.state_dict`)
    to a new file in ``folder``, chunk by chunk, and return its handle. ``keep``: the file
    the round was loaded from (the handle the driver holds until it gets the new one),
    which stays; every other state file in the folder is removed — the generation before
    ``keep`` (the driver's handle moved past it: the load proved it) and an orphan of a
    round whose new handle never reached the driver (module docstring); one of them is
    renamed out of the way and overwritten as the new file (its pages reused, not freed
    and allocated again).

    No ``fsync``: a simulation's files serve one run on one machine, and what the rules
    above need is the order of operations within the run (the file is complete under its
    final name before its handle leaves, ``os.replace``); a machine that crashes ends the
    simulation, and with it every ``context.state`` that names these files. A deployed
    learner's ``state-dir`` does fsync (:func:`~flwr_corrnoise.persistence.atomic_write`)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"g{int(generation)}-{secrets.token_hex(16)}{SUFFIX}"
    path = folder / name
    tmp = path.with_name(f".{path.name}.tmp")
    kept = Path(keep).name if keep else None
    with os.scandir(folder) as entries:  # one scan of the folder (no glob pattern)
        stale = [e.path for e in entries if e.name.startswith("g") and e.name.endswith(SUFFIX)
                 and e.name != kept]
    mode = "wb"
    if stale:  # overwrite a stale file's pages instead of freeing them and allocating new
        # ones (2.5× faster for a 32 MB state); it is renamed out of reach first, so no
        # handle can name it while it is rewritten
        with contextlib.suppress(FileNotFoundError):
            os.replace(stale.pop(), tmp)
            mode = "r+b"
    size = 0
    with open(tmp, mode) as fh:
        for chunk in arraypack.pack_chunks(arrays):
            size += fh.write(chunk)
        fh.truncate()
    os.replace(tmp, path)  # a reader never sees a half-written file under the final name
    for other in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(other)
    return OffloadHandle(str(path), identity, int(generation), size)


def read(handle: OffloadHandle) -> dict[str, np.ndarray]:
    """The arrays of the file ``handle`` names, read into one buffer they view (not
    zero-filled first: every byte is read over), checked against the handle (size,
    identity, generation). Only reads: the files the handle proves stale are removed by
    the next :func:`write` (module docstring)."""
    path = Path(handle.path)
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
