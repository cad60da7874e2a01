"""The simulation attaches to an existing multi-node-capable Ray cluster.

The cluster is a real head node started with ``ray start --head --block`` in its own
process group (:class:`tests.flower_helpers.RayHead`; the same head this test process's
other simulations run on, stopped by its process group when the session ends). A separate
driver process points Flower's Ray backend at it (``init_args = {"address": ...}``, see
docs/flower.md); the test checks that the virtual learners ran *on that cluster* (each
records the GCS address of the cluster hosting it) and that the run produced the same model
as the in-process engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.logreg import run_logreg_inprocess
from flwr_corrnoise.apps.logreg_task import LogRegSetup

from ..flower_helpers import RAY, ray_head

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not RAY.exists(), reason="ray CLI not installed beside sys.executable")
def test_simulation_on_existing_ray_cluster(tmp_path: Path) -> None:
    head = ray_head()
    env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    out = tmp_path / "out"
    out.mkdir()
    job = subprocess.run(
        [sys.executable, "-m", "tests.ray_cluster_job", head.address, str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert head.proc.poll() is None  # the run neither needed nor stopped another cluster
    files = sorted(out.glob("gcs-*.txt"))
    assert [p.name for p in files] == [f"gcs-{i}.txt" for i in range(3)]  # every learner
    gcs = {p.read_text() for p in files}
    assert gcs == {head.address}
    final = np.load(out / "final_model.npy")
    setup = LogRegSetup(num_learners=3, dim=6, rounds=3, tau=2, mechanism="toeplitz",
                        test_size=100, seed=5)
    res = run_logreg_inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], atol=1e-10, rtol=0)
