"""Formatting and timing shared by the benchmark scripts (run as
``python benchmarks/NAME.py``, so this directory is on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def human_bytes(x: float) -> str:
    """``8000000`` → ``"8.0 MB"`` (decimal units, as the tables in docs/ use)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"


def time_block(fn: Callable[[], object], count: int) -> float:
    """Seconds per call of ``fn`` over ``count`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - start) / count


def interleaved(
    reference: Callable[[], object], candidate: Callable[[], object], block: int, repeats: int
) -> tuple[float, float, float]:
    """(median s per reference call, median s per candidate call, median per-pair ratio
    candidate/reference). Why interleaved blocks: the machines are shared and noisy, so
    both sides see the same load and only the ratio within a pair is trusted. Each is
    called once first (allocations, first cipher context)."""
    reference()
    candidate()
    ref, cand, ratios = [], [], []
    for _ in range(repeats):
        r = time_block(reference, block)
        c = time_block(candidate, block)
        ref.append(r)
        cand.append(c)
        ratios.append(c / r)
    return statistics.median(ref), statistics.median(cand), statistics.median(ratios)


def rotated_medians(ways: dict[str, Callable[[], object]], repeats: int,
                    calls: int) -> dict[str, float]:
    """Each way's median seconds a call over ``repeats`` rotations, every way one block of
    ``calls`` calls a rotation (so that a load swing hits all of them alike)."""
    samples: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            samples[name].append(time_block(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def ratio_rows(prefix: str, medians: dict[str, float], base: str,
               scale: float = 1e6) -> list[str]:
    """Markdown rows ``| prefix | way | scale·median | ÷ base |``, one per way."""
    return [f"| {prefix} | {name} | {scale * m:.1f} | {m / medians[base]:.2f}× |"
            for name, m in medians.items()]
