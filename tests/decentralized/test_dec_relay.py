"""The Flower relay: a real simulation equals the in-process engine; nodes refuse bad inboxes,
out-of-order steps and weakening proposals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, RecordDict

from experiments.relay import relay_apps
from flwr_corrnoise.decentralized.engine import run_from_config
from flwr_corrnoise.decentralized.protocol import PrivacyProposalError
from flwr_corrnoise.flower.relay import InboxError, RelayNode, StepError
from flwr_corrnoise.persistence import StateLostError

from ..flower_helpers import simulate

CFG = {"algorithm": "chen-wang", "graph": "ring", "num-nodes": 4, "steps": 5, "dim": 5,
       "seed": 11, "task": "synthetic-logreg", "samples-per-node": 30, "noise-scale": 0.5,
       "init-scale": 1.0}


@pytest.mark.slow
def test_relay_simulation_equals_inprocess(tmp_path: Path) -> None:
    cfg = {**CFG, "results-dir": str(tmp_path / "res"), "record-dir": str(tmp_path / "rec")}
    simulate(*relay_apps(cfg), num_supernodes=cfg["num-nodes"])
    algo, ref = run_from_config(cfg, keep_outboxes=True)
    relayed = np.load(tmp_path / "res" / "relay.npz")["y"]  # [steps, n, dim]
    expected = np.stack([o["y"] for o in ref.outboxes])
    assert relayed.shape == expected.shape
    assert np.allclose(relayed, expected, rtol=0, atol=1e-10)
    for i in range(cfg["num-nodes"]):
        for t in range(cfg["steps"]):
            rec = np.load(tmp_path / "rec" / f"node{i}-step{t}.npz")
            # the relayed array is exactly the node's θ_t + ζ_t, and θ_t is the engine's
            assert np.array_equal(relayed[t, i], rec["theta"][0] + rec["noise"][0])
            assert np.allclose(rec["theta"][0], ref.decisions[t, i], rtol=0, atol=1e-10)
        final = np.load(tmp_path / "rec" / f"node{i}-step{cfg['steps']}.npz")
        assert np.allclose(final["theta"][0], ref.decisions[-1, i], rtol=0, atol=1e-10)
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    eps = algo.epsilon(ref.state, cfg["steps"])
    for label, values in eps.items():
        got = [summary["nodes"][str(i)][f"epsilon {label}"] for i in range(cfg["num-nodes"])]
        assert np.allclose(got, values)


@pytest.mark.parametrize("algorithm", ["chen-wang", "dsgd", "dola", "pdop"])
def test_relay_nodes_driven_by_hand_equal_inprocess(algorithm: str, simulated: None) -> None:
    """The relay's exact message flow without Ray: one RelayNode per graph node, each with
    its own Context, messages forwarded as ArrayRecords keyed "<sender>/<key>" (under the
    simulation rules: a run seed is only used in simulations)."""
    cfg = {**CFG, "algorithm": algorithm, "noise-scale": 0.3}
    _, ref = run_from_config(cfg, keep_outboxes=True)
    n, steps = cfg["num-nodes"], cfg["steps"]
    states = [RecordDict() for _ in range(n)]
    latest: dict[int, dict[str, np.ndarray]] = {}
    for r in range(steps + 1):
        new = {}
        for i in range(n):
            inbox = ArrayRecord()
            if r > 0:
                for j in ((i - 1) % n, (i + 1) % n):
                    for key, arr in latest[j].items():
                        inbox[f"{j}/{key}"] = Array(arr)
            node = RelayNode(_ctx(i, states[i]), cfg)
            new[i], _ = node.round(r, steps, inbox)
        if r < steps:
            latest = new
            got = np.stack([latest[i]["y"] for i in range(n)])
            assert np.allclose(got, ref.outboxes[r]["y"], rtol=0, atol=1e-10)


def _ctx(node: int, state: RecordDict | None = None, run_config: dict | None = None,
         node_config: dict | None = None) -> Context:
    return Context(run_id=1, node_id=100 + node,
                   node_config={"partition-id": node, "num-partitions": 4, **(node_config or {})},
                   state=state if state is not None else RecordDict(),
                   run_config=run_config or {})


def _inbox(senders: list[int], dim: int = 5, value: float = 0.0) -> ArrayRecord:
    rec = ArrayRecord()
    for j in senders:
        rec[f"{j}/y"] = Array(np.full(dim, value))
    return rec


def test_node_refuses_wrong_senders_replays_and_skips() -> None:
    state = RecordDict()
    node = RelayNode(_ctx(1, state), CFG)
    out, _ = node.round(0, 5, ArrayRecord())
    assert set(out) == {"y"} and out["y"].shape == (5,)
    node = RelayNode(_ctx(1, state), CFG)
    with pytest.raises(InboxError, match="differ from its neighbours"):
        node.round(1, 5, _inbox([0]))  # a dropped sender
    with pytest.raises(InboxError):
        node.round(1, 5, _inbox([0, 2, 3]))  # an extra one
    with pytest.raises(InboxError, match="non-finite"):
        node.round(1, 5, _inbox([0, 2], value=np.nan))
    with pytest.raises(StepError):
        node.round(2, 5, _inbox([0, 2]))  # skipped step
    with pytest.raises(StepError):
        node.round(0, 5, ArrayRecord())  # replayed step 0
    node.round(1, 5, _inbox([0, 2]))  # the right one still works: nothing was applied before
    with pytest.raises(StepError):
        node.round(1, 5, _inbox([0, 2]))  # replay


def test_node_refuses_weakening_proposals_and_settings() -> None:
    with pytest.raises(PrivacyProposalError, match="noise-scale"):
        RelayNode(_ctx(0, run_config={"privacy-noise-scale": 0.1}), CFG)
    RelayNode(_ctx(0, run_config={"privacy-noise-scale": 5.0}), CFG)  # stronger is fine
    # deployed: the run config's plain keys are a proposal, never the node's own settings
    with pytest.raises(PrivacyProposalError):
        RelayNode(_ctx(0, run_config={"noise-exponent": 0.0},
                       node_config={"state-dir": "/nonexistent-never-written"}), CFG)
    state = RecordDict()
    RelayNode(_ctx(2, state), CFG).round(0, 5, ArrayRecord())
    weaker = RelayNode(_ctx(2, state, node_config={"noise-scale": 0.1}), CFG)
    with pytest.raises(PrivacyProposalError, match="weaker"):
        weaker.round(1, 5, _inbox([1, 3]))


def test_deployed_node_keeps_state_on_disk(tmp_path: Path) -> None:
    nc = {"state-dir": str(tmp_path / "node1")}  # a real node: its seed from OS entropy
    out0, _ = RelayNode(_ctx(1, RecordDict(), node_config=nc), CFG).round(0, 5, ArrayRecord())
    # a restarted SuperNode: empty context.state, the state comes back from disk
    out1, _ = RelayNode(_ctx(1, RecordDict(), node_config=nc), CFG).round(1, 5, _inbox([0, 2]))
    assert out1["y"].shape == out0["y"].shape
    with pytest.raises(StepError):  # and it is not fooled into starting over
        RelayNode(_ctx(1, RecordDict(), node_config=nc), CFG).round(0, 5, ArrayRecord())
    (tmp_path / "node1" / "learner.state").unlink()
    with pytest.raises(StateLostError):
        RelayNode(_ctx(1, RecordDict(), node_config=nc), CFG).round(2, 5, _inbox([0, 2]))
