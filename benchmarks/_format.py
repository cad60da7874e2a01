"""Formatting shared by the benchmark scripts (run as ``python benchmarks/NAME.py``, so
this directory is on ``sys.path``)."""

from __future__ import annotations


def human_bytes(x: float) -> str:
    """``8000000`` → ``"8.0 MB"`` (decimal units, as the tables in docs/ use)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"
