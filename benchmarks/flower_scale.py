"""Flower at scale: plain FedAvg vs CorrNoiseFedAvg, and what the state offload buys.

    python benchmarks/flower_scale.py --learners 1000 --dims 100000 --fraction 0.1 \\
        --rounds 5 --out benchmarks/results/flower_scale.csv

One Flower Ray simulation per (learners, d, variant), each in a fresh subprocess (so Ray
and memory start clean, ``FLWR_HOME`` a new temporary folder), interleaved plain, ours,
ours-off, plain, ... so that machine noise hits every variant alike:

* ``plain``: Flower's own ``flwr.serverapp.strategy.FedAvg`` and a ClientApp taking τ
  noiseless local SGD steps;
* ``ours``: ``CorrNoiseFedAvg`` + ``make_client_app`` with the same gradient, clipping and
  correlated noise of ``--mechanism`` (BLT by default: a learner state of 4·d floats),
  run-config ``state-offload = --offload`` (``auto``: states ≥ 1 MiB go to one file per
  learner under ``state-offload-dir``, and only a handle stays in ``context.state``);
* ``ours-off``: the same with ``state-offload = off`` (every state in ``context.state``,
  which Flower 1.41 keeps for every virtual node in the simulation process).

**The task** must be cheap at d = 10⁶, so it is a linear least-squares stream, not real
data: learner ``i`` has a fixed unit direction ``a_i`` (one seeded Gaussian vector per
process, rolled by ``7919·i`` places) and at stream position ``t`` a scalar label
``y_{i,t} ~ N(0, 1)`` (seeded by ``(i, t)``); the gradient at ``x`` is
``(⟨a_i, x⟩ − y_{i,t})·a_i``, one dot product and one scaled copy, O(d). Plain and ours
call the same oracle.

**What is measured.** Seconds per round: the median interval between consecutive
``evaluate_fn`` calls over rounds 2..R (round 1 includes actor start-up), as
``flower_overhead.py`` does. Peak memory of the whole process tree: a thread of this
(parent) process sums the RSS of the run's subprocess and all its descendants (Ray's GCS,
raylet, workers and actors) every 0.2 s, and their PSS every 2 s (PSS counts a page that k
processes share, such as Ray's object store, as 1/k in each; reading it costs too much to
do every 0.2 s on a 2-core machine). The simulation driver's own RSS after every round (in
``evaluate_fn``, which runs in the driver, after ``gc.collect`` and glibc's ``malloc_trim``
so that it is live memory) gives its growth from the end of round 2 to the end of round R
beside the number of distinct learners that had trained by then (round 2 as the baseline:
Ray and Flower's own first-round allocations are done by then): with
states in ``context.state`` the driver grows by one state per new learner, with the
offload it should stay flat. The CSV keeps the per-round series. The offload folder's
files and disk use are counted after the last round.

Where the time goes: "learner ms/msg" is the median time a train message spends in the
learner's code inside its actor (the same thin wrapper around both ClientApps; state load
and commit included, Ray's transfer of the message and ``Context`` not); "learner CPU ms"
the median of the same message's thread CPU time (``time.thread_time``; the page faults from
``getrusage``), also apart for a learner's first message (it creates its state and file)
and its later ones; "s/round, later half" and its "× plain" the median over the later half
of the rounds (a short run is mostly learners' first messages); "CPU s/round, later half"
the CPU seconds a round, over the same half, of the driver process, the ClientApp actors and
Ray's other processes (:class:`TreeCpu`; "–" on an existing cluster); "aggregate s" is
the median time of the strategy's ``aggregate_train`` in the driver. "load" is the 1-minute
load average when the run started (the machine is shared). A run whose tree passes
``--max-rss-gib`` is killed (its row says so), so that a run cannot take the shared machine
down.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import importlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

import numpy as np

try:
    import psutil
except ModuleNotFoundError:  # Ray vendors psutil (ray/thirdparty_files): importing ray
    import ray  # noqa: F401  (puts that copy on sys.path)

    psutil = importlib.import_module("psutil")

from flwr_corrnoise.mechanisms import mechanism_names

VARIANTS = ("plain", "ours", "ours-off")
OFFLOAD_MODES = ("auto", "on", "off")
MIB = 2**20
GIB = 2**30


# ---------------------------------------------------------------- the task (cheap at any d)

#: the name in ``sys.modules`` of the per-process cache of :func:`base_direction`
CACHE_MODULE = "_flower_scale_task_cache"


def process_cache() -> dict[tuple[int, int], np.ndarray]:
    """A dict that lives as long as the process. Why not a module global: the simulation's
    child runs this file as ``__main__``, so Ray ships the ClientApp's functions to its
    actors by value (cloudpickle), each message with fresh copies of the globals they use; a
    global cache was empty at every message, and every message of *both* variants drew the
    task's d-vector again (until the ninth pass of issue 34). A module in ``sys.modules`` is
    looked up by name when called, so it stays, as a real app's would."""
    mod = sys.modules.get(CACHE_MODULE)
    if mod is None:
        mod = types.ModuleType(CACHE_MODULE)
        mod.base = {}  # type: ignore[attr-defined]
        sys.modules[CACHE_MODULE] = mod
    return mod.base  # type: ignore[attr-defined, no-any-return]


