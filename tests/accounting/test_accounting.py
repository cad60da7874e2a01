"""flwr_corrnoise.accounting: release descriptions and the accountants that turn them into
(ε, δ), each held against an independent computation; the factorization's release; the
decentralized accountants unchanged by the move onto it; the import structure the split
promises (no accountant reads an algorithm object)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate, stats

from flwr_corrnoise.accounting import (
    GAUSSIAN_ACCOUNTANTS,
    AnalyticGaussianAccountant,
    BasicComposition,
    Composed,
    GaussianRelease,
    LaplaceRelease,
    LaplaceSeries,
    NoRelease,
    PerDatumLaplace,
    PrivacyBudgetError,
    SelfComposed,
    UnsupportedEventError,
    ZCdpAccountant,
)
from flwr_corrnoise.accounting.events import WorstCase
from flwr_corrnoise.decentralized import chen_wang_privacy as cp
from flwr_corrnoise.decentralized import wang_privacy as wp
from flwr_corrnoise.decentralized.chen_wang import StepSizes
from flwr_corrnoise.decentralized.engine import build_from_config
from flwr_corrnoise.decentralized.gossip import gossip_polynomial, mixing_matrix
from flwr_corrnoise.decentralized.graphs import ring
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.privacy import calibrate, calibrate_mechanism, epsilon_for_std, epsilon_spent

ROOT = Path(__file__).resolve().parents[2]
EXACT, ZCDP, BASIC = AnalyticGaussianAccountant(), ZCdpAccountant(), BasicComposition()


# -- independent references ---------------------------------------------------------------
def gaussian_delta_closed(eps: float, mu: float) -> float:
    """Balle & Wang's δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), with scipy's plain cdf."""
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def composed_gaussian_delta_by_integration(eps: float, mus: tuple[float, float]) -> float:
    """δ(ε) = E[(1 − e^{ε − L₁ − L₂})₊] for two independent Gaussian privacy losses
    ``L_i ~ N(μ_i²/2, μ_i²)``: the expectation over ``L₂`` in closed form for each ``l₁``
    (a one-dimensional Gaussian integral), over ``L₁`` numerically — no composition theorem
    used."""
    (m1, s1), s2 = (mus[0] ** 2 / 2, mus[0]), mus[1]

    def given_l1(l1: float) -> float:
        e = eps - l1  # E[(1 − e^{e − L₂})₊] for L₂ ~ N(s2²/2, s2²)
        phi = 0.5 * math.erfc((e / s2 - s2 / 2) / math.sqrt(2))
        tail = 0.5 * math.erfc((e / s2 + s2 / 2) / math.sqrt(2))
        return (phi - math.exp(e) * tail) * math.exp(-((l1 - m1) ** 2) / (2 * s1 * s1)) / (
            s1 * math.sqrt(2 * math.pi))

    value, _ = integrate.quad(given_l1, m1 - 14 * s1, m1 + 14 * s1, limit=400,
                              epsabs=1e-15, epsrel=1e-11)
    return value


def laplace_pld_delta(eps: float, releases: list[tuple[float, float]], n: int = 1201) -> float:
    """Brute force: δ(ε) = E_{y~P}[(1 − e^{ε − L(y)})₊] for independent 1-D Laplace
    releases ``(Δ_i, b_i)`` on neighbours ``x = 0`` and ``x' = Δ`` — the privacy loss
    ``L(y) = Σ_i (|y_i − Δ_i| − |y_i|)/b_i`` and the density of ``y`` evaluated on a grid
    (midpoint rule, tails to ±40 scales), no composition theorem used."""
    grids, masses, losses = [], [], []
    for d, b in releases:
        edges = np.linspace(-40 * b, d + 40 * b, n + 1)
        y = (edges[:-1] + edges[1:]) / 2
        mass = np.diff(stats.laplace.cdf(edges, 0.0, b))
        grids.append(y)
        masses.append(mass)
        losses.append((np.abs(y - d) - np.abs(y)) / b)
    L = losses[0][:, None] + losses[1][None, :]
    P = masses[0][:, None] * masses[1][None, :]
    return float(np.sum(P * np.maximum(0.0, 1.0 - np.exp(eps - L))))


# -- Gaussian accountants ------------------------------------------------------------------
@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("eps", [0.1, 1.0, 4.0])
def test_exact_delta_is_the_closed_form(eps: float, mu: float) -> None:
    release = GaussianRelease(l2_sensitivity=mu * 1.7, std=1.7)
    assert EXACT.delta(release, eps) == pytest.approx(gaussian_delta_closed(eps, mu),
                                                      rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(("eps", "mus"), [(1.0, (0.6, 0.8)), (2.0, (1.0, 0.5))])
def test_exact_composition_matches_a_two_dimensional_integral(eps: float, mus: tuple) -> None:
    event = Composed((GaussianRelease(mus[0], 1.0), GaussianRelease(2 * mus[1], 2.0)))
    assert EXACT.mu(event) == pytest.approx(math.hypot(*mus), rel=1e-15)
    assert EXACT.delta(event, eps) == pytest.approx(
        composed_gaussian_delta_by_integration(eps, mus), rel=1e-6)


@pytest.mark.parametrize("delta", [1e-6, 1e-3])
def test_exact_epsilon_inverts_delta_on_the_safe_side(delta: float) -> None:
    event = SelfComposed(GaussianRelease(1.0, 2.0), 4)  # μ = √4 · 0.5 = 1
    eps = EXACT.epsilon(event, delta)
    assert gaussian_delta_closed(eps, 1.0) == pytest.approx(delta, rel=1e-9)
    assert EXACT.delta(event, eps) <= delta


@pytest.mark.parametrize(("eps", "delta"), [(0.5, 1e-3), (2.0, 1e-5), (8.0, 1e-6)])
def test_zcdp_is_the_closed_form(eps: float, delta: float) -> None:
    event = Composed((GaussianRelease(1.0, 3.0), GaussianRelease(2.0, 5.0)))
    rho = 1.0 / (2 * 9.0) + 4.0 / (2 * 25.0)  # Σ Δ²/(2σ²)
    assert ZCDP.rho(event) == pytest.approx(rho, rel=1e-15)
    assert ZCDP.epsilon(event, delta) == pytest.approx(
        rho + 2 * math.sqrt(rho * math.log(1 / delta)), rel=1e-15)
    assert ZCDP.delta(event, ZCDP.epsilon(event, delta)) == pytest.approx(delta, rel=1e-9)
    # calibration: V = Δ/√(2ρ(ε, δ)), rounded up to a float that provably holds
    rho_budget = (math.sqrt(eps + math.log(1 / delta)) - math.sqrt(math.log(1 / delta))) ** 2
    std = ZCDP.noise_std(3.0, eps, delta)
    assert std == pytest.approx(3.0 / math.sqrt(2 * rho_budget), rel=1e-12)
    assert ZCDP.satisfies(GaussianRelease(3.0, std), eps, delta)


@pytest.mark.parametrize(("eps", "delta"), [(0.5, 1e-3), (2.0, 1e-5), (8.0, 1e-6)])
def test_exact_noise_std_meets_the_budget_and_beats_zcdp(eps: float, delta: float) -> None:
    std = EXACT.noise_std(2.0, eps, delta)
    assert gaussian_delta_closed(eps, 2.0 / std) == pytest.approx(delta, rel=1e-8)
    assert EXACT.satisfies(GaussianRelease(2.0, std), eps, delta)
    assert std < ZCDP.noise_std(2.0, eps, delta)
    assert GAUSSIAN_ACCOUNTANTS["exact"].name == "exact"
    assert GAUSSIAN_ACCOUNTANTS["zcdp"].name == "zcdp"


def test_worst_case_and_no_release_for_gaussians() -> None:
    cases = WorstCase((GaussianRelease(1.0, 2.0), GaussianRelease(3.0, 2.0), NoRelease()))
    assert EXACT.epsilon(cases, 1e-5) == EXACT.epsilon(GaussianRelease(3.0, 2.0), 1e-5)
    assert EXACT.epsilon(NoRelease(), 1e-5) == 0.0
    assert ZCDP.epsilon(Composed(()), 1e-5) == 0.0


# -- the pure-ε accountant -----------------------------------------------------------------
def test_basic_composition_closed_forms() -> None:
    assert BASIC.epsilon(LaplaceRelease(0.6, 2.0)) == 0.3
    event = Composed((LaplaceRelease(1.0, 4.0), SelfComposed(LaplaceRelease(0.5, 0.25), 3),
                      NoRelease()))
    assert BASIC.epsilon(event) == pytest.approx(0.25 + 3 * 2.0, rel=1e-15)
    assert BASIC.delta(event, 6.25) == 0.0 and BASIC.delta(event, 6.2) == 1.0
    sens, scales = np.array([0.0, 1.0, 2.0, 0.5]), np.array([0.0, 2.0, 4.0, 0.25])
    series = LaplaceSeries(sens, scales)  # a zero scale with zero sensitivity costs nothing
    assert np.array_equal(BASIC.epsilon_curve(series), np.cumsum([0.0, 0.5, 0.5, 2.0]))
    assert BASIC.epsilon(series) == BASIC.epsilon(series.releases()) == 3.0
    assert BASIC.epsilon(LaplaceRelease(1.0, 0.0)) == math.inf  # no noise: no guarantee
    assert BASIC.epsilon(LaplaceRelease(0.0, 0.0)) == 0.0
    # calibration: ε ∝ 1/scale
    factor = BASIC.scale_for(series, 1.5)
    scaled = LaplaceSeries(sens, scales * factor)
    assert BASIC.epsilon(scaled) == pytest.approx(1.5, rel=1e-15)


@pytest.mark.parametrize("releases", [[(1.0, 1.0), (0.5, 2.0)], [(0.3, 0.2), (2.0, 1.0)]])
def test_composed_laplace_against_a_brute_force_privacy_loss_integral(releases: list) -> None:
    eps = BASIC.epsilon(Composed(tuple(LaplaceRelease(d, b) for d, b in releases)))
    assert eps == pytest.approx(sum(d / b for d, b in releases), rel=1e-15)
    assert laplace_pld_delta(eps, releases) < 1e-12  # the loss never exceeds the sum…
    assert laplace_pld_delta(eps - 0.05, releases) > 1e-4  # …and reaches it: tight at δ = 0
    # one release alone: the known closed form δ(ε) = 1 − e^{(ε − ε₀)/2} on the same grid
    d, b = releases[0]
    e0 = d / b
    one = laplace_pld_delta(e0 / 2, [(d, b), (0.0, 1.0)])
    assert one == pytest.approx(1 - math.exp((e0 / 2 - e0) / 2), rel=1e-3)


def test_per_datum_recursion_equals_its_cases_by_brute_force() -> None:
    rng = np.random.default_rng(7)
    for contraction in (rng.uniform(0.2, 1.3, 12), np.zeros(12)):
        event = PerDatumLaplace(rng.uniform(0, 2, 12), contraction, rng.uniform(0.5, 3, 12))
        brute = max(sum(event.entry[k] * math.prod(contraction[k + 1 : t]) / event.scales[t]
                        for t in range(k + 1, 12)) for k in range(11))
        assert BASIC.epsilon(event) == pytest.approx(brute, rel=1e-13)
        assert BASIC.epsilon(event.cases()) == pytest.approx(brute, rel=1e-13)
    # a release without noise that a datum reaches: ∞; one that none reaches: free
    free = PerDatumLaplace([1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 2.0])
    assert BASIC.epsilon(free) == 1.0
    assert BASIC.epsilon(PerDatumLaplace([1.0, 1.0], [0.0, 0.0], [1.0, 0.0])) == math.inf
    assert BASIC.epsilon(PerDatumLaplace([1.0], [0.0], [1.0])) == 0.0


def test_bad_descriptions_and_unsupported_events_are_refused() -> None:
    with pytest.raises(PrivacyBudgetError, match="noise std"):
        GaussianRelease(1.0, 0.0)
    with pytest.raises(PrivacyBudgetError, match="sensitivity"):
        GaussianRelease(-1.0, 1.0)
    with pytest.raises(PrivacyBudgetError, match="same length"):
        LaplaceSeries([1.0, 2.0], [1.0])
    with pytest.raises(PrivacyBudgetError, match="ℓ1 sensitivities"):
        LaplaceSeries([np.nan], [1.0])
    with pytest.raises(PrivacyBudgetError, match="count"):
        SelfComposed(LaplaceRelease(1.0, 1.0), -1)
    with pytest.raises(TypeError):
        Composed((1.0,))  # type: ignore[arg-type]
    with pytest.raises(UnsupportedEventError, match="Gaussian"):
        BASIC.epsilon(Composed((LaplaceRelease(1.0, 1.0), GaussianRelease(1.0, 1.0))))
    with pytest.raises(UnsupportedEventError):
        EXACT.epsilon(LaplaceRelease(1.0, 1.0), 1e-5)
    assert not BASIC.supports(GaussianRelease(1.0, 1.0))
    assert not ZCDP.supports(LaplaceSeries([1.0], [1.0]))
    assert EXACT.supports(SelfComposed(GaussianRelease(1.0, 1.0), 3))


# -- the factorization describes its release ------------------------------------------------
@pytest.mark.parametrize("name", ["independent", "tree", "toeplitz"])
def test_factorization_release_is_its_sensitivity_times_clip(name: str) -> None:
    fact = build_factorization(name, 16)
    _, C = fact.matrices()
    norms = np.linalg.norm(C, axis=0)  # materialized C: an independent column-norm maximum
    release = fact.release(0.7, 3.0)
    assert release.l2_sensitivity == pytest.approx(2 * 0.7 * norms.max(), rel=1e-12)
    assert release.std == 3.0
    for k in (1, 5, 16):
        prefix = fact.release(0.7, 3.0, steps=k)
        assert prefix.l2_sensitivity == 2 * 0.7 * fact.prefix_sensitivity(k)
        if C.shape[0] == 16:  # a square causal C: the rows drawn by step k are its first k
            assert prefix.l2_sensitivity == pytest.approx(
                2 * 0.7 * np.linalg.norm(C[:k], axis=0).max(), rel=1e-12)
    # privacy.py reports exactly what the accountant computes from that description
    cal = calibrate_mechanism(2.0, 1e-5, 0.7, name, 16)
    assert cal.release == GaussianRelease(cal.l2_sensitivity, cal.std)
    assert cal.l2_sensitivity == fact.release(0.7, cal.std).l2_sensitivity
    assert EXACT.delta(cal.release, 2.0) <= 1e-5
    for k in (1, 5, 16):
        spent = epsilon_spent(cal.std, 1e-5, 0.7, name, 16, k)
        assert spent == EXACT.epsilon(fact.release(0.7, cal.std, steps=k), 1e-5)
    assert epsilon_spent(cal.std, 1e-5, 0.7, name, 16, 16) == pytest.approx(2.0, rel=1e-9)


def test_privacy_functions_are_the_accountants() -> None:
    for method, acc in GAUSSIAN_ACCOUNTANTS.items():
        cal = calibrate(1.0, 1e-6, 0.5, 3.0, method)  # type: ignore[arg-type]
        assert cal.std == acc.noise_std(2 * 0.5 * 3.0, 1.0, 1e-6)
        assert epsilon_for_std(cal.std, 1e-6, 0.5, 3.0, method) == acc.epsilon(  # type: ignore[arg-type]
            GaussianRelease(3.0, cal.std), 1e-6)


# -- decentralized accountants: unchanged --------------------------------------------------
# Reference values produced by HEAD at commit 61f5d10 (before the accounting package), with
# the same calls; the accountants now compose through flwr_corrnoise.accounting.
S = StepSizes(1.0, 0.77, 1.0, 0.65)
HEAD_CHEN_WANG = {  # T = 2000, d = 112, C = 2, L = 0.26, ϱ_t = (t+1)^0.11: ε after 10, 500, 2000
    cp.TIGHT: [138.59604605020976, 407.2068658147395, 423.83709145252016],
    cp.THM5: [251.6762491029021, 7544.201766605225, 20790.47379608825],
    cp.CONTRACTIVE: [102.41456244221234, 225.36488111954046, 237.5428848827486],
}
HEAD_ALGOS = {  # build_from_config ring of 5, T = 60, dim 4, seed 3, default privacy
    "chen-wang": {cp.TIGHT: [59.42015660154394, 53.846177762977334],
                  cp.THM5: [274.2030450762007, 242.0678647475741],
                  cp.CONTRACTIVE: [35.75885659179764, 32.72858624272224]},
    "dsgd": {cp.PER_STEP: [22.791627381705403, 20.860355755831975],
             cp.PER_DATUM: [7.435059150867844, 7.142578926615584]},
    "dola": {cp.PER_STEP: [365.4058477177324] * 2, cp.PER_DATUM: [8.927239610113638] * 2},
    "pdop": {cp.PER_STEP: [181.59938992646823] * 2, cp.PER_DATUM: [4.081632653061225] * 2},
}


@pytest.mark.parametrize("label", list(HEAD_CHEN_WANG))
def test_chen_wang_epsilon_unchanged(label: str) -> None:
    eps = cp.chen_wang_epsilon(2000, S, w_self=0.6, L=0.26, C=2.0, dim=112, noise_scale=1.0,
                               exponent=0.11, accountant=label, mu=0.01)
    np.testing.assert_allclose(eps[[9, 499, 1999]], HEAD_CHEN_WANG[label], rtol=1e-12, atol=0)
    scale = cp.noise_scale_for_epsilon(5.0, 2000, S, w_self=0.6, L=0.26, C=2.0, dim=112,
                                       exponent=0.11, accountant=label, mu=0.01)
    assert scale == pytest.approx(HEAD_CHEN_WANG[label][2] / 5.0, rel=1e-12)


def test_tight_documented_value() -> None:
    """docs/decentralized.md: d = 112, C = 2, L = 0.26, ϱ = (t+1)^0.11 → 424 at T = 2000,
    by eq. (22) and Lemma 2 written out here."""
    phi, total = 0.0, 0.0
    for t in range(2000):
        total += math.sqrt(112) * phi / (t + 1.0) ** 0.11
        lam, gam = (t + 1.0) ** -0.77, (t + 1.0) ** -0.65
        phi = (abs(1 - 0.6 * gam) + 0.26 * lam) * phi + lam * 2.0 / (t + 1)
    eps = cp.chen_wang_epsilon(2000, S, w_self=0.6, L=0.26, C=2.0, dim=112, noise_scale=1.0,
                               exponent=0.11)[-1]
    assert eps == pytest.approx(total, rel=1e-12)
    assert round(eps) == 424


@pytest.mark.parametrize("algorithm", list(HEAD_ALGOS))
def test_algorithm_epsilons_unchanged(algorithm: str) -> None:
    cfg = {"algorithm": algorithm, "graph": "ring", "num-nodes": 5, "steps": 60, "dim": 4,
           "seed": 3}
    _, algo = build_from_config(cfg)
    state = algo.init(np.arange(5), 0, algo.default_privacy(np.arange(5)))
    eps = algo.epsilon(state, 60)
    assert set(eps) == set(HEAD_ALGOS[algorithm])
    for label, (first, last) in HEAD_ALGOS[algorithm].items():
        np.testing.assert_allclose(eps[label][[0, -1]], [first, last], rtol=1e-12, atol=0)
    assert all(np.all(v == 0) for v in algo.epsilon(state, 0).values())


def test_baseline_accountants_against_closed_forms() -> None:
    T, C, d = 40, 2.0, 4
    t = np.arange(T)
    lam, sc = (t + 1.0) ** -0.77, (t + 1.0) ** 0.1
    a = 0.4 + 0.26 * lam
    per_step = sum(math.sqrt(d) * lam[s - 1] * C / sc[s] for s in range(1, T))
    assert cp.baseline_epsilon_per_step(lam, sc, C, d)[-1] == pytest.approx(per_step, rel=1e-13)
    per_datum = max(sum(math.sqrt(d) * C * lam[k] * math.prod(a[k + 1 : s]) / sc[s]
                        for s in range(k + 1, T)) for k in range(T - 1))
    assert cp.baseline_epsilon_per_datum(lam, a, sc, C, d) == pytest.approx(per_datum,
                                                                             rel=1e-13)
    # HEAD at 61f5d10, T = 500 (DSGD's contraction; DOLA's released-only mixing)
    t = np.arange(500)
    lam, sc = (t + 1.0) ** -0.77, (t + 1.0) ** 0.1
    assert cp.baseline_epsilon_per_step(lam, sc, 2.0, 4)[-1] == pytest.approx(
        39.973434106874464, rel=1e-12)
    assert cp.baseline_epsilon_per_datum(lam, 0.4 + 0.26 * lam, sc, 2.0, 4) == pytest.approx(
        7.569872825513945, rel=1e-12)
    assert cp.baseline_epsilon_per_datum(0.1 / np.sqrt(t + 1.0), np.zeros(500),
                                         0.35 / (t + 1.0), 2.0, 4) == pytest.approx(
        25.58065605919116, rel=1e-12)


def test_wang_accountants_against_closed_forms_and_head() -> None:
    d, G, alpha, R, T = 10, 1.0, 0.1, 10.0, 1000
    paper = 6 * math.sqrt(d) * (G + alpha * R) * (2 + math.log2(T))
    assert wp.paper_epsilon(d, G, alpha, R, T, 2.0) == pytest.approx(paper / 2.0, rel=1e-15)
    assert wp.paper_scale(d, G, alpha, R, T, 1.5) == pytest.approx(paper / 1.5, rel=1e-15)
    assert wp.paper_epsilon(d, G, alpha, R, T, 2.0) == pytest.approx(227.03479397868475,
                                                                     rel=1e-12)  # HEAD
    P = mixing_matrix(ring(9))
    M = np.abs(gossip_polynomial(P, 5, 0.3))
    delta_tot = wp.exact_sensitivity(P, 5, 0.3, G, d)
    assert delta_tot == pytest.approx(2 * G * math.sqrt(d) * M.sum(axis=0).max(), rel=1e-15)
    levels = math.floor(math.log2(99)) + 1  # a leaf of a 99-leaf tree: 7 nodes
    assert wp.exact_epsilon(delta_tot, 99, 2.0) == pytest.approx(levels * delta_tot / 2.0,
                                                                  rel=1e-15)
    assert wp.exact_epsilon(delta_tot, 99, wp.exact_scale(delta_tot, 99, 1.5)) == 1.5
    b = np.linspace(1.0, 3.0, 9)
    net = wp.network_epsilon(P, 5, 0.3, G, d, 99, b)
    ref = [levels * 2 * G * math.sqrt(d) * sum(M[i, j] / b[i] for i in range(9))
           for j in range(9)]
    np.testing.assert_allclose(net, ref, rtol=1e-13, atol=0)
    np.testing.assert_allclose(net[[0, 4, 8]], [28.139946721289565, 23.23213610656892,
                                                25.027315774574593], rtol=1e-12)  # HEAD
    a = 2.0 / np.sqrt(np.arange(300) + 1.0)
    mu = 2 * a * 0.5 * math.sqrt(10) * 300 / 4.0  # the paper's calibration for ε = 4
    ogd = wp.ogd_epsilon(a, mu, 0.5, 10)
    assert ogd[wp.OGD_COMPOSITION] == pytest.approx(4.0, rel=1e-12)
    assert ogd[wp.OGD_PER_DATUM] == pytest.approx(4.0 / 300, rel=1e-12)
    assert wp.ogd_epsilon([], [], 0.5, 10) == {wp.OGD_COMPOSITION: 0.0, wp.OGD_PER_DATUM: 0.0}


@pytest.mark.parametrize(("algorithm", "over", "head"), [
    ("pd-ftgl", {}, {wp.PAPER: [1.0, 4.0],
                     wp.EXACT: [0.15186115333086322, 0.6074446133234529],
                     wp.NETWORK: [0.3202874966763528, 0.18269955729183845]}),
    ("pd-ftgl", {"calibration": "exact"}, {wp.PAPER: [6.584962500721156, 26.339850002884624],
                                          wp.EXACT: [1.0, 4.0],
                                          wp.NETWORK: [2.1090811550636355,
                                                       1.2030697336651128]}),
    ("pd-ogd", {}, {wp.OGD_COMPOSITION: [0.9583333333333331, 3.8333333333333326],
                    wp.OGD_PER_DATUM: [0.04166666666666667, 0.16666666666666669]}),
])
def test_wang_algorithm_epsilons_unchanged(algorithm: str, over: dict, head: dict) -> None:
    """HEAD at 61f5d10: learners' own ε = (1, 2, 0.5, 4); first and last learner."""
    cfg = {"graph": "ring", "num-nodes": 4, "steps": 24, "task": "synthetic-multiclass",
           "dim": 3, "classes": 3, "samples": 200, "clip": 0.5, "block-length": 4,
           "gossip-steps": 3, "h-scale": 0.02, "seed": 5, "set-size": 2.0,
           "algorithm": algorithm, **over}
    _, algo = build_from_config(cfg)
    state = algo.init(np.arange(4), 0, {"epsilon": np.array([1.0, 2.0, 0.5, 4.0])})
    eps = algo.epsilon(state, 24)
    assert set(eps) == set(head)
    for label, values in head.items():
        np.testing.assert_allclose(eps[label][[0, -1]], values, rtol=1e-12, atol=0)


# -- structure: descriptions in, no algorithm object; the accounting package stands alone ----
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_accountants_do_not_import_the_algorithms() -> None:
    dec = ROOT / "flwr_corrnoise" / "decentralized"
    for module, algos in (("chen_wang_privacy.py", ("chen_wang", "baselines")),
                          ("wang_privacy.py", ("wang", "chen_wang", "baselines"))):
        names = _imports(dec / module)
        for algo in algos:
            assert not any(n.split(".")[-1] == algo or f".{algo}." in n
                           or n.endswith(f"decentralized.{algo}") for n in names), (module, algo)


def test_accounting_package_needs_no_flower_torch_or_mechanisms() -> None:
    for path in (ROOT / "flwr_corrnoise" / "accounting").glob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("flwr", "torch", "..")), (path.name, name)
            assert "mechanisms" not in name and "decentralized" not in name, (path.name, name)
