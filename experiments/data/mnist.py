"""MNIST and Fashion-MNIST for the experiments, offline first, and Zhang, Zhu, Fay & Johansson's
("Locally Differentially Private Online Federated Learning With Correlated Noise") non-IID split.

Where the files are looked for (in order): the ``root`` a run names; Debian's
``dataset-fashion-mnist`` package (:data:`FASHION_MNIST_DEBIAN`, Fashion-MNIST only); the IDX
files a ``torchvision`` download left in :data:`CACHE` (``$FLWR_CORRNOISE_DATA``, default
``~/.cache/flwr_corrnoise``); only with ``download=True``, a ``torchvision`` download.

Why this is experiment code: the search path (a Debian location, a cache directory) is a
policy of these reproductions, not something the installed library should assume about an
edge device. The format itself is library (:mod:`flwr_corrnoise.data.idx`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flwr_corrnoise.data.idx import FILES, ImageDataset, find_idx_file, load_idx_dir

__all__ = ["CACHE", "FASHION_MNIST_DEBIAN", "load_dataset", "paper_partition"]

#: where Debian's ``dataset-fashion-mnist`` puts Fashion-MNIST's four IDX files
FASHION_MNIST_DEBIAN = "/usr/share/datasets/fashion-mnist"
#: where a ``torchvision`` download is kept (read from the environment, never written to it)
CACHE = Path(os.environ.get("FLWR_CORRNOISE_DATA", Path.home() / ".cache" / "flwr_corrnoise"))


def load_dataset(name: str, root: str | os.PathLike[str] | None = None,
                 download: bool = False) -> ImageDataset:
    """``"mnist"`` or ``"fashion-mnist"``: from ``root`` (a directory of IDX files) if
    given; else Fashion-MNIST from Debian's package; else the IDX files a ``torchvision``
    download left in the cache; else, only with ``download=True``, ``torchvision``."""
    if name not in ("mnist", "fashion-mnist"):
        raise ValueError(f"unknown dataset {name!r}; use 'mnist' or 'fashion-mnist'")
    if root is not None:
        return load_idx_dir(root, name)
    folder = "MNIST" if name == "mnist" else "FashionMNIST"
    candidates = [CACHE / "torchvision" / folder / "raw"]
    if name == "fashion-mnist":
        candidates.insert(0, Path(FASHION_MNIST_DEBIAN))
    for directory in candidates:
        if directory.is_dir() and all(find_idx_file(directory, s) for s in FILES.values()):
            return load_idx_dir(directory, name)
    if download:
        import torchvision  # the torch extra; only here, only when asked to download

        cls = torchvision.datasets.MNIST if name == "mnist" else torchvision.datasets.FashionMNIST
        for train in (True, False):
            cls(str(CACHE / "torchvision"), train=train, download=True)
        return load_idx_dir(candidates[-1], name)
    hint = ("apt-get install dataset-fashion-mnist" if name == "fashion-mnist"
            else "put the four MNIST IDX files in a directory and pass it as root")
    raise RuntimeError(
        f"{name} is not available offline (looked in {', '.join(map(str, candidates))}); "
        f"{hint}, or pass download=True where a network is available"
    )


def paper_partition(labels: np.ndarray, num_learners: int = 10, iid_size: int = 30000,
                    seed: int = 0) -> list[np.ndarray]:
    """Zhang et al., Sec. V-B's split: ``iid_size`` images drawn at random are spread evenly
    at random over the learners; every other image of class ``l`` goes to learner
    ``l mod num_learners`` (learner ``l + 1`` in the paper's 1-based numbering). Each
    learner's indices are shuffled, so its stream mixes the two parts."""
    labels = np.asarray(labels)
    n = len(labels)
    if not 0 <= iid_size <= n:
        raise ValueError(f"iid_size {iid_size} is not within the {n} training images")
    rng = np.random.default_rng([seed, 0x1DD])
    order = rng.permutation(n)
    iid, rest = order[:iid_size], order[iid_size:]
    parts: list[list[np.ndarray]] = [[chunk] for chunk in np.array_split(iid, num_learners)]
    for i in range(num_learners):
        parts[i].append(rest[labels[rest] % num_learners == i])
    return [rng.permutation(np.concatenate(p)) for p in parts]
