"""The multi-epoch experiment (simulations/multi_epoch.py) at toy size, on IDX files the
test makes: its outputs, and every private method's ε checked against a second accountant
at the sensitivity a brute force over the participation patterns gives."""

from __future__ import annotations

import csv
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
# looked up, not imported: importing opacus costs ≈ 4 s of CPU, paid at collection by every
# xdist worker, while these tests run on one (the ones that use it import it themselves)
if importlib.util.find_spec("opacus") is None:
    pytest.skip("opacus is not installed", allow_module_level=True)
dpa = pytest.importorskip("dp_accounting")

from dp_accounting.pld.pld_privacy_accountant import PLDAccountant  # noqa: E402

from flwr_corrnoise.data.idx import FILES, write_idx  # noqa: E402
from flwr_corrnoise.data.loader import CyclicLoader  # noqa: E402
from flwr_corrnoise.mechanisms.participation import Participation  # noqa: E402
from flwr_corrnoise.settings import PrivacySettings  # noqa: E402
from simulations import multi_epoch  # noqa: E402

# slow, and on one xdist worker: the module fixture (the --quick run) is computed once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multi-epoch")]

COLUMNS = ["dataset", "method", "epsilon", "delta", "seed", "final_accuracy", "eta",
           "rounds", "local_epochs", "examples", "batch_size", "learners", "steps",
           "clip_norm", "accountant", "relation", "epsilon_reported", "epsilon_replace_one",
           "noise_std", "noise_multiplier", "sensitivity", "noise_rmse"]
EPSILON = 2.0


