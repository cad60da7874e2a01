"""Issue 20, item 6: Chen & Wang's ("Locally Differentially Private Distributed Online Learning with
Guaranteed Optimality") ε comes from *declared* bounds, and the clip that enforces them.

The attack: C and L used to be the maximum row norm over the shards at hand. A neighbouring
stream whose replaced row is larger than every row here then gets a smaller C and L than the
pair needs, so the reported ε under-bounds that pair (the issue's numbers: 10.71 reported vs
12.78 by the theorem at T = 5, 46.95 vs 65.97 at T = 200) — and the reported ε itself is a
function of the data. Now a task declares its feature bound B (config key ``feature-bound``),
every row is projected onto ``{‖a‖ ≤ B}`` before any gradient sees it, and the accountants use
``C = 2·min(clip, B)``, ``L = B²/4 + r`` only.

Every reference value below is computed here, in plain Python, from the paper's formulas —
not with the accountant's own functions.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.decentralized import graphs as G  # noqa: N812
from flwr_corrnoise.decentralized.baselines import DSGD
from flwr_corrnoise.decentralized.chen_wang import ChenWang, StepSizes
from flwr_corrnoise.decentralized.chen_wang_privacy import (
    CONTRACTIVE,
    PER_DATUM,
    PER_STEP,
    THM5,
    TIGHT,
    gradient_constants,
)
from flwr_corrnoise.decentralized.engine import build_from_config, run
from flwr_corrnoise.decentralized.multiclass import MulticlassTask, synthetic_multiclass
from flwr_corrnoise.decentralized.protocol import Inbox, select
from flwr_corrnoise.decentralized.tasks import LogisticTask

N, DIM, REG, W_SELF = 5, 4, 1e-3, 0.6  # ring of 5, w_ij = 0.3 → |w_ii| = 0.6
STEPS = StepSizes(1.0, 0.77, 1.0, 0.65)


# -- independent references (Chen & Wang: eq. (22), Thm 5(i) as printed, Lemma 2) ----------
def _lam(t: int) -> float:
    return (t + 1.0) ** -0.77


def _gam(t: int) -> float:
    return (t + 1.0) ** -0.65


def tight_phi(T: int, C: float, L: float, lam0: float = 1.0) -> list[float]:
    """Φ_0..Φ_{T−1} of eq. (22): Φ_{t+1} = (|1 − |w_ii|γ_t| + Lλ_t)Φ_t + λ_t C/(t+1)."""
    phi = [0.0]
    for t in range(T - 1):
        lam = lam0 * _lam(t)
        phi.append((abs(1 - W_SELF * _gam(t)) + L * lam) * phi[-1] + lam * C / (t + 1))
    return phi


def tight_eps(T: int, C: float, L: float, b0: float, s: float) -> float:
    """Lemma 2 with eq. (22): Σ_{t<T} √d Φ_t / (b0 (t+1)^s)."""
    return sum(math.sqrt(DIM) * p / (b0 * (t + 1.0) ** s)
               for t, p in enumerate(tight_phi(T, C, L)))


def thm5_eps(T: int, C: float, L: float, b0: float, s: float) -> float:
    """Theorem 5(i) as printed: Δ_t = √d C τ_t,
    τ_t = Σ_{p=1}^{t−1} λ_{p−1} Π_{q=p}^{t−1}(1 − w̄γ_q + Lλ_q) + λ_{t−1}."""
    total = 0.0
    for t in range(1, T):
        tau = sum(_lam(p - 1) * math.prod(1 - W_SELF * _gam(q) + L * _lam(q)
                                          for q in range(p, t)) for p in range(1, t))
        tau += _lam(t - 1)
        total += math.sqrt(DIM) * C * tau / (b0 * (t + 1.0) ** s)
    return total


def contractive_eps(T: int, C: float, L: float, mu: float, b0: float, s: float) -> float:
    phi, total = 0.0, 0.0
    for t in range(T):
        total += math.sqrt(DIM) * phi / (b0 * (t + 1.0) ** s)
        keep = 1 - W_SELF * _gam(t)
        eta = _lam(t) / keep
        phi = keep * max(abs(1 - eta * mu), abs(1 - eta * L)) * phi + _lam(t) * C / (t + 1)
    return total


# -- data: rows of norm exactly 0.8 (the setting), one row replaced ---------------
def _shards(seed: int = 0, norm: float = 0.8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng([seed, 20])
    out = []
    for _ in range(N):
        X = rng.normal(size=(30, DIM))
        X *= norm / np.linalg.norm(X, axis=1, keepdims=True)
        out.append((X, (rng.random(30) < 0.5).astype(float)))
    return out


def _neighbour(shards: list, node: int, row: int, norm: float
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``shards`` with row ``row`` of node ``node`` replaced by a row of norm ``norm`` and the
    other label."""
    out = [(X.copy(), y.copy()) for X, y in shards]
    X, y = out[node]
    X[row] = norm * np.ones(DIM) / math.sqrt(DIM)
    y[row] = 1.0 - y[row]
    return out


