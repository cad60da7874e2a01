"""Reader for the LIBSVM / SVMlight text format (``label idx:val idx:val ...`` per line).

Why our own reader: the decentralized experiments' named datasets ("mushrooms", "letter",
"poker") are distributed by the LIBSVM site in this format, and the only common reader
(scikit-learn's ``load_svmlight_file``) would pull in a large dependency for twenty lines.
Indices are 1-based as the format specifies (a file with an index 0 is read as 0-based, as
scikit-learn's ``zero_based="auto"`` does); missing entries are zeros; the result is dense,
because these datasets are small (≤ 10⁶ × 10 or 8124 × 112).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = ["LibsvmFormatError", "read_libsvm", "write_libsvm"]


class LibsvmFormatError(ValueError):
    """A malformed LIBSVM file (the message names the file and line)."""


def _open_text(path: Path) -> list[str]:
    with open(path, "rb") as fh:
        head = fh.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rt", encoding="ascii", errors="strict") as fh:  # type: ignore[operator]
        return fh.read().splitlines()


def read_libsvm(
    path: str | os.PathLike[str], num_features: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read ``(X, y)``: ``X`` dense float64 ``(rows, num_features)``, ``y`` float64 labels.

    ``num_features`` fixes the width (an index beyond it is an error); by default it is the
    largest index seen. Comments (``#``) and blank lines are skipped. Gzipped files are read
    transparently.
    """
    path = Path(path)
    try:
        lines = _open_text(path)
    except UnicodeDecodeError as err:
        raise LibsvmFormatError(f"{path}: not an ASCII LIBSVM file ({err})") from err
    labels: list[float] = []
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    saw_zero = False
    for lineno, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            label = float(parts[0])
            pairs = [p.split(":", 1) for p in parts[1:]]
            idx = np.array([int(i) for i, _ in pairs], dtype=np.int64)
            val = np.array([float(v) for _, v in pairs], dtype=float)
        except ValueError as err:
            raise LibsvmFormatError(f"{path}:{lineno}: malformed line ({err})") from err
        if not np.isfinite(label) or not np.all(np.isfinite(val)):
            raise LibsvmFormatError(f"{path}:{lineno}: non-finite value")
        if np.any(idx < 0):
            raise LibsvmFormatError(f"{path}:{lineno}: negative feature index")
        if len(set(idx.tolist())) != idx.size:
            raise LibsvmFormatError(f"{path}:{lineno}: repeated feature index")
        saw_zero = saw_zero or bool(np.any(idx == 0))
        labels.append(label)
        rows.append((idx, val))
    if not rows:
        raise LibsvmFormatError(f"{path}: no data lines")
    offset = 0 if saw_zero else 1
    width = max((int(i.max()) + 1 - offset for i, _ in rows if i.size), default=0)
    if num_features is not None:
        if width > num_features:
            raise LibsvmFormatError(
                f"{path}: feature index {width} exceeds num_features={num_features}"
            )
        width = int(num_features)
    X = np.zeros((len(rows), width))
    for r, (idx, val) in enumerate(rows):
        X[r, idx - offset] = val
    return X, np.asarray(labels, dtype=float)


def write_libsvm(path: str | os.PathLike[str], X: np.ndarray, y: np.ndarray) -> None:
    """Write ``(X, y)`` in LIBSVM format (1-based indices, zeros omitted); for tests and for
    exporting stand-in data sets in the format users' tools read."""
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"X must be 2-D and y match its rows, got {X.shape} and {y.shape}")
    with open(path, "w", encoding="ascii") as fh:
        for row, label in zip(X, y, strict=True):
            nz = np.flatnonzero(row)
            items = " ".join(f"{j + 1}:{row[j]:.17g}" for j in nz)
            fh.write(f"{label:g} {items}".rstrip() + "\n")
