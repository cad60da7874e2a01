"""End to end on Flower's real transport: a SuperLink and 2 SuperNodes as real processes.

Each test starts its own ``flower-superlink`` and ``flower-supernode`` processes on free
localhost ports with their own ``FLWR_HOME`` (:class:`deploy.local.LocalDeployment`), crashes
one of them mid-run with SIGKILL, restarts it, and checks the run against an in-process
replay of the same rounds with the same noise (seeds, or the secure ChaCha20 keys, rewound):
the final model must match, and every learner's on-disk state must be exactly where an
uninterrupted stream would be — so no noise index was used twice. Every process is stopped
by its own pid (its session).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from deploy.local import APP, CONNECTION, LocalDeployment
from deploy.trusted_apps import (
    PUBLISHER,
    TRUSTED_ENTITIES,
    build_fab,
    generate_publisher_key,
    sign_fab,
)
from flwr_corrnoise.aggregation import aggregate
from flwr_corrnoise.apps.logreg_task import LogRegSetup, initial_parameters, logistic_gradient
from flwr_corrnoise.flower.checkpoint import CHECKPOINT_FILE
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.learner import local_round
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.persistence import STATE_FILE, StateStore
from flwr_corrnoise.secure_noise import ChaCha20Gaussian
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.streams import NoiseStream

from .test_trusted_apps import (
    BAD_SIGNATURE,
    UNSIGNED,
    refusals,
    start_run,
    variant,
    wait_for,
)

pytestmark = [
    pytest.mark.slow,
    # `flwr build` (flwr.cli.build) uses a pathspec pattern class that pathspec deprecates
    pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning"),
    # Flower's executables of this environment (deploy.local starts them from there)
    pytest.mark.skipif(not (Path(sys.executable).parent / "flower-superlink").exists(),
                       reason="flower-superlink not installed beside sys.executable"),
]

#: three rounds are enough for each crash test: one before the crash, one that the crash
#: interrupts, one after the restart (each round of a real deployment costs ~10 s: every
#: SuperNode starts a ClientApp process, and Flower's SuperNode and ServerApp poll every 3 s)
SEED, ROUNDS, TAU = 11, 3, 2
#: two SuperNodes: one to crash and one that goes on (each more costs its SuperNode,
#: SuperExec and a ClientApp process a round, ≈ 25 s of CPU a test, measured in a cgroup)
NODES = 2
SETUP = LogRegSetup(num_learners=NODES, dim=6, rounds=ROUNDS, tau=TAU, mechanism="blt",
                    seed=SEED, data_seed=4, test_size=100)
#: what each SuperNode's operator sets. No seed: a learner on a real SuperNode draws it
#: from OS entropy; the test reads it back from the learner's own state to replay the run
LEARNER = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-3, "horizon": ROUNDS * TAU}


def node_config(i: int) -> dict[str, Any]:
    return dict(LEARNER)


def secure_node_config(i: int) -> dict[str, Any]:
    """The learners opt in to secure noise (ChaCha20 keyed from OS entropy, no seed)."""
    return {**LEARNER, "secure-noise": True}


def run_config(out: Path, **extra: Any) -> dict[str, Any]:
    return {"num-learners": NODES, "dim": SETUP.dim, "num-server-rounds": ROUNDS,
            "local-steps": TAU, "mechanism": "blt", "seed": SEED, "data-seed": 4,
            "test-size": 100, "results-dir": str(out), **extra}


def learner_state(dep: LocalDeployment, i: int) -> LearnerState | None:
    path = dep.state_dir(i) / STATE_FILE
    return LearnerState.from_bytes(path.read_bytes()) if path.exists() else None


def wait_until(predicate, timeout: float, what: str, dep: LocalDeployment) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-1500:]
                             for p in sorted(dep.logs.glob("*.log")))
            raise TimeoutError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def finish(dep: LocalDeployment, run, timeout: float = 300) -> dict[str, Any]:
    try:
        run.wait(timeout=timeout)
    finally:
        log = (dep.logs / "flwr-run.log").read_text(errors="replace")
    assert run.returncode == 0, log[-4000:]
    out = dep.workdir / "results"
    wait_until(lambda: (out / "summary.json").exists(), 60, "summary.json", dep)
    return json.loads((out / "summary.json").read_text())


def ledger(dep: LocalDeployment, i: int) -> list[dict[str, Any]]:
    """Learner ``i``'s effective ledger lines, checked to tile its noise indices: each
    round's steps start where the previous round's ended, from index 0 — no index twice."""
    lines = StateStore(dep.state_dir(i)).ledger()
    assert [e["first-step"] for e in lines] == [TAU * k for k in range(len(lines))]
    assert all(e["steps"] == TAU for e in lines)
    state = learner_state(dep, i)
    assert state is not None and state.step == TAU * len(lines)
    return lines


def rewound(
    deployed: LearnerState, settings: PrivacySettings, shapes: list[tuple[int, ...]]
) -> LearnerState:
    """The deployed learner at step 0, drawing the same noise: from its seed, or — with
    secure noise — from its ChaCha20 key (kept in the state on disk, never sent; there is no
    seed), whose keystream at block 0 is the first draw. A test-only rewind: a learner
    itself never reuses noise."""
    stream = deployed.noise
    assert stream is not None
    if not stream.secure:  # PCG64 from the seed the state keeps (never sent)
        return LearnerState.create(settings, shapes, deployed.seed)
    assert deployed.seed is None
    key, _ = stream._rng.state  # type: ignore[union-attr]
    fresh = NoiseStream(settings.mechanism, settings.horizon, shapes, stream.std,
                        ChaCha20Gaussian(key))  # type: ignore[arg-type]
    return LearnerState(noise=fresh, binding=deployed.binding)


def replay(
    participation: list[list[int]], trained: Mapping[int, list[int]],
    deployed: list[LearnerState],
) -> tuple[list[np.ndarray], list[LearnerState]]:
    """The run in process. ``trained[i]``: the (1-based) rounds learner ``i`` trained in,
    from its ledger, once per time it trained; ``participation[r]``: the learners whose
    update round ``r + 1`` aggregated. A learner can train in a round without being
    aggregated (it crashed after its state was written, its reply came too late, or the
    server died and ran the round again): those steps are spent, and a round run again
    after a server crash starts from the same checkpointed model."""
    defaults = LogRegSetup().to_run_config()
    settings = settings_from_config({**defaults, **LEARNER})
    grads = [logistic_gradient(SETUP, i) for i in range(NODES)]
    x = initial_parameters(SETUP)
    shapes = [p.shape for p in x]
    states = [rewound(deployed[i], settings, shapes) for i in range(NODES)]
    for r, chosen in enumerate(participation):
        assert set(chosen) <= {i for i in range(NODES) if r + 1 in trained[i]}
        updates = []
        for i in range(NODES):
            for _ in range(trained[i].count(r + 1)):  # the last of them may be aggregated
                res = local_round(x, grads[i], states[i], settings, TAU, SETUP.eta)
                states[i] = res.state
            if i in chosen:
                updates.append(res.update)
        x = aggregate(x, updates, SETUP.eta, SETUP.eta_g, TAU)
    return x, states


def check_against_replay(dep: LocalDeployment, summary: Mapping[str, Any]) -> None:
    participation = summary["participation"]
    assert len(participation) == ROUNDS
    trained = {i: [int(e["server-round"]) for e in ledger(dep, i)] for i in range(NODES)}
    deployed = [learner_state(dep, i) for i in range(NODES)]
    x, states = replay(participation, trained, deployed)  # type: ignore[arg-type]
    final = np.load(dep.workdir / "results" / "final_model.npy")
    np.testing.assert_allclose(final, x[0], atol=1e-10, rtol=0)
    assert_streams_continue(dep, states)


def assert_streams_continue(dep: LocalDeployment, states: list[LearnerState]) -> None:
    """Each learner's state on disk is the replayed one: same step (noise index), same data
    position, same noise-stream state — i.e. the restart continued the sequence."""
    for i, expected in enumerate(states):
        got = learner_state(dep, i)
        assert got is not None
        assert (got.step, got.position, got.rounds) == (
            expected.step, expected.position, expected.rounds), f"learner {i}"
        assert got.noise is not None and expected.noise is not None
        assert got.noise.to_bytes() == expected.noise.to_bytes(), f"learner {i}"


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="corrnoise-deploy-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_tls_deployment_survives_a_supernode_crash(workdir: Path) -> None:
    """TLS + SuperNode auth, and SuperNodes that run only the app signed by the trusted
    publisher key (``--trusted-entities``): three untrusted apps are refused first
    (:func:`refuse_untrusted_apps`), then the signed app runs and SuperNode 1 is SIGKILLed
    after its first round and restarted with the same key, trusted entities and state
    directory once the SuperLink has declared it gone.

    Most of this test's time is Flower noticing the crash: the SuperLink declares a node
    unavailable once it has missed two heartbeats (Flower 1.41: a 30 s interval, not
    configurable), and refuses a restarted SuperNode with the same key until then."""
    ckpt = workdir / "checkpoint"
    with LocalDeployment(workdir, NODES, tls=True, trusted_apps=True,
                         node_config=secure_node_config) as dep:
        untrusted = refuse_untrusted_apps(dep, workdir)
        # min-learners = every node: once the SuperLink has seen node 1 go, the next round
        # waits for it to come back, so the restarted learner is sure to train again
        run = dep.run_app(run_config(workdir / "results", **{"round-timeout": 90.0,
                                                             "min-learners": NODES,
                                                             "checkpoint-dir": str(ckpt)}))
        wait_until(lambda: (s := learner_state(dep, 1)) is not None and s.step >= TAU,
                   240, "learner 1 to finish a round", dep)
        offsets = log_sizes(dep)
        dep.kill_node(1)
        killed_at = learner_state(dep, 1)
        # Node 1 stays down until the ServerApp has seen it go. Restarted earlier, it could
        # be admitted again before the ServerApp's next poll saw it offline, and that round
        # would wait out its 90 s timeout for a reply the new process never sends. Which
        # sign comes depends on where the kill lands: killed inside a round (its reply not
        # yet sent), that round ends with the SuperLink's "node unavailable" reply for it
        # (checkpointed); killed between rounds, the next round's sampling waits for a
        # second node ("1 connected (minimum required: 2)") and no round ever misses it.
        waiting = f"{NODES - 1} connected (minimum required: {NODES})"
        wait_until(lambda: unavailable_rounds(ckpt) or logged_since(dep, offsets, waiting),
                   240, "the ServerApp to see node 1 gone", dep)
        dep.restart_node(1)
        summary = finish(dep, run)
        missed = unavailable_rounds(ckpt)
        assert all(p.poll() is None for p in dep.nodes.values())
        for i in range(NODES):  # the signed run was never refused (the logs append)
            assert set(refusals(dep, i)) == set(untrusted), f"SuperNode {i}"
    assert killed_at is not None and killed_at.step >= TAU
    # the round that lost node 1 went on without it
    assert all(1 not in summary["participation"][r - 1] for r in missed)
    check_against_replay(dep, summary)
    assert len(ledger(dep, 1)) > killed_at.step // TAU  # it trained again after the restart


def refuse_untrusted_apps(dep: LocalDeployment, workdir: Path) -> dict[int, str]:
    """SuperNodes run only app code their operator trusts (``--trusted-entities``; the
    signature checks themselves: tests/flower/test_trusted_apps.py). Before the signed app
    runs, three runs are started that every SuperNode must refuse with nothing installed or
    written: an unsigned FAB, a FAB modified after signing, and a FAB signed by an untrusted
    key claiming the trusted key's id. Their run ids → the refusal each SuperNode logged.

    Why on this deployment: a TLS deployment with trusted apps costs its processes'
    start-up and polling (≈ 55 s of CPU measured in a cgroup); the crash test already
    starts one, so the refusals are shown on it instead of on a second one."""
    cfg = {**run_config(workdir / "untrusted-results"), "num-server-rounds": 1,
           "round-timeout": 30.0}
    rogue_key = workdir / "rogue" / f"{PUBLISHER}.key"
    generate_publisher_key(rogue_key.parent)
    assert dep.registry is not None
    kid = next(iter(yaml.safe_load((dep.trust / TRUSTED_ENTITIES).read_text())))
    good = sign_fab(build_fab(APP), dep.trust / f"{PUBLISHER}.key")
    tampered = build_fab(variant(APP, workdir / "tampered", "0.1.1", 1000.0))
    rogue = build_fab(variant(APP, workdir / "rogue-app", "0.1.2", 1000.0))
    untrusted = {
        # uploaded by `flwr run <dir>`: no verification records at all
        str(APP): UNSIGNED,
        # modified after signing: the genuine FAB's signature does not match its bytes
        dep.registry.publish(tampered, [good]): BAD_SIGNATURE,
        # signed by a key the operators never trusted, claiming the trusted key's id
        dep.registry.publish(rogue, [sign_fab(rogue, rogue_key, public_key_id=kid)]):
            BAD_SIGNATURE,
    }
    runs = {start_run(dep, app, cfg): (app, reason) for app, reason in untrusted.items()}
    nodes = range(len(dep.nodes))
    wait_for(lambda: all(set(runs) <= set(refusals(dep, i)) for i in nodes), 75,
             f"every SuperNode to refuse runs {sorted(runs)}", dep)
    for run_id, (app, reason) in runs.items():
        assert all(refusals(dep, i)[run_id] == reason for i in nodes), app
        dep.flwr("stop", str(run_id), CONNECTION)  # its ServerApp, if still running
    # nothing of an untrusted app ran: no learner state, no ledger
    assert not any(dep.state_dir(i).exists() for i in nodes)
    return {run_id: reason for run_id, (_, reason) in runs.items()}


def test_insecure_deployment_resumes_after_a_superlink_crash(workdir: Path) -> None:
    """Insecure mode (local development); the SuperLink is SIGKILLed after round 1 is
    checkpointed, restarted on the same database, and the run started again resumes."""
    ckpt = workdir / "checkpoint"
    cfg = run_config(workdir / "results", **{"checkpoint-dir": str(ckpt),
                                             "round-timeout": 30.0})
    with LocalDeployment(workdir, NODES, tls=False, node_config=node_config) as dep:
        run = dep.run_app(cfg)

        def checkpointed_round() -> int:
            try:
                return json_round(ckpt / CHECKPOINT_FILE)
            except (OSError, ValueError):
                return 0

        wait_until(lambda: checkpointed_round() >= 1, 240, "round 1's checkpoint", dep)
        dep.kill_superlink()
        crashed_after = checkpointed_round()
        dep.kill(run)
        dep.start_superlink()
        for i in range(NODES):  # a SuperNode that gave up reconnecting is restarted
            if dep.nodes[i].poll() is not None:
                dep.start_node(i)
        run = dep.run_app(cfg)
        summary = finish(dep, run)
    assert crashed_after < ROUNDS
    history = (workdir / "results" / "history.csv").read_text().splitlines()
    assert [int(float(line.split(",")[0])) for line in history[1:]] == list(range(ROUNDS + 1))
    check_against_replay(dep, summary)


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """A checkpoint file's metadata (round, per-round log), without checking whose it is."""
    from flwr_corrnoise.arraypack import unpack

    return json.loads(unpack(path.read_bytes())["meta"].tobytes())


def json_round(path: Path) -> int:
    """The round number in a checkpoint file."""
    return int(checkpoint_meta(path)["round"])


def log_sizes(dep: LocalDeployment) -> dict[Path, int]:
    """Every log file's size now, so that :func:`logged_since` reads only what follows."""
    return {p: p.stat().st_size for p in dep.logs.glob("*.log")}


def logged_since(dep: LocalDeployment, offsets: dict[Path, int], text: str) -> bool:
    """Whether any log got a line containing ``text`` after ``offsets`` were taken."""
    for path in dep.logs.glob("*.log"):
        with open(path, "rb") as f:
            f.seek(offsets.get(path, 0))
            if text.encode() in f.read():
                return True
    return False


def unavailable_rounds(ckpt: Path) -> list[int]:
    """The checkpointed rounds in which the SuperLink answered for a node with Flower's
    "node unavailable" error (it had missed its heartbeats)."""
    from flwr.common.constant import ErrorCode

    try:
        rounds = checkpoint_meta(ckpt / CHECKPOINT_FILE)["rounds"]
    except (OSError, ValueError, KeyError):
        return []
    return [int(r["round"]) for r in rounds
            if any(e["code"] == ErrorCode.NODE_UNAVAILABLE for e in r["errors"])]