def _privacy(b0: float = 1.0, s: float = 0.1) -> dict[str, np.ndarray]:
    return {"noise-scale": np.full(N, b0), "noise-exponent": np.full(N, s)}


# -- 1. the reported ε: identical for neighbours, equal to the theorem's declared value ---
@pytest.mark.parametrize("replaced_norm", [1.0, 3.0])
def test_reported_epsilon_identical_for_neighbours_and_equals_theorem(
        replaced_norm: float) -> None:
    shards = _shards()
    ring = G.ring(N)
    tasks = [LogisticTask(s, reg=REG, horizon=200) for s in
             (shards, _neighbour(shards, 0, 0, replaced_norm))]  # declared B = 1 (default)
    algos = [ChenWang(ring, t, STEPS) for t in tasks]
    B = 1.0
    C, L = 2 * B, B * B / 4 + REG
    for T in (5, 200):
        eps = [a.epsilon(a.init(np.arange(N), 0, _privacy()), T) for a in algos]
        assert set(eps[0]) == {TIGHT, THM5, CONTRACTIVE}
        for label in eps[0]:  # bit-for-bit the same: nothing of the data enters
            assert np.array_equal(eps[0][label], eps[1][label]), label
        ref = {TIGHT: tight_eps(T, C, L, 1.0, 0.1),
               CONTRACTIVE: contractive_eps(T, C, L, REG, 1.0, 0.1)}
        if T == 5:  # the printed double sum is O(T³): checked where it is cheap
            ref[THM5] = thm5_eps(T, C, L, 1.0, 0.1)
        for label, value in ref.items():
            assert np.allclose(eps[0][label], value, rtol=1e-12, atol=0), label
        # the numbers, recomputed: the data's maxima (C = 1.6, L = 0.8²/4 + r) gave
        # the reported value, the pair's own constants (C = 0.8 + 1, L = 1/4 + r) the theorem's
        old = tight_eps(T, 1.6, 0.8**2 / 4 + REG, 1.0, 0.1)
        pair = tight_eps(T, 0.8 + 1.0, 1.0 / 4 + REG, 1.0, 0.1)
        assert (old, pair) == pytest.approx({5: (10.71, 12.78), 200: (46.95, 65.97)}[T],
                                            abs=0.005)
        assert np.all(eps[0][TIGHT] >= pair)  # no longer under-bounds the pair


def test_baseline_epsilon_identical_for_neighbours() -> None:
    """DSGD's two accountants read the same declared constants (its per-datum propagation
    factor ``A_ii + Lλ_t`` included)."""
    shards = _shards()
    ring = G.ring(N)
    algos = [DSGD.from_config(ring, LogisticTask(s, reg=REG, horizon=50), {})
             for s in (shards, _neighbour(shards, 1, 3, 2.5))]
    priv = {"noise-scale": np.ones(N), "noise-rate": np.full(N, 0.1)}
    T = 50
    eps = [a.epsilon(a.init(np.arange(N), 0, priv), T) for a in algos]
    for label in (PER_STEP, PER_DATUM):
        assert np.array_equal(eps[0][label], eps[1][label])
    C, L = 2.0, 0.25 + REG
    lam = [_lam(t) for t in range(T)]
    sc = [(t + 1.0) ** 0.1 for t in range(T)]
    per_step = sum(math.sqrt(DIM) * lam[t - 1] * C / sc[t] for t in range(1, T))
    best = 0.0
    for k in range(T - 1):  # datum k enters θ_{k+1}, then Φ_{t+1} = (0.4 + Lλ_t) Φ_t
        phi, e = lam[k] * C, 0.0
        for t in range(k + 1, T):
            e += math.sqrt(DIM) * phi / sc[t]
            phi *= 0.4 + L * lam[t]
        best = max(best, e)
    assert np.allclose(eps[0][PER_STEP], per_step, rtol=1e-12)
    assert np.allclose(eps[0][PER_DATUM], best, rtol=1e-12)


