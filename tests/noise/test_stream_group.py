"""StreamGroup: L streams' noise as one recurrence (issue 22), held to the L separate
streams and to the noising matrix, for every registered mechanism."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_corrnoise.learner import StepCounts, clip_margin, private_step, private_steps
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import MECHANISMS, build_factorization
from flwr_corrnoise.mechanisms.streaming import HistoryKernel
from flwr_corrnoise.mechanisms.tree import BinaryTree
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.stream_group import GroupCursor, GroupedNoise, StreamGroup
from flwr_corrnoise.streams import HorizonExhaustedError, NoiseStream
from tests.noise.test_streams import xi_matrix

N, DIM, STD, SEEDS = 40, 5, 0.7, (3, 17, 101)


def streams(name: str, seeds=SEEDS, n: int = N) -> list[NoiseStream]:
    return [NoiseStream.create(name, n, DIM, STD, seed=s) for s in seeds]


def run_grouped(group_of: list[NoiseStream], rounds: list[int]) -> np.ndarray:
    """Steps ``rounds[r]`` at a time, the group opened and closed around each round (as
    local_rounds does); returns the increments, ``steps × L × d``."""
    out = []
    for steps in rounds:
        with StreamGroup(group_of) as group:
            out.extend(group.next() for _ in range(steps))
    return np.array(out)


def noising_reference(name: str, seed: int, n: int = N) -> np.ndarray:
    """A stream's increments computed independently: V·M·ξ with ξ in the documented order."""
    fact = build_factorization(name, n)
    M = fact.noising_matrix()
    if isinstance(fact, BinaryTree):  # the vanilla tree draws only the nodes B uses
        used = fact.drawn_nodes()
        xi = np.zeros((M.shape[1], DIM))
        xi[used] = xi_matrix(seed, len(used), DIM)
    else:
        xi = xi_matrix(seed, M.shape[1], DIM)
    return STD * M @ xi


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_group_equals_separate_streams_and_the_noising_matrix(name: str) -> None:
    """Increments, final states and the continuation of every member equal L separate
    streams' (rounding of a wider product only), and each member's increments are its own
    V·M·ξ — so no member's rows are another's, in any order or window."""
    rounds = [1, 3, 4, 4, 7, 9, 12]  # 40 steps: dense windows of 1 … 16 rows, one clipped
    grouped_streams, alone = streams(name), streams(name)
    grouped = run_grouped(grouped_streams, rounds[:-1])
    separate = np.array([[s.next() for s in alone] for _ in range(sum(rounds[:-1]))])
    np.testing.assert_allclose(grouped, separate, rtol=0, atol=1e-12)
    # the states after close are the separate streams' (generator, step, levels exactly)
    for g, a in zip(grouped_streams, alone, strict=True):
        sg, sa = g.state_dict(), a.state_dict()
        assert sg.keys() == sa.keys()
        for key in sg:
            if key == "rows":
                np.testing.assert_allclose(sg[key], sa[key], rtol=0, atol=1e-12)
            else:
                np.testing.assert_array_equal(sg[key], sa[key])
    # every member continues alone as its separate twin does
    for g, a in zip(grouped_streams, alone, strict=True):
        rest = [g.next() for _ in range(rounds[-1])]
        np.testing.assert_allclose(rest, [a.next() for _ in range(rounds[-1])],
                                   rtol=0, atol=1e-12)
    # and against the second computation: member i's increments are V·M·ξ_i
    full = np.concatenate([grouped, np.full((rounds[-1], len(SEEDS), DIM), np.nan)])
    for i, seed in enumerate(SEEDS):
        ref = noising_reference(name, seed)
        np.testing.assert_allclose(full[: N - rounds[-1], i], ref[: N - rounds[-1]],
                                   rtol=0, atol=1e-11)
    # the comparison has power: the members' noises differ
    assert np.abs(grouped[:, 0] - grouped[:, 1]).max() > 0.1


