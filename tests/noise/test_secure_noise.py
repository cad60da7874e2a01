"""Secure noise: ChaCha20 keystream, Box–Muller law, the power-of-two grid, streams."""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from scipy import stats

from flwr_corrnoise import cipher_noise as cn
from flwr_corrnoise import secure_noise
from flwr_corrnoise.flower.session import LearnerSession
from flwr_corrnoise.learner import local_round
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import MECHANISMS, build_factorization
from flwr_corrnoise.mechanisms.tree import BinaryTree
from flwr_corrnoise.secure_noise import (
    GRID_BITS,
    ChaCha20Gaussian,
    add_on_grid,
    granularity,
    on_grid,
    round_to_grid,
)
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings
from flwr_corrnoise.streams import NoiseStream
from tests.noise.test_cipher_noise import ref_pair

KEY = bytes(range(32))


# -- an independent ChaCha20 (RFC 8439, pure Python) --------------------------------------
def _rotl(x: int, n: int) -> int:
    return ((x << n) | (x >> (32 - n))) & 0xFFFFFFFF


def _quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & 0xFFFFFFFF
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & 0xFFFFFFFF
    s[b] = _rotl(s[b] ^ s[c], 7)


def chacha20_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    init = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574]
    init += [*struct.unpack("<8I", key), counter, *struct.unpack("<3I", nonce)]
    s = list(init)
    for _ in range(10):
        for q in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                  (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            _quarter(s, *q)
    return struct.pack("<16I", *[(x + y) & 0xFFFFFFFF for x, y in zip(s, init, strict=True)])


def reference_block(key: bytes, block: int) -> bytes:
    """Block ``block`` of the generator's keystream: the low 32 bits are ChaCha20's block
    counter, the next 64 bits its nonce (as documented in secure_noise)."""
    return chacha20_block(key, block & 0xFFFFFFFF, (block >> 32).to_bytes(12, "little"))


def test_reference_chacha20_matches_rfc8439_vector() -> None:
    """RFC 8439 §2.3.2: key 00..1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, counter 1."""
    out = chacha20_block(KEY, 1, bytes.fromhex("000000090000004a00000000"))
    assert out[:16].hex() == "10f1e7e4d13b5915500fdd1fa32071c4"


@pytest.mark.parametrize("block", [0, 7, 2**32 - 1, 2**32, 5 * 2**40 + 3])
def test_keystream_is_chacha20_at_the_block_counter(block: int) -> None:
    """Two blocks from ``block`` on (crossing the 32-bit counter boundary at 2³²−1)."""
    gen = ChaCha20Gaussian(KEY, block)
    got = gen.keystream(2)
    assert got == reference_block(KEY, block) + reference_block(KEY, block + 1)
    assert gen.state == (KEY, block + 2)


def test_the_draws_are_the_kernels_transform_of_the_keystream() -> None:
    """standard_normal(n) is the library's transform 2 (the scalar reference of
    tests/noise/test_cipher_noise.py) on consecutive keystream words: the pairs' radius
    words, then their angle words."""
    n = 10  # 5 pairs: 10 words, 80 bytes → 2 blocks
    got = ChaCha20Gaussian(KEY).standard_normal(n)
    words = struct.unpack("<10Q", (reference_block(KEY, 0) + reference_block(KEY, 1))[:80])
    pairs = [ref_pair(words[j], words[5 + j], 0, np.float64) for j in range(5)]
    want = [c for c, _ in pairs] + [s for _, s in pairs]
    np.testing.assert_array_equal(got, want)


def test_refill_words_come_from_their_own_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Radius word ``w`` of the keystream (counted from block 0) takes, below the refill
    threshold, the first 8 bytes of block ``2⁹⁵ + w`` (which no draw reaches), and the draws
    ask for exactly those words, the second call's counting on. The threshold is raised to
    2⁶³ so that about half the words take the path; a refill word's bits reach the float
    only below 2⁵², so the words asked for are checked, and each word against ChaCha20."""
    for w in (0, 5, 2**40 + 3):
        want = int.from_bytes(reference_block(KEY, 2**95 + w)[:8], "little")
        assert ChaCha20Gaussian(KEY)._refill_word(w) == want
    monkeypatch.setattr(cn, "REFILL_BELOW", 1 << 63)
    asked: list[int] = []
    real = ChaCha20Gaussian._refill_word

    def spy(self: ChaCha20Gaussian, word: int) -> int:
        asked.append(word)
        return real(self, word)

    monkeypatch.setattr(ChaCha20Gaussian, "_refill_word", spy)
    gen = ChaCha20Gaussian(KEY, 3)
    got = [gen.standard_normal(7), gen.standard_normal(7)]
    want_asked = []
    for call, first in ((0, 3), (1, 4)):  # 4 pairs = 64 bytes: one block a call
        words = struct.unpack("<8Q", reference_block(KEY, first))
        want = []
        for j in range(4):
            v = 0
            if words[j] < 1 << 63:
                want_asked.append(8 * first + j)
                v = int.from_bytes(reference_block(KEY, 2**95 + 8 * first + j)[:8], "little")
            want.append(ref_pair(words[j], words[4 + j], v, np.float64, below=1 << 63))
        np.testing.assert_array_equal(got[call], [c for c, _ in want] + [s for _, s in want[:3]])
    assert want_asked and asked == want_asked
    # a call of two chunks: the second chunk's words start 2·CHUNK_PAIRS words in
    asked.clear()
    n, k = 2 * cn.CHUNK_PAIRS + 6, cn.CHUNK_PAIRS
    ChaCha20Gaussian(KEY, 5).standard_normal(n)
    words = np.frombuffer(ChaCha20Gaussian(KEY, 5).keystream(-(-16 * (n // 2) // 64)), "<u8")
    radius = np.concatenate([np.arange(k), 2 * k + np.arange(3)])  # the radius words' places
    assert asked == [8 * 5 + int(w) for w in radius if words[w] < 1 << 63]


def test_a_format_1_state_is_refused() -> None:
    words = ChaCha20Gaussian(KEY).pack()
    words[0] = np.uint64(secure_noise.FORMAT1_TAG)
    with pytest.raises(ValueError, match=r"format 1.*start a new stream"):
        ChaCha20Gaussian.unpack(words)


def test_exact_law_mean_variance_ks() -> None:
    n = 200_000
    x = ChaCha20Gaussian(KEY).standard_normal(n)
    assert abs(x.mean()) < 5 / math.sqrt(n)
    assert abs(x.var() - 1.0) < 5 * math.sqrt(2 / n)
    assert stats.kstest(x, "norm").pvalue > 1e-3
    # the pairs' two halves and consecutive draws are uncorrelated
    assert abs(np.corrcoef(x[: n // 2], x[n // 2 :])[0, 1]) < 5 / math.sqrt(n / 2)
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 5 / math.sqrt(n)
    # the KS test has power: a 5 % wider law is rejected
    assert stats.kstest(1.05 * x, "norm").pvalue < 1e-6


def test_secure_stream_increments_have_the_law_and_sit_on_the_grid() -> None:
    std, d = 0.37, 100_000
    e = NoiseStream.create("independent", 2, d, std, secure=True).next()
    g = granularity(std)
    assert on_grid(e, g)
    z = e / std
    assert abs(z.mean()) < 5 / math.sqrt(d) and abs(z.var() - 1) < 5 * math.sqrt(2 / d)
    assert stats.kstest(z, "norm").pvalue > 1e-4


def test_no_holes_on_a_coarse_grid() -> None:
    """Every grid point in [−1, 1] is reached: the sampler's float outputs leave no gap
    the grid could see (the defence needs every cell reachable, ≈ 94 draws per cell)."""
    g = 2.0**-8
    x = round_to_grid(ChaCha20Gaussian(KEY, 11).standard_normal(100_000), g)
    hit = np.unique(np.rint(x[np.abs(x) <= 1.0] / g).astype(np.int64))
    assert np.array_equal(hit, np.arange(-256, 257))


@pytest.mark.parametrize("std", [1.0, 1.5, 0.37, 3e-7, 2.0**-20, 12345.0])
def test_granularity_is_the_next_power_of_two(std: float) -> None:
    g = granularity(std)
    assert math.frexp(g)[0] == 0.5  # a power of two
    assert std * 2.0**-GRID_BITS <= g < 2 * std * 2.0**-GRID_BITS
    assert granularity(0.0) == 0.0
    with pytest.raises(ValueError, match="std"):
        granularity(float("nan"))
    with pytest.raises(ValueError, match="too small"):
        granularity(1e-295)


def test_round_to_grid_and_exact_addition() -> None:
    rng = np.random.default_rng(0)
    g = granularity(0.8)
    noise = round_to_grid(0.8 * rng.standard_normal(2000), g)
    assert on_grid(noise, g)
    assert np.max(np.abs(noise - round_to_grid(noise, g))) == 0.0
    value = rng.uniform(-3, 3, 2000) / 3.0  # arbitrary floats, not on the grid
    assert not on_grid(value, g)
    total = add_on_grid(value, noise, g)
    truncated = np.trunc(value / g) * g
    assert np.all(np.abs(truncated) <= np.abs(value))  # truncation never grows a norm
    assert np.all(np.abs(truncated - value) < g)
    for t, v, e in zip(total[:300], truncated[:300], noise[:300], strict=True):
        assert Fraction(float(t)) == Fraction(float(v)) + Fraction(float(e))  # exact
    # the check has power: plain float addition of off-grid values is not exact
    inexact = sum(
        Fraction(float(v + e)) != Fraction(float(v)) + Fraction(float(e))
        for v, e in zip(value[:300], 0.8 * rng.standard_normal(300), strict=True)
    )
    assert inexact > 100


def test_add_on_grid_refuses_what_it_cannot_do_exactly() -> None:
    g = granularity(1.0)
    with pytest.raises(ValueError, match="not on the grid"):
        add_on_grid(np.zeros(3), np.array([0.1, 0.2, 0.3]), g)
    with pytest.raises(ValueError, match="exact"):
        add_on_grid(np.array([2.0**22]), np.zeros(1), g)
    with pytest.raises(ValueError, match="non-finite"):
        add_on_grid(np.array([np.nan]), np.zeros(1), g)
    with pytest.raises(ValueError, match="power of two"):
        round_to_grid(np.zeros(2), 0.3)
    # a float32 value is truncated in float64: never rounded up past itself
    v32 = np.array([0.1, -0.7, 0.33333334], dtype=np.float32)
    t = add_on_grid(v32, np.zeros(3), g)
    assert np.all(np.abs(t) <= np.abs(v32.astype(np.float64))) and on_grid(t, g)


def test_same_key_and_block_reproduce_and_state_rewinds() -> None:
    a = ChaCha20Gaussian(KEY, 5)
    first = a.standard_normal(1001)
    b = ChaCha20Gaussian.unpack(ChaCha20Gaussian(KEY, 5).pack())
    assert np.array_equal(first, b.standard_normal(1001))
    assert a.state == b.state == (KEY, 5 + math.ceil(501 * 16 / 64))
    a.state = (KEY, 5)
    assert np.array_equal(first, a.standard_normal(1001))
    assert not np.array_equal(first, ChaCha20Gaussian(KEY, 6).standard_normal(1001))
    assert not np.array_equal(first, ChaCha20Gaussian(bytes(32), 5).standard_normal(1001))


def test_bad_states_are_rejected() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        ChaCha20Gaussian(b"short")
    with pytest.raises(ValueError, match="2\\^96"):
        ChaCha20Gaussian(KEY, 2**96)
    with pytest.raises(ValueError, match="2\\^96"):
        ChaCha20Gaussian(KEY, 2**96 - 1).keystream(2)
    words = ChaCha20Gaussian(KEY).pack()
    words[0] ^= np.uint64(1)
    with pytest.raises(ValueError, match="not a secure"):
        ChaCha20Gaussian.unpack(words)
    with pytest.raises(ValueError, match="not a secure"):
        ChaCha20Gaussian.unpack(np.zeros(6, dtype=np.uint64))  # a PCG64 state


def test_two_fresh_secure_streams_differ() -> None:
    a = NoiseStream.create("tree", 4, 64, 1.0, secure=True)
    b = NoiseStream.create("tree", 4, 64, 1.0, secure=True)
    assert not np.array_equal(a.next(), b.next())
    assert a.state_dict()["rng"][1:5].tolist() != b.state_dict()["rng"][1:5].tolist()


def test_a_secure_stream_takes_no_seed() -> None:
    for seed in (0, 1234):
        with pytest.raises(ValueError, match="OS entropy only"):
            NoiseStream.create("blt", 8, 3, 1.0, seed=seed, secure=True)


def secure_stream(name: str, n: int, dim, std: float, key: bytes = KEY) -> NoiseStream:
    """A secure stream with a known key (tests only: the public path takes no key)."""
    from flwr_corrnoise.streams import normalize_shapes

    return NoiseStream(name, n, normalize_shapes(dim), std, ChaCha20Gaussian(key))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_secure_increments_are_the_rounded_noising_matrix_times_xi(name: str) -> None:
    """e[k] = round_g(V·(b_k − b_{k−1})·ξ) with ξ the ChaCha20 rows: the correlation
    structure is the standard stream's, only the generator and the grid change."""
    n, dim, std = 13, 4, 0.7
    E = np.array([s for s in iter_all(secure_stream(name, n, dim, std))])
    fact = build_factorization(name, n)
    M = fact.noising_matrix()
    gen = ChaCha20Gaussian(KEY)
    rows = np.array([gen.standard_normal(dim) for _ in range(M.shape[1])])
    if isinstance(fact, BinaryTree):
        used = fact.drawn_nodes()
        xi = np.zeros((M.shape[1], dim))
        xi[used] = rows[: len(used)]
    else:
        xi = rows
    g = granularity(std)
    assert on_grid(E, g)
    assert np.max(np.abs(E - std * M @ xi)) <= 0.5 * g + 1e-13


def iter_all(stream: NoiseStream):
    while stream.remaining:
        yield stream.next()


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_secure_prefix_sum_covariance(name: str) -> None:
    """As tests/noise/test_streams.py: Cov(prefix sums) = V²·B·Bᵀ, d coordinates as samples."""
    from .test_streams import assert_prefix_covariance

    n, dim, std = 12, 40_000, 1.5
    assert_prefix_covariance(
        np.array(list(iter_all(secure_stream(name, n, dim, std, bytes(32))))), name, std)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
@pytest.mark.parametrize("cut", [0, 1, 6])
def test_secure_restore_continues_bit_for_bit(name: str, cut: int) -> None:
    n = 16
    original = secure_stream(name, n, [(2, 3), (4,)], 2.0)
    for _ in range(cut):
        original.next()
    data = original.to_bytes()
    restored = NoiseStream.from_bytes(data)
    assert bool(restored.state_dict()["secure"]) and restored.step == cut
    rest_a, rest_b = list(iter_all(original)), list(iter_all(restored))
    assert np.array_equal(rest_a, rest_b)
    fresh = list(iter_all(secure_stream(name, n, [(2, 3), (4,)], 2.0)))
    assert np.array_equal(fresh[cut:], rest_a)
    # the public path too: an OS-keyed stream survives a round trip
    public = NoiseStream.create(name, n, 5, 1.0, secure=True)
    public.next()
    twin = NoiseStream.from_bytes(public.to_bytes())
    assert np.array_equal(public.next(), twin.next())


def test_secure_fork_steps_the_same_increments() -> None:
    s = secure_stream("blt", 10, 50, 1.0)
    s.next()
    kept = s.fork()
    first = [s.next() for _ in range(3)]
    assert np.array_equal(first, [kept.next() for _ in range(3)])


def test_secure_flag_cannot_be_dropped_or_forged() -> None:
    secure = secure_stream("tree", 8, 3, 1.0).state_dict()
    assert secure["rng"].shape == (7,)
    secure["secure"] = np.array(False)
    with pytest.raises(ValueError, match=r"secure \(ChaCha20\) generator state, not a Philox"):
        NoiseStream.from_state_dict(secure)
    plain = NoiseStream.create("tree", 8, 3, 1.0, seed=1).state_dict()
    assert not bool(plain["secure"])
    plain["secure"] = np.array(True)
    with pytest.raises(ValueError, match="not a secure"):
        NoiseStream.from_state_dict(plain)
    del plain["secure"]  # states written before the flag are standard streams
    plain["rng"] = NoiseStream.create("tree", 8, 3, 1.0, seed=1).state_dict()["rng"]
    assert NoiseStream.from_state_dict(plain).next().shape == (3,)


def test_secure_stream_with_zero_std_is_zero() -> None:
    s = NoiseStream.create("blt", 4, 6, 0.0, secure=True)
    assert np.array_equal(s.next(), np.zeros(6))


def test_benchmark_script_runs_at_toy_size() -> None:
    """benchmarks/secure_noise.py (quoted in docs/benchmarks.md) runs and prints ratios."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "secure_noise.py"), "--dims", "1000",
         "--block", "1", "--repeats", "1", "--mechanisms", "independent", "blt"],
        capture_output=True, text=True, timeout=120, cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in proc.stdout.splitlines() if line.startswith("| 1,000")]
    assert [r[1] for r in rows] == ["draws (N(0,1) × d)", "of which ChaCha20 keystream (0.008 MB)",
                                "independent step", "blt step"]
    assert all(float(r[4].rstrip("×")) > 0 for r in rows)


# -- wired into the learner ------------------------------------------------------------------
def _settings() -> PrivacySettings:
    return PrivacySettings(mechanism="blt", epsilon=2.0, delta=1e-3, clip_norm=1.0, horizon=6)


def test_local_round_releases_trunc_g_of_the_clipped_step_plus_grid_noise() -> None:
    """Second computation of the secure release: replay the same ChaCha20 increments from
    a fork of the stream taken before the round and form trunc_g(clip(g)) + e by hand; the
    round's update must equal it bit for bit, and lie on the grid (τ = 1: the update is
    the release)."""
    settings = _settings()
    state = LearnerState.create(settings, [(5,)], None, secure=True)
    assert state.noise is not None and state.noise.secure and state.seed is None
    kept = state.noise.fork()
    grad = np.array([3.0, -4.0, 0.1, 1e-13, 0.0])  # norm > 1: clipped

    result = local_round([np.zeros(5)], lambda p, pos: [grad], state, settings, 1, 0.5)

    noise = kept.next()
    g = granularity(kept.std)
    clipped = grad / np.linalg.norm(grad)
    expected = np.trunc(clipped / g) * g + noise
    np.testing.assert_array_equal(result.update[0], expected)
    assert on_grid(result.update[0], g)
    assert np.linalg.norm(np.trunc(clipped / g) * g) <= 1.0  # truncation never grows it


def test_secure_state_refuses_a_seed_and_records_none() -> None:
    with pytest.raises(PrivacyConfigError, match="no seed"):
        LearnerState.create(_settings(), [(3,)], 5, secure=True)
    state = LearnerState.create(_settings(), [(3,)], None, secure=True)
    restored = LearnerState.from_bytes(state.to_bytes())
    assert restored.seed is None and restored.noise is not None and restored.noise.secure
    np.testing.assert_array_equal(restored.noise.next(), state.noise.next())  # type: ignore[union-attr]


def _context(tmp_path: Path | None = None, **node: object) -> Context:
    cfg = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-3,
           "clip-norm": 1.0, "data-reuse": "once", "horizon": 6, **node}
    if tmp_path is not None:
        cfg["state-dir"] = str(tmp_path)
    return Context(run_id=1, node_id=1, node_config=cfg, state=RecordDict(),
                   run_config={"seed": 3, "secure-noise": False})


def test_secure_noise_is_the_learners_opt_in_on_a_real_supernode(tmp_path: Path) -> None:
    """Off unless the learner asks (node config or app code); the run config (the
    server's) can neither switch it on nor off."""
    assert not LearnerSession(_context(tmp_path)).secure  # a direct call: real SuperNode rules
    session = LearnerSession(_context(tmp_path, **{"secure-noise": True}))
    assert session.secure and session.seed is None
    state = session.load([(3,)])
    assert state.noise is not None and state.noise.secure
    server_says_yes = _context(tmp_path)
    server_says_yes.run_config["secure-noise"] = True
    assert not LearnerSession(server_says_yes).secure
    server_says_no = _context(tmp_path, **{"secure-noise": True})  # run config says False
    assert LearnerSession(server_says_no).secure


def test_simulation_default_is_seeded_and_secure_is_the_learners_opt_in(
    simulated: None,
) -> None:
    plain = LearnerSession(_context())
    assert not plain.secure and plain.seed is not None  # reproducible simulations
    assert LearnerSession(_context(**{"secure-noise": True})).secure
    assert LearnerSession(_context(), defaults={"secure-noise": True}).secure  # app code
    with pytest.raises(PrivacyConfigError, match="takes no seed"):
        LearnerSession(_context(**{"secure-noise": True, "noise-seed": 4}))


def test_secure_learner_refuses_to_continue_a_stored_plain_stream(tmp_path: Path) -> None:
    plain = LearnerSession(_context(tmp_path))
    state = plain.load([(3,)])
    plain.store.save(state.to_bytes())  # type: ignore[union-attr]
    with pytest.raises(PrivacyConfigError, match="not secure"):
        LearnerSession(_context(tmp_path, **{"secure-noise": True})).load([(3,)])


def test_a_budget_too_large_for_the_grid_is_refused_before_any_step() -> None:
    """ε so large that V < B_g·2⁻²⁰: the release could leave the grid's exact range for some
    data; refused as a configuration error before any step, whatever the data."""
    settings = PrivacySettings(mechanism="independent", epsilon=1e14, delta=0.5, clip_norm=1.0,
                               horizon=2, method="zcdp")  # exact calibration refuses sooner
    state = LearnerState.create(settings, [(2,)], None, secure=True)
    assert settings.clip_norm > 2**20 * state.noise.std  # type: ignore[union-attr]
    with pytest.raises(PrivacyConfigError, match="secure noise needs clip-norm"):
        local_round([np.zeros(2)], lambda p, pos: [np.ones(2)], state, settings, 1, 0.1)
    assert state.step == 0 and state.noise.step == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("front_end", ["make_client_app", "numpy_client_app",
                                       "CorrNoiseRoundMod", "PrivateSteps",
                                       "make_torch_client_app-host"])
def test_secure_neighbours_send_identical_replies_but_for_the_noised_arrays(
    front_end: str, tmp_path: Path
) -> None:
    """The release gate's neighbouring-stream test with secure noise switched on: a huge
    datum changes nothing in the replies but the noised arrays' values."""
    from ..flower.test_release_gate import all_front_ends, conversation, ctx

    build = all_front_ends()[front_end]
    a = conversation(build("small"), ctx(tmp_path / "a", **{"secure-noise": True}))
    b = conversation(build("huge"), ctx(tmp_path / "b", **{"secure-noise": True}))
    assert a == b
    assert all("error" not in t for t in a[0::3]), a[0::3]


@pytest.mark.parametrize("fault", ["off-grid", "nan", "inf", "beyond 2^53 g"])
def test_the_chunked_grid_sum_is_the_one_piece_sum_and_checks_every_chunk(fault: str) -> None:
    """``add_on_grid`` and an in-place ``round_to_grid`` run in cache-sized chunks: over
    several chunks (and a ragged last one) they give the floats of the one-piece
    computation (``trunc(v/g)·g + e`` and ``rint(x/g)·g``), and a fault in the last chunk
    only — noise off the grid, a NaN or ±∞ value, a sum beyond ``2⁵³·g`` — is refused (a
    check over a min of chunks would let a NaN through)."""
    from flwr_corrnoise.secure_noise import GRID_CHUNK

    rng = np.random.default_rng(11)
    d = 2 * GRID_CHUNK + 17
    g = granularity(1.3)
    x = rng.standard_normal(d) * 1.3
    noise = x.copy()
    assert round_to_grid(noise, g, out=noise) is noise
    np.testing.assert_array_equal(noise, np.rint(x / g) * g)
    value = rng.standard_normal(d)
    np.testing.assert_array_equal(add_on_grid(value, noise, g),
                                  (np.trunc(value / g) + noise / g) * g)
    bad_value, bad_noise = value.copy(), noise.copy()
    if fault == "off-grid":
        bad_noise[-1] += g / 2
    else:
        bad_value[-1] = {"nan": np.nan, "inf": -np.inf, "beyond 2^53 g": 2.0**54 * g}[fault]
    with pytest.raises(ValueError):
        add_on_grid(bad_value, bad_noise, g)
