"""The banded-inverse mechanism (issue 22, item 2): its band, its regenerating stream, its
O(1) state, and the refusals a tampered or foreign state meets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.cipher_noise import CipherGaussian
from flwr_corrnoise.learner import local_round
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import FactorizationChangedError, build_factorization, cache
from flwr_corrnoise.mechanisms.banded import (
    NAME,
    BandedInverse,
    optimize_band,
    rmse_squared,
    step_down,
    step_up,
)
from flwr_corrnoise.mechanisms.streaming import NUMPY_OPS
from flwr_corrnoise.mechanisms.toeplitz import inverse_sqrt_coefficients
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.streams import NoiseStream, normalize_shapes

from ..noise.test_streams import draw_all, xi_matrix


@pytest.mark.parametrize("bands", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 4, 17])
def test_band_factorizes_and_its_norms_are_the_dense_ones(bands: int, n: int) -> None:
    """M = C⁻¹ has `bands` diagonals; B·C = A; C is the dense inverse of M (second method:
    np.linalg.inv, not the recursion); sensitivity and RMSE from those dense matrices."""
    fact = build_factorization(NAME, n, bands=bands)
    M = fact.noising_matrix()
    w = min(bands, n)
    offsets = np.subtract.outer(np.arange(n), np.arange(n))
    assert np.all(M[(offsets < 0) | (offsets >= w)] == 0.0)
    assert np.all(np.diag(M) == 1.0)
    B, C = fact.matrices()
    np.testing.assert_allclose(C, np.linalg.inv(M), atol=1e-10)
    np.testing.assert_allclose(B, np.tril(np.ones((n, n))) @ M, atol=1e-12)
    np.testing.assert_allclose(B @ C, np.tril(np.ones((n, n))), atol=1e-9)
    dense_sens = np.linalg.norm(np.linalg.inv(M), axis=0).max()
    assert fact.sensitivity == pytest.approx(dense_sens, rel=1e-10)
    assert fact.rmse == pytest.approx(dense_sens * math.sqrt(np.sum(B * B) / n), rel=1e-10)


def test_optimized_band_is_a_local_optimum_below_the_closed_form() -> None:
    """The optimized band beats the truncated (1 − x)^{1/2} it starts from, and no nearby
    stable band (random reflection-coefficient perturbations) is better."""
    n, w = 300, 4
    band, report = optimize_band(n, w)
    closed = inverse_sqrt_coefficients(w)
    assert rmse_squared(band, n) < rmse_squared(closed, n)
    assert report["rmse"] == pytest.approx(build_factorization(NAME, n, bands=w).rmse)
    kappa = step_down(band)
    assert kappa is not None and np.all(np.abs(kappa) < 1)
    np.testing.assert_allclose(step_up(kappa), band, atol=1e-12)
    rng = np.random.default_rng(0)
    best = rmse_squared(band, n)
    for _ in range(40):
        near = np.clip(kappa + 1e-3 * rng.standard_normal(kappa.size), -0.999999, 0.999999)
        assert rmse_squared(step_up(near), n) >= best * (1 - 1e-7)


def test_it_lies_between_the_optimum_and_independent_noise() -> None:
    n = 256
    banded = build_factorization(NAME, n).rmse
    assert build_factorization("optimized", n).rmse < banded
    assert banded < build_factorization("toeplitz", n).rmse * 1.2
    assert banded < build_factorization("independent", n).rmse / 2
    wider = build_factorization(NAME, n, bands=8).rmse
    assert wider < banded  # more bands, closer to the optimum


def _generator(kind: str, seed: int) -> CipherGaussian | np.random.Generator:
    """The stream's generator keyed by SeedSequence(seed): the AES kernel, or the keyed
    Philox a format-2 stream keeps; and its rows 0 … n−1 in draw order."""
    key = np.random.SeedSequence(seed).generate_state(2, np.uint64)
    if kind == "aes":
        return CipherGaussian(key.astype("<u8").tobytes())
    return np.random.Generator(np.random.Philox(key=key))


def _xi(kind: str, seed: int, n: int, dim: int) -> np.ndarray:
    if kind == "aes":
        return xi_matrix(seed, n, dim)
    return _generator(kind, seed).standard_normal((n, dim))  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["aes", "philox"])
@pytest.mark.parametrize("bands", [1, 2, 4, 7])
def test_stream_is_its_noising_matrix_times_xi(bands: int, kind: str) -> None:
    """e = V·M·ξ with ξ the documented rows of the stream's keyed generator (the AES
    kernel's rows by counter; a format-2 stream's Philox): the regenerated rows are
    exactly the rows drawn the first time."""
    n, dim, std, seed = 19, 6, 0.8, 5
    fact = build_factorization(NAME, n, bands=bands)
    stream = NoiseStream("banded-inverse", n, normalize_shapes(dim), std,
                         _generator(kind, seed), factorization=fact)
    E = draw_all(stream)
    np.testing.assert_allclose(E, std * fact.noising_matrix() @ _xi(kind, seed, n, dim),
                               atol=1e-12)


def test_regenerated_rows_equal_kept_rows() -> None:
    """The kernel fed a plain callable keeps its rows; fed the stream's cursor it redraws
    them. Both give the same increments, bit for bit."""
    n, dim = 15, 4
    fact = build_factorization(NAME, n, bands=5)
    kernel = fact.stream_kernel()
    stream = NoiseStream("banded-inverse", n, normalize_shapes(dim), 1.0,
                         _generator("aes", 3), factorization=fact)
    regenerated = draw_all(stream)
    rows = iter(xi_matrix(3, n, dim))
    state = kernel.init(NUMPY_OPS, dim, [], [])
    kept = []
    for k in range(n):
        e, state = kernel.next(state, k, lambda: next(rows).copy(), NUMPY_OPS)
        kept.append(e)
    assert np.array_equal(regenerated, np.array(kept))
    assert len(kernel.save(state)[1]) == 4  # the plain path keeps bands − 1 rows


@pytest.mark.parametrize("secure", [False, True])
def test_state_is_constant_size_and_restores_bit_for_bit(secure: bool) -> None:
    """A few words, whatever d is (BLT's grows with d), and a restored stream continues
    exactly where it was, at every cut."""
    n = 12
    sizes = {}
    for dim in (10, 100_000):
        s = NoiseStream.create(NAME, n, dim, 1.0, seed=None if secure else 1, secure=secure)
        for _ in range(5):
            s.next()
        assert s.state_floats == 0
        sizes[dim] = len(s.to_bytes())
    assert max(sizes.values()) < 2000  # only the shape's digits differ
    assert abs(sizes[100_000] - sizes[10]) < 16
    blt = NoiseStream.create("blt", n, 100_000, 1.0, seed=1)
    blt.next()
    assert len(blt.to_bytes()) > 100 * sizes[10]
    for cut in range(n + 1):
        a = NoiseStream.create(NAME, n, [(2, 3), (4,)], 2.0, seed=9) if not secure else \
            NoiseStream.create(NAME, n, [(2, 3), (4,)], 2.0, secure=True)
        for _ in range(cut):
            a.next()
        b = NoiseStream.from_bytes(a.to_bytes())
        assert np.array_equal(draw_all(a), draw_all(b))


def test_a_kept_state_and_a_failed_round() -> None:
    stream = NoiseStream.create(NAME, 20, 7, 1.0, seed=4)
    for _ in range(3):
        stream.next()
    kept = stream.fork()
    first = [stream.next() for _ in range(6)]
    assert np.array_equal(first, [kept.next() for _ in range(6)])
    # a learner round that fails half-way is not written (it ran on LearnerState.fork)
    settings = PrivacySettings(NAME, 1.0, 1e-5, 1.0, horizon=12)
    state = LearnerState.create(settings, [(3,)], seed=2)
    before = state.to_bytes()
    calls = []

    class Interrupted(BaseException):
        """Not a datum's failure (those count as zero): the round itself stops."""

    def failing(params, step):
        calls.append(step)
        if len(calls) == 3:
            raise Interrupted
        return [np.ones(3)]

    with pytest.raises(Interrupted):
        local_round([np.zeros(3)], failing, state, settings, 4, 0.1)
    assert state.to_bytes() == before


def _advanced(step: int = 6, kind: str = "aes") -> NoiseStream:
    if kind == "aes":
        s = NoiseStream.create(NAME, 16, 5, 1.0, seed=8)
    else:  # a noise-state format-2 stream: Philox, whose rows have no counter
        s = NoiseStream(NAME, 16, normalize_shapes(5), 1.0, _generator("philox", 8),
                        factorization=build_factorization(NAME, 16))
    for _ in range(step):
        s.next()
    return s


def test_rows_by_counter_keep_no_generator_position() -> None:
    """Issue 34: an AES stream goes back by rows (its position is the row counter) and
    saves only the oldest live row's index; a Philox stream still saves where that row
    began. Both continue bit for bit after a restore, at every step."""
    w = build_factorization(NAME, 16).bands
    for step in range(1, 12):
        levels = _advanced(step).state_dict()["levels"]
        np.testing.assert_array_equal(levels, [max(0, step - w + 1)])
        assert len(_advanced(step, "philox").state_dict()["levels"]) > 1
        for kind in ("aes", "philox"):
            a = _advanced(step, kind)
            b = NoiseStream.from_state_dict(a.state_dict())
            np.testing.assert_array_equal(draw_all(a), draw_all(b))


def test_tampered_or_foreign_states_are_refused() -> None:
    # a position that does not lead back to the generator's counter (positions are saved
    # where rows have no counter: a format-2 Philox stream)
    state = _advanced(kind="philox").state_dict()
    state["levels"] = state["levels"].copy()
    state["levels"][1] -= 1
    with pytest.raises(ValueError, match="does not lead back"):
        NoiseStream.from_state_dict(state).next()
    # a step that does not match the position's row
    for step in (5, 7):
        state = _advanced().state_dict()
        state["step"] = np.array(step)
        with pytest.raises(ValueError, match="does not match its step"):
            NoiseStream.from_state_dict(state)
    # no position after step 0, a position at step 0, rows smuggled in
    state = _advanced().state_dict()
    state["levels"] = np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="does not match its step"):
        NoiseStream.from_state_dict(state)
    fresh = NoiseStream.create(NAME, 16, 5, 1.0, seed=8).state_dict()
    fresh["levels"] = _advanced().state_dict()["levels"]
    with pytest.raises(ValueError, match="does not match its step"):
        NoiseStream.from_state_dict(fresh)
    state = _advanced().state_dict()
    state["levels"] = np.zeros(0, dtype=np.int64)
    state["rows"] = np.zeros((3, 5))
    with pytest.raises(ValueError, match=r"does not match its step|holds no rows"):
        NoiseStream.from_state_dict(state)
    # a position of another generator type (of another length) is refused by the cursor
    state = _advanced(kind="philox").state_dict()
    state["levels"] = state["levels"][:2]
    with pytest.raises(ValueError, match="another generator type"):
        NoiseStream.from_state_dict(state).next()


