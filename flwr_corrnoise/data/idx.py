"""Image datasets in the IDX format (MNIST, Fashion-MNIST), offline first, and paper 000's
non-IID split of them.

Why IDX: MNIST and Fashion-MNIST ship as four IDX files, and that is what can be had
without a network — Debian's ``dataset-fashion-mnist`` puts Fashion-MNIST in
:data:`FASHION_MNIST_DEBIAN`, and a ``torchvision`` download leaves MNIST's IDX files in
``<root>/MNIST/raw``. :func:`load_dataset` reads local files first and touches the network
only when asked (``download=True``, through ``torchvision``). The reader needs NumPy only.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FASHION_MNIST_DEBIAN = "/usr/share/datasets/fashion-mnist"
CACHE = Path(os.environ.get("FLWR_CORRNOISE_DATA", Path.home() / ".cache" / "flwr_corrnoise"))
FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODES = {np.dtype(v).newbyteorder("=").str: k for k, v in _DTYPES.items()}


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: corrupt gzip data: {err}") from err
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (plain or gzip-compressed); malformed files raise ``ValueError``."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] not in _DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {data[:4]!r})")
    dtype, ndim = np.dtype(_DTYPES[data[2]]), data[3]
    head = 4 + 4 * ndim
    if len(data) < head:
        raise ValueError(f"{path}: truncated IDX header")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    size = dtype.itemsize * int(np.prod(dims, dtype=np.int64))
    if len(data) - head < size:
        raise ValueError(f"{path}: truncated IDX data ({len(data) - head} of {size} bytes)")
    if len(data) - head > size:
        raise ValueError(f"{path}: {len(data) - head - size} trailing bytes after the IDX data")
    arr = np.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=head)
    return arr.reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed if the name ends in ``.gz``)."""
    arr = np.asarray(array)
    code = _CODES.get(arr.dtype.newbyteorder("=").str)
    if code is None:
        raise TypeError(f"IDX has no type code for dtype {arr.dtype}")
    head = bytes([0, 0, code, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    payload = head + arr.astype(_DTYPES[code]).tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


@dataclass
class ImageDataset:
    """Images as float32 ``(n, 1, 28, 28)`` in [0, 1] and int64 labels; which dataset and
    where it was read from, so every result can say what it used."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    name: str
    source: str

    @property
    def num_classes(self) -> int:
        return int(max(self.train_y.max(), self.test_y.max())) + 1


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (directory / name).exists():
            return directory / name
    return None


def load_idx_dir(directory: str | os.PathLike[str], name: str) -> ImageDataset:
    """The four standard IDX files of ``directory`` (each plain or ``.gz``)."""
    directory = Path(directory)
    paths = {k: _find(directory, stem) for k, stem in FILES.items()}
    missing = [FILES[k] + "[.gz]" for k, p in paths.items() if p is None]
    if missing:
        raise FileNotFoundError(f"{directory} lacks {', '.join(missing)}")
    arrays = {k: read_idx(p) for k, p in paths.items()}  # type: ignore[arg-type]
    for part in ("train", "test"):
        x, y = arrays[f"{part}_x"], arrays[f"{part}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{directory}: {part} images {x.shape} and labels {y.shape} "
                             f"do not match")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"{directory}: {part} labels outside 0..9")

    def images(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32) / 255.0)[:, None, :, :]

    return ImageDataset(
        train_x=images(arrays["train_x"]), train_y=arrays["train_y"].astype(np.int64),
        test_x=images(arrays["test_x"]), test_y=arrays["test_y"].astype(np.int64),
        name=name, source=str(directory),
    )


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
        if directory.is_dir() and all(_find(directory, s) for s in FILES.values()):
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
    """Paper 000 Sec. V-B's split: ``iid_size`` images drawn at random are spread evenly
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
