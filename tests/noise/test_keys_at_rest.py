"""Keys at rest: a learner's state holds its noise key, so its files are the owner's only
(0600 in 0700 folders), and no noise stream defaults to a seed anyone knows.

The offloaded simulation states have the same checks in ``tests/learner/test_state_offload.py``
(``test_offloaded_files_are_0600_in_0700_folders``,
``test_the_default_folder_is_private_to_the_user``)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flwr_corrnoise.decentralized.laplace import LaplaceStream, ScaleSchedule
from flwr_corrnoise.noise_keys import generator_key
from flwr_corrnoise.persistence import StateStore


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """The common umask 022 (files 0644, folders 0755 unless the code asks for less)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_state_directory_and_its_files_are_private(tmp_path: Path, loose_umask: None) -> None:
    """Every file a deployed learner's state directory gets — state, marker, ledger, commit
    log, diagnostics, lock — is 0600, the directory 0700, under a umask that would make
    them 0644 and 0755."""
    store = StateStore(tmp_path / "state")
    with store.lock():
        store.commit(b"state with a noise key", identity="a" * 32, generation=1,
                     entry={"first-step": 0, "steps": 2}, diagnostics={"clipped": 1})
    names = sorted(p.name for p in store.directory.iterdir())
    assert names == sorted(["learner.state", "learner.started", "ledger.jsonl",
                            "commits.jsonl", "diagnostics.jsonl", "learner.lock"])
    assert mode(store.directory) == 0o700
    assert {name: mode(store.directory / name) for name in names} == dict.fromkeys(names, 0o600)


def test_a_loose_state_directory_is_tightened(tmp_path: Path, loose_umask: None) -> None:
    """A directory and files left world-readable (by an older version, or made by hand)
    are made private when the learner next opens and writes them."""
    directory = tmp_path / "state"
    directory.mkdir(mode=0o755)
    (directory / "learner.state").write_bytes(b"old")
    (directory / "ledger.jsonl").write_text("")
    os.chmod(directory / "learner.state", 0o644)
    os.chmod(directory / "ledger.jsonl", 0o644)
    store = StateStore(directory)
    assert mode(directory) == 0o700
    store.commit(b"new", identity="b" * 32, generation=1, entry={"first-step": 0})
    assert mode(directory / "learner.state") == 0o600  # a new file, replaced atomically
    assert mode(directory / "ledger.jsonl") == 0o600  # appended to: tightened


def test_laplace_streams_without_a_seed_draw_unrelated_noise() -> None:
    """No default seed 0: two streams made without a seed have different 128-bit keys
    from OS entropy and draw different noise, neither of them seed 0's; a given seed
    still reproduces."""
    sched = ScaleSchedule("constant", 1.0)
    a, b = LaplaceStream(16, sched), LaplaceStream(16, sched)
    zero = LaplaceStream(16, sched, seed=0)
    assert generator_key(a.rng) != generator_key(b.rng)
    assert generator_key(a.rng).bit_length() > 64 or generator_key(b.rng).bit_length() > 64
    first_a, first_b = a.next(), b.next()
    assert not np.array_equal(first_a, first_b)
    assert not np.array_equal(first_a, zero.next())
    np.testing.assert_array_equal(LaplaceStream(16, sched, seed=5).next(),
                                  LaplaceStream(16, sched, seed=5).next())
    # the state carries the key: a restored stream continues, it is not re-keyed
    restored = LaplaceStream.from_bytes(a.to_bytes())
    np.testing.assert_array_equal(restored.next(), a.next())
