"""Chen & Wang, "Locally Differentially Private Distributed Online Learning with Guaranteed
Optimality", Table II's DLG attack (simulations/chen_wang_cnn.py --dlg, issue 24): the attacker's
gradient estimate from the shared messages is exact when the messages carry no noise (so the noised
rows measure the noise, not a wrong estimate), and the attack and its score behave."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_corrnoise.decentralized.engine import run  # noqa: E402
from simulations import chen_wang_cnn as sim  # noqa: E402


def _task(steps: int = 6) -> sim.CNNTask:
    rng = np.random.default_rng(0)
    n = 200
    y = np.arange(n) % 10
    x = rng.uniform(0, 0.2, (n, 28, 28)).astype(np.float32)
    x[np.arange(n), 2 * y, :] = 1.0
    return sim.CNNTask(x, y, sim.partition(y, 0), steps, 2, 0)


@pytest.mark.parametrize("name", ["chen-wang", "dsgd", "dola", "pdop"])
def test_noise_free_messages_reveal_the_exact_gradient(name: str) -> None:
    torch.set_num_threads(1)
    task = _task()
    algo = sim.build(name, task, argparse.Namespace())
    priv = sim.privacy(name, argparse.Namespace(noise_multiplier=0.0))
    res = run(algo, 4, 0, priv, keep_outboxes=True)
    ys = [o["y"] for o in res.outboxes]
    for t in (0, 2):
        for i in (0, 3):
            point, g_hat = sim.gradient_estimate(name, algo, ys, t, i)
            # independent: the true parameter and the gradient the node used, from the run
            theta_t = res.decisions[t][i]
            if name in ("dola", "pdop"):  # gradient at the mixed released values
                theta_t = sum(algo.A[i, j] * res.decisions[t][j] for j in range(5))
            ids = (task.history if name == "chen-wang" else task.batch)(np.array([i]), t)[0]
            want = task.grad(theta_t[None], ids, None)[0]
            assert np.allclose(point, theta_t, atol=1e-9)
            assert np.allclose(g_hat, want, atol=2e-4 * max(1.0, np.abs(want).max()))


def test_attack_and_score() -> None:
    torch.set_num_threads(1)
    task = _task()
    ids = task.batch_ids(np.array([0]), 0)[0]
    truth = task.images[ids, 0].numpy()
    labels = task.labels[ids].numpy()
    assert sim.inference_error(truth, truth, labels) == 0.0
    swapped = truth[::-1]
    same = labels[0] == labels[1]
    assert (sim.inference_error(swapped, truth, labels) == 0.0) == bool(same)
    theta0 = task.initial()
    g = task.grad(theta0[None], ids[None], None)[0]
    recon = sim.dlg_attack(task, theta0, g, labels, 30, seed=0)
    assert recon.shape == truth.shape and recon.min() >= 0 and recon.max() <= 1
    start = sim.dlg_attack(task, theta0, g, labels, 0, seed=0)
    # gradient matching moves toward the batch: better than its own random start
    assert sim.inference_error(recon, truth, labels) < sim.inference_error(start, truth, labels)
