"""The IDX file format (MNIST, Fashion-MNIST and anything else stored that way): read, write,
and load a directory of the four standard files as an :class:`ImageDataset`.

Why IDX: MNIST-style image sets ship as four IDX files, which is also what a ``torchvision``
download leaves on disk, so a user's local copy can be read without a network or torch. The
reader needs NumPy only. *Where* a named data set is found (the experiments' search path, a
download) is the caller's business: the experiments' loader with its default search path is
``experiments/data/mnist.py`` in the repository, not part of the installed package.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


def find_idx_file(directory: Path, stem: str) -> Path | None:
    """``directory/stem`` or ``directory/stem.gz``, whichever exists (else ``None``)."""
    for name in (stem, stem + ".gz"):
        if (directory / name).exists():
            return directory / name
    return None


def load_idx_dir(directory: str | os.PathLike[str], name: str) -> ImageDataset:
    """The four standard IDX files of ``directory`` (each plain or ``.gz``)."""
    directory = Path(directory)
    paths = {k: find_idx_file(directory, stem) for k, stem in FILES.items()}
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
