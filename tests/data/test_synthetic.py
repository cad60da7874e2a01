"""Tests of the synthetic(α, β) online streams (flwr_corrnoise.data.synthetic)."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

from flwr_corrnoise.data import BLOCK_SIZE, SyntheticConfig, SyntheticFederation
from flwr_corrnoise.metrics import accuracy, fit_logistic

SMALL = SyntheticConfig(num_learners=4, dim=12, seed=7)


def test_config_defaults_match_paper_000() -> None:
    cfg = SyntheticConfig()
    assert (cfg.num_learners, cfg.dim, cfg.alpha, cfg.beta) == (20, 100, 0.1, 0.1)
    assert cfg.drift == 0.0 and cfg.label_noise == 0.0 and cfg.seed == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_learners": 0},
        {"dim": 0},
        {"dim": 2.5},
        {"alpha": -0.1},
        {"beta": float("nan")},
        {"label_noise": 0.6},
        {"label_noise": -0.1},
        {"drift": float("inf")},
        {"seed": -1},
        {"shared_scale": -1.0},
    ],
)
def test_config_rejects_invalid(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SyntheticConfig(**kwargs)


def test_shapes_and_label_values() -> None:
    fed = SyntheticFederation(SMALL)
    assert fed.num_learners == 4 and fed.dim == 12
    a, y = fed.learner_batch(2, 5, 300)
    assert a.shape == (300, 12) and y.shape == (300,)
    assert set(np.unique(y)) <= {-1.0, 1.0}
    a0, y0 = fed.learner_batch(0, 3, 0)
    assert a0.shape == (0, 12) and y0.shape == (0,)
    with pytest.raises(ValueError):
        fed.learner_batch(4, 0, 1)
    with pytest.raises(ValueError):
        fed.learner_batch(0, -1, 1)


def test_random_access_is_independent_of_chunking() -> None:
    """The datum at a position never depends on how it was requested (state restore)."""
    total = 3 * BLOCK_SIZE + 17
    ref_x, ref_y = SyntheticFederation(SMALL).learner_batch(1, 0, total)

    fed = SyntheticFederation(SMALL, cache_blocks=1)  # force regeneration
    rng = np.random.default_rng(0)
    xs, ys, pos = [], [], 0
    while pos < total:
        count = int(min(rng.integers(1, 50), total - pos))
        a, y = fed.learner_batch(1, pos, count)
        xs.append(a)
        ys.append(y)
        pos += count
    np.testing.assert_array_equal(np.concatenate(xs), ref_x)
    np.testing.assert_array_equal(np.concatenate(ys), ref_y)

    # Single positions, out of order, interleaved with another learner, fresh object.
    fresh = SyntheticFederation(SMALL)
    for p in rng.permutation(total)[:60]:
        fresh.learner_batch(3, int(p), 2)
        a, y = fresh.learner_batch(1, int(p), 1)
        np.testing.assert_array_equal(a[0], ref_x[p])
        assert y[0] == ref_y[p]


def test_returned_arrays_do_not_alias_the_cache() -> None:
    fed = SyntheticFederation(SMALL)
    a, y = fed.learner_batch(0, 0, 4)
    a[:] = 0.0
    y[:] = 0.0
    a2, y2 = fed.learner_batch(0, 0, 4)
    assert np.all(a2 != 0.0) and np.all(np.abs(y2) == 1.0)


def test_deterministic_across_instances_pickling_and_learner_count() -> None:
    fed = SyntheticFederation(SMALL)
    a, y = fed.learner_batch(2, 1000, 10)
    clone = pickle.loads(pickle.dumps(fed))
    a2, y2 = clone.learner_batch(2, 1000, 10)
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(y, y2)
    # Adding learners does not change the existing learners' streams.
    bigger = SyntheticFederation(SyntheticConfig(num_learners=9, dim=12, seed=7))
    a3, y3 = bigger.learner_batch(2, 1000, 10)
    np.testing.assert_array_equal(a, a3)
    np.testing.assert_array_equal(y, y3)


def test_streams_differ_across_learners_seeds_and_positions() -> None:
    fed = SyntheticFederation(SMALL)
    other = SyntheticFederation(SyntheticConfig(num_learners=4, dim=12, seed=8))
    a0, _ = fed.learner_batch(0, 0, 5)
    assert not np.allclose(a0, fed.learner_batch(1, 0, 5)[0])
    assert not np.allclose(a0, fed.learner_batch(0, 5, 5)[0])
    assert not np.allclose(a0, other.learner_batch(0, 0, 5)[0])


def test_features_follow_fedprox_distribution() -> None:
    """x − v_i ~ N(0, diag(j^−1.2)): check the per-coordinate means and variances."""
    fed = SyntheticFederation(SyntheticConfig(num_learners=2, dim=8, seed=3))
    a, _ = fed.learner_batch(1, 0, 20_000)
    centred = a - fed.feature_means[1]
    np.testing.assert_allclose(centred.mean(axis=0), 0.0, atol=0.03)
    np.testing.assert_allclose(centred.var(axis=0), np.arange(1, 9) ** -1.2, rtol=0.05)


def test_labels_follow_the_centred_rule() -> None:
    fed = SyntheticFederation(SMALL)
    a, y = fed.learner_batch(3, 0, 500)
    margin = (a - fed.feature_means[3]) @ fed.true_models()[3] + fed.biases[3]
    np.testing.assert_array_equal(y, np.where(margin >= 0, 1.0, -1.0))


def test_labels_are_roughly_balanced_per_learner() -> None:
    for seed in range(3):
        fed = SyntheticFederation(SyntheticConfig(seed=seed))
        fractions = np.array(
            [np.mean(fed.learner_batch(i, 0, 2000)[1] > 0) for i in range(fed.num_learners)]
        )
        assert np.all((fractions > 0.1) & (fractions < 0.9)), fractions
        assert 0.4 < fractions.mean() < 0.6


def test_naive_fedprox_labels_are_nearly_constant() -> None:
    """The failure the adaptation fixes: uncentred labels are (almost) constant per learner."""
    fed = SyntheticFederation(SyntheticConfig(shared_scale=0.0, centered=False))
    fractions = np.array(
        [np.mean(fed.learner_batch(i, 0, 2000)[1] > 0) for i in range(fed.num_learners)]
    )
    assert np.mean((fractions < 0.1) | (fractions > 0.9)) > 0.5


def test_heterogeneity_grows_with_beta() -> None:
    """β spreads the learners' feature means: the spread of mean_j v_i[j] is ≈ β + 1/d."""

    def spread(beta: float) -> float:
        values = []
        for seed in range(5):
            fed = SyntheticFederation(SyntheticConfig(beta=beta, seed=seed))
            values.append(np.var(fed.feature_means.mean(axis=1)))
        return float(np.mean(values))

    low, mid, high = spread(0.0), spread(0.1), spread(1.0)
    assert low < mid < high
    assert low < 0.03 and 0.5 < high < 1.5

    def mean_distance(beta: float) -> float:
        v = SyntheticFederation(SyntheticConfig(beta=beta, seed=1)).feature_means
        return float(np.mean(np.linalg.norm(v[:, None] - v[None], axis=-1)))

    assert mean_distance(0.0) < mean_distance(4.0)


