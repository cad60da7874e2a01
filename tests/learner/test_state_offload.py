"""Offloaded simulation states (:mod:`flwr_corrnoise.state_offload`): a handle in
``context.state``, the buffers in a file, and the privacy rules of a stored state — no
rollback, no clone, never lost silently, a round that released nothing redone."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, RecordDict

from flwr_corrnoise import arraypack, state_offload
from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import StateIntegrityError, StateLostError
from flwr_corrnoise.settings import PrivacySettings
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


def handle_of(ctx: Context) -> OffloadHandle:
    handle = OffloadHandle.from_record(ctx.state[STATE_KEY])
    assert handle is not None
    return handle


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes: a refused load must change nothing."""
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_previous_handle_put_back_is_refused(tmp_path: Path) -> None:
    """The driver's handle put back one generation (its file still on disk, its MAC
    right): the folder holds a newer committed file, whose round may have been released,
    so the learner refuses (4104) before anything is released, changing nothing. The same
    holds when an actor died after its commit and the new handle never reached the driver:
    a committed file counts as released, as a state-dir's committed round does."""
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
    store.write(state, {})
    previous = ctx.state[STATE_KEY]
    advance(state)
    store.write(state, {})
    assert len(files(tmp_path)) == 2  # the loaded file stays until the handle moves on
    current = ctx.state[STATE_KEY]
    ctx.state[STATE_KEY] = previous  # put back
    before = snapshot(tmp_path)
    with pytest.raises(StateIntegrityError, match="holds generation 2, committed after it"):
        store.read()
    assert snapshot(tmp_path) == before
    ctx.state[STATE_KEY] = current
    back = store.read()
    assert back.generation == 2 and back.step == 3
    for _ in range(3):  # the commit after a load keeps the loaded file and its own only
        advance(back)
        store.write(back, {})
        assert len(files(tmp_path)) == 2
        back = store.read()
    assert state_offload.read(handle_of(ctx), tmp_path / "run-5" / "node-1" / STATE_KEY)


