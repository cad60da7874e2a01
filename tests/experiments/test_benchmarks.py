"""The benchmark scripts run (at toy sizes) and print the tables docs/ quotes."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flower_helpers import RAY, ray_head

ROOT = Path(__file__).resolve().parents[2]


#: scripts that start processes of their own (a Flower simulation per variant, the CLI's
#: start-up): run as the user runs them, in a subprocess
OWN_PROCESSES = {"flower_scale.py", "cli_startup.py"}


def run(script: str, *args: str) -> list[list[str]]:
    """``python benchmarks/SCRIPT ARGS``'s table rows. The scripts whose work is in this
    process run here, as ``__main__`` with their own ``sys.argv`` and ``sys.path[0]``
    (``runpy``): a fresh interpreter importing NumPy, SciPy, Flower and PyTorch again cost
    3–8 s of CPU per script, more than the toy run. The environment and PyTorch's thread
    count, which some scripts set, are restored after; a non-zero exit fails the test."""
    path = ROOT / "benchmarks" / script
    if script in OWN_PROCESSES:
        proc = subprocess.run([sys.executable, str(path), *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = proc.stdout
    else:
        out = run_here(path, *args)
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ")]


def run_here(path: Path, *args: str) -> str:
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    environ, argv, syspath, cwd = dict(os.environ), sys.argv, list(sys.path), os.getcwd()
    buf = io.StringIO()
    try:
        sys.argv = [str(path), *args]
        sys.path.insert(0, str(path.parent))
        os.chdir(ROOT)
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as ex:
                assert ex.code in (None, 0), f"{path.name} exited {ex.code}"
    finally:
        sys.argv, sys.path[:] = argv, syspath
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        if torch is not None:  # as it was before the script (one it imported keeps its own)
            torch.set_num_threads(threads)
    return buf.getvalue()


def test_scale_table() -> None:
    rows = run("scale_table.py", "--steps", "64", "--dense-max", "64")
    names = [r[1] for r in rows[1:]]
    assert names[:3] == ["optimized", "optimized (2 % gap)", "blt (4 buffers)"]
    rmse = {r[1]: float(r[2]) for r in rows[1:]}
    bound = rmse["*certified lower bound* ‖A‖_*/N"]
    assert all(v >= bound for v in rmse.values())
    assert rmse["optimized"] <= rmse["blt (4 buffers)"] < rmse["toeplitz"]


def test_noise_throughput() -> None:
    rows = run("noise_throughput.py", "--dim", "2000", "--steps", "64", "--repeats", "2",
               "--block", "2", "--dense-steps", "4")
    by_name = {r[0]: r for r in rows[1:]}
    assert set(by_name) == {"independent", "tree", "efficient-tree", "blt", "toeplitz",
                            "optimized", "banded-inverse", "bandmf"}
    assert by_name["independent"][4] == "0 MB" and float(by_name["blt"][3]) > 0


@pytest.mark.parametrize("steps", ["16"])
def test_mechanisms_table(steps: str) -> None:
    rows = run("mechanisms_table.py", "--steps", steps)
    assert [r[1] for r in rows[1:7]] == ["optimized", "blt", "toeplitz", "efficient-tree",
                                         "tree", "independent"]


@pytest.mark.slow
def test_torch_step() -> None:
    pytest.importorskip("torch")
    rows = run("torch_step.py", "--batch-sizes", "1", "--steps", "2", "--repeats", "1",
               "--mechanisms", "blt")
    by = {(r[0], r[1]): r for r in rows[1:]}
    for b in ("1",):
        assert {(b, "bare SGD"), (b, "draw d Gaussians + bare"), (b, "ours, blt"),
                (b, "host reference (v0.x), blt")} <= set(by)
        assert by[(b, "bare SGD")][3] == "1.00×"
    assert ("1", "ours, blt, whole-batch clip") in by
    assert all(float(r[2]) > 0 and r[3].endswith("×") and r[4].endswith("×")
               and float(r[6].replace(",", "")) >= 0 for r in rows[1:])
    assert rows[0][6] == "page faults per step"


def test_torch_step_parts() -> None:
    """``torch_step.py --parts --no-opacus`` at toy size: no Opacus row, then ours (BLT)
    and the bare step part by part. Ours' parts run inside its step, so their sum is at
    most the step (a part counted twice, or one outside the step, fails here); the wrapped
    functions are the library's own again afterwards. Timings are not compared."""
    pytest.importorskip("torch")
    from flwr_corrnoise.torch import grad_sample, optimizer

    before = (optimizer.clip_factors, grad_sample.Materialized.weighted_sum)
    rows = run("torch_step.py", "--batch-sizes", "4", "--steps", "2", "--repeats", "1",
               "--mechanisms", "blt", "--no-host", "--no-opacus", "--parts")
    assert (optimizer.clip_factors, grad_sample.Materialized.weighted_sum) == before
    methods = {r[1] for r in rows if len(r) == 7}
    assert {"bare SGD", "ours, blt"} <= methods and "Opacus (i.i.d. noise)" not in methods
    parts = {r[0]: float(r[1]) for r in rows if len(r) == 2 and r[0] != "part"}
    inside = ["forward", "backward to the layers' outputs",
              "per-example conv weight gradients", "per-example norms and clip factors",
              "weighted sums", "noise increment (draws, recurrence, scaling)"]
    assert set(inside) <= set(parts) and all(parts[p] > 0 for p in inside)
    assert parts["rest of ours (losses, hooks, sums, update)"] >= -0.02
    assert sum(parts[p] for p in inside) <= parts["ours: step"] + 0.02
    assert parts["bare: forward"] + parts["bare: backward"] <= parts["bare: step"] + 0.02


