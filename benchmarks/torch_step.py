"""Cost of one private step of the paper's CNN, as ratios to a bare SGD step, in one run.

    python benchmarks/torch_step.py --batch-sizes 1 64 --steps 20 --repeats 7
    python benchmarks/torch_step.py --device cuda --batch-sizes 64 --no-host   # on a GPU
    python benchmarks/torch_step.py --batch-sizes 64 --no-host --no-opacus --isolated

``--isolated`` runs every block in a fresh process of its own (a warm-up block, then the
timed one; the processes in rotation), so that each method meets glibc's allocator as a
user's training process would, alone: in one process a step's page faults depend on what
the steps before it, of any method, freed.

For every batch size ``b``, blocks of ``--steps × max(1, 16 // b)`` steps of each method
run in rotation on the same batches (so every method sees the same machine load; blocks
of small batches are longer so that no block is shorter than the machine's load swings),
and each ratio is the median over ``--repeats`` rotations of (method's block) / (the
reference's block of the same rotation), the reference being the bare step, the bare step
plus drawing ``d`` Gaussians (the batch-1 target is ≤ 1.5× that) and Opacus:

* ``bare SGD`` — forward, backward of the batch-mean loss, ``p -= η·grad`` (float32): what
  a user would otherwise run;
* ``draw d Gaussians + bare`` — the bare block plus ``torch.randn(d)`` per step: the floor
  for a private step at batch 1 (every mechanism draws at least one d-vector per step);
* ``ours, <mechanism>`` — :class:`flwr_corrnoise.torch.PrivateOptimizer` on the model's
  device: per-example gradients (the layers' grad samplers), per-example clipping, the correlated
  increment from the device stream, the SGD step (and the round's running sum for ĝ);
* ``ours, <mechanism>, whole-batch clip`` — the same with ``loss.backward()`` and the batch
  gradient clipped as a whole (batch 1 only: per-example clipping is the point at b > 1);
* ``host reference (v0.x)`` — ``torch_local_round``: the float64 NumPy round that copies
  parameters and gradients between host and model every step (what this replaces);
* ``Opacus`` — Opacus' ``GradSampleModule`` + ``DPOptimizer`` (hook-based per-example
  gradients, clipping, i.i.d. Gaussian noise), if ``opacus`` is installed (optional: it is
  a benchmark-only comparison, never a dependency).

Each row also gives the thread's minor page faults per step (median over the rotations,
``getrusage(RUSAGE_THREAD)``): on a VM a step's time moves with them, and the bare step's
move the ratios.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import check_mechanism, mechanism_names
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.torch import PrivateOptimizer, torch_local_round

# the paper's CNN is experiment code (the repository's experiments/, not installed); this
# script runs as `python benchmarks/torch_step.py`, so the repository root is put on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.cnn import PaperCNN

ETA = 0.01
#: the default subset: constant-memory correlated noise and its baseline (checked)
DEFAULT = [check_mechanism(name) for name in ("blt", "independent")]
CE = torch.nn.functional.cross_entropy


def methods(model: torch.nn.Module, b: int, steps: int, repeats: int, mechanisms: list[str],
            data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], host: bool,
            with_opacus: bool = True) -> dict[str, Callable[[], None]]:
    """name → a function running one block of ``steps`` steps of that method."""
    d = sum(p.numel() for p in model.parameters())
    horizon = steps * (repeats + 2)
    out: dict[str, Callable[[], None]] = {}

    bare_model = copy.deepcopy(model)

    def bare_step(pos: int) -> None:
        x, y = data(pos)
        bare_model.zero_grad(set_to_none=True)
        CE(bare_model(x), y).backward()
        with torch.no_grad():
            for p in bare_model.parameters():
                p -= ETA * p.grad

    def bare() -> None:
        for pos in range(steps):
            bare_step(pos)

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(0)

    def draw_and_bare() -> None:
        for pos in range(steps):
            torch.randn(d, generator=gen, device=device)
            bare_step(pos)

    out["bare SGD"] = bare
    out["draw d Gaussians + bare"] = draw_and_bare
    for mech in mechanisms:
        settings = PrivacySettings(mechanism=mech, horizon=horizon)
        m = copy.deepcopy(model)
        private = PrivateOptimizer(torch.optim.SGD(m.parameters(), lr=ETA), m, settings,
                                   seed=0)

        def ours(private: PrivateOptimizer = private) -> None:
            for pos in range(steps):
                private.zero_grad()
                private.backward(*data(pos))
                private.step()
            private.round_update()

        out[f"ours, {mech}"] = ours
        if b == 1:
            m2 = copy.deepcopy(model)
            whole = PrivateOptimizer(torch.optim.SGD(m2.parameters(), lr=ETA), m2, settings,
                                     seed=0)

            def ours_whole(private: PrivateOptimizer = whole, m2: torch.nn.Module = m2) -> None:
                for pos in range(steps):
                    private.zero_grad()
                    x, y = data(pos)
                    CE(m2(x), y).backward()
                    private.step()
                private.round_update()

            out[f"ours, {mech}, whole-batch clip"] = ours_whole
        if host:
            m3 = copy.deepcopy(model)
            state = LearnerState.create(settings, [tuple(p.shape) for p in m3.parameters()],
                                        seed=0)

            def reference(m3: torch.nn.Module = m3, state: LearnerState = state,
                          settings: PrivacySettings = settings) -> None:
                torch_local_round(m3, CE, lambda pos: data(pos % steps), state, settings,
                                  steps, ETA)

            out[f"host reference (v0.x), {mech}"] = reference
    try:
        if not with_opacus:
            raise ImportError
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError:
        print("(opacus not installed or --no-opacus: no Opacus row)")
    else:
        gsm = GradSampleModule(copy.deepcopy(model))
        dp = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=ETA), noise_multiplier=1.0,
                         max_grad_norm=1.0, expected_batch_size=b)

        def opacus() -> None:
            for pos in range(steps):
                x, y = data(pos)
                dp.zero_grad(set_to_none=True)
                CE(gsm(x), y).backward()
                dp.step()

        out["Opacus (i.i.d. noise)"] = opacus
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="rotations (median over them)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mechanisms", nargs="+", default=DEFAULT, choices=mechanism_names())
    p.add_argument("--no-host", action="store_true", help="skip the host reference rows")
    p.add_argument("--device", default="cpu", help="the model's device (cpu, cuda)")
    p.add_argument("--no-opacus", action="store_true", help="leave Opacus out (its "
                   "allocations change how often the others' steps page-fault)")
    p.add_argument("--parts", action="store_true",
                   help="after the table, ours (BLT) and the bare step part by part, each "
                        "part's ms a step over a block (where ours' extra goes)")
    p.add_argument("--isolated", action="store_true",
                   help="each block of each method in a fresh process of its own (a "
                        "warm-up block, then the timed one), the processes in rotation: "
                        "every method meets the allocator as a user's training process "
                        "would, alone, instead of after the others' frees")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one method (--isolated)
    p.add_argument("--profile", action="store_true",
                   help="after the table, torch.profiler's top operators of one block of "
                        "each 'ours' method (where a step's time goes)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = PaperCNN().to(device)
    d = sum(q.numel() for q in model.parameters())
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"CPU, {args.threads} thread(s)")
    print(f"paper CNN, d = {d:,}, {where}, torch {torch.__version__}; "
          f"blocks of {args.steps} steps, median of {args.repeats} rotations")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    print("| batch | method | ms per step | ÷ bare SGD | ÷ (draw d Gaussians + bare) | "
          "÷ Opacus | page faults per step |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batch_sizes:
        steps = args.steps * max(1, 16 // b)
        g = torch.Generator().manual_seed(1)
        x = torch.rand(steps * b, 1, 28, 28, generator=g).to(device)
        y = torch.randint(0, 10, (steps * b,), generator=g).to(device)

        def data(pos: int, b: int = b, x: torch.Tensor = x, y: torch.Tensor = y):
            return x[pos * b : (pos + 1) * b], y[pos * b : (pos + 1) * b]

        fns = methods(model, b, steps, args.repeats, args.mechanisms, data,
                      host=not args.no_host, with_opacus=not args.no_opacus)
        times: dict[str, list[float]] = {name: [] for name in fns}
        # the kernel's minor page faults in the block (this thread's): on some machines a
        # step's time moves with them (memory the allocator gave back and takes again)
        faults: dict[str, list[float]] = {name: [] for name in fns}
        if args.only is not None:  # one method's warm-up and timed block (--isolated)
            fn = fns[args.only]
            fn()
            t, f = timed_block(fn, steps, sync)
            print(f"ONLY\t{t!r}\t{f!r}", flush=True)
            return 0
        if args.isolated:
            for _ in range(args.repeats):
                for name in fns:
                    t, f = isolated_block(argv, b, name)
                    times[name].append(t)
                    faults[name].append(f)
        else:
            for fn in fns.values():  # warm-up (allocations, vmap tracing)
                fn()
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t, f = timed_block(fn, steps, sync)
                    times[name].append(t)
                    faults[name].append(f)

        def ratio(ts: list[float], ref: str, times: dict[str, list[float]] = times) -> str:
            if ref not in times:
                return "–"
            r = statistics.median(t / u for t, u in zip(ts, times[ref], strict=True))
            return f"{r:.2f}×"

        for name, ts in times.items():
            print(f"| {b} | {name} | {1e3 * statistics.median(ts):.2f} | "
                  f"{ratio(ts, 'bare SGD')} | {ratio(ts, 'draw d Gaussians + bare')} | "
                  f"{ratio(ts, 'Opacus (i.i.d. noise)')} | "
                  f"{statistics.median(faults[name]):,.0f} |", flush=True)
        if args.profile:
            profile(fns, device, sync)
        if args.parts:
            parts(model, data, steps, args.repeats, sync)
    return 0


def timed_block(fn: Callable[[], None], steps: int, sync: Callable[[], None]
                ) -> tuple[float, float]:
    """One block of ``fn``: seconds a step, and this thread's minor page faults a step."""
    sync()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    start = time.perf_counter()
    fn()
    sync()
    return ((time.perf_counter() - start) / steps,
            (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / steps)


def isolated_block(argv: list[str] | None, b: int, name: str) -> tuple[float, float]:
    """:func:`timed_block` of method ``name`` at batch ``b`` in a fresh process of this
    script (the same options, ``--only``): its seconds and faults a step."""
    args = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--isolated", "--parts", "--profile"):
        while flag in args:
            args.remove(flag)
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args,
                           "--batch-sizes", str(b), "--only", name],
                          capture_output=True, text=True, check=False)
    line = [r for r in done.stdout.splitlines() if r.startswith("ONLY\t")]
    if done.returncode != 0 or not line:
        raise SystemExit(f"{name} at batch {b} failed in its own process:\n{done.stderr}")
    _, t, f = line[-1].split("\t")
    return float(t), float(f)


