"""On-disk cache of solved mechanism parameters (a few arrays per horizon).

Why: the optimized factorizations are solved once per horizon (seconds to minutes), but
every virtual learner of a simulation, every process and every later run needs the same
numbers. Files are ``.npz`` (no pickle) under ``$FLWR_CORRNOISE_CACHE`` or
``~/.cache/flwr_corrnoise``, written atomically (write, then rename), and an unreadable or
incomplete file is treated as absent: caching is an optimization, never a failure.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where solved parameters live (``$FLWR_CORRNOISE_CACHE`` overrides)."""
    env = os.environ.get("FLWR_CORRNOISE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flwr_corrnoise"


def path_for(key: str) -> Path:
    return cache_dir() / f"{key}.npz"


def load(key: str, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` stored under ``key``, or ``None`` if absent or unreadable."""
    path = path_for(key)
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as f:
            return {name: np.array(f[name]) for name in names}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        # BadZipFile: a member whose bytes fail their CRC-32 (a damaged file)
        log.warning("ignoring unreadable cache %s: %s", path, err)
        return None


def digest_key(name: str, n: int, digest: str) -> str:
    """The content-addressed key of one exact factorization (never overwritten)."""
    return f"{name}-N{n}-sha256-{digest}"


def store_once(key: str, **arrays: np.ndarray | str) -> None:
    """Store under ``key`` unless an entry exists: content-addressed entries are immutable,
    so a later solve can never change the factorization an in-flight stream uses."""
    if not path_for(key).exists():
        store(key, **arrays)


def store(key: str, **arrays: np.ndarray | str) -> None:
    """Store ``arrays`` under ``key`` atomically; failures are logged, not raised."""
    path = path_for(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not write the cache %s: %s", path, err)


def band_restorer(name: str, build: Callable[[int, np.ndarray], Any]
                  ) -> Callable[[int, str], Any]:
    """The registry's ``restore(N, digest)`` for a mechanism solved as one ``band`` array
    (``banded-inverse``, ``bandmf``): the band cached under ``digest`` when the stream was
    built, rebuilt by ``build(N, band)``, or ``None`` — a later solve may differ in its last
    bits on another machine, and a stream continues under exactly its own."""
    def restore(n: int, digest: str) -> Any:
        stored = load(digest_key(name, n, digest), ("band",))
        return None if stored is None else build(n, stored["band"])
    return restore
