"""The mechanism registry: names, parameters, no fallthrough — and the worked example of
docs/architecture.md, a mechanism added in one file (tests/toy_mechanism.py) that is found,
built, streamed, calibrated and run end to end by the in-process engine."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import pytest

from flwr_corrnoise.engine import run_inprocess
from flwr_corrnoise.mechanisms import (
    MECHANISMS,
    build_factorization,
    get_mechanism,
    mechanism_names,
    register,
)
from flwr_corrnoise.mechanisms.base import prefix_sum_matrix
from flwr_corrnoise.mechanisms.independent import Independent
from flwr_corrnoise.mechanisms.registry import factorization_by_digest, unregister
from flwr_corrnoise.noise_keys import noise_generator
from flwr_corrnoise.privacy import calibrate, calibrate_mechanism
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings, derive_seed
from flwr_corrnoise.streams import NoiseStream, normalize_shapes

from ..noise import test_streams
from ..noise.test_streams import assert_prefix_covariance, draw_all

BUILT_IN = ["independent", "tree", "efficient-tree", "toeplitz", "optimized", "blt"]


@pytest.fixture
def toy() -> Iterator[ModuleType]:
    """Import the one-file mechanism (which registers itself); forget it afterwards."""
    module = importlib.import_module("tests.toy_mechanism")
    try:
        yield module
    finally:
        unregister(module.NAME)
        sys.modules.pop("tests.toy_mechanism", None)


# -- the registry ---------------------------------------------------------------------------
def test_every_registered_name_builds_itself_and_feeds_mechanisms() -> None:
    """MECHANISMS is the registry's view, and no name falls through to another builder
    (the old ``if`` chain built ``optimized`` for any branch it missed)."""
    assert list(MECHANISMS) == mechanism_names()
    assert set(BUILT_IN) <= set(MECHANISMS)
    for name in mechanism_names():
        assert MECHANISMS[name] == get_mechanism(name).description
        fact = build_factorization(name, 5)
        assert (fact.name, fact.n) == (name, 5)
    with pytest.raises(TypeError):
        MECHANISMS["x"] = "y"  # type: ignore[index]


def test_unknown_name_is_an_error_listing_the_known_ones(toy: ModuleType) -> None:
    for attempt in (lambda: build_factorization("laplace", 8),
                    lambda: get_mechanism("laplace"),
                    lambda: factorization_by_digest("laplace", 8, "0" * 64),
                    lambda: NoiseStream.create("laplace", 8, 3, 1.0, seed=0),
                    lambda: mechanism_names(["blt", "laplace"])):
        with pytest.raises(ValueError, match="unknown mechanism 'laplace'") as err:
            attempt()
        for name in [*BUILT_IN, toy.NAME]:  # the live list, the toy included
            assert repr(name) in str(err.value)
    with pytest.raises(PrivacyConfigError, match="banded-sqrt"):
        PrivacySettings("laplace")


def test_duplicate_reserved_and_misbuilt_mechanisms_are_refused(toy: ModuleType) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register("blt", "another BLT", build=Independent)
    with pytest.raises(ValueError, match="already registered"):
        importlib.reload(toy)  # the module registering itself a second time
    with pytest.raises(ValueError, match="cannot name"):
        register("none", "the noiseless baseline's name", build=Independent)
    # a builder that returns another mechanism is caught when it builds, not used
    register("misbuilt", "returns independent noise", build=Independent)
    try:
        with pytest.raises(TypeError, match="returned 'independent'"):
            build_factorization("misbuilt", 8)
    finally:
        unregister("misbuilt")
    assert "misbuilt" not in MECHANISMS


def test_parameters_are_checked_memoized_and_restored_by_digest() -> None:
    """BLT's ``buffers`` is a registered parameter: checked, part of the memo key, and a
    stream made with a non-default BLT restores its own (from the write-once cache)."""
    two = build_factorization("blt", 5, buffers=2)
    assert two.buffers == 2 and build_factorization("blt", 5).buffers == 4
    assert build_factorization("blt", 5, buffers=2) is two
    assert two.digest != build_factorization("blt", 5).digest
    for bad in (0, 2.5, True, "3"):
        with pytest.raises(ValueError, match="mechanism 'blt': parameter buffers"):
            build_factorization("blt", 5, buffers=bad)
    with pytest.raises(ValueError, match=r"takes no parameter 'bands'.*\['buffers', "
                                         r"'max_participations', 'min_sep'\]"):
        build_factorization("blt", 5, bands=2)
    with pytest.raises(ValueError, match="parameter gap must be a float > 0"):
        build_factorization("optimized", 5, gap=0.0)
    stream = NoiseStream("blt", 5, normalize_shapes(3), 1.0, noise_generator(5),
                         factorization=two)
    for _ in range(2):
        stream.next()
    restored = NoiseStream.from_bytes(stream.to_bytes())
    assert restored.factorization.buffers == 2
    assert restored.factorization.digest == two.digest
    assert np.array_equal(draw_all(restored), draw_all(stream))


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_kernel_peak_memory_is_the_measured_one(name: str) -> None:
    """A kernel's closed-form peak state (what the benchmarks quote at N = 10⁵) is the
    peak its stream actually holds."""
    for n in (1, 5, 23):  # the sizes test_streams.py builds (cached in a full run)
        stream = NoiseStream.create(name, n, 1, 1.0, seed=0)
        peak = 0
        for _ in range(n):
            stream.next()
            peak = max(peak, stream.state_floats)
        assert build_factorization(name, n).stream_kernel().peak_rows(n) == peak


# -- the worked example: a mechanism in one file -------------------------------------------
def h_squared_sum(k: int) -> float:
    """Σ_{j<k} h(j)² for the Toeplitz square root's h(0) = 1, h(j) = h(j−1)·(1 − 1/(2j))."""
    total, h = 0.0, 1.0
    for j in range(k):
        if j:
            h *= 1.0 - 1.0 / (2.0 * j)
        total += h * h
    return total


