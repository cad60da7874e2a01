"""The cyclic Poisson sampler (flwr_corrnoise/data/sampling.py): batches reproducible from
(key, step), only group ``i mod b`` eligible at step ``i``, each member drawn with
probability ``q``, another key another draw."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from flwr_corrnoise.amplification import CyclicPoissonSampling
from flwr_corrnoise.data.sampling import CyclicPoissonLoader, sampling_key
from flwr_corrnoise.mechanisms.participation import Participation


def loader(**kw) -> CyclicPoissonLoader:
    args = {"num_examples": 200, "batch_size": 10, "rounds": 5, "key": 7,
            "local_epochs": 2, "bands": 4} | kw
    return CyclicPoissonLoader(**args)


def all_batches(ld: CyclicPoissonLoader) -> list[np.ndarray]:
    return [ld.indices(i) for i in range(ld.horizon)]


def test_what_the_accounting_reads() -> None:
    ld = loader()
    assert ld.steps_per_epoch == 20 and ld.local_steps == 40 and ld.horizon == 200
    assert ld.sampling_rate == pytest.approx(4 / 20)
    assert ld.expected_batch_size == pytest.approx(200 / 20)
    assert ld.sampling == CyclicPoissonSampling(0.2, 4, 200)
    assert ld.sampling.cycles() == 50 and ld.sampling.cycles(41) == 11
    # the un-amplified fallback: an example is used at most at its group's steps
    part = ld.participation
    assert Participation(part.max_participations, part.min_sep, part.fixed_epoch) == \
        Participation(50, 4, True)
    assert (part.sampling_rate, part.bands, part.expected_batch_size) == (0.2, 4, 10.0)
    assert "key=" not in repr(ld)  # the key is never shown


def test_batches_are_a_function_of_key_and_step() -> None:
    ld = loader()
    first = all_batches(ld)
    again = loader()  # a rebuilt loader (a ClientApp is rebuilt every round)
    order = np.random.default_rng(3).permutation(ld.horizon)
    for step in order:  # in any order: nothing carries over between steps
        assert np.array_equal(again.indices(int(step)), first[step])
    thawed = pickle.loads(pickle.dumps(ld))
    assert all(np.array_equal(thawed.indices(i), b) for i, b in enumerate(first))
    assert list(map(len, ld.round_indices(40))) == list(map(len, first[40:80]))


def test_another_key_draws_other_batches() -> None:
    a, b = all_batches(loader(key=7)), all_batches(loader(key=8))
    differ = sum(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert differ >= 0.95 * len(a)
    c = all_batches(loader(key=bytes(range(16))))
    assert sum(not np.array_equal(x, y) for x, y in zip(a, c, strict=True)) >= 0.95 * len(a)


def test_only_the_step_s_group_is_eligible() -> None:
    ld = loader()
    groups = [set(ld.group(g).tolist()) for g in range(ld.bands)]
    assert sorted(x for g in groups for x in g) == list(range(ld.num_examples))  # a partition
    assert {len(g) for g in groups} == {50}
    for step, batch in enumerate(all_batches(ld)):
        assert set(batch.tolist()) <= groups[step % ld.bands]
        assert len(set(batch.tolist())) == len(batch)
    for example in (0, 17, 199):
        steps = ld.eligible_steps(example)
        g = next(i for i, grp in enumerate(groups) if example in grp)
        np.testing.assert_array_equal(steps, np.arange(g, ld.horizon, ld.bands))
        used = [s for s, batch in enumerate(all_batches(ld)) if example in batch]
        assert set(used) <= set(steps.tolist())


def test_inclusion_frequency_is_q() -> None:
    """Over 1000 eligible steps per member, each member's frequency is within 5 standard
    errors of q, and the mean over all members within 5 of theirs."""
    ld = CyclicPoissonLoader(64, 4, rounds=250, key=11, bands=4)  # q = 1/4, 4000 steps
    q, counts, eligible = ld.sampling_rate, np.zeros(64), np.zeros(64)
    for step in range(ld.horizon):
        eligible[ld.group(step)] += 1
        counts[ld.indices(step)] += 1
    assert np.all(eligible == 1000)
    freq = counts / eligible
    se = math.sqrt(q * (1 - q) / 1000)
    assert np.all(np.abs(freq - q) < 5 * se)
    assert abs(freq.mean() - q) < 5 * se / 8
    # and the batch sizes average the expected batch size
    sizes = np.array([len(ld.indices(s)) for s in range(ld.horizon)])
    assert abs(sizes.mean() - ld.expected_batch_size) < 5 * math.sqrt(16 * q * (1 - q) / 4000)


def test_one_band_is_poisson_sampling_over_everything() -> None:
    ld = loader(bands=1)
    assert ld.sampling_rate == pytest.approx(1 / 20)  # Opacus: 1/len(data_loader)
    assert np.array_equal(np.sort(ld.group(5)), np.arange(200))


def test_as_many_bands_as_steps_is_a_fixed_partition() -> None:
    """bands = steps per epoch: rate 1, every step takes its whole group, the cyclic
    loader's participation (each example once per epoch, 20 steps apart)."""
    ld = loader(bands=20)
    assert ld.sampling_rate == 1.0
    for step in range(ld.horizon):
        assert np.array_equal(ld.indices(step), ld.group(step))
    part = ld.participation
    assert Participation(part.max_participations, part.min_sep, part.fixed_epoch) == \
        Participation.epochs(10, 20)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="at most 20 bands"):
        loader(bands=21)
    ld = loader()
    for step in (-1, ld.horizon, 2.0, True):
        with pytest.raises(IndexError):
            ld.indices(step)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="round starts"):
        next(ld.round_indices(3))
    with pytest.raises(ValueError, match="16 to 64 bytes"):
        loader(key=b"short")
    with pytest.raises(TypeError):
        loader(key=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        loader(batch_size=201)


def test_sampling_key() -> None:
    """The AES key is derived (keyed BLAKE2b, its own personalization): not the learner's
    key itself, the same for the same key in any of its forms, another for another key."""
    words = np.array([1, 2], dtype=np.uint64)
    assert sampling_key(words) == sampling_key(words.astype("<u8").tobytes())
    assert sampling_key(words) != words.astype("<u8").tobytes()
    assert len(sampling_key(5)) == 16 and sampling_key(5) != sampling_key(6)
    assert sampling_key(bytes(32)) != sampling_key(bytes(16))
