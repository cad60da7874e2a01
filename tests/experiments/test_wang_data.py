"""Wang, Yang, Yao, Song & Wan's ("Revisiting Differentially Private Algorithms for Decentralized
Online Learning") data: letter and poker loaders on tiny files, the exact poker synthesizer, the
multiclass task."""

from itertools import combinations

import numpy as np
import pytest
from scipy import stats

from experiments.data.letter import load_letter, scale_features
from experiments.data.poker import (
    CLASS_COUNTS,
    classify_hands,
    load_poker,
    synthesize_poker,
)
from flwr_corrnoise.data.libsvm import write_libsvm
from flwr_corrnoise.decentralized.multiclass import MulticlassTask


def test_classifier_counts_every_hand_exactly():
    cards = np.fromiter((c for hand in combinations(range(52), 5) for c in hand),
                        dtype=np.int64).reshape(-1, 5)
    counts = np.bincount(classify_hands(cards // 13 + 1, cards % 13 + 1), minlength=10)
    np.testing.assert_array_equal(counts, CLASS_COUNTS)
    assert CLASS_COUNTS.sum() == 2598960


def test_classifier_examples():
    hands = {  # (suits, ranks) → class
        ((1, 1, 1, 1, 1), (1, 10, 11, 12, 13)): 9,
        ((2, 2, 2, 2, 2), (9, 10, 11, 12, 13)): 8,
        ((1, 2, 3, 4, 1), (5, 5, 5, 5, 2)): 7,
        ((1, 2, 3, 4, 1), (5, 5, 5, 2, 2)): 6,
        ((3, 3, 3, 3, 3), (1, 4, 7, 9, 12)): 5,
        ((1, 2, 3, 4, 1), (1, 2, 3, 4, 5)): 4,
        ((1, 2, 3, 4, 1), (10, 11, 12, 13, 1)): 4,
        ((1, 2, 3, 4, 1), (11, 12, 13, 1, 2)): 0,  # no wrap-around straights
        ((1, 2, 3, 4, 1), (7, 7, 7, 2, 3)): 3,
        ((1, 2, 3, 4, 1), (7, 7, 2, 2, 3)): 2,
        ((1, 2, 3, 4, 1), (7, 7, 2, 4, 3)): 1,
    }
    s = np.array([k[0] for k in hands])
    r = np.array([k[1] for k in hands])
    np.testing.assert_array_equal(classify_hands(s, r), list(hands.values()))


def test_synthesizer_frequencies_match_exact_probabilities():
    X, y = synthesize_poker(60000, seed=3)
    assert X.shape == (60000, 10)
    suits, ranks = X[:, 0::2].astype(int), X[:, 1::2].astype(int)
    cards = (suits - 1) * 13 + ranks - 1
    assert np.all(np.sort(cards, axis=1)[:, 1:] != np.sort(cards, axis=1)[:, :-1])  # distinct
    p = CLASS_COUNTS / CLASS_COUNTS.sum()
    obs = np.bincount(y, minlength=10)
    # merge the rare classes 4..9 so every expected count is large
    o = np.r_[obs[:4], obs[4:].sum()]
    e = np.r_[p[:4], p[4:].sum()] * len(y)
    assert stats.chisquare(o, e).pvalue > 1e-3
    # the test can fail: a biased sampler (one card always present) is rejected
    biased = np.r_[o[0] * 0.9, o[1] * 1.1, o[2:]]
    assert stats.chisquare(biased, biased.sum() * e / e.sum()).pvalue < 1e-6


def test_poker_loaders(tmp_path):
    X, y = synthesize_poker(30, seed=1)
    svm = tmp_path / "poker"
    write_libsvm(svm, X, y)
    X2, y2, src = load_poker(svm)
    np.testing.assert_array_equal(X2, X)
    np.testing.assert_array_equal(y2, y)
    assert "LIBSVM" in src
    csv = tmp_path / "poker-hand-testing.data"
    csv.write_text("\n".join(",".join(str(int(v)) for v in [*row, lab])
                             for row, lab in zip(X, y, strict=True)))
    X3, _y3, src3 = load_poker(csv)
    np.testing.assert_array_equal(X3, X)
    assert "UCI" in src3
    _, _, src4 = load_poker(None, num=10)
    assert "stand-in" in src4
    bad = tmp_path / "bad"
    bad.write_text("1,14,1,2,1,3,1,4,1,5,0\n")
    with pytest.raises(ValueError, match="ranks"):
        load_poker(bad)


def test_letter_loaders(tmp_path):
    raw = np.array([[2, 8, 3, 5, 1, 8, 13, 0, 6, 6, 10, 8, 0, 8, 0, 8],
                    [15, 0, 7, 7, 2, 8, 7, 7, 5, 6, 6, 7, 3, 8, 4, 10]])
    uci = tmp_path / "letter-recognition.data"
    uci.write_text("T," + ",".join(map(str, raw[0])) + "\nA," + ",".join(map(str, raw[1])) + "\n")
    X, y, src = load_letter(uci)
    np.testing.assert_array_equal(y, [19, 0])
    np.testing.assert_allclose(X, raw / 7.5 - 1)
    assert X.min() == -1 and X.max() == 1 and "UCI" in src
    svm = tmp_path / "letter.scale"
    write_libsvm(svm, X, y + 1)
    X2, y2, _ = load_letter(svm)
    np.testing.assert_allclose(X2, X)
    np.testing.assert_array_equal(y2, y)
    with pytest.raises(ValueError):
        scale_features(np.full((1, 16), 16.0))
    (tmp_path / "bad.data").write_text("1,2,3\n")
    with pytest.raises(ValueError, match="17"):
        load_letter(tmp_path / "bad.data")
    with pytest.raises(FileNotFoundError):
        load_letter(tmp_path / "missing")


def test_multiclass_task_gradient_and_streams():
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(12, 3))
    y = rng.integers(0, 4, size=12)
    task = MulticlassTask(X, y, num_nodes=3, copies=2, seed=1)
    assert task.horizon == 8 and task.dim == 12
    # every row appears `copies` times over all streams (copies shuffled and split evenly)
    np.testing.assert_array_equal(np.bincount(task.indices.ravel(), minlength=12), 2)
    theta = rng.normal(size=(3, 12))
    Xb, yb = task.batch(np.arange(3), 5)
    g = task.grad(theta, Xb, yb)
    # finite differences of the loss
    num = np.zeros_like(theta)
    for i in range(12):
        e = np.zeros(12)
        e[i] = 1e-6
        num[:, i] = (task.loss(theta + e, Xb, yb) - task.loss(theta - e, Xb, yb)) / 2e-6
    np.testing.assert_allclose(g, num, atol=1e-6)
    gc = task.grad(theta, Xb, yb, clip=0.1)
    assert np.all(np.linalg.norm(gc, axis=1) <= 0.1 + 1e-12)
    # the paper's form log(1 + Σ_{ℓ≠y} exp(x_ℓᵀe − x_yᵀe))
    W = theta[0].reshape(4, 3)
    s = W @ Xb[0, 0]
    direct = np.log1p(sum(np.exp(s[c] - s[yb[0, 0]]) for c in range(4) if c != yb[0, 0]))
    assert task.loss(theta[:1], Xb[:1], yb[:1])[0] == pytest.approx(direct)
    full = task.network_loss(theta, 5)
    manual = [np.mean([task.loss(theta[k:k + 1], Xb[j:j + 1], yb[j:j + 1])[0]
                       for j in range(3)]) for k in range(3)]
    np.testing.assert_allclose(full, manual)
    with pytest.raises(ValueError, match="horizon"):
        MulticlassTask(X, y, num_nodes=3, copies=1, horizon=10)
