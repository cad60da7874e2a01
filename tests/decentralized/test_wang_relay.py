"""Wang, Yang, Yao, Song & Wan, "Revisiting Differentially Private Algorithms for Decentralized
Online Learning" over Flower's real simulation engine (the relay ServerApp) equals the in-process
engine for the same seeds: PD-FTGL, whose relayed messages are raw gossip iterates (not LDP), and
PD-OGD, whose relayed messages are its Laplace-noised iterates (local DP)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.relay import relay_apps
from flwr_corrnoise.decentralized.engine import run_from_config

from ..flower_helpers import simulate

#: 6 steps: two blocks of 3, the second one gossiping (each step is a Flower round trip
#: of every node: the relay's cost grows with the steps, not with the toy task)
CFG = {"algorithm": "pd-ftgl", "graph": "ring", "num-nodes": 4, "steps": 6, "seed": 7,
       "task": "synthetic-multiclass", "dim": 3, "classes": 3, "samples": 120, "clip": 0.5,
       "block-length": 3, "gossip-steps": 2, "h-scale": 0.05, "set-size": 2.0,
       "epsilon": 5.0}


@pytest.mark.slow
def test_pd_ftgl_relay_equals_inprocess(tmp_path: Path) -> None:
    cfg = {**CFG, "results-dir": str(tmp_path / "res"), "record-dir": str(tmp_path / "rec")}
    simulate(*relay_apps(cfg), num_supernodes=cfg["num-nodes"])
    algo, ref = run_from_config(cfg, keep_outboxes=True)
    relayed = np.load(tmp_path / "res" / "relay.npz")["d"]  # [steps, n, dim]
    expected = np.stack([o["d"] for o in ref.outboxes])
    assert relayed.shape == expected.shape == (6, 4, algo.dim)
    np.testing.assert_allclose(relayed, expected, rtol=0, atol=1e-10)
    # gossip messages flow only in blocks z ≥ 2 (steps 3..) and only for k < gossip-steps
    assert np.all(relayed[:3] == 0) and np.abs(relayed[3]).max() > 0 and np.all(relayed[5] == 0)
    for i in range(cfg["num-nodes"]):
        final = np.load(tmp_path / "rec" / f"node{i}-step{cfg['steps']}.npz")
        np.testing.assert_allclose(final["x"][0], ref.decisions[-1, i], rtol=0, atol=1e-10)
        np.testing.assert_array_equal(final["tree_noisy"][0], ref.state["tree_noisy"][i])
        for t in range(cfg["steps"]):
            rec = np.load(tmp_path / "rec" / f"node{i}-step{t}.npz")
            np.testing.assert_allclose(rec["x"][0], ref.decisions[t, i], rtol=0, atol=1e-10)
    assert np.abs(ref.decisions[-1]).max() > 1e-4  # it moved
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    eps = algo.epsilon(ref.state, cfg["steps"])
    for label in ("paper-thm-3.6", "exact-gossip-sensitivity"):
        got = [summary["nodes"][str(i)][f"epsilon {label}"] for i in range(cfg["num-nodes"])]
        np.testing.assert_allclose(got, eps[label])
    np.testing.assert_allclose(eps["paper-thm-3.6"], 5.0)


@pytest.mark.slow
def test_pd_ogd_relay_equals_inprocess_and_messages_are_noised(tmp_path: Path) -> None:
    cfg = {**CFG, "algorithm": "pd-ogd", "steps": 6, "step-scale": 0.5,
           "ogd-accounting": "per-datum", "results-dir": str(tmp_path / "res"),
           "record-dir": str(tmp_path / "rec")}
    simulate(*relay_apps(cfg), num_supernodes=cfg["num-nodes"])
    algo, ref = run_from_config(cfg, keep_outboxes=True)
    relayed = np.load(tmp_path / "res" / "relay.npz")["w"]
    np.testing.assert_allclose(relayed, np.stack([o["w"] for o in ref.outboxes]), rtol=0,
                               atol=1e-10)
    for i in range(cfg["num-nodes"]):
        for t in range(cfg["steps"]):
            rec = np.load(tmp_path / "rec" / f"node{i}-step{t}.npz")
            # PD-OGD is local DP: every relayed array is the node's iterate plus its noise
            np.testing.assert_array_equal(relayed[t, i], rec["w"][0] + rec["noise"][0])
            assert np.abs(rec["noise"][0]).max() > 0
        final = np.load(tmp_path / "rec" / f"node{i}-step{cfg['steps']}.npz")
        np.testing.assert_allclose(final["x"][0], ref.decisions[-1, i], rtol=0, atol=1e-10)
    assert algo.local_dp