def test_torch_step_isolated() -> None:
    """``torch_step.py --isolated`` at toy size: every method's block ran in a process of
    its own (the parent runs none: a method that fails there fails the run) and came back
    as a row with its time and page faults. Timings are not compared."""
    pytest.importorskip("torch")
    rows = run("torch_step.py", "--batch-sizes", "2", "--steps", "2", "--repeats", "1",
               "--mechanisms", "blt", "--no-host", "--no-opacus", "--isolated")
    by = {r[1]: r for r in rows[1:] if len(r) == 7}
    assert set(by) == {"bare SGD", "draw d Gaussians + bare", "ours, blt"}
    assert by["bare SGD"][3] == "1.00×"
    assert all(float(r[2]) > 0 and float(r[6].replace(",", "")) >= 0 for r in by.values())


def test_conv_per_example() -> None:
    """benchmarks/conv_per_example.py at toy size: every alternative gave the library's
    per-example gradients (the script checks each against them and exits non-zero
    otherwise), and the batch-summed row is the base. Timings are not compared."""
    pytest.importorskip("torch")
    rows = run("conv_per_example.py", "--batch", "3", "--repeats", "1")
    assert rows[0] == ["per-example weight gradients", "ms", "× batch-summed"]
    names = [r[0] for r in rows[1:]]
    assert names[0].startswith("the library's") and len(names) == 8
    assert rows[-1][0].startswith("batch-summed") and rows[-1][2] == "1.00×"
    assert all(float(r[1]) > 0 for r in rows[1:])


def test_blt_recurrence() -> None:
    """benchmarks/blt_recurrence.py at toy size (docs/benchmarks.md quotes it): every way
    gave the library's floats (the script checks them and exits non-zero otherwise), the
    compiled row is the base, torch's row only at τ = 1. Timings are not compared."""
    from flwr_corrnoise import compiled_kernel

    if compiled_kernel.kernel() is None:
        pytest.skip("no compiled kernel here")
    rows = run("blt_recurrence.py", "--dims", "300", "--buffers", "4", "7", "--taus", "1", "3",
               "--repeats", "1")
    assert rows[0] == ["d", "k", "τ", "way", "µs per step", "× library (compiled)"]
    body = {(r[1], r[2], r[3]): r for r in rows[1:]}
    for k in ("4", "7"):
        for tau in ("1", "3"):
            assert body[(k, tau, "library (compiled)")][5] == "1.00×"
            assert (k, tau, "library (NumPy path)") in body
    has_torch = importlib.util.find_spec("torch") is not None
    assert (("4", "1", "torch addmv + addcmul") in body) == has_torch
    assert ("4", "3", "torch addmv + addcmul") not in body
    assert all(float(r[4]) > 0 for r in rows[1:])


