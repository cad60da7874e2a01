"""A simulated learner's state handling per round: inside ``context.state``, offloaded to a
file, or (``--ray``) in Ray's object store.

    python benchmarks/state_handling.py --dims 100000 1000000 --repeats 7 --ray

One learner-round's state work, as Flower's simulation engine and the learner session do
it, for a BLT learner (4 buffers of d floats, float64 or ``--dtype float32``): ``commit``
(serialize and store: into the ``ConfigRecord`` in ``context.state``, or to the learner's
file with a handle in ``context.state``), ``ship`` (pickle the ``Context`` and unpickle it:
Flower sends it to the Ray actor and back on every message, so twice per round — counted
once here and doubled in the total), and ``load`` (read and check the state). The driver's
share is what the simulation process keeps per learner that has trained: the pickled
``Context``'s size. Medians over ``--repeats``; prints a markdown table.

``--ray`` adds the store issue 22 asked to measure beside the file: the state's arrays
(``LearnerState.state_dict(flat=True)``, the offload's) ``ray.put`` into the object store of
a local Ray instance by an actor — the process that runs a learner's round in a
simulation — with the object's id (28 bytes) in ``context.state``, and ``ray.get`` back
and restored by the same actor. The actor keeps each learner's latest ``ObjectRef`` (an
object lives while its owner holds a reference, and dies with it: the reason it is not
the store the library uses). Objects in the store are immutable, so a restored stream
copies its buffers out of the object (``ray.get`` returns read-only views) before it can
step; that copy is in ``load``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _format import human_bytes
from flwr.app import ConfigRecord, Context, RecordDict

from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.state_offload import OffloadPolicy

SETTINGS = PrivacySettings("blt", 2.0, 1e-3, 1.0, 400)


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def summary(commit: list[float], ship: list[float], load: list[float],
            size: int) -> dict[str, float]:
    out = {"commit": median_ms(commit), "ship": median_ms(ship), "load": median_ms(load),
           "driver": float(size)}
    out["total"] = out["commit"] + 2 * out["ship"] + out["load"]
    return out


def time_rounds(state: LearnerState, ctx: Context, repeats: int,
                commit: Callable[[LearnerState, Context], None],
                load: Callable[[Context], LearnerState]) -> dict[str, float]:
    """``repeats`` learner-rounds of one store: a step, ``commit`` (the state into the
    store and its handle into ``ctx``), the Context pickled and unpickled (Flower ships it
    to the actor and back), ``load`` from the unpickled Context; each part timed."""
    commit_s, ship_s, load_s, size = [], [], [], 0
    for _ in range(repeats):
        state.noise.next()
        state.advance()
        t0 = time.perf_counter()
        commit(state, ctx)
        t1 = time.perf_counter()
        blob = pickle.dumps(ctx, protocol=pickle.HIGHEST_PROTOCOL)
        ctx = pickle.loads(blob)
        t2 = time.perf_counter()
        state = load(ctx)
        t3 = time.perf_counter()
        commit_s.append(t1 - t0)
        ship_s.append(t2 - t1)
        load_s.append(t3 - t2)
        size = len(blob)
    return summary(commit_s, ship_s, load_s, size)


def new_context(dim: int) -> Context:
    return Context(run_id=1, node_id=dim, node_config={}, state=RecordDict(), run_config={})


def measure(dim: int, mode: str, repeats: int, root: Path,
            dtype: str = "float64") -> dict[str, float]:
    """``context.state`` (``mode = "off"``) or a file (``"on"``), through the session's
    own :class:`LearnerStorage`."""
    ctx = new_context(dim)
    storage = LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy(mode, root))

    def load(shipped: Context) -> LearnerState:
        storage.context = shipped
        return storage.read()

    return time_rounds(LearnerState.create(SETTINGS, [(dim,)], seed=1, dtype=dtype), ctx,
                       repeats, lambda state, _: storage.write(state, {}), load)


class RayStore:
    """A learner's state in Ray's object store, as the actor running its rounds would keep
    it: ``ray.put`` of the offload's flat arrays, the object id in ``context.state``, the
    ``ObjectRef`` held by this actor (its owner) until the next commit replaces it."""

    def __init__(self) -> None:
        self.refs: dict[bytes, Any] = {}

    def measure(self, dim: int, repeats: int, dtype: str) -> dict[str, float]:
        import ray

        def commit(state: LearnerState, ctx: Context) -> None:
            state.generation += 1
            ref = ray.put(state.state_dict(flat=True, copy=False))
            old = ctx.state[STATE_KEY]["object"] if STATE_KEY in ctx.state else None
            self.refs[ref.binary()] = ref
            if old is not None:  # the previous object is freed with its last reference
                self.refs.pop(bytes(old), None)  # type: ignore[arg-type]
            ctx.state[STATE_KEY] = ConfigRecord({"object": ref.binary(),
                                                 "generation": state.generation})

        def load(ctx: Context) -> LearnerState:
            arrays = ray.get(self.refs[bytes(ctx.state[STATE_KEY]["object"])])  # type: ignore[arg-type]
            state = LearnerState.from_state_dict(arrays, adopt=True)  # read-only: copied
            assert not np.shares_memory(state.noise._state.buf, arrays["noise/rows"])
            return state

        try:
            return time_rounds(LearnerState.create(SETTINGS, [(dim,)], seed=1, dtype=dtype),
                               new_context(dim), repeats, commit, load)
        finally:
            self.refs.clear()


def measure_ray(dims: list[int], repeats: int, dtype: str, address: str = ""
                ) -> list[dict[str, float]]:
    """:class:`RayStore` in an actor of a local Ray instance (one CPU, an object store of
    twice the largest state plus headroom), or of the running cluster at ``address``
    (its own object store, which must hold a few of the largest states)."""
    import ray

    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    else:
        biggest = max(dims) * 4 * np.dtype(dtype).itemsize
        ray.init(num_cpus=1, object_store_memory=max(200 << 20, 4 * biggest),
                 logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=1)(RayStore).remote()
        return [ray.get(actor.measure.remote(dim, repeats, dtype)) for dim in dims]
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="the stream's (the model's) dtype")
    p.add_argument("--ray", action="store_true",
                   help="also measure Ray's object store (starts a local Ray instance)")
    p.add_argument("--ray-address", default="", help="with --ray: use this running Ray "
                   "cluster instead of starting one (one CPU free)")
    args = p.parse_args()
    ray_rows = (measure_ray(args.dims, args.repeats, args.dtype, args.ray_address)
                if args.ray else None)
    print(f"load average {os.getloadavg()[0]:.1f}, {args.dtype} buffers\n")
    print("| d | state | commit ms | ship Context ms (×2 per round) | load ms "
          "| per round ms | kept in the driver per learner |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, dim in enumerate(args.dims):
            rows = [(label, measure(dim, mode, args.repeats, Path(tmp), args.dtype))
                    for mode, label in (("off", "in context.state"),
                                        ("on", "offloaded to a file"))]
            if ray_rows is not None:
                rows.append(("in Ray's object store", ray_rows[i]))
            for label, r in rows:
                print(f"| {dim:,} | {label} | {r['commit']:.1f} | {r['ship']:.1f} | "
                      f"{r['load']:.1f} | {r['total']:.1f} | {human_bytes(r['driver'])} |",
                      flush=True)


if __name__ == "__main__":
    main()
