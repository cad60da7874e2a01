"""docs/adopt.md's diffs, applied to plain Message-API apps (NumPy, PyTorch), run on Flower.

The plain apps (``tests/adoption/plain_app``: logistic regression, local SGD on a stream
kept in ``context.state``, FedAvg; ``plain_torch_app``: the same with ``torch.optim.SGD``)
and the diffs (``tests/adoption/*.diff``) are the files
docs/adopt.md shows verbatim. Each diff is applied with ``patch``, the result runs on
Flower's Ray simulation engine with the app's own run config, and must train privately
(not the noiseless model), report every learner's ε by partition id, and stay within the
changed-line budget. Misconfigurations end with a clear error, not an untrained model.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from flwr_corrnoise.flower import RunFailedError

from ..adoption import harness

ROOT = Path(__file__).resolve().parents[2]
#: changed lines (added + removed) each variant may take (issue 13)
BUDGET = {"per-step": 10, "per-round": 5, "central": 5, "per-step-torch": 10,
          # issue 21: the quickstart-pytorch-style app (a loader, per-example clipping)
          "quickstart-per-step": 17, "quickstart-per-round": 5, "quickstart-central": 3}

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def test_docs_show_the_tested_diffs_and_app_verbatim() -> None:
    doc = (ROOT / "docs" / "adopt.md").read_text()
    for variant in harness.VARIANTS + harness.QUICKSTART_VARIANTS:
        assert harness.diff_path(variant).read_text() in doc, variant
    for plain in (harness.PLAIN, harness.PLAIN_TORCH, harness.QUICKSTART):  # the patched apps
        assert (plain / "plain_app.py").read_text() in doc, plain


@pytest.mark.parametrize("variant", harness.VARIANTS + harness.QUICKSTART_VARIANTS)
def test_changed_line_budget(variant: str) -> None:
    added, removed = harness.changed_lines(harness.diff_path(variant).read_text())
    assert added >= 1
    assert added + removed <= BUDGET[variant], (variant, added, removed)


def noiseless_model(rounds: int, steps: int, lr: float, learners: int = 2) -> np.ndarray:
    """The plain app's model, computed directly: FedAvg of local SGD on each stream."""
    from ..adoption.plain_app.plain_app import TRUE_W, datum

    w = np.zeros(TRUE_W.size)
    for r in range(rounds):
        local = []
        for i in range(learners):
            z = w.copy()
            for t in range(steps):
                x, y = datum(i, r * steps + t)
                z = z - lr * (1 / (1 + np.exp(-x @ z)) - y) * x
            local.append(z)
        w = np.mean(local, axis=0)
    return w


@pytest.mark.slow
@pytest.mark.parametrize("variant", harness.VARIANTS)
def test_adopted_app_trains_privately_and_reports_privacy(variant: str, tmp_path: Path) -> None:
    if variant.endswith("-torch"):
        pytest.importorskip("torch")
    app = harness.adopt(variant, tmp_path / variant)
    module = harness.load(app, f"adopted_{variant.replace('-', '_')}")
    harness.simulate(app, module)
    result = module.RESULTS[-1]
    rounds = 3
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    spent = []
    for r in range(1, rounds + 1):
        metrics = dict(result.train_metrics_clientapp[r])
        per_learner = {k: v for k, v in metrics.items() if k.startswith("epsilon-spent.")}
        assert len(per_learner) == 2, metrics  # one entry per learner, not an average
        if variant != "central":  # local DP: keyed by partition id
            assert set(per_learner) == {"epsilon-spent.learner-0", "epsilon-spent.learner-1"}
        assert all(0 < v <= 2.0 + 1e-9 for v in per_learner.values())
        spent.append(max(per_learner.values()))
    assert spent == sorted(spent) and spent[-1] == pytest.approx(2.0)  # whole budget, used
    final = result.arrays.to_numpy_ndarrays()[0]
    assert np.all(np.isfinite(final))
    # private: the released model is not the noiseless one the plain app would produce
    # (the PyTorch app computes the same SGD in float32)
    plain = noiseless_model(rounds, 4, 0.2)
    assert np.linalg.norm(final - plain) > 1e-3
    assert set(result.evaluate_metrics_serverapp) == {0, 1, 2, 3}