def test_heterogeneity_grows_with_alpha() -> None:
    """α spreads the learners' model means u_i: the spread of mean_j w_i[j] is ≈ α + 1/d."""

    def spread(alpha: float) -> float:
        values = []
        for seed in range(5):
            fed = SyntheticFederation(SyntheticConfig(alpha=alpha, seed=seed))
            values.append(np.var(fed.true_models().mean(axis=1)))
        return float(np.mean(values))

    low, high = spread(0.0), spread(1.0)
    assert low < 0.03 and 0.5 < high < 1.5

    def bias_spread(alpha: float) -> float:
        return float(
            np.mean(
                [
                    np.var(SyntheticFederation(SyntheticConfig(alpha=alpha, seed=s)).biases)
                    for s in range(5)
                ]
            )
        )

    assert bias_spread(0.0) < bias_spread(4.0)


def test_shared_component_makes_a_global_model_informative() -> None:
    """Best global model: well above the majority predictor, clearly below 100 %."""
    cfg = SyntheticConfig(num_learners=8, dim=20, seed=2)
    fed = SyntheticFederation(cfg)
    batches = [fed.learner_batch(i, 0, 1000) for i in range(cfg.num_learners)]
    a = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    x = fit_logistic(a, y, l2=1e-3, gtol=1e-6)
    test_a, test_y = fed.test_set(4000)
    acc = accuracy(x, test_a, test_y)
    majority = max(np.mean(test_y > 0), np.mean(test_y < 0))
    assert majority < 0.6
    assert majority + 0.15 < acc < 0.95


def test_test_set_is_deterministic_prefix_consistent_and_held_out() -> None:
    fed = SyntheticFederation(SMALL)
    a, y = fed.test_set(300)
    a2, y2 = SyntheticFederation(SMALL).test_set(1000)
    np.testing.assert_array_equal(a, a2[:300])
    np.testing.assert_array_equal(y, y2[:300])
    assert set(np.unique(y)) <= {-1.0, 1.0}
    a[:] = 0.0  # the returned arrays do not alias the cached test features
    a3, y3 = fed.test_set(300)
    np.testing.assert_array_equal(a3, a2[:300])
    np.testing.assert_array_equal(y3, y2[:300])
    a = a3
    # Point j comes from learner j mod n: its centred features are small noise.
    means = fed.feature_means
    j = np.arange(300)
    own = np.linalg.norm(a - means[j % 4], axis=1)
    other = np.linalg.norm(a - means[(j + 1) % 4], axis=1)
    assert np.all(own < other)
    # Not a copy of any learner's training stream.
    train = np.concatenate([fed.learner_batch(i, 0, 300)[0] for i in range(4)])
    assert not np.any(np.all(np.isclose(a[:, None, :], train[None, :, :]), axis=-1))


