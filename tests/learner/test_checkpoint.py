"""The server's checkpoint: atomic, bound to one configuration, refused when corrupt."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.flower.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointError,
    ServerCheckpoint,
    ServerProgress,
    fingerprint,
)


def progress(r: int) -> ServerProgress:
    return ServerProgress(
        round=r, arrays=[np.arange(4.0) * r, np.eye(2)],
        privacy={123: {"epsilon-spent": 1.5, "steps": 4.0}},
        rounds=[{"round": k, "accepted": 3, "learners": [0.0, 1.0, 2.0]} for k in range(1, r + 1)],
        evaluations=[{"round": float(k), "test-accuracy": 0.5} for k in range(r + 1)],
    )


def test_round_trip_and_overwrite(tmp_path) -> None:
    ckpt = ServerCheckpoint(tmp_path, fingerprint({"a": 1}))
    assert ckpt.load() is None
    ckpt.save(progress(2))
    ckpt.save(progress(3))
    got = ckpt.load()
    assert got is not None and got.round == 3
    np.testing.assert_array_equal(got.arrays[0], np.arange(4.0) * 3)
    np.testing.assert_array_equal(got.arrays[1], np.eye(2))
    assert got.privacy == {123: {"epsilon-spent": 1.5, "steps": 4.0}}
    assert got.rounds[-1]["round"] == 3 and len(got.evaluations) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]  # no temp files


def test_other_configuration_is_refused(tmp_path) -> None:
    ServerCheckpoint(tmp_path, fingerprint({"epsilon": 2.0})).save(progress(2))
    with pytest.raises(CheckpointError, match="other settings"):
        ServerCheckpoint(tmp_path, fingerprint({"epsilon": 4.0})).load()


@pytest.mark.parametrize("damage", [lambda b: b[:-5], lambda b: b"x" + b[1:], lambda b: b + b"!"])
def test_corrupt_checkpoint_is_refused_and_kept(tmp_path, damage) -> None:
    ckpt = ServerCheckpoint(tmp_path, "k")
    ckpt.save(progress(1))
    bad = damage(ckpt.path.read_bytes())
    ckpt.path.write_bytes(bad)
    with pytest.raises(CheckpointError, match="unreadable"):
        ckpt.load()
    assert ckpt.path.read_bytes() == bad  # left for the operator to inspect


def test_fingerprint_is_order_independent_and_sensitive() -> None:
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1})
    assert fingerprint({"a": 1, "b": 2}) != fingerprint({"a": 1, "b": 3})
