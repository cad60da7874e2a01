"""The CNN experiment at toy size, on IDX files the test makes: the in-process engine, the
script's outputs, and one configuration on Flower's Ray simulation."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from experiments.cnn import CNNSetup, PaperCNN, cnn_data, run_cnn  # noqa: E402
from tests.data.test_idx import make_idx_dir  # noqa: E402
from tests.flower_helpers import RAY, ray_head  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("idx")
    make_idx_dir(d, n_train=200, n_test=40, gz=True, seed=1)
    return d


def toy(root: Path, **kw) -> CNNSetup:
    base = dict(dataset="mnist", data_root=str(root), num_learners=2, steps=4, tau=2,
                batch_size=3, mechanism="blt", eta=0.05, test_size=40, threads=1)
    return CNNSetup(**{**base, **kw})


def test_paper_cnn_shape() -> None:
    model = PaperCNN()
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    sizes = [p.numel() for p in model.parameters()]
    assert sizes == [288, 32, 9216, 32, 294912, 64, 640, 10]  # the paper's layers


def test_streams_use_each_image_once_and_refuse_too_short(root: Path) -> None:
    data = cnn_data(toy(root))
    both = np.concatenate(data.streams)
    assert len(both) == len(np.unique(both)) == 200
    with pytest.raises(ValueError, match="fewer than steps"):
        cnn_data(toy(root, steps=200))


def test_run_is_reproducible_and_noise_matters(root: Path) -> None:
    a, b = run_cnn(toy(root), progress=False), run_cnn(toy(root), progress=False)
    for x, y in zip(a.params, b.params, strict=True):
        np.testing.assert_array_equal(x, y)
    quiet = run_cnn(toy(root, mechanism="none"), progress=False)
    assert max(float(np.max(np.abs(x - y)))
               for x, y in zip(a.params, quiet.params, strict=True)) > 1e-3
    assert [r["round"] for r in a.rows] == [0.0, 1.0, 2.0]
    assert 0.0 <= a.final_accuracy <= 1.0
    # the NumPy reference engine runs the same learners; its noise comes from another
    # generator, so only the noiseless runs agree (float32 device vs float64 host)
    host_quiet = run_cnn(toy(root, mechanism="none", engine="host"), progress=False)
    for x, y in zip(quiet.params, host_quiet.params, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    with pytest.raises(ValueError, match="engine"):
        run_cnn(toy(root, engine="tpu"), progress=False)


def test_tuning_picks_eta_on_its_own_seed_and_resumes(root: Path, tmp_path: Path) -> None:
    """--tune-etas: one run per method, τ and grid point (η = c/τ) on the tuning seed, the
    best η per cell then used for the evaluation seeds; a rerun runs nothing again."""
    from simulations.cnn import best_etas, main, read_csv, tuning_table

    out = tmp_path / "tuned"
    args = ["--dataset", "mnist", "--data-root", str(root), "--learners", "2", "--steps",
            "4", "--taus", "1", "2", "--batch-size", "3", "--methods", "none", "blt",
            "--test-size", "40", "--threads", "1", "--seeds", "2", "--tune-etas", "0.01",
            "0.08", "--tune-seed", "9", "--out", str(out)]
    assert main(args) == 0
    tuning, runs = read_csv(out / "tuning.csv"), read_csv(out / "runs.csv")
    assert {(r[1], r[2], r[10], r[6]) for r in tuning} == {
        (m, t, e, "9") for m in ("none", "blt") for t, es in (("1", ("0.01", "0.08")),
                                                              ("2", ("0.005", "0.04")))
        for e in es}
    chosen = best_etas(tuning)
    assert {(r[1], int(r[2])): float(r[10]) for r in runs} == chosen
    assert sorted({r[6] for r in runs}) == ["0", "1"]  # the tuning seed is not among them
    for (m, t), eta in chosen.items():  # the chosen η has the cell's best tuning accuracy
        cell = [float(r[7]) for r in tuning if (r[1], int(r[2])) == (m, t)]
        assert max(cell) == next(float(r[7]) for r in tuning
                                 if (r[1], int(r[2]), float(r[10])) == (m, t, eta))
    assert "**" in tuning_table(tuning)
    before = (out / "runs.csv").read_text(), (out / "tuning.csv").read_text()
    assert main(args) == 0  # resumes: every run is already there
    assert ((out / "runs.csv").read_text(), (out / "tuning.csv").read_text()) == before
    with pytest.raises(ValueError, match="tuning seed"):
        main([*args[:-4], "--tune-seed", "1", "--out", str(out)])
    assert best_etas([["d", "blt", "1", "", "", "", "9", "nan", "", "", "0.1"],
                      ["d", "blt", "1", "", "", "", "9", "0.2", "", "", "0.2"],
                      ["d", "blt", "1", "", "", "", "9", "0.2", "", "", "0.05"]]) == {
        ("blt", 1): 0.05}  # NaN ranks last, ties go to the smaller η


def test_script_writes_csv_plot_and_checks_flower(root: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The CNN script at toy size, its Flower check included. That check's ``ray.init()``
    joins this test worker's Ray head (``RAY_ADDRESS``, which ``ray.init`` reads when it is
    given no address) instead of starting a Ray of its own: the same simulation, without
    a Ray start-up in the suite's busiest minutes; one ClientApp actor on its 2 CPUs
    (``--flower-client-cpus 2``: an actor is a process that imports torch, Flower and the
    app)."""
    from simulations.cnn import HEADER, main

    if RAY.exists():
        monkeypatch.setenv("RAY_ADDRESS", ray_head().address)

    out = tmp_path / "out"
    assert main(["--dataset", "mnist", "--data-root", str(root), "--learners", "2",
                 "--steps", "4", "--taus", "1", "2", "--batch-size", "3", "--methods",
                 "none", "blt", "--test-size", "40", "--threads", "1", "--flower",
                 "--flower-client-cpus", "2",
                 "--out", str(out)]) == 0
    with open(out / "runs.csv") as fh:
        rows = list(csv.reader(fh))
    assert rows[0][:8] == ["dataset", "method", "tau", "rounds", "epsilon", "delta", "seed",
                           "final_accuracy"] and rows[0] == HEADER
    assert [(r[0], r[1], r[2], r[3]) for r in rows[1:]] == [
        ("mnist", "none", "1", "4"), ("mnist", "blt", "1", "4"),
        ("mnist", "none", "2", "2"), ("mnist", "blt", "2", "2")]
    assert (out / "accuracy.png").stat().st_size > 10_000
    diff = float((out / "flower-check.txt").read_text().split()[-1])
    assert diff < 1e-6  # Flower's Ray simulation gives the in-process model
    (out / "accuracy.png").unlink()
    assert main(["--out", str(out), "--from-runs"]) == 0  # replot from the CSVs only
    assert (out / "accuracy.png").exists()


