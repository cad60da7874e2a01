"""The "poker" data set of Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private
Algorithms for Decentralized Online Learning") experiments (UCI Poker Hand; LIBSVM ``poker``: 10
features, 10 classes, 10⁶ examples in its test split) — and an exact synthesizer.

Each example is a hand of five distinct cards drawn uniformly from a 52-card deck; features
are ``S1, C1, …, S5, C5`` (suit 1–4, rank 1–13 with ace = 1), the class is the hand's poker
rank by the UCI rules: 0 nothing, 1 one pair, 2 two pairs, 3 three of a kind, 4 straight
(ace high or low), 5 flush, 6 full house, 7 four of a kind, 8 straight flush, 9 royal flush.
Because the UCI data *is* such uniform hands, :func:`synthesize_poker` produces data with
exactly the real set's law; it is still a stand-in (not the same hands), and experiments name
it so on every row and plot.

:func:`load_poker` reads the user's LIBSVM (``poker``/``poker.t``: labels 0–9) or UCI CSV
(``poker-hand-testing.data``: 11 comma-separated integers) file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flwr_corrnoise.data.libsvm import read_libsvm

__all__ = ["CLASS_COUNTS", "NUM_CLASSES", "NUM_FEATURES", "classify_hands", "load_poker",
           "synthesize_poker"]

NUM_FEATURES, NUM_CLASSES, NUM_EXAMPLES = 10, 10, 1_000_000
#: number of the C(52, 5) = 2,598,960 hands in each class (the exact law)
CLASS_COUNTS = np.array([1302540, 1098240, 123552, 54912, 10200, 5108, 3744, 624, 36, 4])


def classify_hands(suits: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Hand class 0–9 of each row of five ``suits`` (1–4) and ``ranks`` (1–13, ace = 1)."""
    suits, ranks = np.asarray(suits), np.asarray(ranks)
    if suits.shape != ranks.shape or suits.ndim != 2 or suits.shape[1] != 5:
        raise ValueError("need suits and ranks of shape [hands, 5]")
    m = len(ranks)
    counts = np.bincount((np.arange(m)[:, None] * 13 + ranks - 1).ravel(),
                         minlength=13 * m).reshape(m, 13)
    c1 = counts.max(axis=1)
    pairs = (counts == 2).sum(axis=1)
    flush = np.all(suits == suits[:, :1], axis=1)
    distinct = c1 == 1
    span = ranks.max(axis=1) - ranks.min(axis=1)
    broadway = distinct & (ranks.min(axis=1) == 1) & (np.sort(ranks, axis=1)[:, 1] == 10)
    straight = distinct & ((span == 4) | broadway)
    out = np.zeros(m, dtype=np.int64)
    out[c1 == 2] = 1
    out[pairs == 2] = 2
    out[c1 == 3] = 3
    out[straight] = 4
    out[flush] = 5
    out[(c1 == 3) & (pairs == 1)] = 6
    out[c1 == 4] = 7
    out[straight & flush] = 8
    out[broadway & flush] = 9
    return out


def synthesize_poker(num: int = NUM_EXAMPLES, seed: int = 0, chunk: int = 200_000
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``num`` uniform random hands: ``(X [num, 10] raw UCI features, y in 0..9)``."""
    if num < 1:
        raise ValueError(f"need at least one hand, got {num}")
    rng = np.random.default_rng([seed, 0x9C6E7])
    X = np.empty((num, NUM_FEATURES))
    y = np.empty(num, dtype=np.int64)
    for start in range(0, num, chunk):
        m = min(chunk, num - start)
        cards = np.argsort(rng.random((m, 52)), axis=1)[:, :5]  # 5 distinct cards
        suits, ranks = cards // 13 + 1, cards % 13 + 1
        X[start : start + m, 0::2] = suits
        X[start : start + m, 1::2] = ranks
        y[start : start + m] = classify_hands(suits, ranks)
    return X, y


def _check(X: np.ndarray, y: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    if X.shape[1] != NUM_FEATURES:
        raise ValueError(f"{where}: poker needs {NUM_FEATURES} features, got {X.shape[1]}")
    if not np.all(np.isin(y, np.arange(NUM_CLASSES))):
        raise ValueError(f"{where}: poker labels must be 0..9")
    suits, ranks = X[:, 0::2], X[:, 1::2]
    if not (np.all(np.isin(suits, [1, 2, 3, 4])) and np.all(np.isin(ranks, np.arange(1, 14)))):
        raise ValueError(f"{where}: suits must be 1..4 and ranks 1..13")
    return X.astype(float), y.astype(np.int64)


def load_poker(path: str | os.PathLike[str] | None = None, num: int = NUM_EXAMPLES,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """``(X, y, source)``: the user's LIBSVM/UCI file, else ``num`` synthesized hands."""
    if path is None:
        X, y = synthesize_poker(num, seed)
        return X, y, f"poker stand-in (synthesized uniform hands, seed {seed})"
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"poker file {p} not found")
    first = p.read_bytes()[:200].decode("ascii", errors="replace").splitlines()
    if first and "," in first[0]:
        try:
            arr = np.loadtxt(p, delimiter=",", ndmin=2)
        except ValueError as err:
            raise ValueError(f"{p}: not a UCI poker CSV ({err})") from err
        if arr.shape[1] != NUM_FEATURES + 1:
            raise ValueError(f"{p}: expected 11 comma-separated fields per line")
        X, y = _check(arr[:, :NUM_FEATURES], arr[:, NUM_FEATURES], str(p))
        return X[:num], y[:num], f"poker (UCI file {p.name})"
    X, lab = read_libsvm(p, num_features=NUM_FEATURES)
    X, y = _check(X, lab, str(p))
    return X[:num], y[:num], f"poker (LIBSVM file {p.name})"
