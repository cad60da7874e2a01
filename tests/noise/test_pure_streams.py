"""The pure stream contract (issue 33): a kernel's ``next`` returns the next state and never
changes the one it is given, so a round that fails is undone by not writing it.

Checked against a second computation: a stream stepped straight through, with no fork —
for every registered mechanism, both dtypes, one stream and a group of streams (whose dense
windows share their sums), and a learner's round that fails half-way."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.learner import local_rounds
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import MECHANISMS, build_factorization
from flwr_corrnoise.mechanisms.streaming import NUMPY_OPS
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.stream_group import StreamGroup, grouped_noise
from flwr_corrnoise.streams import NoiseStream

N, DIM = 24, 6


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_a_kept_state_and_the_state_after_it_both_go_on_bit_for_bit(name: str,
                                                                   dtype: type) -> None:
    """Fork at step 3; step the stream 5 times, then the kept fork 5 times (the failed
    round's start, stepped again), then the stream 4 more: each equals the straight run,
    bit for bit — the fork's steps changed nothing the stream reads, and the other way."""
    straight = NoiseStream.create(name, N, DIM, 1.3, seed=5, dtype=dtype)
    ref = [straight.next() for _ in range(12)]
    stream = NoiseStream.create(name, N, DIM, 1.3, seed=5, dtype=dtype)
    head = [stream.next() for _ in range(3)]
    kept = stream.fork()
    ahead = [stream.next() for _ in range(5)]
    again = [kept.next() for _ in range(5)]
    more = [stream.next() for _ in range(4)]
    for got, want in ((head + ahead + more, ref), (again, ref[3:8])):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_next_never_changes_the_state_it_is_given(name: str) -> None:
    """The kernel itself: the saved form of a state before and after a ``next`` from it."""
    kernel = build_factorization(name, N).stream_kernel()
    draws = np.random.default_rng(0).standard_normal((4 * N, DIM))
    rows = iter(draws)
    state = kernel.init(NUMPY_OPS, DIM, [], [])
    for step in range(N - 1):
        levels, saved = kernel.save(state)
        before = (list(levels), [np.array(r, copy=True) for r in saved])
        _, after = kernel.next(state, step, lambda: next(rows).copy(), NUMPY_OPS)
        levels, saved = kernel.save(state)
        assert list(levels) == before[0]
        assert len(saved) == len(before[1])
        for a, b in zip(saved, before[1], strict=True):
            np.testing.assert_array_equal(a, b)
        state = after


@pytest.mark.parametrize("name", ["toeplitz", "optimized", "blt", "tree"])
def test_a_group_round_on_forks_leaves_the_kept_streams_to_go_on(name: str) -> None:
    """Three streams grouped for 6 steps (a dense group sums in windows it shares with the
    states after it), the round dropped; the kept streams grouped again give the straight
    run's increments (to the rounding of a wider product, as any group)."""
    seeds = (1, 2, 3)
    straight = [NoiseStream.create(name, N, DIM, 0.9, seed=s) for s in seeds]
    with StreamGroup(straight) as group:
        ref = [group.next() for _ in range(4)]
    with StreamGroup(straight) as group:
        ref += [group.next() for _ in range(8)]
    members = [NoiseStream.create(name, N, DIM, 0.9, seed=s) for s in seeds]
    with StreamGroup(members) as group:
        got = [group.next() for _ in range(4)]
    kept = [s.fork() for s in members]
    with StreamGroup(members) as group:  # the round that fails: never written
        for _ in range(6):
            group.next()
    with StreamGroup(kept) as group:
        got += [group.next() for _ in range(8)]
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-12, atol=1e-12)


def test_a_failed_round_writes_nothing_and_the_rerun_is_the_uninterrupted_one() -> None:
    """local_rounds (its own streams, and the engine's groups): interrupted half-way, every
    learner's state is byte for byte what it was, and the rerun releases what a learner
    that never failed releases."""
    settings = PrivacySettings("toeplitz", 2.0, 1e-3, 1.0, 16)

    def learners() -> list[LearnerState]:
        return [LearnerState.create(settings, [(DIM,)], seed=i) for i in range(3)]

    def grad(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        return [np.full(DIM, 0.1 * (position % 3))]

    x = [np.zeros(DIM)]
    for noise in (None, grouped_noise):
        states, twins = learners(), learners()
        local_rounds(x, [grad] * 3, states, settings, 4, 0.1, noise=noise)
        local_rounds(x, [grad] * 3, twins, settings, 4, 0.1, noise=noise)
        before = [s.to_bytes() for s in states]
        calls = {"n": 0}

        def failing(params: list[np.ndarray], position: int,
                    calls: dict[str, int] = calls) -> list[np.ndarray]:
            calls["n"] += 1
            if calls["n"] == 7:
                raise KeyboardInterrupt  # not a datum's failure: the round stops
            return grad(params, position)

        with pytest.raises(KeyboardInterrupt):
            local_rounds(x, [failing] * 3, states, settings, 4, 0.1, noise=noise)
        assert [s.to_bytes() for s in states] == before
        redo = local_rounds(x, [grad] * 3, states, settings, 4, 0.1, noise=noise)
        ref = local_rounds(x, [grad] * 3, twins, settings, 4, 0.1, noise=noise)
        for a, b in zip(redo, ref, strict=True):
            np.testing.assert_allclose(a.update[0], b.update[0], rtol=1e-13, atol=1e-13)
            assert a.state.step == b.state.step == 8