def base_direction(dim: int, seed: int) -> np.ndarray:
    """One seeded unit Gaussian vector per process (memoized in :func:`process_cache`: every
    virtual learner an actor runs shares it, so the data costs one d-vector per process,
    not one per learner, and is drawn once, not once a message)."""
    cache, key = process_cache(), (dim, seed)
    if key not in cache:
        u = np.random.default_rng([seed, dim]).standard_normal(dim)
        cache[key] = u / np.linalg.norm(u)
    return cache[key]


def linear_gradient(dim: int, learner: int, seed: int = 0
                    ) -> Callable[[list[np.ndarray], int], list[np.ndarray]]:
    """Learner ``learner``'s oracle: ``(⟨a_i, x⟩ − y_{i,t})·a_i`` with ``a_i`` the base
    direction rolled by ``7919·i`` and ``y_{i,t} ~ N(0, 1)`` seeded by ``(seed, i, t)``."""
    a = np.roll(base_direction(dim, seed), (7919 * learner) % dim)
    in_dtype = {a.dtype: a}

    def gradient(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        # in the model's dtype, as a float32 model's task computes: ``a @ x`` across dtypes
        # takes NumPy's casting loop, ≈ 3.5 ms instead of ≈ 0.05 at d = 10⁵, which the
        # float32 runs before 2026-11-28 charged to ours (plain cast x to float64 first)
        x = params[0]
        if x.dtype not in in_dtype:
            in_dtype[x.dtype] = a.astype(x.dtype)
        ax = in_dtype[x.dtype]
        y = np.random.default_rng([seed, learner, position]).standard_normal()
        return [(float(ax @ x) - y) * ax]

    return gradient


def plain_train(dim: int, tau: int, eta: float) -> Callable[[Any, Any], Any]:
    """The ``plain`` variant's train function: τ local SGD steps of :func:`linear_gradient`
    on the received model, in its dtype, and the model back — what a Flower user runs
    without privacy (the simulations' ClientApp and :func:`message_cpu` both use it)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    def inner(msg: Any, context: Any) -> Any:
        learner = int(context.node_config["partition-id"])
        grad = linear_gradient(dim, learner)
        pos = int(context.state["pos"]["p"]) if "pos" in context.state else 0
        x = msg.content["arrays"].to_numpy_ndarrays()[0]  # in the model's dtype, as ours
        for t in range(tau):
            x = x - eta * grad([x], pos + t)[0]
        context.state["pos"] = MetricRecord({"p": pos + tau})
        return Message(RecordDict({"arrays": ArrayRecord([x]),
                                   "metrics": MetricRecord({"num-examples": tau})}),
                       reply_to=msg)

    return inner


# ---------------------------------------------------------------- one run (the subprocess)

@dataclass
class RunSpec:
    """Everything one simulation needs; passed to the subprocess as JSON."""

    variant: str
    learners: int
    dim: int
    fraction: float
    rounds: int
    tau: int
    actors: int
    mechanism: str
    offload: str  # the ``state-offload`` of the "ours" variant
    offload_dir: str
    times_dir: str
    dtype: str = "float64"  # the model's (plain and ours alike)
    client_cpus: float = 1.0  # Flower's client_resources.num_cpus
    eta: float = 0.05
    epsilon: float = 2.0
    delta: float = 1e-3
    clip: float = 1.0
    ray_address: str = ""  # an existing Ray cluster's (``--ray-address``); "" = a fresh one

    @property
    def state_offload(self) -> str | None:
        return {"plain": None, "ours": self.offload, "ours-off": "off"}[self.variant]


@dataclass
class RunResult:
    """What the subprocess reports (``marks``: ``evaluate_fn`` times from round 0;
    ``driver_rss``: the driver's RSS at each of them; ``sampled``: node ids per round;
    ``aggregate_s``: seconds of each round's ``aggregate_train``)."""

    marks: list[float] = field(default_factory=list)
    driver_rss: list[int] = field(default_factory=list)
    sampled: list[list[int]] = field(default_factory=list)
    aggregate_s: list[float] = field(default_factory=list)
    offload_files: int = 0
    offload_bytes: int = 0
    #: at each mark, the CPU seconds (user + system) used so far by each part of the run's
    #: process tree (:func:`tree_cpu`)
    cpu: list[dict[str, float]] = field(default_factory=list)


#: the parts of a simulation's process tree whose CPU is reported apart
CPU_PARTS = ("driver", "actors", "ray")


class TreeCpu:
    """CPU seconds used so far by each part of a simulation's process tree: ``driver`` (this
    process: the ServerApp, Flower's in-memory link state, the Ray driver), ``actors``
    (Flower's ClientApp actors: the learners' work and Ray's per-task handling) and ``ray``
    (raylet, GCS, agents, idle workers). Why: on a 2-core machine a round is as long as the
    busiest of them allows, and what ours adds lands on the actors; a process that exited
    keeps the last value seen. The tree is listed anew at each call (a scan of /proc:
    a few ms a round)."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self._kind: dict[int, str] = {}
        self._last: dict[int, float] = {}

    def __call__(self) -> dict[str, float]:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                # read again until it is an actor: Ray may start a worker as ray::IDLE and
                # make it a ClientApp actor later
                if self._kind.get(p.pid) not in ("driver", "actors"):
                    name = " ".join(p.cmdline()[:1]) or p.name()
                    self._kind[p.pid] = ("driver" if p.pid == self.root.pid else
                                         "actors" if "ClientAppActor" in name else "ray")
                t = p.cpu_times()
                self._last[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        out = dict.fromkeys(CPU_PARTS, 0.0)
        for pid, used in self._last.items():
            out[self._kind[pid]] += used
        return out


def dir_usage(path: Path) -> tuple[int, int]:
    """(state files, their bytes on disk) under ``path``, recursively (not the run marker
    or a commit's temporary file)."""
    files = used = 0
    for root, _, names in os.walk(path):
        for name in names:
            if not (name.startswith("g") and name.endswith(".state")):
                continue
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:  # replaced while we walk
                continue
            files += 1
            used += st.st_blocks * 512
    return files, used


def _tracking(base: type) -> type:
    """``base`` (a Flower strategy) that records the node ids it samples each round and the
    seconds its ``aggregate_train`` takes (the driver's share of a round)."""

    class Tracking(base):  # type: ignore[misc, valid-type]
        sampled: list[list[int]]
        aggregate_s: list[float]

        def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> Any:
            t0 = time.perf_counter()
            out = super().aggregate_train(server_round, replies)
            self.aggregate_s.append(time.perf_counter() - t0)
            return out

        def configure_train(self, server_round: int, arrays: Any, config: Any,
                            grid: Any) -> Iterable[Any]:
            messages = list(super().configure_train(server_round, arrays, config, grid))
            self.sampled.append([int(m.metadata.dst_node_id) for m in messages])
            return messages

    Tracking.__name__ = f"Tracking{base.__name__}"
    return Tracking


def trim() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc
    ``malloc_trim``), so that the driver's RSS after a round is its live memory: without it
    the round's reply buffers (100 × 8 MB at d = 10⁶) leave a high-water of several hundred
    MiB that moves from round to round and hides a growth of one state per learner."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def child(spec: RunSpec, result_path: Path) -> None:
    """Run one simulation and write a :class:`RunResult` to ``result_path``."""
    from flwr.app import ArrayRecord, Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from flwr_corrnoise.apps.logreg import wait_for_nodes
    from flwr_corrnoise.flower import CorrNoiseFedAvg, make_client_app
    from flwr_corrnoise.settings import PrivacySettings

    logging.getLogger("flwr").setLevel(logging.ERROR)
    me = psutil.Process()
    res = RunResult()
    start = time.perf_counter()
    tree_cpu = TreeCpu(me)

    def evaluate(r: int, arrays: Any) -> None:
        res.marks.append(time.perf_counter())
        res.cpu.append(tree_cpu())
        trim()  # live memory, not the allocator's high-water of the round's replies
        res.driver_rss.append(me.memory_info().rss)
        if r == spec.rounds and spec.variant != "plain":
            # the states of the last round are committed before the server aggregates
            res.offload_files, res.offload_bytes = dir_usage(Path(spec.offload_dir))
        print(f"  [{spec.variant} {spec.learners}×{spec.dim}] round {r}/{spec.rounds} "
              f"{time.perf_counter() - start:.0f} s, driver RSS "
              f"{res.driver_rss[-1] / MIB:.0f} MiB", file=sys.stderr, flush=True)

    settings = PrivacySettings(mechanism=spec.mechanism, epsilon=spec.epsilon,
                               delta=spec.delta, clip_norm=spec.clip,
                               horizon=spec.rounds * spec.tau)
    initial = ArrayRecord([np.zeros(spec.dim, dtype=spec.dtype)])

    if spec.variant == "plain":
        inner = plain_train(spec.dim, spec.tau, spec.eta)
        strategy = _tracking(FedAvg)(fraction_train=spec.fraction, fraction_evaluate=0.0,
                                     min_available_nodes=spec.learners)
    else:
        settings.calibration()  # solve the factorization outside the timed rounds
        defaults = {"mechanism": spec.mechanism, "epsilon": spec.epsilon,
                    "delta": spec.delta, "clip-norm": spec.clip,
                    "num-server-rounds": spec.rounds, "local-steps": spec.tau,
                    "learning-rate": spec.eta, "seed": 0,
                    "state-offload": spec.state_offload,
                    "state-offload-dir": spec.offload_dir}
        inner = make_client_app(
            lambda context: linear_gradient(spec.dim, int(context.node_config["partition-id"])),
            config_defaults=defaults)
        strategy = _tracking(CorrNoiseFedAvg)(
            local_steps=spec.tau, learning_rate=spec.eta, privacy=settings,
            fraction_train=spec.fraction, min_available_nodes=spec.learners)

    # the same thin wrapper around both: the seconds each train message spends in the
    # learner's code inside its actor (state load and commit included, Ray's transfer of
    # the message and the Context not), one line per message in a file per actor process
    times = Path(spec.times_dir)
    times.mkdir(parents=True, exist_ok=True)
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        fresh = len(context.state) == 0  # the learner's first message (nothing kept yet)
        t0 = time.perf_counter()
        # the thread's CPU from its clock: getrusage's utime + stime of one thread is
        # split by timer ticks, and on some kernels moves by 4 ms or 0 over a 2 ms message
        # (medians of 0.0 seen on 2026-11-28); page faults from getrusage (exact counts)
        c0, u0 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
        try:
            return inner(msg, context)
        finally:
            c1, u1 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
            with open(times / f"{os.getpid()}.txt", "a") as fh:
                fh.write(f"{time.perf_counter() - t0}\n")
            with open(times / f"{os.getpid()}.cpu", "a") as fh:  # the thread's own work
                fh.write(f"{c1 - c0} {u1.ru_minflt - u0.ru_minflt} {int(fresh)}\n")
            with open(times / f"{os.getpid()}.state", "a") as fh:  # what stays per learner
                fh.write(f"{state_bytes(context)}\n")
            kernel = times / f"{os.getpid()}.kernel"  # which noise kernel the actor ran
            if not kernel.exists():
                from flwr_corrnoise import compiled_kernel

                kernel.write_text(compiled_kernel.status())

    strategy.sampled, strategy.aggregate_s = res.sampled, res.aggregate_s

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        wait_for_nodes(grid, spec.learners, timeout=1800)
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=spec.rounds,
                       evaluate_fn=evaluate)

    from flower_overhead import backend  # here: flwr.simulation, not needed in-process

    run_simulation(server_app=server, client_app=client, num_supernodes=spec.learners,
                   backend_config=backend(spec.ray_address, num_cpus=spec.actors,
                                          client_cpus=spec.client_cpus))
    result_path.write_text(json.dumps(asdict(res)))


def state_bytes(context: Any) -> int:
    """The payload a learner keeps in ``context.state`` between rounds (Flower keeps it for
    every virtual node in the simulation process): array bytes, bytes and strings by
    length, every other value 8 bytes (record and key names not counted)."""
    total = 0
    for record in context.state.values():
        for value in record.values():
            if hasattr(value, "data"):  # an ArrayRecord's Array
                total += len(value.data)
            elif isinstance(value, bytes | str):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(v) if isinstance(v, bytes | str) else 8 for v in value)
            else:
                total += 8
    return total