def test_clip_norms() -> None:
    """benchmarks/clip_norms.py at toy size: both library paths gave the same floats and
    einsum agreed within the bound (the script exits non-zero otherwise); the compiled row
    is the base. Timings are not compared."""
    from flwr_corrnoise import compiled_kernel

    if compiled_kernel.kernel() is None:
        pytest.skip("no compiled kernel here")
    rows = run("clip_norms.py", "--shapes", "1x300", "20x70", "--repeats", "1")
    header = ["rows × d", "dtype", "way", "µs per call", "× compiled"]
    assert rows[0] == header and rows.count(header) == 2  # the norms, then the scaling
    second = rows.index(header, 1)
    for table, ways in ((rows[1:second], ("compiled", "NumPy path",
                                          "einsum over a float64 copy (before)")),
                        (rows[second + 1:], ("compiled", "NumPy path",
                                             "masked multiply (before)"))):
        body = {(r[0], r[1], r[2]): r for r in table}
        assert set(body) == {(shape, dt, way) for shape in ("1 × 300", "20 × 70")
                             for dt in ("float32", "float64") for way in ways}
        assert all(body[(shape, dt, "compiled")][4] == "1.00×"
                   for shape in ("1 × 300", "20 × 70") for dt in ("float32", "float64"))


def test_device_noise() -> None:
    """The device-noise table at toy size on the CPU (no fused kernel there: Triton runs on
    CUDA devices); every row a positive time per normal."""
    pytest.importorskip("torch")
    rows = run("device_noise.py", "--device", "cpu", "--dims", "3000", "--repeats", "1")
    names = {r[1] for r in rows[1:]}
    assert {"keystream, torch ops", "DeviceGaussian row, float32",
            "DeviceGaussian row, float64", "torch.randn float32",
            "TorchNoiseStream blt float32, next()"} <= names
    assert "keystream, fused Triton" not in names
    assert all(r[0] == "3,000" and float(r[2]) > 0 for r in rows[1:])


@pytest.mark.slow
def test_toeplitz_stream() -> None:
    """The regenerated Toeplitz increment equals the stored one (the script checks it and
    exits non-zero otherwise); the regenerated stream's work per step, (k + 1)·d Gaussian
    draws, grows with k. Timings are only checked to be measured (positive): comparing them
    in a test is noise on a shared machine (docs/benchmarks.md compares them)."""
    pytest.importorskip("torch")
    rows = run("toeplitz_stream.py", "--dim", "5000", "--horizon", "200", "--ks", "5", "60",
               "--repeats", "1")
    steps = {r[0]: r for r in rows if r[0] in ("5", "60")}
    assert float(steps["60"][2]) > 0 and float(steps["5"][2]) > 0
    assert steps["5"][4] == f"{6 * 5000:,}" and steps["60"][4] == f"{61 * 5000:,}"
    names = [r[0] for r in rows]
    assert {"independent", "BLT, 4 buffers", "Toeplitz, stored history",
            "Toeplitz, regenerated (counter-based)"} <= set(names)


def test_cipher_noise() -> None:
    """benchmarks/cipher_noise.py at toy size (≈ 5 s): every generator timed beside NumPy's
    Philox ziggurat of its dtype in the same run, the floor's pieces, and the moments and KS
    rows of the --ks check (timings are only checked to be measured: docs/benchmarks.md
    compares them)."""
    rows = run("cipher_noise.py", "--dims", "2000", "--repeats", "2", "--floor",
               "--ks", "20000", "--grid-dims", "500", "--stream-steps", "5")
    draws = {(r[1], r[2]): r for r in rows if r[0] == "2,000"}
    assert set(draws) == {("Philox ziggurat", "float32"), ("Philox ziggurat", "float64"),
                          ("ChaCha20Gaussian (secure_noise)", "float64"),
                          ("cipher row (AES-128-CTR)", "float32"),
                          ("cipher row (AES-128-CTR)", "float64"),
                          ("cipher row, NumPy path", "float32"),
                          ("cipher row, NumPy path", "float64"),
                          ("ziggurat (candidate, AES-128-CTR)", "float32"),
                          ("ziggurat (candidate, AES-128-CTR)", "float64")}
    assert all(float(r[3]) > 0 and r[4].endswith("×") for r in draws.values())
    assert draws[("Philox ziggurat", "float32")][4] == "1.00×"
    pieces = {r[0]: float(r[1]) for r in rows if len(r) == 2 and r[0] != "piece (hot buffers)"
              and not r[0].startswith("---")}
    assert {"AES-128-CTR keystream, 8 B a normal (float64 Box–Muller and ziggurat)",
            "ChaCha20 keystream, 8 B a normal", "NumPy float64 sin + cos (a pair)",
            "float64 table gathers (cos, sin; a pair)",
            "Box–Muller transform, float32 (the kernel's)",
            "ziggurat main path, float64 (candidate)"} <= set(pieces)
    assert all(v > 0 for v in pieces.values())
    # its learner messages (flower_scale.LearnerMessages) ran under the simulation rules
    # in this process; they must not stay on for the tests that run here after it
    from flwr_corrnoise.flower import session
    assert session.in_simulation() is False
    grid = [r for r in rows if r[0] == "500"]  # the floating-point defence's share
    assert len(grid) == 1 and float(grid[0][1]) > 0 and float(grid[0][2]) > 0
    assert grid[0][3].endswith("%") and float(grid[0][4]) > 0 and grid[0][5].endswith("%")
    ks = {r[0]: r for r in rows if r[0] in ("float32", "float64")}
    assert set(ks) == {"float32", "float64"}
    assert all(r[1] == "20,000" and 0 <= float(r[-1]) <= 1 for r in ks.values())


