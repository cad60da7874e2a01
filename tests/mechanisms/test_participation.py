"""Multi-participation sensitivity (issue 21 item 1) against brute force over every pattern.

The independent computation: for a small horizon, enumerate *every* participation pattern
the scheme allows and, on each, compute a value the adversary reaches (the best sign
vector ``s``: ``sᵀX_πs``, a lower bound of ``sens²(π)``) and the absolute-value bound
``Σ|X_π|`` (an upper bound of ``sens²(π)``). The library's figure must lie above every
reachable value, must equal the brute-force maximum when it says "exact", and must lie above
the brute-force upper bound when it says "bound".
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flwr_corrnoise.mechanisms import BLTParams, build_factorization
from flwr_corrnoise.mechanisms.blt import BufferedToeplitz
from flwr_corrnoise.mechanisms.participation import (
    Participation,
    ParticipationError,
    best_separated_sum,
    gram_sensitivity,
    toeplitz_sensitivity,
)
from flwr_corrnoise.mechanisms.registry import mechanism_names
from flwr_corrnoise.mechanisms.tree import node_list


def released_rows(f, steps: int) -> np.ndarray:
    """``C``'s rows drawn by ``steps``, from ``matrices()`` (tree: nodes ending before)."""
    _, C = f.matrices()
    if f.name in ("tree", "efficient-tree"):
        done = sum(1 for _, end in node_list(f.n) if end < steps)
        return C[:done]
    return C[:steps]


def patterns(n: int, p: Participation):
    if p.fixed_epoch:
        yield from (tuple(idx) for idx in p.patterns(n))
        return
    for size in range(1, p.max_participations + 1):
        for combo in itertools.combinations(range(n), size):
            if all(b - a >= p.min_sep for a, b in itertools.pairwise(combo)):
                yield combo


def brute(C: np.ndarray, p: Participation) -> tuple[float, float]:
    """(max reachable sens, max absolute-value bound) over every pattern."""
    X = C.T @ C
    lo2 = hi2 = 0.0
    for pat in patterns(X.shape[0], p):
        sub = X[np.ix_(pat, pat)]
        hi2 = max(hi2, float(np.abs(sub).sum()))
        for signs in itertools.product((1.0, -1.0), repeat=len(pat) - 1):
            s = np.array((1.0, *signs))
            lo2 = max(lo2, float(s @ sub @ s))
    return math.sqrt(lo2), math.sqrt(hi2)


SCHEMES = [
    Participation.min_separation(1, 2),
    Participation.min_separation(2, 3),
    Participation.min_separation(3, 2),
    Participation.min_separation(4, 3),
    Participation.min_separation(5, 12),
    Participation.epochs(2, 6),
    Participation.epochs(3, 4),
    Participation.epochs(4, 3),
    Participation.epochs(6, 2),
]


def check_against_brute(sens, lo: float, hi: float) -> None:
    tol = 1e-9 * max(1.0, hi)
    assert sens.value >= lo - tol, "below a value some pattern reaches: not private"
    assert sens.lower <= hi + tol
    if sens.exact:
        assert sens.value == pytest.approx(lo, rel=1e-9, abs=1e-12)
    else:
        assert sens.value >= hi - tol, "a 'bound' below the absolute-value bound"


@pytest.mark.parametrize("name", mechanism_names())
@pytest.mark.parametrize("p", SCHEMES, ids=str)
def test_every_mechanism_matches_brute_force(name: str, p: Participation) -> None:
    f = build_factorization(name, 12)
    _, C = f.matrices()
    sens = f.participation_sensitivity(p)
    check_against_brute(sens, *brute(C, p))