def test_a_dense_group_sums_in_windows_and_a_stream_in_one_product() -> None:
    """The stacked dense state's windows double (1, 2, 4, … rows), a lone stream's stay at
    one step (so that a restored stream continues bit for bit), and both agree."""
    grouped_streams = streams("toeplitz")
    kernel = grouped_streams[0]._kernel
    assert isinstance(kernel, HistoryKernel)
    windows = []
    with StreamGroup(grouped_streams) as group:
        for _ in range(N):
            group.next()
            windows.append(group._state.acc_rows)
        last = group._state.acc.shape[0]
    # windows [0,1) [1,3) [3,7) [7,15) [15,31) [31,63) — the last cut at the horizon
    assert windows == [1, 2, 2, 4, 4, 4, 4, *[8] * 8, *[16] * 16, *[32] * 9] and last == 9
    lone = streams("toeplitz")[0]
    for _ in range(5):
        lone.next()
        assert lone._state.acc_rows == 1


def test_stacking_the_same_streams_again_copies_nothing() -> None:
    members = streams("optimized")
    with StreamGroup(members) as group:
        group.next()
        first = group._state
    with StreamGroup(members) as group:
        assert group._state is first  # the columns were views of it: no copy, window on
    members[1].next()  # a member stepping alone owns its rows again
    with pytest.raises(ValueError, match="step"):
        StreamGroup(members)
    for s in (members[0], members[2]):
        s.next()
    with StreamGroup(members) as group:
        assert group._state is not first


def test_partition_groups_by_step_and_mechanism() -> None:
    a, b, c = streams("blt")
    d = NoiseStream.create("tree", N, DIM, STD, seed=5)
    b.next()
    groups = StreamGroup.partition([a, b, c, d])
    assert [idx for idx, _ in groups] == [[0, 2], [1], [3]]
    for _, g in groups:
        g.close()


def test_horizon_refused_before_anything_is_drawn() -> None:
    members = streams("blt", n=3)
    with StreamGroup(members) as group:
        for _ in range(3):
            group.next()
        before = [s._pack_rng().tolist() for s in members]
        with pytest.raises(HorizonExhaustedError):
            group.next()
        assert [s._pack_rng().tolist() for s in members] == before
        assert [s.step for s in members] == [3, 3, 3]


def test_a_members_own_call_closes_the_group() -> None:
    """No member can step or save a state the group has moved on: its own call takes the
    state back first, and the group then refuses to step."""
    members, twins = streams("blt"), streams("blt")
    group = StreamGroup(members)
    group.next()
    for t in twins:
        t.next()
    np.testing.assert_allclose(members[1].next(), twins[1].next(), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="closed"):
        group.next()
    assert members[0].state_dict()["step"] == 1


def test_a_group_round_leaves_the_kept_streams_as_they_were() -> None:
    """A round on forks of the streams, grouped: the streams it was forked from (what a
    learner keeps when the round fails) are unchanged, their states byte for byte."""
    members = streams("banded-inverse")
    for s in members:
        s.next()
    before = [s.to_bytes() for s in members]
    kept = [s.fork() for s in members]
    with StreamGroup(members) as group:
        for _ in range(5):
            group.next()
    assert [s.to_bytes() for s in kept] == before


def test_secure_streams_release_on_their_grid_as_one_does() -> None:
    originals = [NoiseStream.create("blt", N, DIM, STD, secure=True) for _ in range(2)]
    twins = [NoiseStream.from_bytes(s.to_bytes()) for s in originals]
    values = np.random.default_rng(0).normal(size=(2, DIM))
    with StreamGroup(originals) as group:
        grouped = group.add_next(values)
    alone = np.array([t.add_next(v) for t, v in zip(twins, values, strict=True)])
    np.testing.assert_array_equal(grouped, alone)


