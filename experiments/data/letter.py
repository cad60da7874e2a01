"""The "letter" data set of Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private
Algorithms for Decentralized Online Learning") experiments (UCI Letter Recognition; LIBSVM
``letter.scale``: 15000 training rows, 16 features scaled to [−1, 1], 26 classes).

Sources, in order:

1. a LIBSVM file the user has (``letter.scale`` from the LIBSVM site, labels 1–26), or the
   UCI ``letter-recognition.data`` CSV (``T,2,8,3,...``: letter, then 16 integer features);
2. offline, the R package ``mlbench``'s ``data/LetterRecognition.rda`` (the same 20000 × 17 UCI
   table), shipped by Debian as ``r-cran-mlbench`` and read with the PyPI package ``rdata``
   (optional extra ``decentralized``). Like LIBSVM's training split we keep the first 15000
   rows and scale the integer features ``0..15`` to ``[−1, 1]`` (``x/7.5 − 1``; LIBSVM's
   ``svm-scale`` uses the observed min/max, which is the same map wherever a feature spans
   0–15).

Labels are returned as ``0..25`` (A = 0). :func:`load_letter` returns a ``source`` string that
experiments print on every row and plot.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flwr_corrnoise.data.libsvm import read_libsvm

__all__ = ["DEBIAN_RDA", "NUM_CLASSES", "NUM_FEATURES", "letter_from_rda", "letter_from_uci",
           "load_letter", "scale_features"]

DEBIAN_RDA = Path("/usr/lib/R/site-library/mlbench/data/LetterRecognition.rda")
NUM_FEATURES, NUM_CLASSES, NUM_TRAIN = 16, 26, 15000


def scale_features(raw: np.ndarray) -> np.ndarray:
    """UCI integer features ``0..15`` to ``[−1, 1]``."""
    raw = np.asarray(raw, dtype=float)
    if raw.ndim != 2 or raw.shape[1] != NUM_FEATURES:
        raise ValueError(f"letter needs {NUM_FEATURES} features, got shape {raw.shape}")
    if not np.all(np.isfinite(raw)) or raw.min() < 0 or raw.max() > 15:
        raise ValueError("letter's UCI features must be integers in 0..15")
    return raw / 7.5 - 1.0


def _labels_from_letters(letters: list[str], where: str) -> np.ndarray:
    bad = [c for c in letters if len(c) != 1 or not ("A" <= c <= "Z")]
    if bad:
        raise ValueError(f"{where}: labels must be letters A–Z, got {bad[:3]!r}")
    return np.array([ord(c) - ord("A") for c in letters], dtype=np.int64)


def letter_from_uci(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(X scaled, y)`` from UCI's ``letter-recognition.data`` (all its rows)."""
    rows = [ln.strip().split(",") for ln in Path(path).read_text(encoding="ascii").splitlines()
            if ln.strip()]
    if not rows or any(len(r) != NUM_FEATURES + 1 for r in rows):
        raise ValueError(f"{path}: expected {NUM_FEATURES + 1} comma-separated fields per line")
    y = _labels_from_letters([r[0] for r in rows], str(path))
    try:
        raw = np.array([[float(v) for v in r[1:]] for r in rows])
    except ValueError as err:
        raise ValueError(f"{path}: non-numeric feature ({err})") from err
    return scale_features(raw), y


def letter_from_rda(path: str | os.PathLike[str] = DEBIAN_RDA) -> tuple[np.ndarray, np.ndarray]:
    """``(X scaled, y)`` from R's ``LetterRecognition.rda`` (all 20000 rows; needs ``rdata``)."""
    try:
        import rdata
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading LetterRecognition.rda needs the 'rdata' package: "
                          "pip install 'flwr-corrnoise[decentralized]'") from err
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Unknown encoding. Assumed ASCII."
        conv = rdata.conversion.convert(rdata.parser.parse_file(str(path)))
    if "LetterRecognition" not in conv:
        raise ValueError(f"{path}: no 'LetterRecognition' data frame (found {sorted(conv)})")
    df = conv["LetterRecognition"]
    y = _labels_from_letters([str(v) for v in df.iloc[:, 0]], str(path))
    return scale_features(df.iloc[:, 1:].to_numpy(dtype=float)), y


def load_letter(path: str | os.PathLike[str] | None = None, rows: int = NUM_TRAIN
                ) -> tuple[np.ndarray, np.ndarray, str]:
    """``(X [rows, 16], y in 0..25, source)``: the user's file if given, else Debian's rda.

    A LIBSVM file is used as it is (already scaled, labels 1..26); a UCI CSV or the rda are
    scaled and cut to their first ``rows`` rows (LIBSVM's training split)."""
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"letter file {p} not found")
        head = p.read_bytes()[:200].decode("ascii", errors="replace")
        if "," in head.splitlines()[0] if head else False:
            X, y = letter_from_uci(p)
            return X[:rows], y[:rows], f"letter (UCI file {p.name}, first {min(rows, len(y))})"
        X, lab = read_libsvm(p, num_features=NUM_FEATURES)
        if not np.all(np.isin(lab, np.arange(1, NUM_CLASSES + 1))):
            raise ValueError(f"{p}: LIBSVM letter labels must be 1..{NUM_CLASSES}")
        return X, lab.astype(np.int64) - 1, f"letter (LIBSVM file {p.name})"
    if not DEBIAN_RDA.exists():
        raise FileNotFoundError(
            "letter is not available offline here: pass the LIBSVM 'letter.scale' or UCI "
            f"'letter-recognition.data' file, or apt-get install r-cran-mlbench ({DEBIAN_RDA})")
    X, y = letter_from_rda(DEBIAN_RDA)
    return X[:rows], y[:rows], f"letter (Debian r-cran-mlbench LetterRecognition, first {rows})"
