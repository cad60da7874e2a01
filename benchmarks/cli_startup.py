"""The CLI's start-up against the build it reports (issue 22, item 4).

    OPENBLAS_NUM_THREADS=1 python benchmarks/cli_startup.py --steps 1000 4000 \
        --names blt optimized toeplitz --optimized-gap 0.02

For each command (the interpreter alone, ``python -c pass``; ``--help``; ``mechanism
--name NAME --steps N`` for every name and N; ``calibrate`` and ``plan`` once), one row:

* **wall s**: the ``flwr-corrnoise`` process from spawn to exit
  (``python -X importtime -m flwr_corrnoise.cli …``), as a user waits for it;
* **imports s**: what that same process spent importing (the sum of its top-level
  imports' cumulative times from ``-X importtime``, which writes one line per import and
  costs little besides): with the build, from one process, so ``wall ≥ imports + build``
  and the rest is the interpreter and the command's other work;
* **CLI build s**: the ``build_seconds`` that process printed (``mechanism`` only);
* **warm build s**: the same build (``cli._build`` on the same arguments, so the same
  parameters) run twice in this one Python process, each time with the in-process memo
  cleared and a fresh empty disk cache, timed the second time;
* **load**: ``os.getloadavg()`` (1 and 5 min) when the row started: the machines are
  shared, and a build measured under a load of 8 on 2 cores is not one measured idle.

The BLAS threads matter more than the start-up on a shared machine: with OpenBLAS's
default (one thread per core) and other processes busy, the dense solves (``optimized``)
can run many times slower than with ``OPENBLAS_NUM_THREADS=1``, and vary from run to run;
the header line says which was set.

Every build solves (no disk cache): each CLI process gets an empty
``$FLWR_CORRNOISE_CACHE`` of its own. ``--optimized-gap`` passes ``--gap`` to the
``optimized`` rows (its default, 0.01 %, takes minutes at N = 4000). Timings are printed,
never compared in a test (``tests/experiments/test_benchmarks.py`` checks the table's
structure at toy size).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flwr_corrnoise import cli
from flwr_corrnoise.mechanisms import build_factorization

#: the plan row: the example of ``flwr-corrnoise plan`` in the CLI's docstring
PLAN = "--model-size 200000 --examples 6000 --batch-size 32 --epochs 3 --learners 10"
#: the variables that set OpenBLAS's threads (the CLI processes inherit them)
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
COLUMNS = ("command", "wall s", "imports s", "CLI build s", "warm build s", "load 1/5 min")


def import_seconds(stderr: str) -> float:
    """The seconds a ``python -X importtime`` process spent importing: the cumulative
    times (µs) of its top-level imports (the least indented), summed. Nested imports are
    inside their parent's cumulative time, so they are not added again."""
    rows: list[tuple[int, int]] = []
    for line in stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = line.split("|", 2)
        if not cumulative.strip().isdigit():  # the header line
            continue
        rows.append((len(name) - len(name.lstrip()), int(cumulative)))
    if not rows:
        return float("nan")
    top = min(depth for depth, _ in rows)
    return sum(us for depth, us in rows if depth == top) / 1e6


def run_cli(argv: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    """``flwr-corrnoise ARGV`` in a fresh interpreter under ``-X importtime`` (no ARGV: the
    interpreter alone, ``python -c pass``, the floor under every row)."""
    cmd = [sys.executable, "-X", "importtime",
           *(["-m", "flwr_corrnoise.cli", *argv] if argv else ["-c", "pass"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "FLWR_CORRNOISE_CACHE": str(cache)})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


def warm_build(argv: list[str], scratch: Path) -> float:
    """Seconds of the second of two builds of ``argv``'s factorization in this process
    (each with the memo cleared and an empty disk cache), through the CLI's own
    ``_build`` so that the parameters are the CLI's."""
    args = cli.build_parser().parse_args(argv)
    name = args.name if args.command == "mechanism" else args.mechanism
    seconds = float("nan")
    for _ in range(2):
        build_factorization.cache_clear()
        os.environ["FLWR_CORRNOISE_CACHE"] = str(Path(tempfile.mkdtemp(dir=scratch)))
        with contextlib.redirect_stderr(io.StringIO()):  # the solver's progress lines
            _, seconds = cli._build(name, args.steps, args)
    return seconds


def row(label: str, argv: list[str], scratch: Path, builds: bool) -> list[str]:
    load = os.getloadavg()
    cache = Path(tempfile.mkdtemp(dir=scratch))
    start = time.perf_counter()
    proc = run_cli(argv, cache)
    wall = time.perf_counter() - start
    imports = import_seconds(proc.stderr)
    printed = "–"
    if argv and argv[0] == "mechanism":
        printed = f"{json.loads(proc.stdout)['build_seconds']:.2f}"
    warm = f"{warm_build(argv, scratch):.2f}" if builds else "–"
    return [label, f"{wall:.2f}", f"{imports:.2f}", printed, warm,
            f"{load[0]:.1f} / {load[1]:.1f}"]


def commands(args: argparse.Namespace) -> list[tuple[str, list[str], bool]]:
    """(label, argv, whether it builds) for every row."""
    out: list[tuple[str, list[str], bool]] = [
        ("python -c pass", [], False), ("--help", ["--help"], False)]
    for name in args.names:
        for steps in args.steps:
            argv = ["mechanism", "--name", name, "--steps", str(steps)]
            if name == "optimized" and args.optimized_gap is not None:
                argv += ["--gap", str(args.optimized_gap)]
            out.append((" ".join(argv), [*argv, "--json"], True))
    cal = ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
           "--mechanism", "blt", "--steps", str(args.steps[0])]
    out.append((" ".join(cal), [*cal, "--json"], True))
    plan = ["plan", *args.plan.split()]
    out.append((" ".join(plan), [*plan, "--json"], False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--names", nargs="+", default=["blt", "optimized", "toeplitz"])
    parser.add_argument("--optimized-gap", type=float, default=None,
                        help="--gap for the optimized rows (default: the CLI's)")
    parser.add_argument("--plan", default=PLAN,
                        help=f"the plan row's arguments (default: {PLAN})")
    args = parser.parse_args()
    threads = {k: os.environ[k] for k in BLAS_THREADS if k in os.environ}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; BLAS threads: "
          f"{', '.join(f'{k}={v}' for k, v in threads.items()) or 'unset (one per core)'}; "
          f"every build solves (empty disk cache)\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    with tempfile.TemporaryDirectory() as scratch:
        for label, argv, builds in commands(args):
            print("| " + " | ".join(row(f"`{label}`", argv, Path(scratch), builds)) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
