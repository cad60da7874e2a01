"""Chen & Wang, "Locally Differentially Private Distributed Online Learning with Guaranteed
Optimality": Algorithm 1, its baselines and both accountants."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_corrnoise.decentralized import graphs as G  # noqa: N812
from flwr_corrnoise.decentralized.baselines import DOLA, DSGD, PDOP
from flwr_corrnoise.decentralized.chen_wang import ChenWang, StepSizes, project_ball
from flwr_corrnoise.decentralized.chen_wang_privacy import (
    CONTRACTIVE,
    PER_DATUM,
    PER_STEP,
    THM5,
    TIGHT,
    baseline_epsilon_per_datum,
    chen_wang_epsilon,
    contractive_sensitivity,
    noise_scale_for_epsilon,
    thm5_sensitivity,
    tight_sensitivity,
)
from flwr_corrnoise.decentralized.engine import run
from flwr_corrnoise.decentralized.protocol import (
    Inbox,
    PrivacyProposalError,
    check_privacy_proposal,
    select,
    stack,
    state_from_bytes,
    state_to_bytes,
)
from flwr_corrnoise.decentralized.tasks import LogisticTask, synthetic_shards

STEPS = StepSizes(1.0, 0.77, 1.0, 0.65)


def _task(n: int = 5, dim: int = 6, horizon: int = 60, seed: int = 0) -> LogisticTask:
    return LogisticTask(synthetic_shards(n, dim, 40, seed), reg=0.01, horizon=horizon, seed=seed)


# -- accountants against independent closed forms ----------------------------------------
def test_tight_recursion_equals_closed_form_sum() -> None:
    T, w, L, C, d = 40, 0.6, 0.26, 2.0, 7
    lam = lambda t: (t + 1.0) ** -0.77  # noqa: E731
    gam = lambda t: (t + 1.0) ** -0.65  # noqa: E731
    a = lambda q: abs(1 - w * gam(q)) + L * lam(q)  # noqa: E731
    # Φ_t = Σ_{p<t} λ_p C/(p+1) Π_{q=p+1}^{t-1} a_q, Δ_t = √d Φ_t
    phi = [sum(lam(p) * C / (p + 1) * math.prod(a(q) for q in range(p + 1, t))
               for p in range(t)) for t in range(T)]
    assert np.allclose(tight_sensitivity(T, STEPS, w, L, C, d), math.sqrt(d) * np.array(phi),
                       rtol=1e-12, atol=0)
    eps = chen_wang_epsilon(T, STEPS, w_self=w, L=L, C=C, dim=d, noise_scale=0.8, exponent=0.12)
    lemma2 = sum(math.sqrt(d) * phi[t] / (0.8 * (t + 1) ** 0.12) for t in range(T))
    assert eps[-1] == pytest.approx(lemma2, rel=1e-12)


def test_thm5_matches_printed_tau() -> None:
    T, wbar, L, C, d = 30, 0.6, 0.26, 2.0, 5
    lam = lambda t: (t + 1.0) ** -0.77  # noqa: E731
    gam = lambda t: (t + 1.0) ** -0.65  # noqa: E731

    def tau(t: int) -> float:  # as printed in Theorem 5(i)
        if t == 0:
            return 0.0
        return sum(lam(p - 1) * math.prod(1 - wbar * gam(q) + lam(q) * L for q in range(p, t))
                   for p in range(1, t)) + lam(t - 1)

    expected = math.sqrt(d) * C * np.array([tau(t) for t in range(T)])
    assert np.allclose(thm5_sensitivity(T, STEPS, wbar, L, C, d), expected, rtol=1e-12)


def test_tight_budget_bounded_while_thm5_grows() -> None:
    kw = dict(w_self=0.6, L=0.26, C=2.0, dim=112, noise_scale=1.0, exponent=0.11)
    tight = chen_wang_epsilon(200_000, STEPS, **kw)
    assert np.all(np.diff(tight) >= 0)
    # the notes' reference numbers: 424 at T = 2000, converging (≈ 449 at 10⁶)
    assert tight[1999] == pytest.approx(423.84, abs=0.05)
    assert tight[-1] - tight[99_999] < 0.01 * tight[-1]  # the tail has almost nothing left
    assert tight[-1] < 450
    thm5 = chen_wang_epsilon(200_000, STEPS, accountant=THM5, **kw)
    assert thm5[1999] > 40 * tight[1999]
    assert thm5[-1] > 5 * thm5[1999]  # still growing


def test_sigma_epsilon_roundtrip() -> None:
    kw = dict(w_self=0.6, L=0.3, C=2.0, dim=10, exponent=0.1)
    for acc in (TIGHT, THM5):
        b0 = noise_scale_for_epsilon(3.0, 500, STEPS, accountant=acc, **kw)
        eps = chen_wang_epsilon(500, STEPS, noise_scale=b0, accountant=acc, **kw)[-1]
        assert eps == pytest.approx(3.0, rel=1e-12)
    with pytest.raises(ValueError):
        noise_scale_for_epsilon(0.0, 500, STEPS, **kw)


def test_baseline_per_datum_against_brute_force() -> None:
    rng = np.random.default_rng(0)
    T, C, d = 25, 1.5, 4
    lam, a, sc = rng.uniform(0.1, 1, T), rng.uniform(0, 1.2, T), rng.uniform(0.5, 2, T)
    best = 0.0
    for k in range(T - 1):  # datum k enters θ_{k+1}; then Φ_{t+1} = a_t Φ_t
        phi, eps = lam[k] * C, 0.0
        for t in range(k + 1, T):
            eps += math.sqrt(d) * phi / sc[t]
            phi *= a[t]
        best = max(best, eps)
    assert baseline_epsilon_per_datum(lam, a, sc, C, d) == pytest.approx(best, rel=1e-12)


# -- empirical sensitivity: adjacent data, identical noise and inboxes -------------------
def test_contractive_recursion_closed_form_and_below_tight() -> None:
    T, w, L, mu, C, d = 50, 0.6, 0.26, 0.01, 2.0, 3
    steps = StepSizes(4.0, 0.77, 1.0, 0.65)

    def a(q: int) -> float:
        keep = 1 - w * (q + 1.0) ** -0.65
        eta = 4.0 * (q + 1.0) ** -0.77 / keep
        return keep * max(abs(1 - eta * mu), abs(1 - eta * L))

    phi = [sum(4.0 * (p + 1.0) ** -0.77 * C / (p + 1) * math.prod(a(q) for q in range(p + 1, t))
               for p in range(t)) for t in range(T)]
    got = contractive_sensitivity(T, steps, w, L, mu, C, d)
    assert np.allclose(got, math.sqrt(d) * np.array(phi), rtol=1e-12, atol=0)
    assert np.all(got <= tight_sensitivity(T, steps, w, L, C, d) + 1e-15)
    kw = dict(w_self=w, L=L, C=C, dim=117, noise_scale=1.0, exponent=0.13, mu=mu)
    e_c = chen_wang_epsilon(2000, steps, accountant=CONTRACTIVE, **kw)[-1]
    e_t = chen_wang_epsilon(2000, steps, **kw)[-1]
    assert e_c < e_t / 100  # λ₀ = 4: eq. (22) explodes, the contraction does not


@pytest.mark.parametrize("clip", [0.5, None])
def test_empirical_sensitivity_below_tight_bound(clip: float | None) -> None:
    n, dim, T = 5, 6, 60
    task = _task(n, dim, T)
    steps = STEPS if clip is not None else StepSizes(4.0, 0.77, 1.0, 0.65)
    algo = ChenWang(G.ring(n), task, steps, clip=clip)
    ref = run(algo, T, run_seed=3, keep_outboxes=True)
    node, k = 2, 0
    other = _task(n, dim, T)
    X, y = other.shards[node]
    j = other.indices[node, k, 0]
    X = X.copy()
    y = y.copy()
    X[j], y[j] = np.eye(dim)[0], 1 - y[j]  # replace datum k of node 2's stream
    other.shards[node] = (X, y)
    algo2 = ChenWang(G.ring(n), other, steps, clip=clip)
    priv = algo.default_privacy(np.arange(n))
    s1 = select(algo.init(np.arange(n), 3, priv), [node])
    s2 = select(algo2.init(np.arange(n), 3, priv), [node])
    L = task.smoothness
    if clip is not None:
        bound = tight_sensitivity(T, STEPS, 0.6, L, 2 * clip, dim)
    else:  # unclipped convex loss: the contractive bound (C = 2B, B the declared row bound)
        bound = contractive_sensitivity(T, steps, 0.6, L, task.reg, 2 * task.feature_bound, dim)
    diffs = []
    for t in range(T):
        _, s1 = algo.release(s1)
        _, s2 = algo2.release(s2)
        assert np.array_equal(s1["noise"], s2["noise"])
        full = {"y": ref.outboxes[t]["y"]}  # the neighbours' recorded releases
        inbox = Inbox.gather(algo.graph, [node], full)
        s1, s2 = algo.update(s1, inbox), algo2.update(s2, inbox)
        diffs.append(np.abs(s1["theta"] - s2["theta"]).sum())
    diffs = np.array([0.0, *diffs[:-1]])  # Δ_t refers to θ_t
    assert np.allclose(select(ref.state, [node])["theta"], s1["theta"])
    assert diffs.max() > 0
    assert np.all(diffs <= bound + 1e-12)


# -- ε → ∞ equals the non-private algorithm (independent reference loops) --------------
def _reference(kind: str, task: LogisticTask, A: np.ndarray, T: int) -> np.ndarray:
    n, d = task.num_nodes, task.dim
    th = np.zeros((n, d))
    for t in range(T):
        new = np.empty_like(th)
        for i in range(n):
            if kind == "chen-wang":
                Xh = task.shards[i][0][task.indices[i, : t + 1, 0]]
                yh = task.shards[i][1][task.indices[i, : t + 1, 0]]
                s = 1 / (1 + np.exp(-Xh @ th[i]))
                g = ((s - yh)[:, None] * Xh).mean(0) + task.reg * th[i]
                cons = sum(A[i, j] * (th[j] - th[i]) for j in range(n) if j != i)
                new[i] = th[i] + (t + 1.0) ** -0.65 * cons - (t + 1.0) ** -0.77 * g
            else:
                x = task.shards[i][0][task.indices[i, t, 0]]
                yy = task.shards[i][1][task.indices[i, t, 0]]
                mixed = A[i] @ th
                point = th[i] if kind == "dsgd" else mixed
                g = (1 / (1 + np.exp(-x @ point)) - yy) * x + task.reg * point
                step = {"dsgd": (t + 1.0) ** -0.77, "dola": 0.1 * (t + 1.0) ** -0.5,
                        "pdop": 0.5 * 0.97**t}[kind]
                new[i] = mixed - step * g
        th = new
    return th


@pytest.mark.parametrize("cls", [ChenWang, DSGD, DOLA, PDOP])
def test_noise_off_equals_non_private(cls: type) -> None:
    n, T = 5, 25
    task = _task(n, 4, T)
    graph = G.ring(n)
    algo = (ChenWang(graph, task, STEPS) if cls is ChenWang
            else cls.from_config(graph, task, {}))
    fields = list(algo.privacy_fields)
    off = {fields[0]: np.zeros(n), fields[1]: np.full(n, 0.1 if cls is not PDOP else 0.98)}
    res = run(algo, T, run_seed=1, privacy=off)
    A = np.eye(n) + G.laplacian_weights(graph, 0.3)
    expected = _reference(algo.name, task, A, T)
    assert np.allclose(res.decisions[-1], expected, rtol=1e-10, atol=1e-12)
    noisy = run(algo, T, run_seed=1)
    assert not np.allclose(noisy.decisions[-1], expected, atol=1e-3)  # the noise matters


def test_epsilon_labels_and_growth() -> None:
    n, T = 5, 400
    task = _task(n, 4, T)
    graph = G.ring(n)
    cw = ChenWang(graph, task, STEPS)
    st = cw.init(np.arange(n), 0, cw.default_privacy(np.arange(n)))
    e1, e2 = cw.epsilon(st, 200), cw.epsilon(st, 400)
    assert set(e1) == {TIGHT, THM5, CONTRACTIVE}
    assert set(ChenWang(graph, task, STEPS, clip=1.0).epsilon(st, 10)) == {TIGHT, THM5}
    assert np.all(e2[TIGHT] - e1[TIGHT] < 0.1 * e1[TIGHT])  # nearly flat
    assert np.all(np.diff(e2[TIGHT]) < 0)  # larger ς for higher nodes → smaller ε
    dola = DOLA.from_config(graph, task, {})
    sd = dola.init(np.arange(n), 0, dola.default_privacy(np.arange(n)))
    d1, d2 = dola.epsilon(sd, 200), dola.epsilon(sd, 400)
    assert set(d1) == {PER_STEP, PER_DATUM}
    assert np.all(d2[PER_STEP] > 1.9 * d1[PER_STEP])  # papers' summation explodes
    assert np.all(d2[PER_DATUM] < d2[PER_STEP] / 50)


# -- step sizes ---------------------------------------------------------------------------
def test_step_size_rules() -> None:
    W = G.laplacian_weights(G.ring(5), 0.3)
    ev = 0.6 * (np.cos(2 * np.pi * np.arange(5) / 5) - 1)
    d2, dm = abs(np.sort(ev)[-2]), abs(ev.min())
    s = StepSizes.global_parameters(W, L=0.26, mu=0.01)
    assert s.gamma0 == pytest.approx(1 / (3 * dm))
    assert s.lambda0 == pytest.approx(s.gamma0 * d2 * 0.01 / (0.01**2 + 8 * 0.26**2))
    c = StepSizes.global_parameters(W, L=0.26, kappa=0.5, D=1.0)
    assert c.lambda0 == pytest.approx(d2 * c.gamma0 / (2 * (0.26**2 + 0.25 + 1)))
    pf = StepSizes.parameter_free(2.0, 3.0, u=0.6, v=0.7)
    assert pf.lam(0) == 2.0 and pf.gamma(3) == pytest.approx(3.0 * 4**-0.6)
    assert STEPS.violated_conditions(0.15)  # the paper's own run sits on the boundary
    assert not pf.violated_conditions(0.05)
    assert pf.rate_beta(0.05) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        StepSizes.parameter_free(0.0)


def test_projection_and_state_roundtrip() -> None:
    th = np.array([[3.0, 4.0], [0.3, 0.4]])
    assert np.allclose(project_ball(th, 1.0), [[0.6, 0.8], [0.3, 0.4]])
    n, T = 5, 12
    task = _task(n, 4, T)
    algo = ChenWang(G.ring(n), task, STEPS)
    full = run(algo, T, run_seed=9)
    # run 6 steps, serialize each node separately, restore, continue: identical
    nodes = np.arange(n)
    st = algo.init(nodes, 9, algo.default_privacy(nodes))
    for t in range(T):
        if t == 6:
            st = stack([state_from_bytes(state_to_bytes(select(st, [i]))) for i in nodes])
        out, st = algo.release(st)
        st = algo.update(st, Inbox.gather(algo.graph, nodes, out))
    assert np.array_equal(st["theta"], full.state["theta"])


def test_privacy_proposals_refused_when_weaker() -> None:
    fields = {"noise-scale": +1, "epsilon": -1}
    mine = {"noise-scale": 1.0, "epsilon": 2.0}
    check_privacy_proposal(fields, mine, {"privacy-noise-scale": 1.5, "epsilon": 1.0})
    with pytest.raises(PrivacyProposalError, match="noise-scale"):
        check_privacy_proposal(fields, mine, {"privacy-noise-scale": 0.5})
    with pytest.raises(PrivacyProposalError, match="epsilon"):
        check_privacy_proposal(fields, mine, {"epsilon": 3.0})
    with pytest.raises(PrivacyProposalError):
        check_privacy_proposal(fields, mine, {"epsilon": "nan"})