# -- 2. a datum beyond the bound is clipped: the sensitivity bound holds -----------------
@pytest.mark.parametrize("via", ["constructor", "mutated"])
def test_datum_beyond_bound_is_clipped_and_sensitivity_holds(via: str) -> None:
    """Node 2's first datum replaced by a row of norm 50 (the declared bound is 1); identical
    noise and inboxes on both sides, so ‖θ_t − θ'_t‖₁ is the data's effect alone. It must stay
    within eq. (22)'s Δ_t with the declared constants, at every step. ``mutated`` swaps the row
    into the task after construction, so only the projection inside ``grad`` can catch it.
    (Unclipped: the feature bound is the only thing bounding C. With a gradient ``clip`` the
    clip bounds C already; ``tests/decentralized/test_chen_wang.py`` covers that case.)"""
    clip = None
    T, node, r = 60, 2, 0.01
    shards = _shards(norm=1.0)
    task = LogisticTask(shards, reg=r, horizon=T, seed=4)
    row = int(task.indices[node, 0, 0])
    far = _neighbour(shards, node, row, 50.0)
    if via == "constructor":
        other = LogisticTask(far, reg=r, horizon=T, seed=4)
    else:
        other = LogisticTask(shards, reg=r, horizon=T, seed=4)
        other.shards[node] = far[node]
    ring = G.ring(N)
    algo, algo2 = ChenWang(ring, task, STEPS, clip=clip), ChenWang(ring, other, STEPS, clip=clip)
    ref = run(algo, T, run_seed=3, privacy=_privacy(), keep_outboxes=True)
    s1 = select(algo.init(np.arange(N), 3, _privacy()), [node])
    s2 = select(algo2.init(np.arange(N), 3, _privacy()), [node])
    diffs = [0.0]  # Δ_0 = 0: θ_0 does not depend on data
    for t in range(T - 1):
        _, s1 = algo.release(s1)
        _, s2 = algo2.release(s2)
        inbox = Inbox.gather(ring, [node], {"y": ref.outboxes[t]["y"]})
        s1, s2 = algo.update(s1, inbox), algo2.update(s2, inbox)
        diffs.append(float(np.abs(s1["theta"] - s2["theta"]).sum()))
    B = 1.0
    C = 2 * B
    bound = [math.sqrt(DIM) * p for p in tight_phi(T, C, B * B / 4 + r)]
    assert max(diffs) > 0
    assert all(d <= b * (1 + 1e-9) + 1e-15 for d, b in zip(diffs, bound, strict=True)), (
        max(d / b for d, b in zip(diffs[1:], bound[1:], strict=True)))


def test_per_sample_gradient_difference_within_declared_bound() -> None:
    """‖∇l(θ, ξ) − ∇l(θ, ξ')‖ ≤ C = 2B for any θ and any datum, however large its row; and
    a row beyond B is treated as its projection onto the sphere of radius B."""
    rng = np.random.default_rng(7)
    task = LogisticTask(_shards(norm=1.0), reg=REG, horizon=5, feature_bound=1.0)
    for scale in (1.0, 50.0, 1e6):
        for _ in range(50):
            theta = rng.normal(size=(1, DIM)) * rng.choice([0.1, 10.0, 100.0])
            a, a2 = rng.normal(size=DIM), rng.normal(size=DIM) * scale
            b, b2 = float(rng.random() < 0.5), float(rng.random() < 0.5)
            g = task.grad(theta, a[None, None], np.array([[b]]))
            g2 = task.grad(theta, a2[None, None], np.array([[b2]]))
            assert np.linalg.norm(g - g2) <= 2 * task.feature_bound * (1 + 1e-12)
            proj = a2 * min(1.0, 1.0 / np.linalg.norm(a2))
            s = 1 / (1 + np.exp(-proj @ theta[0]))
            assert np.allclose(g2[0], (s - b2) * proj + REG * theta[0], rtol=1e-9, atol=1e-12)