def test_a_position_never_carries_a_key() -> None:
    """The saved position holds no key words: two streams of different keys at the same
    counter save the same levels, and swapping them changes nothing."""
    a, b = _advanced(), NoiseStream.create(NAME, 16, 5, 1.0, seed=99)
    for _ in range(6):
        b.next()
    la, lb = a.state_dict()["levels"], b.state_dict()["levels"]
    key_a = [int(x) for x in a.state_dict()["rng"][1:3]]  # the AES key: words 1–2
    assert not {int(x) for x in la} & {k - (1 << 64) if k >> 63 else k for k in key_a}
    swapped = a.state_dict()
    swapped["levels"] = lb
    # the AES positions are row counters, equal at equal steps (a Philox one differed by
    # its ziggurat's rejections, and the swap was then refused)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(NoiseStream.from_state_dict(swapped).next(), a.next())


def test_another_band_is_restored_from_its_digest_or_refused(tmp_path, monkeypatch) -> None:
    """A stream of a given band restores exactly that band (write-once cache under its
    digest), and refuses when that copy is gone: never other noise."""
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path))
    n = 10
    own = BandedInverse(n, band=np.array([1.0, -0.6, -0.3]))
    assert own.digest != build_factorization(NAME, n).digest
    stream = NoiseStream(NAME, n, normalize_shapes(3), 1.0,
                         np.random.Generator(np.random.Philox(key=[1, 2])), factorization=own)
    for _ in range(4):
        stream.next()
    restored = NoiseStream.from_bytes(stream.to_bytes())
    assert restored.factorization.digest == own.digest
    np.testing.assert_array_equal(restored.factorization.band, own.band)
    assert np.array_equal(draw_all(restored), draw_all(stream))
    cache.path_for(cache.digest_key(NAME, n, own.digest)).unlink()
    with pytest.raises(FactorizationChangedError):
        NoiseStream.from_bytes(stream.to_bytes())


def test_bad_bands_are_refused() -> None:
    with pytest.raises(ValueError, match="parameter bands must be an int ≥ 1"):
        build_factorization(NAME, 8, bands=0)
    with pytest.raises(ValueError, match="m\\(0\\) = 1"):
        BandedInverse(8, band=np.array([2.0, 1.0]), use_cache=False)