@pytest.mark.parametrize("mechanism", ["blt", "toeplitz", "none"])
def test_private_steps_is_private_step_row_by_row(mechanism: str) -> None:
    """L learners' rows: each clipped on its own (one above B_g, one below), a non-finite
    row counted as zero for that learner only, each learner's own noise and counters."""
    settings = PrivacySettings(mechanism, 1.0, 1e-3, 0.5, horizon=8)
    rows = np.array([[3.0, 4.0, 0.0], [0.1, 0.0, 0.2], [np.nan, 1.0, 0.0]])
    group_states = [LearnerState.create(settings, [(3,)], seed=i) for i in range(3)]
    one_states = [LearnerState.create(settings, [(3,)], seed=i) for i in range(3)]
    counts = [StepCounts() for _ in range(3)]
    grouped = GroupedNoise([s.noise for s in group_states]) if settings.private else None
    out = private_steps(group_states, settings, 3, counts, rows=rows, noise=grouped)
    if grouped is not None:
        grouped.close()
    for i, state in enumerate(one_states):
        c = StepCounts()
        row = private_step(state, settings, lambda i=i: rows[i], 3, c)
        np.testing.assert_allclose(out[i], row, rtol=0, atol=1e-12)
        assert (counts[i].clipped, counts[i].nonfinite) == (c.clipped, c.nonfinite)
        assert (group_states[i].step, group_states[i].position) == (1, 1)
    assert [c.nonfinite for c in counts] == [0, 0, 1]
    # by hand: (3, 4, 0) has norm 5 > B_g = 0.5, the second row is within, the third zero;
    # each plus its own stream's first increment (a twin stream of the same seed)
    # (clipped to B_g less the float64 margin that keeps the release's exact norm ≤ B_g)
    shrink = 1.0 - clip_margin(3)
    signal = np.array([[0.3 * shrink, 0.4 * shrink, 0.0], [0.1, 0.0, 0.2], [0.0, 0.0, 0.0]])
    if settings.private:
        assert [c.clipped for c in counts] == [1, 0, 0]
        noise = np.array([LearnerState.create(settings, [(3,)], seed=i).noise.next()
                          for i in range(3)])
        assert np.abs(noise).min() > 0
        np.testing.assert_allclose(out, signal + noise, rtol=0, atol=1e-15)
    else:
        np.testing.assert_array_equal(out, [[3.0, 4.0, 0.0], [0.1, 0.0, 0.2], [0, 0, 0]])


# -- rows drawn ahead (GroupCursor, ahead = τ) -----------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_drawing_a_rounds_rows_at_once_is_the_same_numbers_in_the_same_order(
        dtype: type) -> None:
    """The premise: a stream drawing k rows into a k×d block (its kernel's rows at the
    position, the position moved by k) gives the k single draws, and the generator's state
    after them, bit for bit — for the AES kernel in either dtype, and for the keyed Philox
    of format-2 streams (standard_normal(out=k×d) is k calls of standard_normal(d))."""
    a, b = (NoiseStream.create("independent", N, DIM, 1.0, seed=5, dtype=dtype)
            for _ in range(2))
    block = np.empty((4, DIM), dtype=dtype)
    a._draw_rows(block)
    np.testing.assert_array_equal(block, np.array([b._draw() for _ in range(4)]))
    np.testing.assert_array_equal(a._pack_rng(), b._pack_rng())
    from flwr_corrnoise.noise_keys import noise_generator, pack_generator

    p, q = noise_generator(5), noise_generator(5)
    block = np.empty((4, DIM))
    p.standard_normal(out=block)
    np.testing.assert_array_equal(block, np.array([q.standard_normal(DIM) for _ in range(4)]))
    np.testing.assert_array_equal(pack_generator(p), pack_generator(q))


