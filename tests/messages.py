"""The one builder of Flower messages that tests hand to ClientApps, mods and PrivateSteps.

Why one place: a Flower ``Message`` needs a full ``Metadata`` (run, ids, nodes, group,
created-at, ttl, type), and the library's learner reads only ``server-round`` and the round
settings from its ``config`` and the arrays from ``arrays``; every test module that built
its own ``Metadata`` had to follow Flower's constructor when it changed. Tests call
:func:`flower_message` (or a two-line wrapper of it that fixes their own config).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, Metadata, RecordDict

#: a process-wide counter: every message gets its own id (Flower refuses none, but a test
#: that sends two messages of one round must be able to tell their replies apart)
_IDS = itertools.count()


def flower_message(arrays: ArrayRecord | Sequence[np.ndarray] | np.ndarray, *,
                   server_round: int, config: Mapping[str, Any] | None = None,
                   kind: str = MessageType.TRAIN, dst: int = 1, run_id: int = 1,
                   group_id: str | None = None) -> Message:
    """A message from the server (node 0) to node ``dst`` of ``run_id``: ``arrays`` as the
    ``"arrays"`` record, ``config`` plus ``server-round`` as the ``"config"`` record."""
    if isinstance(arrays, np.ndarray):
        arrays = [arrays]
    record = arrays if isinstance(arrays, ArrayRecord) else ArrayRecord(list(arrays))
    cfg = {"server-round": server_round, **dict(config or {})}
    md = Metadata(run_id=run_id, message_id=f"m{server_round}-{kind}-{dst}-{next(_IDS)}",
                  src_node_id=0, dst_node_id=dst, reply_to_message_id="",
                  group_id=str(server_round) if group_id is None else group_id,
                  created_at=time.time(), ttl=3600.0, message_type=kind)
    return Message(content=RecordDict({"arrays": record, "config": ConfigRecord(cfg)}),
                   metadata=md)