# ---------------------------------------------------------------- the parent: sample, collect

class TreeSampler(threading.Thread):
    """Peak summed RSS of a process and all its descendants every ``interval`` s (PSS every
    ``pss_every``-th sample: reading ``smaps`` costs tens of ms per sample on a big tree,
    which on a 2-core machine would slow the run it measures); the tree is re-listed every
    ``relist`` s (a scan of /proc). Kills the tree (by pid: our own subprocess and its
    children) above ``limit`` bytes."""

    def __init__(self, pid: int, interval: float = 0.2, limit: float | None = None,
                 pss_every: int = 10, relist: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.interval, self.limit = interval, limit
        self.pss_every, self.relist = pss_every, relist
        self.peak_rss = self.peak_pss = 0
        self.max_procs = 0
        self.samples, self.sample_s = 0, 0.0  # the sampler's own cost, reported
        self.killed_at: int | None = None
        self._halt = threading.Event()
        self._pss = True
        self._procs: list[psutil.Process] = []
        self._listed = -float("inf")

    def tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> int:
        t0 = time.perf_counter()
        if t0 - self._listed >= self.relist:
            self._procs, self._listed = self.tree(), t0
        with_pss = self._pss and self.samples % self.pss_every == 0
        rss = pss = 0
        for p in self._procs:
            try:
                if with_pss:
                    info = p.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", 0)
                else:
                    rss += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            except psutil.AccessDenied:
                self._pss = False  # RSS only from here on
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.max_procs = max(self.max_procs, len(self._procs))
        self.samples += 1
        self.sample_s += time.perf_counter() - t0
        return rss

    def run(self) -> None:
        while not self._halt.is_set():
            rss = self.sample()
            if self.limit is not None and rss > self.limit and self.killed_at is None:
                self.killed_at = rss
                for p in reversed(self.tree()):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.kill()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_one(spec: RunSpec, workdir: Path, max_rss: float, timeout: float) -> dict[str, Any]:
    """One simulation in a fresh subprocess; its measured row."""
    result_path = workdir / "result.json"
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    env = {**os.environ, "FLWR_HOME": str(workdir / "flwr-home")}
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec_path),
                             str(result_path)], stdout=sys.stderr, env=env)
    sampler = TreeSampler(proc.pid, limit=max_rss)
    sampler.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in reversed(sampler.tree()):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        rc = proc.wait()
        sampler.killed_at = sampler.killed_at or -1
    sampler.stop()
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "learners": spec.learners, "dim": spec.dim, "fraction": spec.fraction,
        "rounds": spec.rounds, "tau": spec.tau, "actors": spec.actors,
        "client_cpus": spec.client_cpus, "mechanism": spec.mechanism,
        "variant": spec.variant, "dtype": spec.dtype,
        "state_offload": spec.state_offload or "",
        # a run on an existing cluster: its actors are not in the tree measured here
        "ray_address": spec.ray_address,
        "peak_tree_rss_gib": sampler.peak_rss / GIB,
        "peak_tree_pss_gib": sampler.peak_pss / GIB if sampler.peak_pss else float("nan"),
        "tree_procs": sampler.max_procs, "wall_s": wall,
        "load_start": load_start, "load_end": os.getloadavg()[0],
        "sampler_ms": 1e3 * sampler.sample_s / max(1, sampler.samples),
    }
    if sampler.killed_at is not None:
        row["status"] = ("timed out" if sampler.killed_at < 0 else
                         f"killed at {sampler.killed_at / GIB:.1f} GiB")
    elif rc != 0 or not result_path.exists():
        row["status"] = f"failed (exit {rc})"
    else:
        row["status"] = "ok"
    if row["status"] != "ok":
        return row
    res = RunResult(**json.loads(result_path.read_text()))
    trained = [len(set().union(*res.sampled[:r])) for r in range(1, len(res.sampled) + 1)]
    row.update({
        "s_per_round": statistics.median(np.diff(res.marks[1:])),
        # the later half of the rounds: fewer learners that train for the first time
        "s_per_round_late": statistics.median(np.diff(res.marks)[len(res.marks) // 2:]),
        "driver_rss_r2_mib": res.driver_rss[2] / MIB,
        "driver_rss_end_mib": res.driver_rss[-1] / MIB,
        "driver_growth_mib": (res.driver_rss[-1] - res.driver_rss[2]) / MIB,
        "trained_r2": trained[1], "trained_end": trained[-1],
        "growth_per_learner_mib": ((res.driver_rss[-1] - res.driver_rss[2]) / MIB
                                   / (trained[-1] - trained[1])
                                   if trained[-1] > trained[1] else float("nan")),
        "driver_rss_series_mib": " ".join(f"{v / MIB:.0f}" for v in res.driver_rss),
        "trained_series": " ".join(str(t) for t in trained),
        "offload_files": res.offload_files, "offload_mib": res.offload_bytes / MIB,
        "aggregate_s": statistics.median(res.aggregate_s[1:] or res.aggregate_s),
    })
    # CPU s a round of each part over the later half of the rounds (not on an existing
    # cluster: its actors and Ray's processes are not this run's descendants)
    if len(res.cpu) >= 3 and not spec.ray_address:
        half = len(res.cpu) // 2
        for part in CPU_PARTS:
            row[f"cpu_{part}_s_late"] = ((res.cpu[-1][part] - res.cpu[half][part])
                                         / (len(res.cpu) - 1 - half))
    client_s = [float(v) for f in Path(spec.times_dir).glob("*.txt")
                for v in f.read_text().split()]
    if client_s:
        row["client_ms"] = 1e3 * statistics.median(client_s)
        row["messages"] = len(client_s)
    cpu = [line.split() for f in Path(spec.times_dir).glob("*.cpu")
           for line in f.read_text().splitlines() if line.strip()]
    if cpu:  # wall ≫ CPU: the message waited for a core; CPU up: it did more work
        row["client_cpu_ms"] = 1e3 * statistics.median(float(c[0]) for c in cpu)
        row["client_faults"] = statistics.median(int(c[1]) for c in cpu)
        # a learner's first message (it creates its state: a new file, new buffers) and
        # the later ones, apart: a short run is mostly first messages, a long one is not
        for label, flag in (("first", "1"), ("later", "0")):
            part = [float(c[0]) for c in cpu if c[2:3] == [flag]]
            row[f"client_cpu_{label}_ms"] = 1e3 * statistics.median(part) if part else None
            row[f"messages_{label}"] = len(part)
    row["round_s_series"] = " ".join(f"{v:.3f}" for v in np.diff(res.marks))
    kernels = sorted({f.read_text().split(" (")[0] for f in Path(spec.times_dir).glob("*.kernel")})
    if kernels:
        row["kernel"] = "; ".join(kernels)
    kept = [int(v) for f in Path(spec.times_dir).glob("*.state") for v in f.read_text().split()]
    if kept:
        row["state_bytes_max"] = max(kept)
    return row


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "–"
    return format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| learners × d | fraction | variant | s/round | × plain | learner ms/msg "
            "| s/round, later half | × plain, later half "
            "| learner CPU ms / page faults per msg | learner CPU ms, first / later msgs "
            "| CPU s/round, later half: driver / actors / Ray "
            "| aggregate s | peak tree RSS / PSS GiB "
            "| driver RSS r2 → R MiB | growth MiB (per new learner) | trained r2 → R "
            "| offload files | "
            "offload MiB | context.state B per learner (max) | load | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        lines.append(
            f"| {row['learners']:,} × {row['dim']:,}"
            f"{' (float32)' if row.get('dtype') == 'float32' else ''} "
            f"| {row['fraction']:g} | {row['variant']}"
            f"{'' if row['variant'] != 'ours' else ' (' + row['state_offload'] + ')'} "
            f"| {fmt(row.get('s_per_round'), '.2f')} | {fmt(row.get('ratio'), '.2f')} "
            f"| {fmt(row.get('client_ms'), '.1f')} "
            f"| {fmt(row.get('s_per_round_late'), '.2f')} | {fmt(row.get('ratio_late'), '.2f')} "
            f"| {fmt(row.get('client_cpu_ms'), '.1f')} / {fmt(row.get('client_faults'), '.0f')} "
            f"| {fmt(row.get('client_cpu_first_ms'), '.1f')} / "
            f"{fmt(row.get('client_cpu_later_ms'), '.1f')} "
            f"| {fmt(row.get('cpu_driver_s_late'), '.2f')} / "
            f"{fmt(row.get('cpu_actors_s_late'), '.2f')} / {fmt(row.get('cpu_ray_s_late'), '.2f')} "
            f"| {fmt(row.get('aggregate_s'), '.2f')} "
            f"| {fmt(row['peak_tree_rss_gib'], '.2f')} / {fmt(row['peak_tree_pss_gib'], '.2f')} "
            f"| {fmt(row.get('driver_rss_r2_mib'), '.0f')} → "
            f"{fmt(row.get('driver_rss_end_mib'), '.0f')} "
            f"| {fmt(row.get('driver_growth_mib'), '+.0f')} "
            f"({fmt(row.get('growth_per_learner_mib'), '+.2f')}) "
            f"| {fmt(row.get('trained_r2'), 'd')} → {fmt(row.get('trained_end'), 'd')} "
            f"| {fmt(row.get('offload_files') if row['variant'] != 'plain' else None, 'd')} "
            f"| {fmt(row.get('offload_mib') if row['variant'] != 'plain' else None, '.1f')} "
            f"| {fmt(row.get('state_bytes_max'), ',d')} "
            f"| {row['load_start']:.1f} | {row['status']} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- one message, in-process

#: where a learner's train message spends its time (cumulative cProfile seconds of these
#: functions, the recurrence without the draws it calls; "other" is the rest of the
#: message: the round's arithmetic, clipping, privacy metadata, Flower's records)
PROFILE_PARTS = (
    ("noise: draws", "streams.py", "_draw_rows"),  # a BLT round's block (BlockNoise)
    ("noise: recurrence", "streams.py", "next_block"),
    ("load (read + checks)", "session.py", "open"),
    ("commit (write)", "session.py", "commit"),
    ("gradient (the task's)", "flower_scale.py", "gradient"),
)


def part_seconds(stats: dict[tuple[str, int, str], tuple], filename: str, function: str
                 ) -> float:
    """The cumulative seconds of the outermost function named ``function`` in
    ``filename`` (cProfile's ``Stats.stats``). The outermost, not the sum: session.py's
    ``LearnerTransaction.commit`` calls ``LearnerSession.commit``, and a sum counted the
    write twice (the "commit" column of the tables before 2026-11-24 was ≈ 2× its time)."""
    return max((ct for (f, _, name), (_, _, _, ct, _) in stats.items()
                if f.endswith(filename) and name == function), default=0.0)


class LearnerMessages:
    """Train messages through ``make_client_app`` in this process (BLT, ``tau`` local steps,
    4 by default, the state offloaded to a file, the simulation rules), to ``learners``
    learners of one app: the ClientApp call a Ray actor makes, without Ray. Use as a context
    manager (the offload folder is a temporary directory)."""

    tau = 4  # the default

    def __init__(self, dim: int, dtype: str, rounds: int, learners: int = 1,
                 offload: str = "on", plain: bool = False, tau: int = 4) -> None:
        self.dim, self.dtype, self.rounds = dim, dtype, rounds
        self.learners, self.offload, self.plain = learners, offload, plain
        self.tau = int(tau)

    def __enter__(self) -> LearnerMessages:
        from flwr.app import Context, RecordDict

        from flwr_corrnoise.flower import make_client_app, session

        # the simulation rules, as in a Ray actor — restored on exit: a caller in a longer
        # process (the test suite runs benchmarks in its own) must not keep them
        self._in_simulation = session.in_simulation
        session.in_simulation = lambda: True
        self._tmp = tempfile.TemporaryDirectory()
        defaults = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-3, "clip-norm": 1.0,
                    "num-server-rounds": self.rounds + 4, "local-steps": self.tau,
                    "learning-rate": 0.05, "seed": 0, "calibration": "exact",
                    "state-offload": self.offload, "state-offload-dir": self._tmp.name}
        dim = self.dim
        if self.plain:  # the plain variant's ClientApp, as its simulation runs it
            from flwr.clientapp import ClientApp

            self.app = ClientApp()
            self.app.train()(plain_train(dim, self.tau, defaults["learning-rate"]))
        else:
            self.app = make_client_app(
                lambda c: linear_gradient(dim, int(c.node_config["partition-id"])),
                config_defaults=defaults)
        self.contexts = [Context(run_id=1, node_id=7 + i, node_config={"partition-id": 3 + i},
                                 state=RecordDict(), run_config={})
                         for i in range(self.learners)]
        self.x = np.zeros(dim, dtype=self.dtype)
        return self

    def __exit__(self, *exc: object) -> None:
        from flwr_corrnoise.flower import session

        session.in_simulation = self._in_simulation
        self._tmp.cleanup()

    def send(self, r: int, learner: int = 0) -> Any:
        """Learner ``learner``'s train message of server round ``r``; its reply."""
        from flwr.app import ArrayRecord, ConfigRecord, Message, Metadata, RecordDict
        from flwr.common import MessageType

        ctx = self.contexts[learner]
        md = Metadata(run_id=1, message_id=f"m{r}-{learner}", src_node_id=0,
                      dst_node_id=ctx.node_id, reply_to_message_id="", group_id="1",
                      created_at=time.time(), ttl=3600.0, message_type=MessageType.TRAIN)
        config = ConfigRecord({"local-steps": self.tau, "learning-rate": 0.05,
                               "server-round": r})
        msg = Message(content=RecordDict({"arrays": ArrayRecord([self.x]), "config": config}),
                      metadata=md)
        reply = self.app(msg, ctx)
        assert not reply.has_error(), reply.error
        return reply


def profile_message(dim: int, dtype: str, messages: int, offload: str = "on"
                    ) -> dict[str, float]:
    """One learner's train messages (:class:`LearnerMessages`): the median ms per message,
    then ms per message of each :data:`PROFILE_PARTS` under cProfile."""
    import cProfile
    import pstats

    with LearnerMessages(dim, dtype, 4 * messages, offload=offload) as m:
        m.send(1)  # the learner's first message creates its stream
        wall = []
        for r in range(2, 2 + messages):
            t0 = time.perf_counter()
            m.send(r)
            wall.append(time.perf_counter() - t0)
        prof = cProfile.Profile()
        prof.enable()
        for r in range(2 + messages, 2 + 2 * messages):
            m.send(r)
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.items())
    out = {"message ms": 1e3 * statistics.median(wall)}
    for label, filename, function in PROFILE_PARTS:
        out[label] = 1e3 * part_seconds(stats, filename, function) / messages
    out["noise: recurrence"] -= out["noise: draws"]  # the kernel's step calls the draw
    out["profiled message ms"] = 1e3 * total / messages
    out["other"] = out["profiled message ms"] - sum(out[label] for label, _, _ in PROFILE_PARTS)
    return out


