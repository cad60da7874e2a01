"""The "mushrooms" data set of Chen & Wang's ("Locally Differentially Private Distributed Online
Learning with Guaranteed Optimality") logistic-regression experiment (UCI Mushroom, 8124 samples, 22
categorical attributes, edible vs poisonous).

Sources, in order:

1. a LIBSVM file the user has (``mushrooms`` from the LIBSVM site: labels 1 = edible,
   2 = poisonous, 112 one-hot features);
2. offline, the R package ``cba``'s ``data/Mushroom.rda``, shipped by Debian as
   ``r-cran-cba`` (``apt-get install r-cran-cba``), read with the PyPI package ``rdata``
   (optional extra ``decentralized``). It has the same 8124 × 23 table with the 2480 missing
   ``stalk-root`` values as R's ``NA``; we one-hot encode each attribute's *observed* values
   plus "missing" (the LIBSVM file's ``?`` category). That gives 117 columns, not the LIBSVM
   file's 112 (the R table's levels differ slightly from the LIBSVM encoding), so results say
   which source they used (the ``source`` string of :func:`load_mushrooms`).

Labels: ``b = 0`` edible, ``b = 1`` poisonous. Rows are scaled to unit ℓ2 norm (every row
has 22 ones): without it the per-sample smoothness is ``‖a‖²/4 = 5.5`` and Chen & Wang's
sensitivity recursion explodes (≈ 10³⁷); with it ``C = 2``, ``L = ¼ + r``.

Row-norm bounds by construction (what a task *declares* as its ``feature-bound``; the task
projects every row onto that bound, so a file that breaks it cannot break the accounting):
:data:`ROW_NORM` for normalized rows, :data:`RAW_ROW_NORM` (``√22``: one 1 per attribute)
for raw one-hot rows.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from flwr_corrnoise.data.libsvm import read_libsvm

__all__ = ["DEBIAN_RDA", "RAW_ROW_NORM", "ROW_NORM", "load_mushrooms", "mushrooms_from_rda",
           "one_hot", "split_by_class"]

DEBIAN_RDA = Path("/usr/lib/R/site-library/cba/data/Mushroom.rda")
#: ‖a‖ of a normalized row (``load_mushrooms(normalize=True)``)
ROW_NORM = 1.0
#: ‖a‖ of a raw one-hot row: 22 categorical attributes, exactly one 1 each
RAW_ROW_NORM = math.sqrt(22.0)


def one_hot(table: list[list[str | None]]) -> np.ndarray:
    """One column per (attribute, observed value), ``None`` counted as its own value;
    columns ordered by attribute, then value (sorted, missing last)."""
    if not table:
        raise ValueError("empty table")
    cols = []
    for a in range(len(table[0])):
        values = [row[a] for row in table]
        levels = sorted({v for v in values if v is not None}) + (
            [None] if any(v is None for v in values) else [])
        for lev in levels:
            cols.append(np.array([v == lev for v in values], dtype=float))
    return np.stack(cols, axis=1)


def mushrooms_from_rda(path: str | os.PathLike[str] = DEBIAN_RDA) -> tuple[np.ndarray,
                                                                           np.ndarray]:
    """``(X one-hot, y)`` from R's ``Mushroom.rda`` (needs the ``rdata`` package)."""
    try:
        import rdata
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading Mushroom.rda needs the 'rdata' package: "
                          "pip install 'flwr-corrnoise[decentralized]'") from err
    conv = rdata.conversion.convert(rdata.parser.parse_file(str(path)))
    if "Mushroom" not in conv:
        raise ValueError(f"{path}: no 'Mushroom' data frame (found {sorted(conv)})")
    df = conv["Mushroom"]
    if "class" not in df.columns:
        raise ValueError(f"{path}: the data frame has no 'class' column")
    y = (df["class"].astype(str) == "poisonous").to_numpy(dtype=float)
    attrs = [c for c in df.columns if c != "class"]
    table = [[None if (isinstance(v, float) and np.isnan(v)) or v is None else str(v)
              for v in row] for row in df[attrs].astype(object).itertuples(index=False)]
    return one_hot(table), y


def load_mushrooms(path: str | os.PathLike[str] | None = None, normalize: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, str]:
    """``(X, y, source)``: ``path`` (a LIBSVM file, or an ``.rda``) if given, else Debian's
    ``r-cran-cba`` copy. ``source`` names what was read (for every CSV row and plot)."""
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"mushrooms file {p} does not exist")
        if p.suffix == ".rda":
            X, y = mushrooms_from_rda(p)
            source = f"UCI Mushroom via {p.name} (R cba)"
        else:
            X, y = read_libsvm(p)
            labels = set(np.unique(y).tolist())
            if labels <= {1.0, 2.0}:
                y = (y == 2.0).astype(float)
            elif labels <= {0.0, 1.0}:
                pass
            elif labels <= {-1.0, 1.0}:
                y = (y == 1.0).astype(float)
            else:
                raise ValueError(f"{p}: expected two classes, got labels {sorted(labels)}")
            source = f"mushrooms (LIBSVM file {p.name})"
    elif DEBIAN_RDA.exists():
        X, y = mushrooms_from_rda(DEBIAN_RDA)
        source = "UCI Mushroom via Debian r-cran-cba"
    else:
        raise FileNotFoundError(
            "no mushrooms data: pass the LIBSVM file (https://www.csie.ntu.edu.tw/~cjlin/"
            "libsvmtools/datasets/binary.html#mushrooms) or apt-get install r-cran-cba")
    if normalize:
        norms = np.linalg.norm(X, axis=1, keepdims=True)
        X = X / np.where(norms > 0, norms, 1.0)
    return X, y, source


def split_by_class(X: np.ndarray, y: np.ndarray, num_nodes: int = 5
                   ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Chen & Wang's split: the first ``round(0.6 n)`` nodes share the class-0 samples, the others
    the class-1 samples (5 nodes: learners 1–3 get class 0, 4–5 class 1), round-robin."""
    if num_nodes < 2:
        raise ValueError("splitting by class needs at least 2 nodes")
    n0 = max(1, min(num_nodes - 1, round(0.6 * num_nodes)))
    out = []
    for cls, count in ((0.0, n0), (1.0, num_nodes - n0)):
        idx = np.flatnonzero(y == cls)
        if idx.size < count:
            raise ValueError(f"only {idx.size} samples of class {cls:g} for {count} nodes")
        for k in range(count):
            part = idx[k::count]
            out.append((X[part], y[part]))
    return out