def test_float32_and_legacy_philox_groups_draw_ahead_as_separate_streams() -> None:
    """Float32 AES streams now draw ahead too, and streams restored with a keyed Philox
    (noise-state format 2) still do: a group's increments and generator words are those of
    the separate streams."""
    from flwr_corrnoise.noise_keys import noise_generator
    from flwr_corrnoise.streams import normalize_shapes

    def make(kind: str) -> list[NoiseStream]:
        if kind == "float32":
            return [NoiseStream.create("blt", N, DIM, STD, seed=s, dtype=np.float32)
                    for s in SEEDS]
        return [NoiseStream("blt", N, normalize_shapes(DIM), STD, noise_generator(s))
                for s in SEEDS]

    for kind in ("float32", "philox"):
        grouped, alone = make(kind), make(kind)
        with StreamGroup(grouped, ahead=4) as group:
            assert group._cursor._ahead == 4  # type: ignore[union-attr]
            got = [group.next() for _ in range(3)]  # one row drawn ahead is put back
        want = [np.array([s.next() for s in alone]) for _ in range(3)]
        tol = 1e-6 if kind == "float32" else 1e-13
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=tol, atol=tol)
        for a, b in zip(grouped, alone, strict=True):
            np.testing.assert_array_equal(a.state_dict()["rng"], b.state_dict()["rng"])
            np.testing.assert_allclose(a.next(), b.next(), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("ahead", [3, 4])
def test_a_group_drawing_ahead_equals_separate_streams_across_a_restore(name: str,
                                                                         ahead: int) -> None:
    """Rounds of `ahead` steps with the rows drawn ahead (every mechanism: the tree draws
    several rows a step, banded-inverse reads positions and so draws row by row), a
    restore from bytes between rounds: the increments and the states are the separate
    streams' (the generator words exactly)."""
    grouped, alone = streams(name), streams(name)
    got, want = [], []
    for r in range(3):
        with StreamGroup(grouped, ahead=ahead) as group:
            got.extend(group.next() for _ in range(ahead))
        want.extend(np.array([s.next() for s in alone]) for _ in range(ahead))
        for a, b in zip(grouped, alone, strict=True):
            assert np.array_equal(a.state_dict()["rng"], b.state_dict()["rng"])
        if r == 1:  # continue from restored states
            grouped = [NoiseStream.from_bytes(s.to_bytes()) for s in grouped]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("used", [0, 1, 3])
def test_a_group_closed_before_using_its_rows_puts_the_generators_back(used: int) -> None:
    """Closed after `used` of 4 rows drawn ahead (or a member's own call closing it): each
    generator stands where `used` single draws leave it, and the streams go on as
    separate streams do; the forks kept before the group are as they were."""
    grouped, alone = streams("blt"), streams("blt")
    kept = [s.fork() for s in grouped]
    group = StreamGroup(grouped, ahead=4)
    first = [group.next() for _ in range(used)]
    grouped[1].state_dict() if used == 1 else group.close()  # a member's call closes it
    assert not group._open
    want = [np.array([s.next() for s in alone]) for _ in range(used)]
    np.testing.assert_allclose(np.array(first).reshape(-1), np.array(want).reshape(-1),
                               rtol=1e-13, atol=1e-13)
    for a, b in zip(grouped, alone, strict=True):
        assert np.array_equal(a.state_dict()["rng"], b.state_dict()["rng"])
        np.testing.assert_allclose(a.next(), b.next(), rtol=1e-13, atol=1e-13)
    fresh = streams("blt")  # the round not written: the kept streams go on
    for a, b in zip(kept, fresh, strict=True):
        np.testing.assert_array_equal(a.next(), b.next())


def test_rows_are_drawn_ahead_only_where_the_generator_allows() -> None:
    """A group draws ahead when asked and every member draws into rows (an AES stream of
    either dtype, or a float64 Philox one); never past the horizon; a secure member keeps
    the row-by-row draw."""
    plain = streams("independent")
    assert GroupCursor(plain, plain[0]._ops, ahead=4)._ahead == 4
    assert GroupCursor(plain, plain[0]._ops)._ahead == 1
    secure = [NoiseStream.create("independent", N, DIM, STD, secure=True) for _ in range(2)]
    assert GroupCursor(secure, secure[0]._ops, ahead=4)._ahead == 1
    near_end = streams("independent", n=6)
    for s in near_end:
        for _ in range(4):
            s.next()
    with StreamGroup(near_end, ahead=4) as group:
        group.next()
        assert group._cursor._rows.shape[1] == 2  # the 2 steps left
        group.next()
        with pytest.raises(HorizonExhaustedError):
            group.next()