def message_cpu(dim: int, dtype: str, rounds: int, learners: int = 4, tau: int = 4
                ) -> dict[str, float]:
    """``learners`` learners' train messages in turn for ``rounds`` rounds, nothing traced
    (so that a sampling profiler such as py-spy can be put around it, and two library
    versions compared): the median CPU ms (``thread_time``) and wall ms per message, the
    learners' first messages left out. The learners are at the same step count in every
    round, as most of an actor's learners are, so ε spent is computed once per round
    (memoized), as in an actor.

    Side by side in the same rounds (one of each after every message of ours, so that load
    swings hit all three alike): the **plain** variant's message (its ClientApp, the same
    task, no privacy) and the message's **τ·d draws alone** (the library's noise kernel,
    :class:`~flwr_corrnoise.cipher_noise.CipherGaussian`, τ rows of ``d`` in the model's
    dtype) — the issue-34 target is (ours − plain) ≤ 2 × draws. ``tau``: the local steps of
    a message (the state's round trip is once a message, the draws τ rows)."""
    from flwr_corrnoise.cipher_noise import CipherGaussian

    gen = CipherGaussian.from_seed(1)
    with (LearnerMessages(dim, dtype, 4 * rounds + 4, learners=learners, tau=tau) as m,
          LearnerMessages(dim, dtype, 4 * rounds + 4, learners=learners, plain=True,
                          tau=tau) as p):
        for i in range(learners):
            m.send(1, i)
            p.send(1, i)
        cpu, wall, plain, draws = [], [], [], []
        for r in range(2, 2 + rounds):
            for i in range(learners):
                c0, t0 = time.thread_time(), time.perf_counter()
                m.send(r, i)
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - t0)
                c0 = time.thread_time()
                p.send(r, i)
                plain.append(time.thread_time() - c0)
                c0 = time.thread_time()
                for _ in range(tau):
                    gen.next_row(dim, dtype)
                draws.append(time.thread_time() - c0)
    out = {"CPU ms": 1e3 * statistics.median(cpu), "wall ms": 1e3 * statistics.median(wall),
           "plain CPU ms": 1e3 * statistics.median(plain),
           "draws CPU ms": 1e3 * statistics.median(draws), "messages": float(len(cpu))}
    out["extra / draws"] = (out["CPU ms"] - out["plain CPU ms"]) / out["draws CPU ms"]
    return out