@pytest.mark.slow
def test_cipher_noise_stream_steps() -> None:
    """benchmarks/cipher_noise.py --stream-dims at toy size: a stream's step timed for a
    Philox stream, the AES stream one row a kernel call and with rows ahead, each dtype."""
    rows = run("cipher_noise.py", "--dims", "100", "--repeats", "1", "--stream-dims", "2",
               "20", "--stream-steps", "3")
    names = {"Philox stream (format 2)", "AES stream, one row a kernel call (before)",
             "AES stream, rows ahead (now)"}
    steps = {(r[0], r[1], r[2]): r for r in rows if len(r) == 5 and r[1] in names}
    assert set(steps) == {(d, n, t) for d in ("2", "20") for n in names
                          for t in ("float32", "float64")}
    assert all(float(r[3]) > 0 and r[4].endswith("×") for r in steps.values())
    assert steps[("2", "Philox stream (format 2)", "float32")][4] == "1.00×"


def test_offload_pages() -> None:
    """benchmarks/offload_pages.py at toy size: a commit timed in each of a learner's first
    three rounds (new folder and file, new file, stale file reused), with one writer and
    with two processes at once; the third round is the ratios' base."""
    rows = run("offload_pages.py", "--dims", "2000", "--learners", "5", "--writers", "1", "2")
    by = {(r[1], r[2]): r for r in rows[1:]}
    labels = ("1: new folder and file", "2: new file (the loaded one kept)",
              "3: the stale file's pages reused")
    assert set(by) == {(w, label) for w in ("1", "2") for label in labels}
    assert all(r[0] == "2,000" and float(r[3]) > 0 and r[4].endswith("×") for r in by.values())
    assert by[("1", labels[2])][4] == "1.00×"


def test_message_parts() -> None:
    """benchmarks/message_parts.py at toy size: every part timed in each of a learner's
    first three rounds, a fresh state only in round 1, a file read only from round 2; and
    the library's functions are its own again after the run (the timers unwrapped)."""
    from flwr_corrnoise import learner, state_offload
    from flwr_corrnoise.flower import session
    from flwr_corrnoise.learner_state import LearnerState

    rows = run("message_parts.py", "--learners", "3", "--dims", "2000")
    by = {r[0]: [float(v) for v in r[1:]] for r in rows[1:]}
    assert len(by) == 14 and all(len(v) == 3 for v in by.values())
    assert all(v > 0 for v in by["the whole message"] + by["plain Flower's message"])
    fresh, read = by["a fresh state (first message)"], by["the offloaded file's read and MAC"]
    assert fresh[0] > 0 and fresh[2] == 0 and read[0] == 0 and read[2] > 0
    for fn in (state_offload.read, state_offload.write, learner.local_rounds,
               session.LearnerTransaction.open, LearnerState.create):
        assert not hasattr(fn, "__wrapped__")


def test_noise_keys() -> None:
    rows = run("noise_keys.py", "--dims", "100", "2000", "--repeats", "2",
               "--block-elements", "20000")
    names = {r[1] for r in rows[1:]}
    assert {"PCG64 float64 (replaced)", "keyed Philox float64 (NumPy streams)"} <= names
    assert all(float(r[3].rstrip("×")) > 0 for r in rows[1:])
    assert {r[0] for r in rows[1:]} == {"100", "2,000"}


