"""Helpers for tests that run Flower's real simulation engine: in this process by default
(:class:`InProcessBackend`: Flower's runtime without Ray), on Ray where the test's point is
Ray (:func:`backend_config`).

Why a Ray head per test process: ``run_simulation`` on a fresh local Ray starts and stops a
whole Ray instance (GCS, raylet, agents) every run — about 10 s of start-up on 2 cores, more
than the toy run itself. :func:`backend_config` instead points Flower's Ray backend at one
head node per test process (``ray start --head --block``, started on first use and stopped by its
process group when the session ends), as a user does with ``init_args = {"address": ...}``
(docs/flower.md). Each simulation is still its own Ray job with fresh actors (Flower's
``ray.shutdown()`` ends the job and its workers, not the cluster), so nothing is carried from
one test to the next; ``tests/flower/test_ray_cluster.py`` checks that a run really executes on the
head it names.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

from flwr.clientapp import ClientApp
from flwr.server.superlink.fleet.vce.backend import Backend
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation

#: a fresh local Ray per run (``ray.init`` without an address): where no ``ray`` CLI is
#: installed beside ``sys.executable``
LOCAL_BACKEND: dict[str, Any] = {
    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    "init_args": {"num_cpus": 2, "logging_level": "ERROR", "log_to_driver": False},
}

#: this environment's ``ray`` CLI, not whatever ``PATH`` finds
RAY = Path(sys.executable).parent / "ray"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayHead:
    """A real Ray head node (``ray start --head --block``) in its own session, so that
    :meth:`stop` ends exactly the processes it started (``os.killpg`` on its pid).

    No fixed port: ``ray start`` hands its workers and drivers ports counted up from
    10002, and two clusters on one machine then give the same port to two processes (a
    driver that cannot bind its port aborts its whole process — a crashed xdist worker);
    ``--min-worker-port 0`` lets the OS choose, as ``ray.init()`` does, and the client
    server and dashboard agent get free ports instead of 10001 and 52365. Its sockets and
    logs live in its own short ``--temp-dir``, so heads of concurrent test workers do not
    find each other (a plain ``ray.init()`` looks for ``ray_current_cluster`` only in Ray's
    default temp dir). Where ``setpriv`` exists the head also gets SIGTERM when the process
    that started it dies, so a crashed test worker leaves no cluster behind."""

    def __init__(self, num_cpus: int = 2) -> None:
        from ray._private.services import get_node_ip_address

        self.port = free_port()
        self.address = f"{get_node_ip_address()}:{self.port}"
        # Ray's unix sockets live under the temp dir: keep its path short (108-byte limit)
        self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        command = [str(RAY), "start", "--head", "--block", "--port", str(self.port),
                   "--num-cpus", str(num_cpus), "--include-dashboard=false",
                   # no log monitor: the tests set log_to_driver=False, so nothing reads
                   # what it forwards, and it polled every worker's log files (≈ 25 s
                   # of CPU per head over a suite run, measured in a cgroup)
                   "--include-log-monitor=false",
                   "--disable-usage-stats", "--temp-dir", self.temp,
                   "--min-worker-port", "0", "--max-worker-port", "0",
                   "--ray-client-server-port", str(free_port()),
                   "--dashboard-agent-listen-port", str(free_port())]
        if setpriv := shutil.which("setpriv"):
            command = [setpriv, "--pdeathsig", "TERM", *command]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # no prestarted workers: every simulation is its own Ray job with its own
            # actors, so a worker Ray starts ahead (for the first driver, or to keep a
            # pool) is never used and costs a process start (test_central_dp and
            # test_round_mod together: 35.0 → 28.8 s of CPU, 2 worker processes fewer)
            env={**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
                 "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"},
            start_new_session=True,
        )
        try:
            self._wait_for_port(timeout=120)
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"Ray head did not open port {self.port} in {timeout} s")

    def stop(self) -> None:
        """SIGTERM to the head's process group (``ray start --block`` then stops the node
        it runs), SIGKILL if it lingers; then its temp dir is removed."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)


_HEAD: RayHead | None = None


def ray_head() -> RayHead:
    """This test process's Ray head, started on first use (stopped by
    :func:`stop_ray_head` at the end of the session, or at exit)."""
    global _HEAD
    if _HEAD is None or _HEAD.proc.poll() is not None:
        _HEAD = RayHead()
        atexit.register(stop_ray_head)
    return _HEAD


def stop_ray_head() -> None:
    global _HEAD
    if _HEAD is not None:
        head, _HEAD = _HEAD, None
        head.stop()