def message_table(dims: list[int], dtypes: list[str], messages: int) -> str:
    """:func:`profile_message` for every (d, dtype), as a markdown table."""
    rows = [(d, dt, profile_message(d, dt, messages)) for d in dims for dt in dtypes]
    labels = ["message ms", "profiled message ms", *[label for label, _, _ in PROFILE_PARTS],
              "other"]
    lines = [f"load average {os.getloadavg()[0]:.1f}", "",
             "| d | dtype | " + " | ".join(labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for d, dt, r in rows:
        lines.append(f"| {d:,} | {dt} | " + " | ".join(f"{r[k]:.1f}" for k in labels) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--learners", type=int, nargs="+", default=[1000])
    p.add_argument("--dims", type=int, nargs="+", default=[100_000])
    p.add_argument("--fraction", type=float, default=0.1, help="learners sampled per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--actors", type=int, default=2,
                   help="the CPUs of each run's fresh local Ray (one ClientApp actor each)")
    p.add_argument("--client-cpus", type=float, default=1.0, help="Flower's "
                   "client_resources.num_cpus: Ray runs (CPUs) / this many ClientApp actors "
                   "(on --ray-address, the cluster's CPUs count)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--mechanism", default="blt", choices=mechanism_names())
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                   help="the model's dtype (a float32 model's learners keep float32 "
                   "noise buffers)")
    p.add_argument("--offload", default="auto", choices=OFFLOAD_MODES,
                   help="state-offload of the 'ours' variant")
    p.add_argument("--max-rss-gib", type=float, default=14.0,
                   help="kill a run whose process tree passes this (shared machine)")
    p.add_argument("--run-timeout", type=float, default=3600.0)
    p.add_argument("--tmp", default=None, help="parent of the runs' FLWR_HOME and offload "
                   "folders (default: the temp dir)")
    p.add_argument("--ray-address", default="", help="run every simulation on this "
                   "existing Ray cluster (at least --actors CPUs) instead of a fresh local "
                   "one per run: no Ray start-up per run, but the memory columns then count "
                   "the driver's process tree only — the actors belong to the cluster")
    p.add_argument("--out", type=Path, default=None, help="CSV of every run")
    p.add_argument("--message-profile", type=int, metavar="MESSAGES", default=0,
                   help="instead of simulations: profile MESSAGES train messages of one "
                   "learner in this process at each --dims (float64 and float32 models)")
    p.add_argument("--message-cpu", type=int, metavar="ROUNDS", default=0,
                   help="instead of simulations: 4 learners' train messages in turn for "
                   "ROUNDS rounds in this process at each --dims and --dtype, untraced: "
                   "the median CPU and wall ms per message (put py-spy around it, or run "
                   "it at two commits to compare them)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(RunSpec(**json.loads(Path(args.child[0]).read_text())), Path(args.child[1]))
        return
    if args.message_profile:
        print(message_table(args.dims, ["float64", "float32"], args.message_profile))
        return
    if args.message_cpu:
        print(f"load average {os.getloadavg()[0]:.1f}\n")
        print("| d | dtype | τ | messages | CPU ms / message | wall ms / message "
              "| plain CPU ms | τ·d draws CPU ms | (ours − plain) ÷ draws |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for d in args.dims:
            r = message_cpu(d, args.dtype, args.message_cpu, tau=args.tau)
            print(f"| {d:,} | {args.dtype} | {args.tau} | {r['messages']:.0f} | "
                  f"{r['CPU ms']:.2f} | "
                  f"{r['wall ms']:.2f} | {r['plain CPU ms']:.2f} | {r['draws CPU ms']:.2f} | "
                  f"{r['extra / draws']:.2f}× |")
        return
    if args.rounds < 3:
        p.error("--rounds must be ≥ 3 (the median is over rounds 2..R)")

    rows: list[dict[str, Any]] = []
    for learners in args.learners:
        for dim in args.dims:
            for rep in range(args.repeats):
                group = []
                for variant in args.variants:
                    with tempfile.TemporaryDirectory(prefix="flower-scale-", dir=args.tmp,
                                                     ignore_cleanup_errors=True) as tmp:
                        spec = RunSpec(variant=variant, learners=learners, dim=dim,
                                       fraction=args.fraction, rounds=args.rounds,
                                       tau=args.tau, actors=args.actors,
                                       client_cpus=args.client_cpus,
                                       mechanism=args.mechanism, offload=args.offload,
                                       dtype=args.dtype, ray_address=args.ray_address,
                                       offload_dir=str(Path(tmp) / "offload"),
                                       times_dir=str(Path(tmp) / "client-times"))
                        print(f"[{variant}] {learners} learners × d = {dim}, fraction "
                              f"{args.fraction:g}, {args.rounds} rounds (repeat {rep + 1})",
                              file=sys.stderr, flush=True)
                        row = run_one(spec, Path(tmp), args.max_rss_gib * GIB,
                                      args.run_timeout)
                    row["repeat"] = rep + 1
                    print(f"  -> {row['status']}, {fmt(row.get('s_per_round'), '.2f')} "
                          f"s/round, peak tree RSS {row['peak_tree_rss_gib']:.2f} GiB, "
                          f"wall {row['wall_s']:.0f} s, load {row['load_start']:.1f} → "
                          f"{row['load_end']:.1f}, sampler {row['sampler_ms']:.1f} ms/sample",
                          file=sys.stderr, flush=True)
                    group.append(row)
                plain = next((r.get("s_per_round") for r in group if r["variant"] == "plain"),
                             None)
                late = next((r.get("s_per_round_late") for r in group
                             if r["variant"] == "plain"), None)
                for row in group:
                    if plain and row.get("s_per_round"):
                        row["ratio"] = row["s_per_round"] / plain
                    if late and row.get("s_per_round_late"):
                        row["ratio_late"] = row["s_per_round_late"] / late
                rows.extend(group)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        keys = list(dict.fromkeys(k for row in rows for k in row))
        with open(args.out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