@pytest.mark.slow  # three Flower simulations, each starting its own Ray (≈ 1 min)
def test_flower_scale(tmp_path: Path) -> None:
    """benchmarks/flower_scale.py at toy size (20 learners × d = 20 000, 3 rounds, a
    float32 model): the table has one row per variant, and the offload folder holds one or
    two state files per learner that trained with state-offload = on (plain Flower keeps
    none; ``ours-off`` is the same script with ``state-offload = off``, whose learners keep
    their state in ``context.state``: tests/learner/test_state_offload.py).
    Each file holds float32 buffers (4·d·4 bytes and a header, not 4·d·8) after every round:
    the strategy sends the model on in float32 and each learner's stream stays float32.
    All three run on this test worker's Ray head (``--ray-address``): a fresh local Ray
    per run (the script's default: ``backend("")`` is the constant ``BACKEND``; Flower
    starting a local Ray is what the README demo's test and tests/flower/test_flwr_run.py
    run) cost ≈ 25 s of CPU in its own processes, more than the toy runs. Timings are not
    compared."""
    dim = 20_000
    toy = ["--learners", "20", "--dims", str(dim), "--rounds", "3", "--fraction", "0.5",
           "--offload", "on", "--dtype", "float32"]
    # one ClientApp actor a run (the head's 2 CPUs each): an actor is a process that
    # imports Flower, Ray and the app, ≈ 6 s of CPU, more than a toy run's training
    head = (["--ray-address", ray_head().address, "--client-cpus", "2"] if RAY.exists()
            else ["--actors", "1"])
    out = tmp_path / "runs.csv"
    rows = run("flower_scale.py", *toy, "--variants", "plain", "ours",
               "--out", str(out), *head)
    lines = list(csv.DictReader(out.open()))
    header = rows[0]
    by = {r[2]: dict(zip(header, r, strict=True)) for r in rows[1:]}
    assert set(by) == {"plain", "ours (on)"}
    assert all(r["status"] == "ok" and float(r["s/round"]) > 0 for r in by.values())
    for r in by.values():  # each message's own CPU and page faults, from inside the actor
        cpu_ms, faults = r["learner CPU ms / page faults per msg"].split(" / ")
        assert float(cpu_ms) > 0 and int(faults) >= 0
        first, later = r["learner CPU ms, first / later msgs"].split(" / ")
        assert float(first) > 0 and float(later) > 0  # 3 rounds of 10 of 20: both kinds
        assert float(r["s/round, later half"]) > 0
        parts = r["CPU s/round, later half: driver / actors / Ray"].split(" / ")
        if head:  # an existing cluster's actors are not the run's descendants: not shown
            assert parts == ["–"] * 3
        else:
            assert float(parts[0]) > 0 and float(parts[1]) > 0 and float(parts[2]) >= 0
    trained = int(by["ours (on)"]["trained r2 → R"].split("→")[1])
    assert trained <= int(by["ours (on)"]["offload files"]) <= 2 * trained
    assert by["plain"]["offload files"] == "–"
    assert len(lines) == 2  # one line per run
    address = head[1] if head[:1] == ["--ray-address"] else ""
    assert [r["ray_address"] for r in lines] == [address] * 2
    assert all(float(r["client_cpus"]) == (2 if head[:1] == ["--ray-address"] else 1)
               for r in lines)
    (ours,) = [r for r in lines if r["offload_files"] not in ("", "0", "–")]
    assert ours["dtype"] == "float32"
    per_file = float(ours["offload_mib"]) * 2**20 / int(ours["offload_files"])  # on disk
    assert 4 * dim * 4 <= per_file < 4 * dim * 4 + 16 * 2**10