def test_toy_is_found_and_builds_a_valid_factorization(toy: ModuleType) -> None:
    assert toy.NAME in MECHANISMS and toy.NAME in mechanism_names()
    assert [p.name for p in get_mechanism(toy.NAME).params] == ["bands"]
    for n in (1, 2, 7, 20):
        for bands in (1, 3, 5):
            fact = build_factorization(toy.NAME, n, bands=bands)
            B, C = fact.matrices()
            np.testing.assert_allclose(B @ C, prefix_sum_matrix(n), atol=1e-10)
            np.testing.assert_allclose(fact.column_norms(), np.linalg.norm(C, axis=0))
            # the sensitivity is column 0's, Σ of the first min(b, N) h(j)², by hand
            assert fact.sensitivity == pytest.approx(math.sqrt(h_squared_sum(min(bands, n))))
    digests = {build_factorization(toy.NAME, 20, bands=b).digest for b in (1, 3, 5)}
    assert len(digests) == 3
    with pytest.raises(ValueError, match="parameter bands must be an int ≥ 1"):
        build_factorization(toy.NAME, 20, bands=0)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 23])
def test_toy_stream_is_its_noising_matrix_times_xi(toy: ModuleType, n: int) -> None:
    """The existing check of every registered mechanism, on the toy's own kernel."""
    test_streams.test_increments_are_noising_matrix_times_xi(toy.NAME, n)


def test_toy_stream_has_covariance_v2_bbt_restores_and_rolls_back(toy: ModuleType) -> None:
    n, dim, std = 12, 40_000, 1.5
    assert_prefix_covariance(draw_all(NoiseStream.create(toy.NAME, n, dim, std, seed=2024)),
                             toy.NAME, std)
    # the kernel's own state: saved as rows, restored bit for bit, a kept state (a fork)
    # stepped again gives the same increments (the kernel never changes a state)
    stream = NoiseStream.create(toy.NAME, n, [(2, 2), (3,)], std, seed=8)
    for _ in range(5):
        stream.next()
    blob = stream.to_bytes()
    assert stream.state_dict()["rows"].shape == (2, 7)  # bands − 1 increments
    kept = stream.fork()
    ahead = draw_all(stream)
    stream = kept
    restored = NoiseStream.from_bytes(blob)
    assert np.array_equal(draw_all(stream), ahead)
    assert np.array_equal(draw_all(restored), ahead)
    state = NoiseStream.from_bytes(blob).state_dict()
    state["step"] = np.array(1)  # two saved increments cannot follow one step
    with pytest.raises(ValueError, match="banded noise state does not match its step"):
        NoiseStream.from_state_dict(state)
    kernel = build_factorization(toy.NAME, n).stream_kernel()
    assert kernel.peak_rows(n) == 2  # the measured default: bands − 1


def test_toy_calibrates_and_runs_end_to_end_in_the_engine(toy: ModuleType) -> None:
    """Calibration uses the toy's sensitivity (checked against the materialized C), and
    the in-process engine's run equals Algorithm 1 replayed by hand on the toy's streams."""
    rounds, tau, learners, clip, eta, seed = 3, 2, 2, 0.5, 0.1, 7
    horizon = rounds * tau
    _, C = build_factorization(toy.NAME, horizon).matrices()
    cal = calibrate_mechanism(2.0, 1e-3, clip, toy.NAME, horizon)
    expected = calibrate(2.0, 1e-3, clip, float(np.linalg.norm(C, axis=0).max()))
    assert cal.std == expected.std and cal.mechanism == toy.NAME

    settings = PrivacySettings(toy.NAME, 2.0, 1e-3, clip_norm=clip, horizon=horizon)
    targets = [np.arange(4.0), -np.ones(4)]

    def gradient(i: int):
        def grad(params, position):
            return [params[0] - targets[i] - position]
        return grad

    res = run_inprocess(initial=[np.zeros(4)], gradients=[gradient(i) for i in range(2)],
                        settings=settings, rounds=rounds, tau=tau, eta=eta, seed=seed)
    assert all(s.noise.factorization.name == toy.NAME and s.noise.step == horizon
               for s in res.states)
    # by hand: clip each step's gradient, add the toy stream's increment, average
    streams = [NoiseStream.create(toy.NAME, horizon, 4, cal.std, derive_seed(seed, i))
               for i in range(learners)]
    x = np.zeros(4)
    for r in range(rounds):
        updates = []
        for i in range(learners):
            z = x.copy()
            for t in range(tau):
                g = z - targets[i] - (r * tau + t)
                g = g * min(1.0, clip / np.linalg.norm(g))
                z = z - eta * (g + streams[i].next())
            updates.append((x - z) / (eta * tau))
        x = x - eta * tau * np.mean(updates, axis=0)
    np.testing.assert_allclose(res.params[0], x, rtol=1e-12, atol=1e-12)