@pytest.mark.parametrize("name", mechanism_names())
@pytest.mark.parametrize("steps", [5, 9])
def test_prefix_sensitivity_matches_brute_force(name: str, steps: int) -> None:
    f = build_factorization(name, 12)
    p = Participation.min_separation(3, 3)
    sens = f.participation_sensitivity(p, steps=steps)
    check_against_brute(sens, *brute(released_rows(f, steps), p))
    # a prefix never releases more than the whole horizon
    assert sens.value <= f.participation_sensitivity(p).value + 1e-12


@pytest.mark.parametrize("name", mechanism_names())
def test_single_participation_is_the_max_column_norm(name: str) -> None:
    f = build_factorization(name, 48)
    once = f.participation_sensitivity(Participation.once())
    assert once.exact and once.value == f.sensitivity
    assert f.participation_sensitivity(Participation.once(), steps=20).value == \
        f.prefix_sensitivity(20)


def test_known_values() -> None:
    """Closed forms by hand: C = I gives √k; the all-ones tree of N = 4 used at every step
    gives X = [[3,2,1,1],[2,3,1,1],[1,1,3,2],[1,1,2,3]] → Σ = 28."""
    f = build_factorization("independent", 30)
    assert f.participation_sensitivity(Participation.min_separation(7, 9)).value == \
        pytest.approx(math.sqrt(5))  # ⌈30/7⌉ = 5 uses fit
    tree = build_factorization("tree", 4)
    assert tree.participation_sensitivity(Participation.every_step(4)).value == \
        pytest.approx(math.sqrt(28))


@pytest.mark.parametrize("name", ["toeplitz", "blt"])
@pytest.mark.parametrize("p", [Participation.min_separation(7, 5), Participation.epochs(6, 50),
                               Participation.every_step(300)], ids=str)
def test_toeplitz_closed_form_equals_dense(name: str, p: Participation) -> None:
    """Second method: the O(N) closed form against the dense |X| computation at N = 300."""
    f = build_factorization(name, 300)
    _, C = f.matrices()
    closed = f.participation_sensitivity(p)
    dense = gram_sensitivity(C.T @ C, p)
    assert closed.exact
    # the dense computation reaches the same pattern (its lower end) and certifies an upper
    # bound above it (the row-wise dynamic program is loose for min-sep, tight otherwise)
    assert closed.value == pytest.approx(dense.lower, rel=1e-10)
    assert closed.value <= dense.value * (1 + 1e-12)
    if p.fixed_epoch or p.min_sep == 1:
        assert closed.value == pytest.approx(dense.value, rel=1e-10)


def test_non_monotone_toeplitz_is_a_certified_bound() -> None:
    """Σω > 1 makes c(1) > c(0): no longer non-increasing, so the majorant bound applies."""
    params = BLTParams(theta=np.array([0.9, 0.5]), omega=np.array([0.9, 0.6]))
    f = BufferedToeplitz(10, params=params, use_cache=False)
    assert f.c[1] > f.c[0]
    p = Participation.min_separation(2, 3)
    sens = f.participation_sensitivity(p)
    assert not sens.exact
    _, C = f.matrices()
    check_against_brute(sens, *brute(C, p))
    # negative coefficients: majorant of |c|, still above brute force
    c = np.array([1.0, -0.6, 0.3, -0.2, 0.1, 0.0, 0.0, 0.0])
    C = np.tril(np.array([[c[i - j] if i >= j else 0.0 for j in range(8)] for i in range(8)]))
    check_against_brute(toeplitz_sensitivity(c, 8, p), *brute(C, p))


def test_triangle_fallback_beyond_the_dense_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr_corrnoise.mechanisms.base as base

    f = build_factorization("tree", 16)
    p = Participation.min_separation(2, 4)
    dense = f.participation_sensitivity(p)
    monkeypatch.setattr(base, "DENSE_LIMIT", 8)
    g = build_factorization("efficient-tree", 16)  # another object: no memo
    tri = g.participation_sensitivity(p)
    assert tri.method.startswith("triangle")
    assert tri.value == pytest.approx(4 * g.sensitivity)
    assert tri.value >= dense.value