def test_tree_cpu_gives_each_part_of_the_tree_its_own_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower_scale.TreeCpu``: a descendant whose command is a ClientApp actor's (Ray
    names its processes ``ray::ClientAppActor...``) counts as ``actors``, with the CPU it
    used, and the root as ``driver``; the value seen last stays after the process exits."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from flower_scale import TreeCpu, psutil  # Ray's vendored copy where none is installed

    tree_cpu = TreeCpu(psutil.Process())
    before = tree_cpu()  # the test worker's own children (a Ray head) are in the tree too
    burn = ("import sys, time\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
            "sys.stdin.read()")
    proc = subprocess.Popen(["ray::ClientAppActor.run", "-c", burn], executable=sys.executable,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "done\n"
        seen = tree_cpu()
    finally:
        proc.communicate("")
    after = tree_cpu()
    assert seen["actors"] - before["actors"] >= 0.25 and seen["driver"] > 0
    assert after["actors"] == seen["actors"]  # the exited actor keeps its last value


def test_the_scale_task_draws_its_data_once_a_process_even_shipped_by_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower_scale.base_direction``: the simulation's child runs the script as
    ``__main__``, so Ray's cloudpickle ships the task to its actors by value, anew for every
    message. Two such copies of the task, unpickled apart, must share one d-vector (drawn
    once a process, as a real app's data), not draw it again per message."""
    import pickle
    import types

    import numpy as np
    from ray import cloudpickle  # the copy Ray ships functions with

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import flower_scale

    # an empty cache for the test, and whatever was there put back after it
    empty = types.ModuleType(flower_scale.CACHE_MODULE)
    empty.base = {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, flower_scale.CACHE_MODULE, empty)
    cloudpickle.register_pickle_by_value(flower_scale)
    try:
        shipped = cloudpickle.dumps(flower_scale.linear_gradient)
    finally:
        cloudpickle.unregister_pickle_by_value(flower_scale)
    first, second = pickle.loads(shipped), pickle.loads(shipped)
    assert first is not second and first is not flower_scale.linear_gradient  # by value
    x = [np.ones(500)]
    first(500, 3)(x, 0), second(500, 3)(x, 0)
    cache = sys.modules[flower_scale.CACHE_MODULE].base
    assert cache is empty.base and list(cache) == [(500, 0)]  # drawn once for both copies
    assert np.isclose(np.linalg.norm(cache[(500, 0)]), 1.0)


def test_a_profiled_part_is_its_outermost_function_counted_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower_scale.part_seconds``: of two nested functions of one name in one file (the
    transaction's ``commit`` calling the session's), the outer one's cumulative time —
    a sum would count the inner one's time twice."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from flower_scale import part_seconds

    stats = {("x/session.py", 649, "commit"): (1, 1, 0.001, 0.030, {}),
             ("x/session.py", 479, "commit"): (1, 1, 0.002, 0.028, {}),
             ("x/session.py", 629, "open"): (1, 1, 0.001, 0.010, {}),
             ("x/other.py", 1, "commit"): (1, 1, 0.001, 0.500, {})}
    assert part_seconds(stats, "session.py", "commit") == 0.030
    assert part_seconds(stats, "session.py", "open") == 0.010
    assert part_seconds(stats, "session.py", "write") == 0.0


def test_the_scale_task_computes_in_the_models_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower_scale.linear_gradient``: a float32 model's gradient is float32 and equals
    the float64 one to float32 precision — the task a float32 model's user runs, the same
    for plain and ours (a float64 direction against float32 parameters took NumPy's casting
    loop, ≈ 3.5 ms a step at d = 10⁵, charged to ours alone)."""
    import numpy as np

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from flower_scale import linear_gradient

    grad = linear_gradient(1000, 3)
    x64 = np.random.default_rng(1).standard_normal(1000)
    g64 = grad([x64], 5)[0]
    g32 = grad([x64.astype(np.float32)], 5)[0]
    assert g64.dtype == np.float64 and g32.dtype == np.float32
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-6)


def test_compiled_noise_floor() -> None:
    """benchmarks/compiled_noise_floor.py at toy size: the compiled transform is built and
    vectorized, every path has a row per d, and its rows pass the KS check (the script
    fails below p = 1e-4, so a broken transform cannot report a floor). Skipped without
    gcc or AVX2 (the script then measures nothing and says so). Timings are not compared."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compiled_noise_floor.py"),
                           "--dims", "5000", "--repeats", "1", "--check", "20000"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if "nothing measured" in proc.stdout:
        pytest.skip("no gcc or no AVX2 here")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 5,000 |")]
    assert [r.split(" | ")[1] for r in rows] == [
        "compiled row (AES-128-CTR + compiled Box–Muller)",
        "C row (OpenSSL AES-128-CTR + compiled Box–Muller, no Python)",
        "cipher row (the library's kernel)", "cipher row, NumPy path", "Philox ziggurat (NumPy)"]
    checks = [line for line in proc.stdout.splitlines()
              if line.startswith(("| compiled row | float", "| C row | float"))]
    assert len(checks) == 4 and all(float(c.split(" | ")[-1].rstrip(" |")) >= 1e-4
                                    for c in checks)


@pytest.mark.slow
def test_flower_overhead() -> None:
    """benchmarks/flower_overhead.py (docs/benchmarks.md § 3) at toy size: plain FedAvg
    and CorrNoiseFedAvg each take positive seconds per round, the ratio printed is theirs,
    and the learner-code line follows. On the test worker's Ray head (``--ray-address``),
    one ClientApp actor a run (``--client-cpus 2`` of its 2 CPUs). Timings are not
    compared."""
    head = ["--ray-address", ray_head().address] if RAY.exists() else []
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "flower_overhead.py"),
                           "--rounds", "3", "--repeats", "1", "--mechanism", "blt",
                           "--client-cpus", "2", *head],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    pair = next(line for line in lines if line.startswith("repeat 1:"))
    plain = float(pair.split("plain FedAvg ")[1].split()[0])
    ours = float(pair.split("(blt) ")[1].split()[0])
    assert plain > 0 and ours > 0
    ratio = float(next(line for line in lines if line.startswith("median ratio")).split()[-1])
    # Both times are printed to 3 decimals and the ratio to 2: at toy size (≈ 0.05 s a
    # round) that rounding alone moves ours / plain by ≈ 0.02, so the check is that the
    # printed ratio lies within the range the printed times' rounding allows.
    low = (ours - 5e-4) / (plain + 5e-4) - 0.005
    high = (ours + 5e-4) / (plain - 5e-4) + 0.005
    assert low <= ratio <= high, (ratio, ours, plain)
    assert any(line.startswith("learner code per learner-round") for line in lines)