def learnable_idx_dir(directory: Path, n_train: int = 300, n_test: int = 200) -> None:
    """MNIST-shaped images a CNN can learn in a few steps: class ``c`` is a bright 5×5
    square in cell ``c`` of a 2×5 grid, on a dim noisy background."""
    g = np.random.default_rng(3)
    directory.mkdir(parents=True, exist_ok=True)

    def images(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = (np.arange(n) % 10).astype(np.uint8)
        x = g.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(y):
            r, k = 4 + 14 * (c // 5), 1 + 5 * (c % 5) + int(g.integers(0, 2))
            x[i, r:r + 5, k:k + 5] = 255
        return x, y

    (tx, ty), (ex, ey) = images(n_train), images(n_test)
    for key, arr in (("train_x", tx), ("train_y", ty), ("test_x", ex), ("test_y", ey)):
        write_idx(directory / (FILES[key] + ".gz"), arr)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[Path, list[dict[str, str]], list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("idx")
    learnable_idx_dir(root)
    out = tmp_path_factory.mktemp("out")
    assert multi_epoch.main(["--quick", "--data-root", str(root), "--dataset", "mnist",
                             "--epsilons", str(EPSILON), "--etas", "0.3", "--out", str(out)]) == 0
    with open(out / "runs.csv") as fh:
        runs = list(csv.DictReader(fh))
    with open(out / "rounds.csv") as fh:
        rounds = list(csv.DictReader(fh))
    return out, runs, rounds


def by_method(runs: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {r["method"]: r for r in runs}


def test_outputs(outputs) -> None:
    out, runs, rounds = outputs
    assert set(COLUMNS) <= set(runs[0])
    assert sorted(by_method(runs)) == sorted(
        ["none", "bandmf", "blt", "independent", "opacus", "opacus-replace-one"])
    for r in runs:  # every run evaluated after every round, r = 0 … R
        got = sorted(int(c["round"]) for c in rounds if c["method"] == r["method"])
        assert got == list(range(int(r["rounds"]) + 1))
        assert 0.0 <= float(r["final_accuracy"]) <= 1.0
    assert (out / "multi_epoch.png").stat().st_size > 10_000
    assert "| noiseless |" in (out / "tables.md").read_text()


def test_noiseless_learns(outputs) -> None:
    none = by_method(outputs[1])["none"]
    assert float(none["final_accuracy"]) > 0.5  # chance is 0.1


def brute_force_sensitivity(settings: PrivacySettings, steps_per_epoch: int,
                            epochs: int) -> float:
    """``max`` over the fixed-epoch patterns ``{i, i+b, …}`` of ``‖Σ_{t∈π} c_t‖`` from the
    materialized encoder ``C`` (exact when ``CᵀC ≥ 0`` on the pattern, asserted)."""
    _, C = settings.factorization().matrices()
    X = C.T @ C
    n = X.shape[0]
    best = 0.0
    for i in range(steps_per_epoch):
        idx = np.arange(i, n, steps_per_epoch)[:epochs]
        sub = X[np.ix_(idx, idx)]
        assert np.all(sub >= -1e-12)
        best = max(best, float(sub.sum()))
    return math.sqrt(best)


@pytest.mark.parametrize("method", ["blt", "independent"])
def test_ours_epsilon_at_the_brute_force_sensitivity(outputs, method: str) -> None:
    r = by_method(outputs[1])[method]
    examples, batch = int(r["examples"]), int(r["batch_size"])
    rounds, local = int(r["rounds"]), int(r["local_epochs"])
    b, k = -(-examples // batch), rounds * local
    loader = CyclicLoader(examples, batch, rounds=rounds, local_epochs=local)
    assert loader.participation == Participation.epochs(k, b)
    assert int(r["steps"]) == loader.horizon == k * b
    settings = PrivacySettings(method, EPSILON, float(r["delta"]), float(r["clip_norm"]),
                               loader.horizon, participation=loader.participation)
    sens = brute_force_sensitivity(settings, b, k)
    assert float(r["sensitivity"]) == pytest.approx(sens, rel=1e-6)
    assert sens > 1.0  # reused data: more than a one-pass stream's unit sensitivity
    # the whole release is one Gaussian of L2 sensitivity 2·B_g·sens (replace-one)
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dpa.GaussianDpEvent(float(r["noise_std"]) / (2 * float(r["clip_norm"]) * sens)))
    eps = acc.get_epsilon(float(r["delta"]))
    assert eps == pytest.approx(EPSILON, abs=2e-3)
    assert float(r["epsilon_reported"]) == pytest.approx(EPSILON, abs=1e-9)
    assert float(r["epsilon_replace_one"]) == pytest.approx(EPSILON, abs=2e-3)


def test_opacus_epsilon(outputs) -> None:
    from opacus.accountants import PRVAccountant

    r = by_method(outputs[1])["opacus"]
    q = int(r["batch_size"]) / int(r["examples"])
    steps, sigma, delta = int(r["steps"]), float(r["noise_multiplier"]), float(r["delta"])
    assert steps == int(r["rounds"]) * int(r["local_epochs"]) * round(1 / q)
    prv = PRVAccountant()
    prv.history = [(sigma, q, steps)]
    eps = prv.get_epsilon(delta)
    # Opacus' calibration stops within 0.01 below the target; the run took those steps
    assert EPSILON - 0.02 <= eps <= EPSILON
    assert float(r["epsilon_reported"]) == pytest.approx(eps, abs=1e-6)
    # a second accountant (PLD) for the same add/remove Poisson-subsampled Gaussian
    pld = PLDAccountant(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
    pld.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    assert pld.get_epsilon(delta) == pytest.approx(EPSILON, abs=0.05)
    # under replace-one (the relation ours use) the same noise gives a larger ε
    assert float(r["epsilon_replace_one"]) > EPSILON


def test_opacus_replace_one_epsilon(outputs) -> None:
    r = by_method(outputs[1])["opacus-replace-one"]
    q = int(r["batch_size"]) / int(r["examples"])
    steps, sigma, delta = int(r["steps"]), float(r["noise_multiplier"]), float(r["delta"])
    pld = PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE, 1e-4)
    pld.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    eps = pld.get_epsilon(delta)
    assert EPSILON - 0.05 <= eps <= EPSILON + 1e-3
    assert sigma > float(by_method(outputs[1])["opacus"]["noise_multiplier"])


def test_bandmf_epsilon(outputs) -> None:
    """The amplified banded run: its σ over ⌈N/b⌉ Poisson-subsampled Gaussian steps at the
    sampler's rate gives the budget by dp_accounting's PLD (replace-one); the bands are the
    library's choice for the run's FedAvg loop (its steps per round and learners); the std
    is σ·ζ·B_g with ζ the encoder's column norm."""
    from flwr_corrnoise.amplification import choose_bands

    r = by_method(outputs[1])["bandmf"]
    examples, batch = int(r["examples"]), int(r["batch_size"])
    s, n = -(-examples // batch), int(r["steps"])
    best, _ = choose_bands(EPSILON, float(r["delta"]), n, s,
                           steps_per_round=s * int(r["local_epochs"]),
                           learners=int(r["learners"]))
    assert r["accountant"].endswith(f"b={best.bands}") and r["relation"] == "replace-one"
    sigma, delta = float(r["noise_multiplier"]), float(r["delta"])
    pld = PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE, 1e-4)
    pld.compose(dpa.PoissonSampledDpEvent(best.bands / s, dpa.GaussianDpEvent(sigma)),
                -(-n // best.bands))
    assert pld.get_epsilon(delta) == pytest.approx(EPSILON, abs=2e-3)
    assert float(r["noise_std"]) == pytest.approx(
        sigma * float(r["sensitivity"]) * float(r["clip_norm"]), rel=1e-9)


def test_tables_split_steps_per_epoch_and_judge_the_spread() -> None:
    """Two batch sizes: one row per (method, steps per epoch), named by it; the
    library-vs-Opacus table's verdict follows the larger std over seeds. Synthetic rows
    (no run): three cases, one per verdict."""
    base = {"dataset": "d", "delta": "1e-05", "examples": "512", "eta": "0.3",
            "accountant": "flwr-corrnoise pld (replace-one) b=4", "relation": "replace-one",
            "epsilon_reported": "8", "epsilon_replace_one": "8", "noise_multiplier": "1",
            "sensitivity": "1", "noise_rmse": "9"}

    def rows(method: str, eps: str, batch: str, accs: list[float]) -> list[dict[str, str]]:
        return [{**base, "method": method, "epsilon": eps, "batch_size": batch,
                 "seed": str(i), "final_accuracy": str(a)} for i, a in enumerate(accs)]

    runs = (rows("bandmf", "8", "32", [0.60, 0.62]) + rows("opacus-replace-one", "8", "32",
                                                          [0.60, 0.64])
            + rows("bandmf", "8", "8", [0.70, 0.72]) + rows("opacus-replace-one", "8", "8",
                                                           [0.60, 0.62])
            + rows("bandmf", "4", "8", [0.40, 0.42]) + rows("opacus-replace-one", "4", "8",
                                                           [0.50, 0.50]))
    tabs = multi_epoch.tables(runs, [])
    assert "| amplified BandMF, cyclic Poisson, library's bands (ours), 16 steps/epoch |" \
        in tabs["accuracy"]
    assert "Opacus DP-SGD (Poisson, PLD, replace-one), 64 steps/epoch |" in tabs["accuracy"]
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in tabs["versus"].splitlines()[2:]]
    assert verdicts == ["within the spread", "behind beyond the spread",
                        "ahead beyond the spread"]
    assert "| 16 | 8 | 4 | 0.610 ± 0.010 | 0.620 ± 0.020 | -0.010 | 0.020 |" \
        in tabs["versus"]


def test_merge_joins_every_band_choice_and_refuses_one_twice(tmp_path: Path) -> None:
    """Band-choice cells from several ``--band-choice`` invocations are all kept by
    ``--merge`` (in the order given); a candidate two directories both hold is refused.
    Synthetic rows (no run)."""
    def write(d: Path, cells: list[tuple[str, str]]) -> None:
        d.mkdir()
        rows = [{"epsilon": e, "delta": "1e-05", "steps_per_epoch": s, "steps": "10",
                 "steps_per_round": "2", "learners": "3", "bands": str(b),
                 "sampling_rate": "0.5", "noise_multiplier": "1", "column_norm": "1",
                 "prefix_rmse": str(3 - b), "iterate_rmse": str(3 - b), "chosen": str(b - 1)}
                for e, s in cells for b in (1, 2)]
        multi_epoch.write_csv(d / "bands.csv", multi_epoch.BANDS_HEADER, rows)

    write(tmp_path / "a", [("8", "16"), ("4", "16")])
    write(tmp_path / "b", [("8", "256")])
    multi_epoch.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    with open(tmp_path / "out" / "bands.csv") as fh:
        merged = list(csv.DictReader(fh))
    assert [(r["epsilon"], r["steps_per_epoch"], r["bands"]) for r in merged] == [
        ("8", "16", "1"), ("8", "16", "2"), ("4", "16", "1"), ("4", "16", "2"),
        ("8", "256", "1"), ("8", "256", "2")]
    table = multi_epoch.bands_table(merged)
    assert "| 8 | 256 | 2 | 1.000 | 0.500 | 0.500 | **yes** |" in table
    write(tmp_path / "c", [("8.0", "256")])
    with pytest.raises(ValueError, match="more than one directory"):
        multi_epoch.merge([tmp_path / "b", tmp_path / "c"], tmp_path / "out2")


def test_eta_is_chosen_by_the_mean_over_the_tuning_seeds(monkeypatch) -> None:
    """``--tune-seeds 100 101``: every η runs on both seeds, one tuning row per seed, and η
    is the best mean (here η = 1, although seed 100 alone prefers η = 0.3, as in the
    16-step, ε = 8 cell); ties go to the smaller η; the one ``--tune-seed`` still works.
    The runs are replaced by a table of accuracies (no training)."""
    accuracy = {(0.3, 100): 0.655, (1.0, 100): 0.647, (0.3, 101): 0.600, (1.0, 101): 0.640}
    ran: list[tuple[float, int]] = []

    def fake_run_all(jobs, workers):
        ran.extend((j.eta, j.seed) for j in jobs)
        return [({"final_accuracy": accuracy.get((j.eta, j.seed), 0.5), "eta": j.eta,
                  "seed": j.seed}, []) for j in jobs]

    monkeypatch.setattr(multi_epoch, "run_all", fake_run_all)
    args = multi_epoch.parse_args(["--methods", "bandmf", "--epsilons", "8", "--etas", "0.3",
                                   "1", "--tune-seeds", "100", "101"])
    etas, rows = multi_epoch.tune(args, multi_epoch.base_setup(args))
    assert sorted(ran) == sorted(accuracy)
    assert len(rows) == 4 and {r["seed"] for r in rows} == {100, 101}
    assert etas == {("bandmf", 8.0): 1.0}
    # the old flag: one seed, whose own best η
    args = multi_epoch.parse_args(["--methods", "bandmf", "--epsilons", "8", "--etas", "0.3",
                                   "1", "--tune-seed", "100"])
    ran.clear()
    assert multi_epoch.tune(args, multi_epoch.base_setup(args))[0] == {("bandmf", 8.0): 0.3}
    assert sorted(ran) == [(0.3, 100), (1.0, 100)]
    # a tie of the means goes to the smaller η; η run on different seeds is refused
    cell = ("bandmf", 8.0)
    assert multi_epoch.choose_etas([(cell, 1.0, 1, 0.6), (cell, 0.3, 1, 0.5),
                                    (cell, 1.0, 2, 0.5), (cell, 0.3, 2, 0.6)])[cell] == 0.3
    with pytest.raises(ValueError, match="different seeds"):
        multi_epoch.choose_etas([(cell, 1.0, 1, 0.6), (cell, 0.3, 2, 0.5)])
    # a tuning seed that is also an evaluation seed is refused
    with pytest.raises(SystemExit):
        multi_epoch.parse_args(["--etas", "0.3", "1", "--tune-seeds", "100", "2"])


def test_tuning_table_shows_each_seed_and_the_mean(tmp_path: Path) -> None:
    """The tuning block: one line per tuning seed and, for a cell tuned on two, the mean
    that chose η; ``--merge`` refuses a tuning run two directories both hold. Synthetic
    rows (no run)."""
    def row(eta: str, seed: str, acc: str) -> dict[str, str]:
        return {**dict.fromkeys(multi_epoch.RUN_HEADER, ""), "method": "bandmf",
                "epsilon": "8.0", "eta": eta, "seed": seed, "final_accuracy": acc,
                "examples": "512", "batch_size": "32"}

    tuning = [row("0.3", "100", "0.655"), row("1.0", "100", "0.647"),
              row("0.3", "101", "0.600"), row("1.0", "101", "0.640")]
    table = multi_epoch.tuning_table(tuning)
    assert "| amplified BandMF, cyclic Poisson, library's bands (ours) | 8.0 | 100 | " \
        "0.655 | 0.647 |" in table
    assert "| 8.0 | 101 | 0.600 | 0.640 |" in table
    assert "| 8.0 | mean | 0.627 | 0.643 |" in table
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        multi_epoch.write_csv(tmp_path / d / "tuning.csv", multi_epoch.RUN_HEADER, tuning[:1])
    with pytest.raises(ValueError, match="tuning runs held by more than one directory"):
        multi_epoch.merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
