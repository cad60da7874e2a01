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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_a_block_of_steps_is_the_steps_one_by_one(dtype: type, path: str) -> None:
    """NoiseStream.next_block (a learner's round in one pass over BLT's buffers: the
    compiled cn_blt_steps, or the NumPy path step by step): the same increments and the
    same state, bit for bit, as next() τ times — at a d that spans many column blocks
    and ends mid-block — then it goes on like a stream that never drew a block; a block
    past the horizon is refused before anything is drawn."""
    from flwr_corrnoise import compiled_kernel as ck
    from flwr_corrnoise.streams import HorizonExhaustedError, NoiseStream

    ck.select(path)
    try:
        a = NoiseStream.create("blt", horizon=12, dim=70_001, std=1.3, seed=3, dtype=dtype)
        a.next()
        b = NoiseStream.from_bytes(a.to_bytes())
        assert b.draws_blocks
        one_by_one = np.stack([a.next() for _ in range(4)])
        np.testing.assert_array_equal(b.next_block(4), one_by_one)
        assert b.step == a.step == 5
        for key, value in a.state_dict().items():
            np.testing.assert_array_equal(b.state_dict()[key], value, err_msg=key)
        np.testing.assert_array_equal(b.next(), a.next())
        with pytest.raises(HorizonExhaustedError):
            b.next_block(7)
        assert b.step == 6
        np.testing.assert_array_equal(b.next_block(6), np.stack([a.next() for _ in range(6)]))
    finally:
        ck.select(None)


def test_only_kernels_that_step_in_blocks_draw_blocks() -> None:
    """A kernel without a fused form (the tree, banded-inverse) and a secure stream (its
    grid is per step) never take the block path: their rounds step one by one."""
    from flwr_corrnoise.streams import NoiseStream

    assert not NoiseStream.create("tree", horizon=8, dim=4, std=1.0, seed=1).draws_blocks
    assert not NoiseStream.create("banded-inverse", horizon=8, dim=4, std=1.0,
                                  seed=1).draws_blocks
    assert not NoiseStream.create("blt", horizon=8, dim=4, std=1.0, secure=True).draws_blocks


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_round_on_blocks_is_the_round_step_by_step(dtype: type,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """learner.BlockNoise (the round's noise drawn as one block a stream when it opens):
    the same update, state and counters, bit for bit, as the round stepped one increment
    at a time — a clipped step, a non-finite step and an ordinary one — and it is the
    path a BLT learner's round takes."""
    from flwr_corrnoise import learner as L  # noqa: N812

    settings = PrivacySettings("blt", 2.0, 1e-3, clip_norm=0.5, horizon=40)
    grads = [np.full(6, 3.0), np.full(6, np.nan), np.full(6, 0.01), np.arange(6.0)]

    def run(blocks: bool):
        monkeypatch.setattr(L.BlockNoise, "usable",
                            staticmethod(lambda s: blocks and all(x.draws_blocks for x in s)))
        opened = []
        real = L.BlockNoise.__init__

        def spy(self, streams, tau):
            opened.append(tau)
            real(self, streams, tau)

        monkeypatch.setattr(L.BlockNoise, "__init__", spy)
        state = LearnerState.create(settings, [(2, 3)], seed=9, dtype=dtype)
        model = [np.zeros((2, 3), dtype=dtype)]
        out = [L.local_round(model, lambda p, t: [grads[t % 4].reshape(2, 3)], state,
                             settings, tau=4, eta=0.1) for _ in range(2)]
        return out, state, opened

    (a, sa, oa), (b, sb, ob) = run(True), run(False)
    assert oa == [4, 4] and ob == []
    for ra, rb in zip(a, b, strict=True):
        np.testing.assert_array_equal(ra.update[0], rb.update[0])
        assert ra.diagnostics == rb.diagnostics
    assert (sa.step, sa.position) == (sb.step, sb.position) == (8, 8)
    for key, value in sa.noise.state_dict().items():
        np.testing.assert_array_equal(sb.noise.state_dict()[key], value, err_msg=key)


@pytest.mark.parametrize("row_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_release_into_its_row_is_the_release(dtype: type, row_dtype: type) -> None:
    """NoiseStream.release(value, e, out=value) (a round's block added into its gradient
    row in place): the same floats as the release it replaces (``out`` assigned the new
    array), whether the row is in the noise's dtype (the in-place sum) or not (a float64
    row with float32 noise: the float32 sum, then widened), and the row is what comes
    back."""
    from flwr_corrnoise.streams import NoiseStream

    stream = NoiseStream.create("blt", horizon=8, dim=1001, std=1.3, seed=5, dtype=dtype)
    block = stream.next_block(2)
    value = (np.random.default_rng(1).standard_normal(1001) * 1e3).astype(row_dtype)
    want = np.empty_like(value)
    want[...] = stream.release(value, block[1])
    row = value.copy()
    assert stream.release(row, block[1], out=row) is row
    np.testing.assert_array_equal(row, want)
    other = np.empty_like(value)  # an ``out`` that is not the value: written, value kept
    assert stream.release(value, block[1], out=other) is other
    np.testing.assert_array_equal(other, want)
