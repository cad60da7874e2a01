"""A small, fast, pickle-free byte format for a few named NumPy arrays.

Why not ``np.savez``: a learner's state is written to ``context.state`` after every round
and read back before the next, on every virtual learner of a simulation; ``.npz`` is a zip
archive whose per-array headers are parsed with ``ast.literal_eval``, which made
(de)serialization ≈ 80 % of a learner's round (≈ 4 ms of 5 ms at d = 100,
``benchmarks/flower_overhead.py``). This format is a magic string, a JSON header (name,
dtype, shape per array) and the raw little-endian buffers, read back with
``np.frombuffer``; only numeric and fixed-width string dtypes are allowed (never objects),
and every length is checked, so a truncated or tampered payload is an error, not garbage.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np

MAGIC = b"FCNPK1\n"
_ALLOWED_KINDS = "biufU"  # bool, ints, floats, fixed-width unicode: no objects, no pickle
#: arrays of at least this many bytes start at a multiple of :data:`ALIGN` bytes from the
#: start of the pack (the header is padded with spaces, and such an array's header entry
#: names the zero bytes before it as a fourth field). Why: a state file is read into one
#: buffer that its arrays view (``unpack(copy=False)``), and a stream that keeps such a
#: view as its buffers runs its recurrence 2.5× slower on misaligned float64 data.
#: Packs without a large array are byte for byte what they were before.
ALIGN_MIN = 4096
ALIGN = 64


def pack_chunks(arrays: dict[str, np.ndarray]) -> list[bytes | memoryview]:
    """The pieces of :func:`pack`'s output, in order, without joining them: a writer that
    streams them to a file (:mod:`~flwr_corrnoise.state_offload`) copies no array. A
    contiguous little-endian array is passed as a view of its own memory."""
    header, chunks, offset = [], [], 0
    aligned = any(np.asarray(v).nbytes >= ALIGN_MIN for v in arrays.values())
    for name, value in arrays.items():
        arr = np.asarray(value)
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise TypeError(f"array {name!r} has unsupported dtype {arr.dtype}")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            arr = arr.copy(order="C")
        entry: list = [name, arr.dtype.str, list(arr.shape)]
        pad = -offset % ALIGN if aligned and arr.nbytes >= ALIGN_MIN else 0
        if pad:
            entry.append(pad)
            chunks.append(bytes(pad))
        header.append(entry)
        chunks.append(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")
        offset += pad + arr.nbytes
    head = json.dumps(header).encode()
    if aligned:  # the data starts at a multiple of ALIGN (JSON ignores trailing spaces)
        head += b" " * (-(len(MAGIC) + 4 + len(head)) % ALIGN)
    return [MAGIC, len(head).to_bytes(4, "little"), head, *chunks]


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    """Serialize ``arrays`` (names → arrays) to bytes."""
    return b"".join(pack_chunks(arrays))


def unpack(data: bytes | bytearray | memoryview, *, copy: bool = True
           ) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack`; raises ``ValueError`` on anything malformed.

    ``copy=False``: the arrays view ``data`` instead of owning copies — for a buffer the
    caller owns and hands over (a state file read into a fresh ``bytearray``), so reading a
    large state costs no second copy; the arrays are writable only if ``data`` is."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a flwr-corrnoise array pack (bad magic)")
    start = len(MAGIC) + 4
    if len(view) < start:
        raise ValueError("truncated array pack")
    size = int.from_bytes(view[len(MAGIC) : start], "little")
    try:
        header = json.loads(bytes(view[start : start + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"corrupt array-pack header: {err}") from err
    offset, out = start + size, {}
    try:
        for name, dtype_str, shape, *rest in header:
            pad = int(rest[0]) if rest else 0
            if len(rest) > 1 or not 0 <= pad < ALIGN:
                raise ValueError(f"array {name!r}: bad header entry")
            offset += pad
            dtype = np.dtype(dtype_str)
            if dtype.kind not in _ALLOWED_KINDS or any(int(s) < 0 for s in shape):
                raise ValueError(f"array {name!r}: bad dtype {dtype_str} or shape {shape}")
            nbytes = dtype.itemsize * math.prod(int(s) for s in shape)
            if offset + nbytes > len(view):
                raise ValueError(f"array {name!r} is truncated")
            arr = np.frombuffer(view[offset : offset + nbytes], dtype=dtype).reshape(
                [int(s) for s in shape])
            out[str(name)] = arr.copy() if copy else arr
            offset += nbytes
    except (TypeError, ValueError) as err:
        raise ValueError(f"malformed array pack: {err}") from err
    if offset != len(view):
        raise ValueError("array pack has trailing bytes")
    return out


def unpack_any(data: bytes) -> dict[str, np.ndarray]:
    """:func:`unpack`, or the ``.npz`` archive the states of version 0.1 were (read
    without pickle): the one reader of stored learner and stream states."""
    if bytes(data[:2]) == b"PK":
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return {k: archive[k] for k in archive.files}
    return unpack(data)