def test_flower_scale_message_cpu() -> None:
    """benchmarks/flower_scale.py --message-cpu at toy size: one row per d, 4 learners ×
    ROUNDS messages counted, positive CPU and wall ms for ours, plain's message and the
    τ·d draws beside them, and the issue's ratio (ours − plain) ÷ draws computed from the
    printed figures. Timings are not compared."""
    rows = run("flower_scale.py", "--message-cpu", "2", "--dims", "3000", "5000", "--tau", "6")
    header, body = rows[0], rows[1:]
    assert header == ["d", "dtype", "τ", "messages", "CPU ms / message", "wall ms / message",
                      "plain CPU ms", "τ·d draws CPU ms", "(ours − plain) ÷ draws"]
    assert [(r[0], r[1], r[2], r[3]) for r in body] == [("3,000", "float64", "6", "8"),
                                                        ("5,000", "float64", "6", "8")]
    for r in body:
        ours, wall, plain, draws = (float(x) for x in r[4:8])
        assert ours > 0 and wall > 0 and plain > 0 and draws > 0
        ratio = (ours - plain) / draws  # from figures printed to 0.005 ms
        slack = 0.01 + (0.01 + 0.005 * abs(ratio)) / max(draws - 0.005, 1e-3)
        assert abs(float(r[8].rstrip("×")) - ratio) <= slack


