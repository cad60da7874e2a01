"""What authenticating an offloaded learner state costs, against writing and reading it.

    python benchmarks/offload_mac.py --dims 1000000 --repeats 21

A simulated learner's offloaded state (``flwr_corrnoise.state_offload``) is MAC'd as it is
written and checked when it is read, so a rolled-back, edited or foreign file is refused.
For a BLT state of d floats (4 buffers of d, float64 by default: 32 MB at d = 10⁶), medians
over ``--repeats`` of:

* ``write``: the state's chunks (``arraypack.pack_chunks``) written over a stale file's
  pages, as every commit from a learner's third on does (no MAC);
* ``read``: the file read into one buffer (no MAC);
* the MACs over the same bytes: Poly1305 (the library's, under a fresh key per file),
  HMAC-SHA256 (its fallback), and, for the choice, AES-256-GMAC (GCM over the bytes as
  associated data, a one-time key: OpenSSL's carry-less-multiply GHASH) and SHA-256 and
  BLAKE2b-256 digests;
* ``commit`` and ``load``: the whole commit and load of ``LearnerStorage`` as a learner
  does them (write with the MAC, read with the owner, newest-file and MAC checks, rebuild
  the state).

Prints a markdown table: each row's ms and its share of the plain write.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import poly1305
from flwr.app import Context, RecordDict

from flwr_corrnoise import arraypack
from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.state_offload import MAC, OffloadPolicy

SETTINGS = PrivacySettings("blt", 2.0, 1e-3, 1.0, 400)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def mac_over(chunks: list[bytes | memoryview], new: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        m = new()
        for chunk in chunks:
            m.update(chunk)  # type: ignore[attr-defined]
        (m.finalize if hasattr(m, "finalize") else m.digest)()  # type: ignore[attr-defined]
    return run


class Gmac:
    """AES-256-GMAC under a one-time key: GCM with no plaintext, the bytes fed as
    associated data (``update``), the tag at ``finalize``: the other one-time MAC OpenSSL
    accelerates (GHASH with carry-less multiplies), measured for the choice."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._ctx = Cipher(algorithms.AES(secrets.token_bytes(32)),
                           modes.GCM(bytes(12))).encryptor()

    def update(self, data: bytes | memoryview) -> None:
        self._ctx.authenticate_additional_data(data)

    def finalize(self) -> bytes:
        self._ctx.finalize()
        return self._ctx.tag


def measure(dim: int, dtype: str, repeats: int, folder: Path) -> list[tuple[str, float]]:
    state = LearnerState.create(SETTINGS, [(dim,)], seed=1, dtype=dtype)
    arrays = state.state_dict(flat=True, copy=False)
    chunks = arraypack.pack_chunks(arrays)
    path = folder / f"plain-{dim}.state"
    path.write_bytes(b"".join(chunks))  # the stale file whose pages a commit reuses

    def write() -> None:
        with open(path, "r+b") as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.truncate()

    def read() -> None:
        buffer = np.empty(path.stat().st_size, dtype=np.uint8)
        with open(path, "rb") as fh:
            fh.readinto(memoryview(buffer))

    rows = [("write (no MAC)", median_ms(write, repeats)),
            ("read (no MAC)", median_ms(read, repeats))]
    macs: list[tuple[str, Callable[[], object]]] = [
        ("Poly1305 (one-time key)", lambda: poly1305.Poly1305(secrets.token_bytes(32))),
        ("HMAC-SHA256", lambda: hmac.new(secrets.token_bytes(32), digestmod="sha256")),
        ("AES-256-GMAC (one-time key)", Gmac),
        ("SHA-256 digest", hashlib.sha256),
        ("BLAKE2b-256 digest", lambda: hashlib.blake2b(digest_size=32)),
    ]
    rows += [(f"MAC: {name}", median_ms(mac_over(chunks, new), repeats)) for name, new in macs]
    ctx = Context(run_id=1, node_id=dim, node_config={}, state=RecordDict(), run_config={})
    storage = LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy("on", folder))
    for _ in range(3):  # from the third commit on, a commit reuses a stale file's pages
        storage.write(state, {})
        state = storage.read()
    commit, load = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        storage.write(state, {})
        middle = time.perf_counter()
        state = storage.read()
        commit.append(middle - start)
        load.append(time.perf_counter() - middle)
    rows += [(f"LearnerStorage commit (write + {MAC})", 1e3 * statistics.median(commit)),
             (f"LearnerStorage load (read + checks + {MAC})", 1e3 * statistics.median(load))]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[1_000_000])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}, {args.dtype} buffers, "
          f"library MAC: {MAC}\n")
    print("| d | state bytes | operation | ms | × the plain write |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for dim in args.dims:
            size = 4 * dim * np.dtype(args.dtype).itemsize
            rows = measure(dim, args.dtype, args.repeats, Path(tmp))
            base = rows[0][1]
            for name, ms in rows:
                print(f"| {dim:,} | {size / 1e6:.1f} MB | {name} | {ms:.1f} | "
                      f"{ms / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