# -- 3. the declared bound is a setting: config key, any data, validation -----------------
def test_feature_bound_from_config_sets_the_constants_for_any_data() -> None:
    """``feature-bound`` reaches the task through the same config every engine (in-process,
    CLI, Flower relay) builds from; rows within it are kept intact, and ε is the same for
    different data."""
    T = 30
    eps = []
    for data_seed in (0, 1):
        cfg = {"algorithm": "chen-wang", "num-nodes": N, "steps": T, "dim": DIM,
               "task": "synthetic-logreg", "data-seed": data_seed, "feature-bound": 2.0,
               "reg": REG}
        _, algo = build_from_config(cfg)
        assert gradient_constants(algo) == (4.0, 2.0**2 / 4 + REG)
        eps.append(algo.epsilon(algo.init(np.arange(N), 0, _privacy(0.7, 0.12)), T))
    for label in eps[0]:
        assert np.array_equal(eps[0][label], eps[1][label])
    assert np.allclose(eps[0][TIGHT], tight_eps(T, 4.0, 1.0 + REG, 0.7, 0.12), rtol=1e-12)
    # rows inside the bound are not touched (synthetic rows have ‖a‖ ≤ 1 < 2)
    from flwr_corrnoise.decentralized.tasks import synthetic_shards

    raw = synthetic_shards(N, DIM, 200, 1)
    task = algo.task  # type: ignore[attr-defined]
    assert all(np.array_equal(X, Xr) for (X, _), (Xr, _) in zip(task.shards, raw, strict=True))


def test_clip_below_the_bound_tightens_c_only() -> None:
    task = LogisticTask(_shards(), reg=REG, horizon=5, feature_bound=3.0)
    ring = G.ring(N)
    assert gradient_constants(ChenWang(ring, task, STEPS, clip=0.5)) == (1.0, 9 / 4 + REG)
    assert gradient_constants(ChenWang(ring, task, STEPS, clip=10.0)) == (6.0, 9 / 4 + REG)
    assert gradient_constants(ChenWang(ring, task, STEPS)) == (6.0, 9 / 4 + REG)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_invalid_feature_bound_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="feature bound"):
        LogisticTask(_shards(), reg=REG, horizon=5, feature_bound=bad)


def test_task_without_declared_bounds_is_refused_by_the_accountant() -> None:
    X, y = synthetic_multiclass(200, 3, 3)
    task = MulticlassTask(X, y, N, copies=1, horizon=5)
    algo = ChenWang(G.ring(N), task, STEPS, clip=1.0)
    with pytest.raises(ValueError, match="declares no gradient_bound"):
        algo.epsilon(algo.init(np.arange(N), 0, _privacy()), 5)


def test_projected_rows_and_clipped_terms_are_within_their_bounds_exactly() -> None:
    """The accountants take the feature bound B and the clip as exact bounds. In floating
    point a row scaled onto the sphere, or a term scaled to the clip, overshoots by
    rounding; rows and terms go to the bound less the float64 margin
    (learner.clip_margin), so their **exact** norms (rational arithmetic) are within it —
    a projected row, a logistic sample's data term, a multiclass example's gradient."""
    from fractions import Fraction

    from flwr_corrnoise.decentralized.tasks import project_rows

    def exact(v: np.ndarray) -> Fraction:
        return sum(Fraction(float(x)) ** 2 for x in np.ravel(v))

    rng = np.random.default_rng(11)
    dim = 64
    rows = rng.normal(size=(90, dim)) * rng.choice([1e-3, 1.0, 1e6], size=(90, 1))
    for bound in (1.0, 0.3, 7.1):
        for row in project_rows(rows, bound):
            assert exact(row) <= Fraction(bound) ** 2
    clip = 0.37
    task = LogisticTask([(rng.normal(size=(4, dim)), np.array([0, 1, 0, 1]))], reg=0.0,
                        horizon=5, feature_bound=3.0)
    multi = MulticlassTask(rng.normal(size=(8, dim)), np.arange(8) % 3, 1, num_classes=3)
    for _ in range(60):
        a = rng.normal(size=dim) * rng.choice([0.1, 1.0, 100.0])
        theta = rng.normal(size=(1, dim)) * 30
        g = task.grad(theta, a[None, None], np.array([[float(rng.random() < 0.5)]]), clip)
        assert exact(g) <= Fraction(clip) ** 2
        w = rng.normal(size=(1, 3 * dim)) * 30
        g = multi.grad(w, a[None, None], np.array([[float(rng.integers(3))]]), clip)
        assert exact(g) <= Fraction(clip) ** 2