@pytest.mark.slow
@pytest.mark.parametrize(("edit", "why"), [
    # docs' old server example: a horizon of 4000 while the learners' noise covers 12 steps
    ("context.run_config)", "horizon 4000 exceeds"),
    # the learners' keys left out: they default to 'blt', the server proposes 'toeplitz'
    ("{**context.run_config, 'mechanism': 'toeplitz'})", "switch to 'toeplitz'"),
])
def test_a_server_proposal_every_learner_refuses_fails_the_run(edit: str, why: str,
                                                               tmp_path: Path) -> None:
    app = harness.adopt("per-step", tmp_path / "app", {"max-idle-rounds": 1})
    src = app / "plain_app.py"
    text = src.read_text()
    if "4000" in why:
        edit = "context.run_config, privacy=PrivacySettings(horizon=4000))"
        text = text.replace("import numpy as np\n",
                            "import numpy as np\nfrom flwr_corrnoise.learner import "
                            "PrivacySettings\n")
    text = text.replace("FedAvg(fraction_evaluate=0.0), context.run_config)",
                        f"FedAvg(fraction_evaluate=0.0), {edit}")
    src.write_text(text)
    module = harness.load(app, f"refused_{abs(hash(why))}")
    with pytest.raises(RunFailedError, match=r"2 × code 4101") as info:
        harness.simulate(app, module)
    assert why in str(info.value)
    assert not module.RESULTS  # no "completed" run with an untrained model


@pytest.mark.slow
def test_central_dp_with_fewer_supernodes_than_min_learners_fails(tmp_path: Path) -> None:
    app = harness.adopt("central", tmp_path / "app", {"min-learners": 3, "connect-timeout": 2.0})
    module = harness.load(app, "central_too_few")
    with pytest.raises(RunFailedError, match=r"only 2 SuperNode\(s\).*min-learners = 3"):
        harness.simulate(app, module, num_supernodes=2)
    assert not module.RESULTS


@pytest.mark.slow
@pytest.mark.parametrize("variant", harness.QUICKSTART_VARIANTS)
def test_quickstart_style_app_reports_the_epsilon_of_its_data_reuse(
        variant: str, tmp_path: Path) -> None:
    """Issue 21 item 5: the app of Flower's quickstart-pytorch shape (a CNN, a fixed
    partition of 64 examples, 2 local epochs of batches of 16 per round, 3 rounds) adopted
    three ways. Each reports the ε of the multi-participation accounting: per step, the
    loader's 6 epochs of 4 steps (fixed cyclic order); per round and central, the
    ``data-reuse = "every-round"`` key (a datum in every round's update). The ε spent after
    each round is that accounting's prefix ε, not the one-pass stream's."""
    pytest.importorskip("torch")
    from flwr_corrnoise import CyclicLoader, Participation, PrivacySettings

    keys = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0}
    per_step = variant.endswith("per-step")
    if not per_step:
        keys["data-reuse"] = "every-round"
    app = harness.adopt(variant, tmp_path / variant, run_config=keys)
    module = harness.load(app, f"adopted_{variant.replace('-', '_')}")
    harness.simulate(app, module)
    result = module.RESULTS[-1]
    if per_step:
        loader = CyclicLoader(64, 16, rounds=3, local_epochs=2)
        horizon, unit, participation = loader.horizon, loader.local_steps, loader.participation
        assert participation == Participation.epochs(6, 4)
    else:
        horizon, unit, participation = 3, 1, Participation.every_step(3)
    common = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-5, "clip_norm": 1.0,
              "horizon": horizon}
    reused = PrivacySettings(**common, participation=participation)
    once = PrivacySettings(**common)
    for r in (1, 2, 3):
        metrics = dict(result.train_metrics_clientapp[r])
        spent = [v for k, v in metrics.items() if k.startswith("epsilon-spent.")]
        assert len(spent) == 2, metrics
        want = reused.epsilon_spent(r * unit)
        assert spent == pytest.approx([want] * 2, rel=1e-9)
        if r < 3:  # the one-pass accounting would report another (smaller) ε
            assert abs(once.epsilon_spent(r * unit) - want) > 1e-3
    assert reused.calibration().std > 1.5 * once.calibration().std
    assert set(result.evaluate_metrics_serverapp) == {0, 1, 2, 3}
