"""Offloaded simulation states (:mod:`flwr_corrnoise.state_offload`): a handle in
``context.state``, the buffers in a file, and the privacy rules of a stored state — no
rollback, no clone, never lost silently, a round that released nothing redone."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from flwr_corrnoise import arraypack, state_offload
from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner import LearnerState, PrivacySettings
from flwr_corrnoise.persistence import StateIntegrityError, StateLostError
from flwr_corrnoise.state_offload import OffloadHandle, OffloadPolicy

SETTINGS = PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0,
                           horizon=12)
DIM = 40_000  # BLT keeps 4 buffers: ≈ 1.3 MB, above the auto threshold


def context(node_id: int = 1, run_id: int = 5) -> Context:
    return Context(run_id=run_id, node_id=node_id, node_config={"partition-id": node_id},
                   state=RecordDict(), run_config={})


def storage(ctx: Context, root: Path, mode: str = "on") -> LearnerStorage:
    return LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy(mode, root))


def advance(state: LearnerState, steps: int = 3) -> None:
    for _ in range(steps):
        state.noise.next()
        state.advance()


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("g*.state"))


def test_pack_chunks_are_pack_and_unpack_can_view() -> None:
    arrays = {"x": np.arange(5.0), "s": np.array("id"), "e": np.zeros((0, 3)),
              "f": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              "be": np.arange(3, dtype=">f8"), "g": np.array(7, dtype=np.int64)}
    data = arraypack.pack(arrays)
    assert b"".join(arraypack.pack_chunks(arrays)) == data
    viewed = arraypack.unpack(bytearray(data), copy=False)
    for name, value in arrays.items():
        assert viewed[name].shape == value.shape and np.array_equal(viewed[name], value)
    assert viewed["x"].base is not None  # a view of the buffer, not a copy


def test_a_state_round_trips_through_its_file_and_the_handle_is_small(tmp_path: Path) -> None:
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=11)
    advance(state)
    store.write(state, {})
    record = ctx.state[STATE_KEY]
    handle = OffloadHandle.from_record(record)
    assert handle is not None and handle.generation == 1 and handle.identity == state.learner_id
    assert "learner" not in record and len(repr(dict(record))) < 400
    assert Path(handle.path).parent == tmp_path / "run-5" / "node-1" / STATE_KEY
    assert handle.size == Path(handle.path).stat().st_size > 4 * DIM * 8
    back = store.read()
    assert back is not None and back.step == state.step and back.generation == 1
    # the same state as one kept in context.state itself (the same format) ...
    plain = LearnerState.from_bytes(arraypack.pack(state.state_dict()))
    assert plain.step == back.step and plain.learner_id == back.learner_id
    # ... whose stream goes on exactly as the original's
    np.testing.assert_array_equal(back.noise.next(), state.noise.next())


def test_auto_offloads_only_large_states(tmp_path: Path) -> None:
    for dim, offloaded in ((10, False), (DIM, True)):
        ctx = context(node_id=dim)
        state = LearnerState.create(SETTINGS, [(dim,)], seed=1)
        storage(ctx, tmp_path, "auto").write(state, {})
        assert (OffloadHandle.from_record(ctx.state[STATE_KEY]) is not None) is offloaded
        assert storage(ctx, tmp_path, "auto").read().generation == 1
    ctx = context(node_id=99)
    storage(ctx, tmp_path, "off").write(LearnerState.create(SETTINGS, [(DIM,)], seed=1), {})
    assert "learner" in ctx.state[STATE_KEY]
    with pytest.raises(ValueError, match="state-offload must be one of"):
        OffloadPolicy.from_config({"state-offload": "sometimes"})
    assert OffloadPolicy.from_config({"state-offload": True}).mode == "on"


def test_a_rolled_back_file_is_refused(tmp_path: Path) -> None:
    """An older generation's bytes under the current handle's name (a restored copy) name
    the older generation: refused before anything is released."""
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
    store.write(state, {})
    old = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    saved = tmp_path / "old.bin"
    shutil.copy(old, saved)
    advance(state)
    store.write(state, {})
    current = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    shutil.copy(saved, current)
    with pytest.raises(StateIntegrityError, match="older copy"):
        store.read()


def test_another_learners_file_is_refused(tmp_path: Path) -> None:
    a, b = context(node_id=1), context(node_id=2)
    for ctx in (a, b):
        storage(ctx, tmp_path).write(LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    path_a = Path(OffloadHandle.from_record(a.state[STATE_KEY]).path)
    path_b = Path(OffloadHandle.from_record(b.state[STATE_KEY]).path)
    shutil.copy(path_b, path_a)  # same seed, same size: only the identity tells them apart
    with pytest.raises(StateIntegrityError, match="another learner"):
        storage(a, tmp_path).read()


def test_a_missing_or_truncated_file_is_lost_never_a_fresh_start(tmp_path: Path) -> None:
    ctx = context()
    store = storage(ctx, tmp_path)
    store.write(LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    path = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(StateIntegrityError, match="bytes"):
        store.read()
    path.unlink()
    with pytest.raises(StateLostError, match="missing"):
        store.read()


def test_a_round_whose_handle_never_reached_the_driver_is_redone(tmp_path: Path) -> None:
    """The actor wrote generation 2 but the driver kept generation 1's handle (the reply
    and context never came back): the next load continues generation 1 — nothing of
    generation 2 was released — and the next commit removes the orphan; after a commit a
    learner never has more than two files."""
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
    store.write(state, {})
    kept = ctx.state[STATE_KEY]
    advance(state)
    store.write(state, {})
    assert len(files(tmp_path)) == 2
    orphan = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    ctx.state[STATE_KEY] = kept  # the driver's context from before the lost round
    back = store.read()  # only reads
    assert back.generation == 1 and back.step == 0
    assert [p.name.split("-")[0] for p in files(tmp_path)] == ["g1", "g2"]
    loaded = Path(OffloadHandle.from_record(kept).path)
    advance(back)
    store.write(back, {})
    assert not orphan.exists() and loaded.exists()  # the loaded file stays for the driver
    assert len(files(tmp_path)) == 2
    for _ in range(3):
        advance(back)
        store.write(back, {})
        assert len(files(tmp_path)) == 2
    assert not loaded.exists()
    assert state_offload.read(OffloadHandle.from_record(ctx.state[STATE_KEY]))


def test_a_torch_stream_state_round_trips_offloaded(tmp_path: Path) -> None:
    """The torch ClientApp's state (a device stream) takes the same path: its stream's
    arrays stored flat in the file, restored by its backend, continuing bit for bit."""
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import TorchNoiseStream

    ctx = context()
    store = storage(ctx, tmp_path)
    stream = TorchNoiseStream.create("blt", 12, [(200, 250)], 1.0, 4,
                                     device=torch.device("cpu"), dtype=torch.float64)
    state = LearnerState(noise=stream, seed=4, binding=SETTINGS.binding(
        stream.factorization.digest), learner_id=LearnerState.new_id())
    advance(state, 2)
    store.write(state, {})
    assert OffloadHandle.from_record(ctx.state[STATE_KEY]) is not None
    back = store.read()
    assert type(back.noise) is TorchNoiseStream and back.step == 2
    for a, b in zip(back.noise.next(), state.noise.next(), strict=True):
        assert torch.equal(a, b)


def test_a_commit_rewrites_a_stale_file_in_place(tmp_path: Path) -> None:
    """From the third commit on, the new state is written over the pages of the file two
    generations back (renamed out of the way first): the same inode under the new name,
    holding exactly the new state, and the loaded file untouched."""
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=5)
    store.write(state, {})
    first = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    inode = first.stat().st_ino
    for _ in range(2):
        state = store.read()
        loaded = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path).read_bytes()
        advance(state)
        store.write(state, {})
    newest = Path(OffloadHandle.from_record(ctx.state[STATE_KEY]).path)
    assert newest.stat().st_ino == inode and not first.exists()
    assert len(files(tmp_path)) == 2 and not list(tmp_path.rglob(".*.tmp"))
    back = store.read()
    assert back.generation == 3 and back.step == 6
    np.testing.assert_array_equal(back.noise.next(), state.noise.next())
    previous = [p for p in files(tmp_path) if p != newest]
    assert previous[0].read_bytes() == loaded  # the file the driver's handle named