def test_tables() -> None:
    from simulations.cnn import snr_table, table

    rows = [["fashion-mnist", m, str(t), str(8 // t), "2.0", "0.001", str(s), str(acc), "8",
             "3", "0.02", "60000", "1"]
            for m, acc in (("none", 0.8), ("blt", 0.5)) for t in (1, 2) for s in (0, 1)]
    text = table(rows)
    assert "| noiseless | 0.800 ± 0.000 | 0.800 ± 0.000 |" in text
    assert "τ = 2, R = 4" in text and "R·τ = 8 steps of 3 image(s)" in text
    snr = snr_table([300])
    assert snr.count("\n| 300 |") == 1 and "305,194" in snr


@pytest.mark.parametrize("mechanism", ["independent", "tree", "blt"])
def test_final_noise_to_signal_matches_a_sampled_stream(mechanism: str) -> None:
    """The closed form against the noise streams themselves: sum every learner's N
    increments, average over learners, compare the norm with N·B_g."""
    from experiments.cnn import final_noise_to_signal
    from flwr_corrnoise.learner_state import LearnerState

    setup = CNNSetup(mechanism=mechanism, steps=32, num_learners=3, clip=0.7)
    d = 20000
    ratio = final_noise_to_signal(setup, d)
    total = np.zeros(d)
    for i in range(setup.num_learners):
        noise = LearnerState.create(setup.settings(), [(d,)], seed=100 + i).noise
        for _ in range(setup.steps):
            total += noise.next()  # type: ignore[union-attr]
    sampled = np.linalg.norm(total / setup.num_learners) / (setup.steps * setup.clip)
    assert sampled == pytest.approx(ratio, rel=0.03)
    assert final_noise_to_signal(setup.with_(mechanism="none"), d) == 0.0


def test_collapse_diagnostics_measure_the_noise_drift(root: Path, tmp_path: Path) -> None:
    """simulations/cnn_collapse.py: at τ = 1 gradients are taken at x^r (no drift); at
    τ = 2 the second iterate's drift is the learner's own noise increment, whose norm
    η·V·√d·‖(C⁻¹)_k‖ we compute from the factorization independently."""
    from flwr_corrnoise.mechanisms import build_factorization
    from flwr_corrnoise.settings import PrivacySettings
    from simulations import cnn_collapse

    cnn_collapse.main(["--data-root", str(root), "--dataset", "mnist", "--learners", "2",
                       "--steps", "4", "--horizon", "4", "--taus", "1", "2", "--methods",
                       "blt", "--every", "2", "--probe", "20", "--out", str(tmp_path)])
    rows = list(csv.DictReader((tmp_path / "diagnostics.csv").open()))
    assert {(r["tau"], r["step"]) for r in rows} == {(t, s) for t in ("1", "2")
                                                     for s in ("0.0", "2.0", "4.0")}
    settings = PrivacySettings(mechanism="blt", horizon=4, epsilon=2.0, delta=1e-3)
    v, eta = settings.calibration().std, 0.02  # type: ignore[union-attr]
    m = build_factorization("blt", 4).noising_matrix()
    d = sum(p.numel() for p in PaperCNN().parameters())
    for r in rows:
        assert 0.0 <= float(r["dead-conv2"]) <= 1.0 and 0.0 <= float(r["accuracy"]) <= 1.0
        if r["step"] == "0.0":
            continue
        if r["tau"] == "1":
            assert float(r["drift"]) == 0.0
        else:  # iterates t = 0 (no drift) and t = 1 (one increment) of the round at k
            k = int(float(r["step"])) - 2
            expected = eta * v * np.sqrt(d) * np.linalg.norm(m[k]) / 2
            assert float(r["drift"]) == pytest.approx(expected, rel=0.02)


def test_zcdp_calibration_is_the_papers_noise_multiplier() -> None:
    """--calibration zcdp: Zhang, Zhu, Fay & Johansson's Lemma IV.8 at (2, 10⁻³), against
    the closed form written out here: ρ = (√(ε + ln 1/δ) − √(ln 1/δ))², and a Gaussian of
    std σ on a query of L2 sensitivity Δ is Δ²/(2σ²)-zCDP, so σ/Δ = 1/√(2ρ) ≈ 1.98."""
    eps, delta = 2.0, 1e-3
    rho = (np.sqrt(eps + np.log(1 / delta)) - np.sqrt(np.log(1 / delta))) ** 2
    closed = 1 / np.sqrt(2 * rho)
    assert round(closed, 2) == 1.98
    for mechanism in ("independent", "blt"):
        setup = CNNSetup(mechanism=mechanism, steps=200, calibration="zcdp")
        cal = setup.settings().calibration()
        assert cal is not None and cal.method == "zcdp"
        # σ is per unit of the stream's sensitivity (one datum in one step: ‖c‖ = 1 for
        # independent noise; BLT's column norm is the factorization's)
        assert cal.noise_multiplier == pytest.approx(closed, rel=1e-6)
        exact = setup.with_(calibration="exact").settings().calibration()
        assert exact is not None and exact.noise_multiplier < cal.noise_multiplier
    with pytest.raises(Exception, match="calibration method"):
        CNNSetup(mechanism="blt", calibration="rdp").settings()


def test_calibration_scales_the_noise_a_run_adds(root: Path) -> None:
    """One step of one image from the same start and the same noise key: the private
    models' distances from the noiseless one are in the ratio of the two calibrations'
    noise std (the run uses the calibration it is given)."""
    one = dict(steps=1, tau=1, batch_size=1, mechanism="independent")
    quiet = run_cnn(toy(root, **{**one, "mechanism": "none"}), progress=False).params
    moved = {}
    for cal in ("exact", "zcdp"):
        params = run_cnn(toy(root, **one, calibration=cal), progress=False).params
        moved[cal] = np.sqrt(sum(float(np.sum((a - b) ** 2))
                                 for a, b in zip(params, quiet, strict=True)))
    # the expected std ratio from the library's public calibration, not through CNNSetup
    from flwr_corrnoise import calibrate_mechanism

    stds = {c: calibrate_mechanism(epsilon=2.0, delta=1e-3, clip_norm=1.0,
                                   mechanism="independent", steps=1, method=c).std
            for c in moved}
    assert stds["zcdp"] / stds["exact"] > 1.3
    assert moved["zcdp"] / moved["exact"] == pytest.approx(stds["zcdp"] / stds["exact"],
                                                          rel=1e-4)


def test_shared_eta_tunes_the_noiseless_run_and_uses_its_eta_everywhere(
        root: Path, tmp_path: Path) -> None:
    """--shared-eta (the paper's "same step sizes for all algorithms"): only the noiseless
    run at the first τ is tuned; every method and τ runs at its best η; rows name the
    calibration."""
    from simulations.cnn import main, read_csv, table

    out = tmp_path / "paper"
    assert main(["--dataset", "mnist", "--data-root", str(root), "--learners", "2",
                 "--steps", "4", "--taus", "1", "2", "--batch-size", "3", "--methods",
                 "none", "independent", "blt", "--test-size", "40", "--threads", "1",
                 "--seeds", "2", "--calibration", "zcdp", "--shared-eta", "--tune-etas",
                 "0.01", "0.3", "--tune-scale", "none", "--tune-seed", "9",
                 "--out", str(out)]) == 0
    tuning, runs = read_csv(out / "tuning.csv"), read_csv(out / "runs.csv")
    assert {(r[1], r[2], r[10]) for r in tuning} == {("none", "1", "0.01"),
                                                     ("none", "1", "0.3")}
    best = max(tuning, key=lambda r: (float(r[7]), -float(r[10])))[10]
    assert {r[10] for r in runs} == {best} and {r[14] for r in runs} == {"zcdp"}
    assert len(runs) == 3 * 2 * 2
    assert f"zcdp calibration, one η = {float(best):g} for every method and τ" in table(runs)


def test_batch_table_divides_the_ratio_by_the_batch() -> None:
    from experiments.cnn import final_noise_to_signal
    from simulations.cnn import batch_table

    rows = [["fashion-mnist", m, "1", str(40 // b), "2.0", "0.001", str(s), str(acc),
             str(40 // b), str(b), str(0.01 * b), "60000", "1", "device", "zcdp"]
            for b in (1, 4) for m, acc in (("none", 0.8), ("independent", 0.3))
            for s in (0, 1)][:-1]  # the last cell has one seed
    text = batch_table(rows)
    d = sum(p.numel() for p in PaperCNN().parameters())
    ratio = final_noise_to_signal(CNNSetup(mechanism="independent", steps=10,
                                           calibration="zcdp"), d) / 4
    assert f"| 4 | 10 | 0.04 | 0.800 ± 0.000 | 0.300 [1 seed] | {ratio:.2f} |" in text
    assert "40 images per learner (N·B), τ = 1, zcdp calibration" in text
    assert "mean ± std over seeds 0, 1" in text