def test_dynamic_program_against_enumeration() -> None:
    rng = np.random.default_rng(3)
    x = rng.random((4, 11))
    for b, k in [(1, 3), (2, 2), (3, 4), (11, 2)]:
        best = [max(sum(row[list(c)]) for size in range(1, k + 1)
                    for c in itertools.combinations(range(11), size)
                    if all(q - p >= b for p, q in itertools.pairwise(c))) for row in x]
        np.testing.assert_allclose(best_separated_sum(x, b, k), best)


def test_bad_participations_are_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ParticipationError):
            Participation(max_participations=bad)
        with pytest.raises(ParticipationError):
            Participation(max_participations=2, min_sep=bad)
    assert Participation(1, 7, True) == Participation.once()  # one use: nothing else matters


def test_blt_optimized_for_participations_beats_the_single_participation_blt() -> None:
    """Item 2: a BLT optimized for (k, b) has a lower RMSE under (k, b) than the BLT
    optimized for one use, its sensitivity is exact (Σω ≤ 1: c non-increasing), and the
    learner builds it from its participation (another digest, restorable by it)."""
    from flwr_corrnoise.learner_state import LearnerState
    from flwr_corrnoise.settings import PrivacySettings
    from flwr_corrnoise.streams import NoiseStream

    p = Participation.epochs(6, 20)
    multi = build_factorization("blt", 120, min_sep=20, max_participations=6)
    single = build_factorization("blt", 120)
    assert multi.participation_rmse(p) < 0.97 * single.participation_rmse(p)
    assert multi.participation_sensitivity(p).exact and np.sum(multi.omega) <= 1.0
    assert single.participation_rmse() <= multi.participation_rmse()  # each wins its own case
    assert multi.digest != single.digest
    settings = PrivacySettings(mechanism="blt", horizon=120, participation=p)
    assert settings.factorization() is multi
    state = LearnerState.create(settings, [(3,)], seed=1)
    assert state.noise.factorization.digest == multi.digest
    state.noise.next()
    again = NoiseStream.from_bytes(state.noise.to_bytes())
    assert again.factorization.digest == multi.digest
    np.testing.assert_array_equal(again.next(), state.noise.next())


def test_the_dense_toeplitz_reference_bounds_the_blt_from_below() -> None:
    """The best Toeplitz encoder with all N coefficients free (non-increasing, so its
    sensitivity is exact): its analytic gradient against finite differences, its inverse
    against the dense inverse, and its RMSE at or below the (k, b)-BLT it starts from."""
    from scipy.linalg import toeplitz

    from flwr_corrnoise.mechanisms.toeplitz import (
        _objective_and_gradient,
        optimize_toeplitz,
        toeplitz_inverse_coefficients,
        toeplitz_rmse_squared,
    )

    n, p = 24, Participation.min_separation(5, 4)
    c = np.sort(np.random.default_rng(0).random(n))[::-1] + 0.1
    np.testing.assert_allclose(toeplitz_inverse_coefficients(c, n),
                               np.linalg.inv(np.tril(toeplitz(c)))[:, 0], atol=1e-12)
    z = np.random.default_rng(1).normal(size=n)
    _, grad = _objective_and_gradient(z, n, p)
    h = 1e-6
    numeric = [(_objective_and_gradient(z + h * e, n, p)[0]
                - _objective_and_gradient(z - h * e, n, p)[0]) / (2 * h) for e in np.eye(n)]
    np.testing.assert_allclose(grad, numeric, atol=1e-7)
    p = Participation.epochs(4, 15)
    blt = build_factorization("blt", 60, min_sep=15, max_participations=4)
    best = optimize_toeplitz(60, p, init=blt.c)
    assert np.all(np.diff(best) <= 0) and np.all(best > 0)
    assert math.sqrt(toeplitz_rmse_squared(best, 60, p)) <= blt.participation_rmse(p) + 1e-9