def test_label_noise_flips_about_that_fraction() -> None:
    clean = SyntheticFederation(SyntheticConfig(num_learners=2, dim=10, seed=4))
    noisy = SyntheticFederation(SyntheticConfig(num_learners=2, dim=10, seed=4, label_noise=0.2))
    a, y = clean.learner_batch(0, 0, 5000)
    a2, y2 = noisy.learner_batch(0, 0, 5000)
    np.testing.assert_array_equal(a, a2)  # label noise changes labels only
    assert 0.18 < np.mean(y != y2) < 0.22
    _, ty = clean.test_set(5000)
    _, ty2 = noisy.test_set(5000)
    assert 0.18 < np.mean(ty != ty2) < 0.22


def test_no_drift_is_static() -> None:
    fed = SyntheticFederation(SMALL)
    np.testing.assert_array_equal(fed.true_models(0), fed.true_models(10_000))
    a, y = fed.test_set(200, position=0)
    a2, y2 = fed.test_set(200, position=7_777)
    np.testing.assert_array_equal(a, a2)
    np.testing.assert_array_equal(y, y2)


def test_drift_rotates_every_model_by_drift_times_position() -> None:
    drift = 1e-3
    fed = SyntheticFederation(SyntheticConfig(num_learners=3, dim=10, seed=5, drift=drift))
    w0 = fed.true_models(0)
    for p in (0, 100, 1000, 2500):
        wp = fed.true_models(p)
        np.testing.assert_allclose(np.linalg.norm(wp, axis=1), np.linalg.norm(w0, axis=1))
        cos = np.sum(w0 * wp, axis=1) / np.linalg.norm(w0, axis=1) ** 2
        np.testing.assert_allclose(cos, np.cos(drift * p), atol=1e-12)
    # Odd d: norms are kept and the rotating part still turns by drift·p.
    odd = SyntheticFederation(SyntheticConfig(num_learners=3, dim=9, seed=5, drift=drift))
    np.testing.assert_allclose(
        np.linalg.norm(odd.true_models(3000), axis=1), np.linalg.norm(odd.true_models(0), axis=1)
    )
    axis = np.linalg.svd(odd._rot_k)[2][-1]  # the direction K leaves fixed
    w0, wp = odd.true_models(0), odd.true_models(3000)
    np.testing.assert_allclose(w0 @ axis, wp @ axis)
    r0, rp = w0 - np.outer(w0 @ axis, axis), wp - np.outer(wp @ axis, axis)
    cos = np.sum(r0 * rp, axis=1) / np.linalg.norm(r0, axis=1) ** 2
    np.testing.assert_allclose(cos, np.cos(drift * 3000), atol=1e-10)
    # The test set at a later position: same features, labels from the rotated models.
    fresh = SyntheticFederation(SyntheticConfig(num_learners=3, dim=10, seed=5, drift=drift))
    ta0, ty0 = fed.test_set(600, position=0)
    ta1, ty1 = fed.test_set(600, position=2000)
    fa1, fy1 = fresh.test_set(600, position=2000)
    np.testing.assert_array_equal(ta0, ta1)
    np.testing.assert_array_equal(ta1, fa1)
    np.testing.assert_array_equal(ty1, fy1)
    assert np.mean(ty0 != ty1) > 0.1
    j = np.arange(600) % 3
    margin = (
        np.einsum("ij,ij->i", ta1 - fed.feature_means[j], fed.true_models(2000)[j]) + fed.biases[j]
    )
    np.testing.assert_array_equal(ty1, np.where(margin >= 0, 1.0, -1.0))
    # The stream's labels use the model at the datum's own position.
    a, y = fed.learner_batch(1, 2000, 300)
    for k in (0, 150, 299):
        margin = (a[k] - fed.feature_means[1]) @ fed.true_models(2000 + k)[1] + fed.biases[1]
        assert y[k] == (1.0 if margin >= 0 else -1.0)


def test_drift_moves_the_optimal_global_model() -> None:
    def optimum(drift: float, position: int) -> np.ndarray:
        fed = SyntheticFederation(SyntheticConfig(num_learners=4, dim=10, seed=6, drift=drift))
        a, y = fed.test_set(3000, position=position)
        return fit_logistic(a, y, l2=1e-3, gtol=1e-8)

    def cosine(u: np.ndarray, v: np.ndarray) -> float:
        return float(u @ v / np.linalg.norm(u) / np.linalg.norm(v))

    np.testing.assert_allclose(optimum(0.0, 0), optimum(0.0, 3000))
    assert cosine(optimum(5e-4, 0), optimum(5e-4, 3000)) < 0.8
    # Small drift over a short time: the optimum moves only a little.
    assert cosine(optimum(5e-4, 0), optimum(5e-4, 100)) > 0.9


def test_reading_a_few_points_is_fast() -> None:
    fed = SyntheticFederation()
    fed.learner_batch(0, 0, 4)  # warm-up (imports, first block)
    calls = 0
    start = time.perf_counter()
    for pos in range(0, 400, 4):
        for learner in range(fed.num_learners):
            fed.learner_batch(learner, pos, 4)
            calls += 1
    per_call = (time.perf_counter() - start) / calls
    assert per_call < 1e-3, per_call