def test_another_learners_handle_is_refused(tmp_path: Path) -> None:
    """Learner b's whole handle (path, identity, generation, MAC: all of them right for b's
    file) in learner a's context.state: its file is not in a's folder, so a refuses before
    opening it. Without the folder check a would continue b's noise stream."""
    a, b = context(node_id=1), context(node_id=2)
    for ctx in (a, b):
        storage(ctx, tmp_path).write(LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    foreign = b.state[STATE_KEY]
    assert storage(b, tmp_path).read() is not None  # b's handle is fine for b
    a.state[STATE_KEY] = foreign
    with pytest.raises(StateIntegrityError, match="not a state file of generation 1 in the "
                                                  "learner's own folder"):
        storage(a, tmp_path).read()
    # the same handle in a context of another run of the same node
    other_run = context(node_id=2, run_id=6)
    other_run.state[STATE_KEY] = foreign
    with pytest.raises(StateIntegrityError, match="own folder"):
        storage(other_run, tmp_path).read()
    # a path that walks out of the folder and back into b's ("..") resolves to b's folder
    sneaky = handle_of(b)
    own = tmp_path / "run-5" / "node-1" / STATE_KEY
    a.state[STATE_KEY] = ConfigRecord({**sneaky.to_record(), "offloaded": str(
        own / ".." / ".." / "node-2" / STATE_KEY / Path(sneaky.path).name)})
    with pytest.raises(StateIntegrityError, match="own folder"):
        storage(a, tmp_path).read()


def test_an_edited_file_is_refused_by_its_mac(tmp_path: Path) -> None:
    """An older generation's file with its generation field rewritten to the current one,
    put under the current handle's name: same learner, same identity, same size, the
    generation the handle names — everything but the MAC agrees. Refused."""
    ctx = context()
    store = storage(ctx, tmp_path)
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
    store.write(state, {})
    old = Path(handle_of(ctx).path).read_bytes()
    advance(state)
    store.write(state, {})
    current = handle_of(ctx)
    arrays = arraypack.unpack(old)
    arrays["generation"] = np.array(2, dtype=np.asarray(arrays["generation"]).dtype)
    forged = arraypack.pack(arrays)
    # the injected fault: passes every check the handle had before it carried a MAC
    assert len(forged) == current.size
    assert str(arraypack.unpack(forged)["identity"]) == current.identity
    assert int(arraypack.unpack(forged)["generation"]) == current.generation
    Path(current.path).write_bytes(forged)
    with pytest.raises(StateIntegrityError, match="fail the MAC"):
        store.read()
    # one flipped bit anywhere is refused as well
    data = bytearray(Path(current.path).read_bytes())
    data[len(data) // 2] ^= 1
    Path(current.path).write_bytes(bytes(data))
    with pytest.raises(StateIntegrityError, match="fail the MAC"):
        store.read()


def test_a_handle_without_a_mac_is_refused(tmp_path: Path) -> None:
    ctx = context()
    store = storage(ctx, tmp_path)
    store.write(LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    record = {k: v for k, v in handle_of(ctx).to_record().items()
              if k not in ("mac", "mac-key", "mac-tag")}
    ctx.state[STATE_KEY] = ConfigRecord(record)
    with pytest.raises(StateIntegrityError, match="carries no MAC"):
        store.read()


def test_a_handle_outside_a_simulation_is_refused(tmp_path: Path) -> None:
    """A learner that does not offload (not a simulation: no policy) has no folder a
    handle may name: a handle in its context.state is refused, its file never opened."""
    ctx = context()
    storage(ctx, tmp_path).write(LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    with pytest.raises(StateIntegrityError, match="does not offload"):
        LearnerStorage(ctx, STATE_KEY, None, None).read()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_offloaded_files_are_0600_in_0700_folders(tmp_path: Path) -> None:
    """The files hold the learners' noise keys: 0600, every folder the library makes 0700
    (run, node, key), whatever the umask; a loose folder left by an older version is
    tightened."""
    old_umask = os.umask(0o022)
    try:
        ctx = context()
        store = storage(ctx, tmp_path)
        state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
        store.write(state, {})
        run = tmp_path / "run-5"
        for folder in (run, run / "node-1", run / "node-1" / STATE_KEY):
            assert mode(folder) == 0o700, folder
        for path in (*files(tmp_path), run / state_offload.RUN_MARKER):
            assert mode(path) == 0o600, path
        os.chmod(run / "node-1", 0o755)
        for _ in range(3):  # the reused file of two generations back stays 0600
            state = store.read()
            advance(state)
            store.write(state, {})
        assert mode(run / "node-1") == 0o700
        assert [mode(p) for p in files(tmp_path)] == [0o600, 0o600]
    finally:
        os.umask(old_umask)


def test_the_default_folder_is_private_to_the_user(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a world-readable shared temp dir: ``<temp dir>/flwr-corrnoise-states-<uid>``,
    0700; a symlink or a folder of another user in its place is refused (4104)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = state_offload.default_directory()
    assert root == tmp_path / f"flwr-corrnoise-states-{os.getuid()}"
    ctx = context()
    LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy("on")).write(
        LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    assert mode(root) == 0o700 and Path(handle_of(ctx).path).is_relative_to(root)
    shutil.rmtree(root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.symlink_to(elsewhere)  # planted by someone to redirect the states
    fresh = context(node_id=2)
    with pytest.raises(StateLostError, match="not a directory"):
        LearnerStorage(fresh, STATE_KEY, None, OffloadPolicy("on")).write(
            LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})
    assert STATE_KEY not in fresh.state and not list(elsewhere.iterdir())
    root.unlink()
    if os.getuid() == 0:  # a folder of another user (only root can make one here)
        root.mkdir(mode=0o777)
        os.chown(root, 65534, 65534)
        with pytest.raises(StateLostError, match="belongs to another user"):
            LearnerStorage(fresh, STATE_KEY, None, OffloadPolicy("on")).write(
                LearnerState.create(SETTINGS, [(DIM,)], seed=3), {})


def test_a_folder_another_machine_does_not_see_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run marker must be the same on every machine of the Ray cluster: a peer whose
    folder (as that machine resolves it) has no marker, or another one, fails the first
    commit — in round 1 — with a reason that says what to do; nothing is written. A peer
    that sees the marker passes. ``peers`` stands for the Ray nodes here; the real Ray
    check is ``test_offload_on_two_ray_nodes_without_a_shared_folder_fails``."""
    policy = OffloadPolicy("on", tmp_path / "shared")
    unshared = OffloadPolicy("on", tmp_path / "other-machine")  # the peer's own folder
    state_offload.private_dir(tmp_path / "shared")
    state_offload.private_dir(policy.run_folder(7))
    token = state_offload.run_marker(policy.run_folder(7))
    assert state_offload.marker_here(policy, 7) == token
    assert state_offload.marker_here(unshared, 7) is None  # no marker over there

    def blind(_policy: OffloadPolicy, run_id: int) -> dict[str, str | None]:
        return {"node-b (10.0.0.2)": state_offload.marker_here(unshared, run_id)}

    with pytest.raises(StateLostError, match=r"not shared by every machine.*node-b \(10.0.0.2\)"):
        state_offload.check_shared(policy, 7, blind)
    state_offload.private_dir(unshared.root())
    state_offload.private_dir(unshared.run_folder(7))
    state_offload.run_marker(unshared.run_folder(7))  # its own marker: another token
    with pytest.raises(StateLostError, match="state-offload-dir to a folder every machine"):
        state_offload.check_shared(policy, 7, blind)
    state_offload.check_shared(policy, 7, lambda p, r: {"node-b": state_offload.marker_here(
        p, r)})  # the same folder: seen
    # through the learner: its first commit in this process refuses, nothing written
    ctx = context(run_id=8)
    learner = LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy("on", tmp_path / "shared"))
    monkeypatch.setattr(state_offload, "ray_peers", lambda p, r: {"node-b": None})
    state = LearnerState.create(SETTINGS, [(DIM,)], seed=3)
    with pytest.raises(StateLostError, match="not shared"):
        learner.write(state, {})
    assert state.generation == 0 and STATE_KEY not in ctx.state and not files(tmp_path)


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


@pytest.mark.slow
def test_a_simulation_whose_learner_lost_its_state_fails_in_that_round(tmp_path: Path) -> None:
    """Flower's real simulation engine, states offloaded: in round 3 learner 0's handle is
    put back to round 1's (its file still on disk). The learner refuses (4104) and the run
    fails in round 3 with RunFailedError naming the node and the code — it used to go on
    without that learner (and, before the handles were checked, to continue the older
    state)."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from flwr_corrnoise.apps.logreg import logreg_apps
    from flwr_corrnoise.apps.logreg_task import LogRegSetup, logistic_gradient
    from flwr_corrnoise.flower import RunFailedError, make_client_app

    from ..flower_helpers import simulate

    setup = LogRegSetup(num_learners=2, dim=6, rounds=4, tau=2, eta=0.2, mechanism="toeplitz",
                        test_size=50, seed=7, data_seed=3)
    server_app, _ = logreg_apps(setup, str(tmp_path / "results"), progress=False,
                                regret=False)
    inner = make_client_app(
        lambda ctx: logistic_gradient(setup, int(ctx.node_config["partition-id"])),
        config_defaults={**setup.to_run_config(), "state-offload": "on",
                         "state-offload-dir": str(tmp_path / "offload")})
    outer = ClientApp()

    @outer.train()
    def train(msg: Message, ctx: Context) -> Message:
        if int(ctx.node_config["partition-id"]) == 0 and STATE_KEY in ctx.state:
            if int(msg.content["config"]["server-round"]) == 3:
                ctx.state[STATE_KEY] = ctx.state["test-previous"]  # the fault
            ctx.state["test-previous"] = ConfigRecord(dict(ctx.state[STATE_KEY]))
        return inner(msg, ctx)

    with pytest.raises(RunFailedError, match=r"round 3: the learner on node \d+ refused "
                                             r"with code 4104 .*holds generation 2"):
        simulate(server_app, outer, setup.num_learners)
    assert len(files(tmp_path / "offload")) == 4  # two per learner: nothing released after


#: the driver of the two-node test: a learner pinned to the head node prepares its folder
#: as a simulated learner's first commit does, with the default folder (each machine's own
#: temp dir) and with one folder both nodes see; prints what each case gave
TWO_NODES_DRIVER = r"""
import json, sys, time
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 180
while len([n for n in ray.nodes() if n["Alive"]]) < 2:  # the head and the new node
    assert time.monotonic() < deadline, "the second Ray node did not join"
    time.sleep(0.5)
nodes = [n for n in ray.nodes() if n["Alive"]]
head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])


@ray.remote(num_cpus=0)
def temp_dir():
    import tempfile
    return tempfile.gettempdir()


@ray.remote(num_cpus=0)
def first_commit(directory, run_id):
    from pathlib import Path
    from flwr_corrnoise import state_offload
    from flwr_corrnoise.persistence import StateLostError
    policy = state_offload.OffloadPolicy("on", Path(directory) if directory else None)
    try:
        policy.prepare(run_id, 1, "flwr-corrnoise")
    except StateLostError as err:
        return "refused: " + str(err)
    return "ok"


@ray.remote(num_cpus=0)
def remove_default_run_folder(run_id):
    import shutil
    from flwr_corrnoise import state_offload
    shutil.rmtree(state_offload.OffloadPolicy("on", None).run_folder(run_id),
                  ignore_errors=True)


def on(node, task, *args):
    return ray.get(task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(*args), timeout=300)


got = {
    "temp": sorted(on(n["NodeID"], temp_dir) for n in nodes),
    "default": on(head, first_commit, None, int(sys.argv[3])),
    "shared": on(head, first_commit, sys.argv[2], int(sys.argv[4])),
}
on(head, remove_default_run_folder, int(sys.argv[3]))  # the head's temp dir is not ours
print(json.dumps(got))
"""


@pytest.mark.slow
def test_offload_on_two_ray_nodes_without_a_shared_folder_fails(tmp_path: Path) -> None:
    """A real two-node Ray cluster on this machine, each node with its own temp dir (as
    two machines have): a learner's first commit with the default offload folder — which
    each node resolves to its own temp dir — is refused, naming the other node; with a
    folder both nodes see it goes on. What makes an offloaded run on a cluster without a
    shared folder fail in round 1 (its learners answer 4104, and
    ``test_a_simulation_whose_learner_lost_its_state_fails_in_that_round`` shows a 4104
    failing the run).

    The cluster is this test worker's Ray head (``tests/flower_helpers.ray_head``, the
    temp dir it was started with) and a second node started here with a temp dir of its
    own, stopped at the end: a second head of its own cost ≈ 15–20 s of CPU. The run ids
    are fresh random ones, so no marker another run left in the head's temp dir counts."""
    import json
    import secrets
    import signal
    import subprocess
    import sys

    from ..flower_helpers import RAY, free_port, ray_head

    if not RAY.exists():
        pytest.skip("ray CLI not installed beside sys.executable")
    temps = {name: tmp_path / name for name in ("machine-b", "shared")}
    for path in temps.values():
        path.mkdir()
    head = ray_head()
    ray_b = tempfile.mkdtemp(prefix="rayb", dir="/tmp")  # Ray's sockets: a short path
    worker = subprocess.Popen(
        [str(RAY), "start", "--address", head.address, "--num-cpus", "1", "--block",
         "--temp-dir", ray_b, "--disable-usage-stats", "--min-worker-port", "0",
         "--max-worker-port", "0", "--dashboard-agent-listen-port", str(free_port()),
         "--include-log-monitor=false"],
        env={**os.environ, "TMPDIR": str(temps["machine-b"]),
             "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_enable_worker_prestart": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    runs = [secrets.randbits(62) for _ in range(2)]
    try:
        job = subprocess.run(
            [sys.executable, "-c", TWO_NODES_DRIVER, head.address, str(temps["shared"]),
             *map(str, runs)],
            capture_output=True, text=True, timeout=400,
            env={**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"})
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
        shutil.rmtree(ray_b, ignore_errors=True)
    assert job.returncode == 0, job.stderr[-3000:]
    got = json.loads(job.stdout.strip().splitlines()[-1])
    assert len(got["temp"]) == 2 and str(temps["machine-b"]) in got["temp"]
    assert len(set(got["temp"])) == 2  # the head's own temp dir is another one
    assert got["default"].startswith("refused: ") and "not shared by every machine" in \
        got["default"] and "1 node(s) do not see this run's marker" in got["default"]
    assert got["shared"] == "ok"
    assert (temps["shared"] / f"run-{runs[1]}" / state_offload.RUN_MARKER).exists()
