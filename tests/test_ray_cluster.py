"""The simulation attaches to an existing multi-node-capable Ray cluster.

We start a real head node with ``ray start --head --block`` in its own process group,
point Flower's Ray backend at it (``init_args = {"address": ...}``, see docs/flower.md),
check that the virtual learners ran *on that cluster* (each records the GCS address of
the cluster hosting it) and that the run produced the same model as the in-process
engine, then stop exactly the process group we started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from experiments.logreg import run_logreg_inprocess
from flwr_corrnoise.apps.logreg_task import LogRegSetup

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"Ray head did not open port {port}")


RAY = Path(sys.executable).parent / "ray"  # this environment's, not whatever PATH finds


@pytest.mark.skipif(not RAY.exists(), reason="ray CLI not installed beside sys.executable")
def test_simulation_on_existing_ray_cluster(tmp_path: Path) -> None:
    from ray._private.services import get_node_ip_address

    port = free_port()
    env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    # Ray's unix sockets live under the temp dir: keep its path short (108-byte limit)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    head = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
         "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        start_new_session=True,
    )
    address = f"{get_node_ip_address()}:{port}"
    try:
        wait_port(port)
        out = tmp_path / "out"
        out.mkdir()
        job = subprocess.run(
            [sys.executable, "-m", "tests.ray_cluster_job", address, str(out)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
        )
        assert job.returncode == 0, job.stderr[-3000:]
        gcs = {p.read_text() for p in out.glob("gcs-*.txt")}
        assert gcs == {address}
        final = np.load(out / "final_model.npy")
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # exactly the processes we started
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
    setup = LogRegSetup(num_learners=3, dim=6, rounds=3, tau=2, mechanism="toeplitz",
                        test_size=100, seed=5)
    res = run_logreg_inprocess(setup)
    np.testing.assert_allclose(final, res.params[0], atol=1e-10, rtol=0)
