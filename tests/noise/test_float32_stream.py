"""Noise streams in the model's dtype (issue 22): a float32 model's learner keeps its BLT
buffers, draws, recurrence and release in float32; a float64 learner is what it was.

Every claim here is checked against a second computation: the float32 stream against the
float64 noising matrix ``V·C⁻¹·ξ`` applied to the same draws (and, over a long horizon,
against a float64 recurrence written out here), a forked stream against one never
forked, the release against the float32 sum formed by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from scipy.linalg import toeplitz

from flwr_corrnoise.cipher_noise import CipherGaussian
from flwr_corrnoise.flower.session import STATE_KEY, LearnerStorage
from flwr_corrnoise.learner import local_rounds
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import build_factorization, mechanism_names
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.state_offload import OffloadPolicy
from flwr_corrnoise.stream_group import StreamGroup, grouped_noise
from flwr_corrnoise.streams import NoiseStream

F32 = np.dtype(np.float32)
#: the float32 stream's largest error per coordinate, in units of the noise std ``V``.
#: Why this bound: float32 rounds each operation by u = 2⁻²⁴ ≈ 6e-8 relative; BLT's
#: recurrence is contractive (every θ < 1), so errors do not build up over the horizon —
#: measured 4.2e-7 at N = 1000, 5.0e-7 at N = 4000 and no larger at N = 20000 — and the
#: bound leaves 20× room. An error of 1e-5·V moves the noise's variance in any coordinate
#: by at most ≈ 2e-5 relative: the calibration's own rounding of ε (it rounds the std up
#: until the budget holds in exact arithmetic) is of that order, and a float64 stream's
#: error is 1e-15·V.
F32_BOUND = 1e-5


def float32_draws(seed: int, steps: int, dim: int) -> np.ndarray:
    """The float32 stream's normals, drawn again from its key: the kernel's float32 rows
    0, 1, … (cipher_noise.py; Philox's float32 normals before noise-state format 3)."""
    return CipherGaussian.from_seed(seed).rows(0, steps, dim, np.float32)


def test_float32_stream_is_the_factorization_to_float32_precision() -> None:
    horizon, dim, std, seed = 1000, 48, 3.0, 7
    stream = NoiseStream.create("blt", horizon, dim, std, seed=seed, dtype=np.float32)
    increments = np.array([stream.next() for _ in range(horizon)])
    assert increments.dtype == F32 and stream.noise_dtype == F32
    xi = float32_draws(seed, horizon, dim).astype(np.float64)
    exact = std * build_factorization("blt", horizon).noising_matrix() @ xi
    error = np.abs(increments - exact).max() / std
    assert error < F32_BOUND
    assert error > 1e-9  # it is float32 arithmetic (a float64 stream would be ~1e-15)


@pytest.mark.parametrize("mechanism", mechanism_names())
def test_every_mechanism_streams_in_float32(mechanism: str) -> None:
    """Every registered kernel runs in float32 (its state and increments float32, restored
    as float32) and is its noising matrix applied to the same draws, to float32 precision."""
    horizon, dim, seed = 64, 5, 3
    fact = build_factorization(mechanism, horizon)
    stream = NoiseStream.create(mechanism, horizon, dim, 1.0, seed=seed, dtype=np.float32)
    increments = np.array([stream.next() for _ in range(horizon)])
    assert increments.dtype == F32
    matrix = fact.noising_matrix()
    # the rows the stream draws, in order (the vanilla tree: only the nodes it uses)
    used = (np.asarray(fact.drawn_nodes()) if hasattr(fact, "drawn_nodes")
            else np.arange(matrix.shape[1]))
    xi = float32_draws(seed, used.size, dim).astype(np.float64)
    assert np.abs(increments - matrix[:, used] @ xi).max() < F32_BOUND
    back = NoiseStream.from_bytes(stream.to_bytes())
    assert back.noise_dtype == F32


def blt_float64(theta: np.ndarray, omega: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """BLT's recurrence written out in float64: ``e = ξ − Σ ω_i r_i``, ``r_i ← θ_i r_i + e``."""
    r = np.zeros((theta.size, xi.shape[1]))
    out = np.empty_like(xi)
    for t, row in enumerate(xi):
        e = row - omega @ r
        r = theta[:, None] * r + e
        out[t] = e
    return out


def test_float32_error_does_not_grow_over_a_long_horizon() -> None:
    horizon, dim, seed = 20_000, 4, 3
    fact = build_factorization("blt", horizon)
    stream = NoiseStream.create("blt", horizon, dim, 1.0, seed=seed, dtype=np.float32)
    increments = np.array([stream.next() for _ in range(horizon)])
    xi = float32_draws(seed, horizon, dim).astype(np.float64)
    theta, omega = np.asarray(fact.theta), np.asarray(fact.omega)
    exact = blt_float64(theta, omega, xi)
    # the written-out recurrence is the factorization (checked on a prefix, dense)
    n = 300  # C⁻¹ is lower-triangular Toeplitz with first column g
    dense = np.tril(toeplitz(np.asarray(fact.g)[:n])) @ xi[:n]
    np.testing.assert_allclose(exact[:n], dense, rtol=0, atol=1e-12)
    error = np.abs(increments - exact).max(axis=1)
    assert error.max() < F32_BOUND
    # no drift: the last quarter's worst error is of the first quarter's order
    q = horizon // 4
    assert error[-q:].max() < 4 * error[:q].max()


def test_float32_std_is_never_below_the_calibration() -> None:
    for std in (0.1, 1 / 3, 2.718281828459045, 1e3 + 1e-9):
        stream = NoiseStream.create("blt", 8, 3, std, seed=1, dtype=np.float32)
        factor = stream._std_factor()
        assert float(np.float32(factor)) == factor and factor >= std  # a float32, ≥ V
        assert factor - std <= 2.0**-23 * std  # the nearest float32 from above
        # and the increments are the unit draws times exactly that float32
        twin = NoiseStream.create("independent", 8, 1000, std, seed=2, dtype=np.float32)
        unit = NoiseStream.create("independent", 8, 1000, 1.0, seed=2, dtype=np.float32)
        np.testing.assert_array_equal(twin.next(), unit.next() * np.float32(factor))
    # a float64 stream multiplies by V itself
    assert NoiseStream.create("blt", 8, 3, 1 / 3, seed=1)._std_factor() == 1 / 3


def test_float32_release_is_formed_in_float32() -> None:
    """``value + e`` in float32: the value rounded to float32, then the float32 noise
    added — not a float64 sum, which would keep the value's bits below the noise's grid."""
    stream = NoiseStream.create("blt", 8, 5, 2.0, seed=4, dtype=np.float32)
    twin = NoiseStream.from_state_dict(stream.state_dict())
    value = np.array([1e-9, 0.1, -0.3, 1 / 3, 7.0])
    released = stream.add_next(value)
    noise = twin.next()
    assert released.dtype == F32
    np.testing.assert_array_equal(released, value.astype(np.float32) + noise)
    assert not np.array_equal(np.asarray(released, np.float64), value + noise.astype(np.float64))


def test_float64_streams_are_unchanged_and_record_no_dtype() -> None:
    s = NoiseStream.create("blt", 16, 7, 1.5, seed=2)
    assert s.noise_dtype == np.float64 and "dtype" not in s.state_dict()
    assert s.next().dtype == np.float64
    with pytest.raises(ValueError, match="secure"):
        NoiseStream.create("blt", 16, 7, 1.5, secure=True, dtype=np.float32)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forks_change_no_bit(dtype: type) -> None:
    """BLT's step writes new buffers and keeps the old (the pure kernel): a stream forked
    before every step (twice, as a round on a fork inside a transaction) releases the same
    bits as one never forked, and a kept fork steps the same increments again."""
    plain = NoiseStream.create("blt", 40, 300, 1.0, seed=9, dtype=dtype)
    checked = NoiseStream.create("blt", 40, 300, 1.0, seed=9, dtype=dtype)
    for _ in range(10):
        outer = checked.fork()
        inner = checked.fork()
        a, b = plain.next(), checked.next()
        np.testing.assert_array_equal(a, b)
        assert outer._state is inner._state  # no copy
    saved = checked.state_dict()
    outer = checked.fork()
    first = [checked.next() for _ in range(3)]
    inner = outer.fork()
    again = [inner.next() for _ in range(3)]  # the kept state, stepped again
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, y)
    for key, value in outer.state_dict().items():
        np.testing.assert_array_equal(value, saved[key])
    np.testing.assert_array_equal(outer.next(), plain.next())  # the kept one goes on


def test_float32_state_restores_as_float32_and_refuses_other_rows() -> None:
    s = NoiseStream.create("blt", 16, 9, 1.0, seed=5, dtype=np.float32)
    s.next()
    state = s.state_dict()
    assert str(state["dtype"]) == "float32" and state["rows"].dtype == F32
    back = NoiseStream.from_bytes(s.to_bytes())
    assert back.noise_dtype == F32
    np.testing.assert_array_equal(back.next(), s.next())
    # rows of another dtype than the state records: refused, never converted
    with pytest.raises(ValueError, match="refusing to convert"):
        NoiseStream.from_state_dict({**state, "rows": state["rows"].astype(np.float64)})
    no_dtype = {k: v for k, v in state.items() if k != "dtype"}  # read as float64
    with pytest.raises(ValueError, match="refusing to convert"):
        NoiseStream.from_state_dict(no_dtype)


def test_state_dict_views_and_adoption() -> None:
    s = NoiseStream.create("blt", 16, 1000, 1.0, seed=6)
    s.next()
    live = s.state_dict(copy=False)["rows"]
    assert np.shares_memory(live, s._state.buf)
    assert not np.shares_memory(s.state_dict()["rows"], s._state.buf)
    owned = s.state_dict()
    adopted = NoiseStream.from_state_dict(owned, adopt=True)
    assert np.shares_memory(adopted._state.buf, owned["rows"])
    copied = NoiseStream.from_state_dict(s.state_dict())
    assert not np.shares_memory(copied._state.buf, s._state.buf)
    np.testing.assert_array_equal(adopted.next(), copied.next())
    np.testing.assert_array_equal(adopted.next(), copied.next())


def test_float32_group_is_its_streams() -> None:
    streams = [NoiseStream.create("blt", 12, 50, 1.0, seed=i, dtype=np.float32)
               for i in range(3)]
    alone = [NoiseStream.create("blt", 12, 50, 1.0, seed=i, dtype=np.float32)
             for i in range(3)]
    with StreamGroup(streams) as group:
        for _ in range(5):
            rows = group.next()
            assert rows.dtype == F32
            np.testing.assert_allclose(rows, [s.next() for s in alone], rtol=1e-6, atol=1e-6)
    mixed = StreamGroup.partition([streams[0], NoiseStream.create("blt", 12, 50, 1.0, seed=9)])
    assert len(mixed) == 2  # a float64 stream never shares a float32 recurrence
    for _, g in mixed:
        g.close()


def test_rolled_back_round_of_grouped_float32_learners_is_exact() -> None:
    """``local_rounds`` over three float32 learners (one stacked recurrence) that is
    interrupted in its second round: no learner's state was written, and the rerun
    releases what an uninterrupted run releases."""
    settings = PrivacySettings("blt", 2.0, 1e-3, 1.0, 40)
    dim = 30

    def learners() -> list[LearnerState]:
        return [LearnerState.create(settings, [(dim,)], seed=i, dtype=np.float32)
                for i in range(3)]

    def grad(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        return [np.full(dim, 0.01 * (position % 5))]

    x = [np.zeros(dim, dtype=np.float32)]
    states, twins = learners(), learners()
    local_rounds(x, [grad] * 3, states, settings, 4, 0.1, noise=grouped_noise)
    local_rounds(x, [grad] * 3, twins, settings, 4, 0.1, noise=grouped_noise)
    before = [s.noise.state_dict() for s in states]
    calls = {"n": 0}

    def failing(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # not a datum's failure: the round stops, rolled back
        return grad(params, position)

    with pytest.raises(KeyboardInterrupt):
        local_rounds(x, [failing] * 3, states, settings, 4, 0.1, noise=grouped_noise)
    for s, saved in zip(states, before, strict=True):
        assert s.step == 4 and s.noise.noise_dtype == F32
        for key, value in s.noise.state_dict().items():
            np.testing.assert_array_equal(value, saved[key])
    redo = local_rounds(x, [grad] * 3, states, settings, 4, 0.1, noise=grouped_noise)
    ref = local_rounds(x, [grad] * 3, twins, settings, 4, 0.1, noise=grouped_noise)
    for a, b in zip(redo, ref, strict=True):
        np.testing.assert_array_equal(a.update[0], b.update[0])


def test_offloaded_float32_state_is_half_the_file_and_adopted(tmp_path: Path) -> None:
    settings = PrivacySettings("blt", 2.0, 1e-3, 1.0, 12)
    sizes = {}
    for dtype in (np.float64, np.float32):
        ctx = Context(run_id=1, node_id=int(np.dtype(dtype).itemsize), node_config={},
                      state=RecordDict(), run_config={})
        store = LearnerStorage(ctx, STATE_KEY, None, OffloadPolicy("on", tmp_path))
        state = LearnerState.create(settings, [(50_000,)], seed=1, dtype=dtype)
        state.noise.next()
        state.advance()
        store.write(state, {})
        sizes[np.dtype(dtype).name] = int(ctx.state[STATE_KEY]["size"])
        back = store.read()
        assert back.noise.noise_dtype == np.dtype(dtype)
        buf = back.noise._state.buf
        assert buf.flags.aligned and buf.flags.writeable and buf.base is not None  # a view
        np.testing.assert_array_equal(back.noise.next(), state.noise.next())
    assert sizes["float32"] < 0.51 * sizes["float64"]


def test_flower_learner_with_a_float32_model(simulated: None) -> None:
    """``make_client_app``'s learner: a float32 model makes a float32 stream and a float32
    reply; a later float64 model does not convert the stream (it keeps its dtype)."""
    from flwr_corrnoise.flower import CorrNoiseLearner

    dim = 20
    ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 3}, state=RecordDict(),
                  run_config={})
    defaults = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-3, "clip-norm": 1.0,
                "data-reuse": "once", "horizon": 40, "calibration": "exact", "seed": 0}

    def grad(params: list[np.ndarray], position: int) -> list[np.ndarray]:
        return [np.full(dim, 0.1)]

    config = {"local-steps": 4, "learning-rate": 0.1}
    learner = CorrNoiseLearner(ctx, grad, config_defaults=defaults)
    update, _ = learner.train([np.zeros(dim, dtype=np.float32)], config)
    assert update[0].dtype == F32 and learner.last_state.noise.noise_dtype == F32
    learner = CorrNoiseLearner(ctx, grad, config_defaults=defaults)
    update, _ = learner.train([np.zeros(dim)], config)
    assert update[0].dtype == np.float64 and learner.last_state.noise.noise_dtype == F32
    assert learner.last_state.step == 8
