"""CorrNoiseFedAvg on Flower's simulation engine: round numbers and message TTLs the
learners see, and a run resumed from the server checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from flwr_corrnoise.apps.logreg import wait_for_nodes
from flwr_corrnoise.flower import CorrNoiseFedAvg
from flwr_corrnoise.flower.checkpoint import ServerCheckpoint
from tests.flower_helpers import simulate

pytestmark = pytest.mark.slow


def apps(log: Path, ckpt: Path, rounds: int, timeout: float) -> tuple[ServerApp, ClientApp]:
    """A learner that answers the constant update 1 and logs what its messages carry."""
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        with open(log, "a") as fh:
            fh.write(json.dumps({"round": int(msg.content["config"]["server-round"]),
                                 "ttl": msg.metadata.ttl}) + "\n")
        update = [np.ones_like(a) for a in msg.content["arrays"].to_numpy_ndarrays()]
        return Message(RecordDict({"arrays": ArrayRecord(update),
                                   "metrics": MetricRecord({"steps": 1.0})}), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, 2)
        strategy = CorrNoiseFedAvg(local_steps=1, learning_rate=0.5,
                                   checkpoint=ServerCheckpoint(ckpt, "k"))
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(3)]), num_rounds=rounds,
            timeout=timeout,
            evaluate_fn=lambda r, a: MetricRecord({"round": float(r),
                                                   "x": float(a.to_numpy_ndarrays()[0][0])}),
        )
        (ckpt / "final.json").write_text(json.dumps({
            "x": result.arrays.to_numpy_ndarrays()[0].tolist(),
            "rounds": [r["round"] for r in strategy.rounds],
            "evaluations": strategy.evaluations}))

    return server, client


def test_rounds_are_numbered_across_a_resume_and_messages_expire(tmp_path: Path) -> None:
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    simulate(*apps(log, ckpt, rounds=2, timeout=120.0), num_supernodes=2)
    first = json.loads((ckpt / "final.json").read_text())
    assert first["x"] == [-1.0] * 3  # two rounds of x − 0.5·1
    simulate(*apps(log, ckpt, rounds=4, timeout=120.0), num_supernodes=2)
    final = json.loads((ckpt / "final.json").read_text())
    assert final["x"] == [-2.0] * 3  # resumed from x = −1, not from 0
    assert final["rounds"] == [1, 2, 3, 4]
    assert [e["round"] for e in final["evaluations"]] == [0, 1, 2, 3, 4]
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(e["round"] for e in seen) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(0 < e["ttl"] <= 120.0 for e in seen)  # a round's messages expire with it
    # nothing left to run: the checkpoint is the final model
    simulate(*apps(log, ckpt, rounds=4, timeout=120.0), num_supernodes=2)
    assert json.loads((ckpt / "final.json").read_text())["x"] == [-2.0] * 3
    assert len(log.read_text().splitlines()) == 8