def test_learner_messages_take_the_local_steps_they_are_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flower_scale.LearnerMessages(tau=…)`` (what ``--message-cpu --tau`` times): each
    message of ours runs that many private steps (its reply's step count), and plain's
    message the same number of SGD steps (its ``num-examples``)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from flower_scale import LearnerMessages

    with LearnerMessages(50, "float32", 10, tau=6) as ours:
        ours.send(1)
        assert ours.send(2).content["metrics"]["steps"] == 12
    with LearnerMessages(50, "float32", 10, tau=6, plain=True) as plain:
        assert plain.send(1).content["metrics"]["num-examples"] == 6


def test_message_shares_reads_py_spy_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/message_shares.py: only samples inside a train message count, the
    one-time build does not, and a sample goes to the first part its frames name (the
    draws before BLT's step that calls them)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from message_shares import REST, shares

    send = "<module> (flower_scale.py:1);LearnerMessages.send (flower_scale.py:551)"
    lines = [
        f"{send};BLTKernel.next (blt.py:390);NoiseStream._draw (streams.py:447) 6",
        f"{send};BLTKernel.next (blt.py:390);NumpyOps.blt_step (streaming.py:135) 2",
        f"{send};LearnerTransaction.open (session.py:629);read (state_offload.py:199) 1",
        f"{send};make_client_app.<locals>.round_ (client.py:222) 1",
        f"{send};PrivacySettings.calibration;optimize_blt (blt.py:300) 50",
        "<module> (flower_scale.py:1);main (flower_scale.py:600) 40",
        "",
    ]
    total, parts = shares(lines)
    assert total == 10
    assert parts == {"noise: the 4·d Gaussian draws": 0.6, "noise: BLT's recurrence": 0.2,
                     "load: read, check, rebuild the state": 0.1, REST: 0.1}


@pytest.mark.slow
def test_cli_startup() -> None:
    """benchmarks/cli_startup.py at toy size: one row per command, in order, each with a
    wall time, an import time, the CLI's build seconds where it prints them (mechanism),
    a warm build where the command builds, and the load. Timings are not compared."""
    rows = run("cli_startup.py", "--steps", "16", "--names", "toeplitz", "--plan",
               "--model-size 100 --examples 32 --batch-size 8 --epochs 1 --no-levers")
    header, body = rows[0], rows[1:]
    assert header == ["command", "wall s", "imports s", "CLI build s", "warm build s",
                      "load 1/5 min"]
    assert [r[0].split()[0].strip("`") for r in body] == [
        "python", "--help", "mechanism", "calibrate", "plan"]
    by = {r[0].split()[0].strip("`"): dict(zip(header, r, strict=True)) for r in body}
    assert all(float(r["wall s"]) > 0 and float(r["imports s"]) > 0 for r in by.values())
    assert float(by["mechanism"]["CLI build s"]) >= 0
    assert float(by["mechanism"]["warm build s"]) >= 0
    assert float(by["calibrate"]["warm build s"]) >= 0
    assert by["calibrate"]["CLI build s"] == by["plan"]["warm build s"] == "–"
    load1, load5 = (float(x) for x in by["plan"]["load 1/5 min"].split(" / "))
    assert load1 >= 0 and load5 >= 0


def test_state_handling() -> None:
    """benchmarks/state_handling.py at toy size: both stores per d; an offloaded state
    leaves the driver a handle of under 1 KB whatever d, one in context.state ≥ 4·d floats
    (BLT's buffers). Timings are not compared."""
    rows = run("state_handling.py", "--dims", "2000", "20000", "--repeats", "2")
    body = {(r[0], r[1]): r for r in rows[1:]}
    assert set(body) == {(d, s) for d in ("2,000", "20,000")
                         for s in ("in context.state", "offloaded to a file")}
    for d in ("2,000", "20,000"):
        assert body[(d, "offloaded to a file")][6].endswith(" B")
        kept = body[(d, "in context.state")][6]
        assert kept.endswith("KB") and float(kept.split()[0]) * 1e3 >= 4 * 8 * int(
            d.replace(",", ""))


def test_offload_mac() -> None:
    """benchmarks/offload_mac.py at toy size (docs/benchmarks.md quotes it): every
    operation measured per d, the library's MAC named, the commit and load going through
    LearnerStorage (so through the owner, newest-file and MAC checks). Timings are not
    compared."""
    from flwr_corrnoise.state_offload import MAC

    rows = run("offload_mac.py", "--dims", "2000", "20000", "--repeats", "2")
    body = {(r[0], r[2]): r for r in rows[1:]}
    operations = {"write (no MAC)", "read (no MAC)", "MAC: Poly1305 (one-time key)",
                  "MAC: HMAC-SHA256", "MAC: AES-256-GMAC (one-time key)",
                  "MAC: SHA-256 digest", "MAC: BLAKE2b-256 digest",
                  f"LearnerStorage commit (write + {MAC})",
                  f"LearnerStorage load (read + checks + {MAC})"}
    assert set(body) == {(d, op) for d in ("2,000", "20,000") for op in operations}
    assert body[("20,000", "write (no MAC)")][1] == "0.6 MB"
    assert all(float(r[3]) >= 0 and float(r[4]) >= 0 for r in body.values())
    assert body[("2,000", "write (no MAC)")][4] == "1.00"


def test_server_aggregate() -> None:
    """benchmarks/server_aggregate.py at toy size: the aggregation's peak memory is a few
    updates' worth, not the replies' (40 replies of 20 000 floats: 6.1 MiB all at once).
    Timings are not compared."""
    rows = run("server_aggregate.py", "--dim", "20000", "--replies", "40", "--repeats", "1")
    (row,) = rows[1:]
    assert row[0] == "40 × 20,000"
    peak, update = float(row[2]), float(row[3])
    assert update == pytest.approx(20000 * 8 / 2**20, abs=0.05)
    assert peak < 10 * update  # held one at a time (all 40 at once: ≥ 40 × update)


def test_stream_contract() -> None:
    """benchmarks/stream_contract.py at toy size: the commit before issue 33's pure streams
    and this checkout time the same steps, one table row per case."""
    out = run_here(ROOT / "benchmarks" / "stream_contract.py", "--toy", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == ["blt", "tree", "banded-inverse"]
    assert all(float(r.rstrip(" |").split(" | ")[-1]) > 0 for r in rows)