def backend_config(actors: int = 1) -> dict[str, Any]:
    """Flower's Ray backend on this process's head (2 CPUs), or a fresh local Ray without
    the ``ray`` CLI, with ``actors`` ClientApp actors (``client_resources`` of ``2 /
    actors`` CPUs each).

    Why one actor by default: each actor is a new Ray worker process that imports Flower,
    Ray and the app, ≈ 3 s of CPU on these 2 cores, more than a toy run's training; the
    suite runs some 40 simulations. The learners' state still goes through
    ``context.state`` (or the offload folder) between rounds either way: Flower ships a
    node's Context to whichever actor runs its message. The tests whose point is that the
    state survives the round trip run two actors (``actors=2``), so a learner moves
    between processes there."""
    if actors not in (1, 2):
        raise ValueError("the test Ray head has 2 CPUs: 1 or 2 actors")
    if not RAY.exists():
        return {**LOCAL_BACKEND, "client_resources": {"num_cpus": 2 // actors,
                                                      "num_gpus": 0.0}}
    return {"client_resources": {"num_cpus": 2 // actors, "num_gpus": 0.0},
            "init_args": {"address": ray_head().address, "logging_level": "ERROR",
                          "log_to_driver": False}}


class InProcessBackend(Backend):
    """Flower's simulation runtime (its LinkState, Grid, message routing and per-node
    Contexts, all real) with the ClientApp run in this process instead of on a Ray actor.

    Why: a Ray run costs a driver connection and a fresh actor process that imports
    Flower, Ray and the app (≈ 3–7 s of CPU each, measured in a cgroup: some 400 s of the
    suite's 1,600), while most Flower tests are about the strategy's and the learner's
    logic, not about Ray. What a Ray actor would do is kept: the message and the node's
    Context are pickled on the way in and out (as Ray serializes them to and from the actor
    process), so a learner still remembers only what comes back in ``context.state``, and an
    exception in the ClientApp becomes Flower's ``ClientAppException`` (an error reply), as
    ``ClientAppActor.run`` makes it; the library's "am I in Flower's simulation" test
    (a Ray actor) is answered yes during the call. What it cannot show, module globals
    living in another process, is what the Ray tests keep: :func:`backend_config` runs on
    Ray, and the tests whose point is Ray (two actors, an existing cluster, the offload
    across nodes) use it.
    """

    def __init__(self, backend_config: Any) -> None:
        super().__init__(backend_config)
        self.app_fn: Any = None

    def build(self, app_fn: Any) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return 1

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        self.app_fn = None

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

        from flwr_corrnoise.flower import session

        message, context = pickle.loads(pickle.dumps((message, context)))
        # the library tells Flower's simulation from a real SuperNode by "am I a Ray actor"
        # (session.in_ray_actor): here the ClientApp runs in Flower's simulation runtime,
        # so it is answered yes for the call, and restored after
        original, session.in_ray_actor = session.in_ray_actor, lambda: True
        try:
            out = self.app_fn()(message=message, context=context)
        except LoadClientAppError:
            raise
        except Exception as ex:  # as Flower's ClientAppActor.run: an error reply
            raise ClientAppException(str(ex)) from ex
        finally:
            session.in_ray_actor = original
        return pickle.loads(pickle.dumps((out, context)))


@contextlib.contextmanager
def in_process_backend() -> Any:
    """Flower's simulation runtime with :class:`InProcessBackend` in place of Ray's:
    ``start_vce`` imports ``RayBackend`` from its module when it builds the backend, so
    the module attribute is swapped for the duration of the run and restored after."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend
    raybackend.RayBackend = InProcessBackend  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        raybackend.RayBackend = original  # type: ignore[misc]


def simulate(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    backend: dict[str, Any] | None = None,
) -> None:
    """Flower's ``run_simulation``: in this process by default (:class:`InProcessBackend`),
    on this process's Ray head where ``backend`` is :func:`backend_config`'s."""
    logging.getLogger("flwr").setLevel(logging.ERROR)
    with in_process_backend() if backend is None else contextlib.nullcontext():
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=num_supernodes, backend_config=backend or {})


def read_results(out: Path) -> tuple[np.ndarray, dict[str, Any]]:
    return np.load(out / "final_model.npy"), json.loads((out / "summary.json").read_text())


def local_sgd(setup: Any, learner: int, r: int, x: np.ndarray) -> np.ndarray:
    """τ plain SGD steps of ``learner`` in round ``r`` from ``x`` (the unmodified app that
    the per-round and central variants wrap), for replays in tests."""
    from flwr_corrnoise.apps.logreg_task import logistic_gradient

    grad, z = logistic_gradient(setup, learner), np.array(x, dtype=np.float64)
    for t in range(setup.tau):
        z = z - setup.eta * grad([z], r * setup.tau + t)[0]
    return z


def fingerprint(reply: Any) -> dict[str, Any]:
    """Everything in a reply except the values of its arrays: the neighbouring-stream
    tests compare these (record names, array names, shapes and dtypes, every metric and
    config value, error codes and reasons)."""
    from flwr.app import ArrayRecord

    if reply.has_error():
        return {"error": (reply.error.code, reply.error.reason)}
    out: dict[str, Any] = {"records": sorted(reply.content.keys())}
    for name, rec in reply.content.items():
        if isinstance(rec, ArrayRecord):
            out[name] = [(k, tuple(a.shape), a.dtype) for k, a in rec.items()]
        else:
            out[name] = dict(rec)
    return out
