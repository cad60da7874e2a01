"""The server's checkpoint: what a restarted SuperLink run needs to resume.

Why: a deployment runs for hours; if the SuperLink (or the machine under the ServerApp)
restarts, starting over from round 0 would waste every learner's privacy budget already
spent — each learner's noise stream has moved on and cannot be rewound. So after every
round :class:`~flwr_corrnoise.flower.strategy.CorrNoiseFedAvg` writes, atomically (the
same write-then-rename-and-fsync as the learners' state), the round number, the global
model, the per-learner privacy records, the per-round log and the server-side evaluations.
A new run of the same app with the same ``checkpoint-dir`` resumes from the next round.

A checkpoint belongs to one configuration: it stores a fingerprint of the run's settings
(all but the round count, so a run can be extended) and refuses to resume a different one,
which would silently mix two experiments. A round that was in flight when the server died
is run again from the last checkpoint; the learners that had already trained in it have
spent those steps (their streams never rewind), so their next update continues their
streams — no noise is reused, but those steps are lost from their budget.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..arraypack import pack, unpack
from ..persistence import atomic_write

CHECKPOINT_FILE = "server.checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, or written by another configuration."""


def fingerprint(settings: Mapping[str, Any]) -> str:
    """A stable digest of a run's settings (JSON with sorted keys)."""
    text = json.dumps({str(k): settings[k] for k in sorted(settings)}, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class ServerProgress:
    """What the server knows after ``round`` complete rounds."""

    round: int
    arrays: list[np.ndarray]
    privacy: dict[int, dict[str, float]] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, float]] = field(default_factory=list)


class ServerCheckpoint:
    """One checkpoint file in ``directory``, bound to a settings fingerprint."""

    def __init__(self, directory: str | os.PathLike[str], key: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / CHECKPOINT_FILE
        self.key = key

    def save(self, progress: ServerProgress) -> None:
        """Write ``progress`` atomically (the old checkpoint stays until the new is whole)."""
        meta = {
            "key": self.key,
            "round": int(progress.round),
            "privacy": {str(k): v for k, v in progress.privacy.items()},
            "rounds": progress.rounds,
            "evaluations": progress.evaluations,
        }
        arrays = {f"a{i}": np.asarray(a) for i, a in enumerate(progress.arrays)}
        arrays["meta"] = np.frombuffer(json.dumps(meta, default=float).encode(), dtype=np.uint8)
        atomic_write(self.path, pack(arrays))

    def load(self) -> ServerProgress | None:
        """The saved progress, ``None`` if there is none.

        Raises :class:`CheckpointError` if the file is corrupt or belongs to a run with other
        settings: resuming either would mix runs or lose the learners' spent budget silently.
        """
        if not self.path.exists():
            return None
        try:
            arrays = unpack(self.path.read_bytes())
            meta = json.loads(arrays.pop("meta").tobytes())
            progress = ServerProgress(
                round=int(meta["round"]),
                arrays=[arrays[f"a{i}"] for i in range(len(arrays))],
                privacy={int(k): dict(v) for k, v in meta["privacy"].items()},
                rounds=list(meta["rounds"]),
                evaluations=list(meta["evaluations"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"the server checkpoint {self.path} is unreadable: {err}; "
                                  f"move it away to start a new run") from err
        if meta.get("key") != self.key:
            raise CheckpointError(
                f"the server checkpoint {self.path} was written by a run with other settings; "
                f"refusing to resume it (use another checkpoint-dir for a new run)"
            )
        return progress
