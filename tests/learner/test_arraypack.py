"""The state byte format: exact round trip, strict rejection, old .npz states still read."""

from __future__ import annotations

import io

import numpy as np
import pytest

from flwr_corrnoise.arraypack import MAGIC, pack, unpack
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.streams import NoiseStream


def test_round_trip_is_exact() -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f": rng.standard_normal((3, 4)),
        "i": np.arange(5, dtype=np.int64),
        "u": np.array([2**64 - 1, 7], dtype=np.uint64),
        "s": np.array("optimized"),
        "empty": np.zeros((0, 6)),
        "big_endian": np.arange(3, dtype=">f8"),
    }
    out = unpack(pack(arrays))
    assert list(out) == list(arrays)
    for name, value in arrays.items():
        assert out[name].shape == value.shape
        np.testing.assert_array_equal(out[name], value)
    assert out["big_endian"].dtype == np.dtype("<f8")
    out["f"][0, 0] = 99.0  # a private copy, not a view of the payload
    assert unpack(pack(arrays))["f"][0, 0] == arrays["f"][0, 0]


def test_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="unsupported dtype"):
        pack({"o": np.array([{"a": 1}], dtype=object)})


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b"XX" + b[2:], "bad magic"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b + b"\x00", "trailing bytes"),
        (lambda b: b[: len(MAGIC) + 4] + b"{" + b[len(MAGIC) + 5 :], "corrupt array-pack header"),
        (lambda b: b.replace(b'"<f8"', b'"|O8"'), "bad dtype"),
        (lambda b: b[: len(MAGIC) + 2], "truncated array pack"),
    ],
)
def test_malformed_payloads_raise(mangle, message: str) -> None:
    data = pack({"x": np.arange(4.0)})
    with pytest.raises(ValueError, match=message):
        unpack(mangle(data))


def test_states_written_as_npz_are_still_read() -> None:
    """0.1 stored states as .npz: a learner upgraded mid-run must continue, not restart."""
    settings = PrivacySettings("blt", epsilon=2.0, delta=1e-3, clip_norm=1.0, horizon=16)
    state = LearnerState.create(settings, [(5,)], seed=3)
    for _ in range(3):
        state.noise.next()
    state.step = state.noise.step
    buf = io.BytesIO()
    np.savez(buf, **state.noise.state_dict())
    old_noise = buf.getvalue()
    restored = NoiseStream.from_bytes(old_noise)
    np.testing.assert_array_equal(restored.next(), NoiseStream.from_bytes(
        state.noise.to_bytes()).next())
    buf = io.BytesIO()
    np.savez(buf, counters=np.array([3, 3, 1]), noise=np.frombuffer(old_noise, dtype=np.uint8))
    old_state = LearnerState.from_bytes(buf.getvalue())
    assert (old_state.step, old_state.position, old_state.rounds) == (3, 3, 1)