def parts(model: torch.nn.Module, data: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
          steps: int, repeats: int, sync: Callable[[], None]) -> None:
    """Ours (BLT) and the bare step part by part: each part's wall ms a step, the median
    over ``repeats`` blocks of ``steps`` steps, the parts timed by wrapping the library's
    functions in place (restored after). Ours' parts: the model's forward, the backward to
    the layers' outputs, the per-example conv weight gradients, the per-example norms and
    clip factors, the weighted sums, the noise increment, the rest of the private backward
    and step; the bare step's: forward, backward, update."""
    from flwr_corrnoise.torch import grad_sample as gs
    from flwr_corrnoise.torch import optimizer as opt

    settings = PrivacySettings(mechanism="blt", horizon=steps * (repeats + 2))
    m = copy.deepcopy(model)
    private = PrivateOptimizer(torch.optim.SGD(m.parameters(), lr=ETA), m, settings, seed=0)
    spent: dict[str, float] = {}
    patched: list[tuple[object, str, object]] = []

    def timed(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def run(*a, **k):  # type: ignore[no-untyped-def]
            sync()
            start = time.perf_counter()
            out = inner(*a, **k)
            sync()
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
            return out
        patched.append((owner, name, owner.__dict__.get(name, None)))
        setattr(owner, name, run)

    timed(m, "forward", "forward")
    timed(torch.autograd, "grad", "backward to the layers' outputs")
    timed(gs, "_conv2d_weight_per_example", "per-example conv weight gradients")
    timed(opt, "clip_factors", "per-example norms and clip factors")
    timed(gs.Materialized, "weighted_sum", "weighted sums")
    timed(gs.Outer, "weighted_sum", "weighted sums")
    assert private.noise is not None
    timed(private.noise, "next", "noise increment (draws, recurrence, scaling)")
    bare_model = copy.deepcopy(model)
    try:
        per_block: dict[str, list[float]] = {}
        for _ in range(repeats + 1):  # the first block warms up
            spent.clear()
            start = time.perf_counter()
            for pos in range(steps):
                private.zero_grad()
                private.backward(*data(pos))
                private.step()
            sync()
            spent["ours: step"] = time.perf_counter() - start
            for pos in range(steps):
                x, y = data(pos)
                bare_model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                loss = CE(bare_model(x), y)
                sync()
                t1 = time.perf_counter()
                loss.backward()
                sync()
                t2 = time.perf_counter()
                with torch.no_grad():
                    for q in bare_model.parameters():
                        q -= ETA * q.grad
                sync()
                t3 = time.perf_counter()
                for label, dt in (("bare: forward", t1 - t0), ("bare: backward", t2 - t1),
                                  ("bare: update", t3 - t2), ("bare: step", t3 - t0)):
                    spent[label] = spent.get(label, 0.0) + dt
            for label, total in spent.items():
                per_block.setdefault(label, []).append(total / steps)
    finally:
        for owner, name, before in reversed(patched):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
    # the rest: the private backward and step less the parts inside them
    inside = ("forward", "backward to the layers' outputs",
              "per-example conv weight gradients", "per-example norms and clip factors",
              "weighted sums", "noise increment (draws, recurrence, scaling)")
    med = {label: statistics.median(v[1:]) for label, v in per_block.items()}
    med["rest of ours (losses, hooks, sums, update)"] = (
        med["ours: step"] - sum(med.get(label, 0.0) for label in inside))
    print("\n| part | ms a step |\n|---|---|")
    for label in ("ours: step", *inside, "rest of ours (losses, hooks, sums, update)",
                  "bare: step", "bare: forward", "bare: backward", "bare: update"):
        print(f"| {label} | {1e3 * med.get(label, 0.0):.2f} |")


def profile(fns: dict[str, Callable[[], None]], device: torch.device,
            sync: Callable[[], None]) -> None:
    """torch.profiler's operators of one block of each ``ours`` method and the bare step,
    by self time on the device (CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    activities = [ProfilerActivity.CPU]
    key = "self_cpu_time_total"
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        key = "self_cuda_time_total"
    for name, fn in fns.items():
        if not (name.startswith("ours") or name == "bare SGD"):
            continue
        with run_profile(activities=activities) as prof:
            fn()
            sync()
        print(f"\n{name}: top operators by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
