"""simulations/doc_numbers.py at toy size, and the docs' numbers against its committed CSVs
(issue 36 item 3: every number in README.md and docs/ comes from a committed CSV)."""

from __future__ import annotations

import csv
import itertools
import re
from pathlib import Path

import pytest

from simulations import doc_numbers
from simulations.marked import marked_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _read(path: Path) -> list[dict[str, str]]:
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_calibration_rows_compare_zcdp_with_exact() -> None:
    rows = doc_numbers.calibration_rows([("page", "blt", 50, 2.0, 1e-3)])
    exact, zcdp = rows
    assert exact[5] == "exact" and zcdp[5] == "zcdp"
    assert float(exact[8]) == 1.0
    assert float(zcdp[6]) > float(exact[6])  # zCDP is the looser calibration
    assert float(zcdp[8]) == pytest.approx(float(zcdp[6]) / float(exact[6]), rel=1e-3)


def test_demo_tuning_marks_each_methods_best_mean(tmp_path: Path) -> None:
    out = tmp_path / "tuning.csv"
    assert doc_numbers.main(["demo-tuning", "--out", str(out), "--methods", "none", "blt",
                             "--grid", "0.1", "1", "--seeds", "100", "101",
                             "--rounds", "2"]) == 0
    rows = _read(out)
    assert len(rows) == 2 * 2 * 2
    for method in ("none", "blt"):
        mine = [r for r in rows if r["method"] == method]
        chosen = {r["eta"] for r in mine if r["chosen"] == "1"}
        assert len(chosen) == 1
        best = max(mine, key=lambda r: float(r["mean_final_accuracy"]))
        assert best["eta"] in chosen


def test_logreg_norms_at_toy_size() -> None:
    (row,) = doc_numbers.logreg_norms_rows([0], points=40, learners=3, dim=10)
    values = dict(zip(doc_numbers.NORMS_HEADER, row, strict=True))
    assert 0.0 < float(values["share_of_squared_norm_in_learner_mean"]) <= 1.0
    q = [float(values[f"feature_norm_q{p}"]) for p in (10, 50, 90)]
    assert q == sorted(q)
    # a per-datum logistic gradient at x = 0 is half the feature's norm
    assert float(values["grad_norm_at_zero_q50"]) == pytest.approx(
        0.5 * float(values["feature_norm_q50"]), rel=0.3)


def test_paired_counts_seeds(tmp_path: Path) -> None:
    runs = tmp_path / "runs.csv"
    header = "method,epsilon,delta,seed,eta,final_accuracy,avg_online_loss,dynamic_regret\n"
    lines = ["none,,,0,1,0.9,0.1,1", "none,,,1,1,0.9,0.1,1",
             "a,2.0,0.001,0,1,0.6,0.5,1", "a,2.0,0.001,1,1,0.7,0.5,1",
             "b,2.0,0.001,0,1,0.65,0.5,1", "b,2.0,0.001,1,1,0.65,0.5,1"]
    runs.write_text(header + "\n".join(lines) + "\n")
    rows = doc_numbers.paired_rows(runs, ["final_accuracy"])
    ab = next(r for r in rows if r[3:5] == ["a", "b"])
    assert ab[5:9] == [2, 1, 0, 1]  # seeds, a above b, equal, a below b
    assert float(ab[9]) == pytest.approx(0.0)


def test_readme_demo_numbers_are_the_committed_summary() -> None:
    summary = {r["method"]: float(r["final_accuracy_mean"])
               for r in _read(DOCS / "results-demo-summary.csv")}
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"no noise ([\d.]+), correlated noise ([\d.]+), independent noise ([\d.]+)",
                  text)
    assert m is not None
    assert [float(x) for x in m.groups()] == [
        round(summary[k], 2) for k in ("noiseless", "blt", "independent")]


def test_demo_step_sizes_are_the_committed_tuning() -> None:
    from experiments.demo import ETAS

    chosen = {r["method"]: float(r["eta"]) for r in _read(DOCS / "results-demo-tuning.csv")
              if r["chosen"] == "1"}
    assert chosen == {m: ETAS[m] for m in chosen}
    summary = {r["method"]: float(r["eta"]) for r in _read(DOCS / "results-demo-summary.csv")}
    assert summary == {"noiseless": ETAS["none"], "independent": ETAS["independent"],
                       "blt": ETAS["blt"]}


def test_cnn_calibration_numbers_are_the_committed_csv() -> None:
    rows = {(r["mechanism"], r["steps"], r["calibration"]): r
            for r in _read(DOCS / "results-calibration.csv")}
    exact, zcdp = rows[("blt", "5000", "exact")], rows[("blt", "5000", "zcdp")]
    text = (DOCS / "results-cnn.md").read_text()
    assert f"{float(exact['noise_multiplier']):.3f}" in text  # 1.445
    assert f"{float(zcdp['noise_multiplier']):.2f}" in text  # 1.98
    assert f"{float(zcdp['std_over_exact']):.2f}× less" in text  # 1.37
    assert f"V = {float(exact['std_per_coordinate_clip1']):.2f}" in text  # 5.45


#: the results pages whose tables are generated into marked blocks
MARKED_PAGES = sorted(p.name for p in DOCS.glob("results-*.md") if "<!-- BEGIN " in p.read_text())

#: tables on a results page that are not generated, each with why. A data table must be in
#: a generated block; a table listed here is either not data (settings, a method list) or a
#: known gap on a page another issue owns, said so.
UNGENERATED = {
    ("results-chen-wang.md", "| Chen & Wang figure / table | paper | ours"):
        "a summary: the paper's numbers beside this page's generated tables, with verdicts",
    ("results-multi-epoch.md", "| method | loop | noise and accounting |"):
        "not data: the methods and their accounting",
}


def unmarked_tables(text: str) -> list[str]:
    """The header line of every markdown table (a ``| … |`` line followed by ``|---``)
    outside the generated blocks."""
    lines = re.sub(r"<!-- BEGIN (\S+) -->\n.*?\n<!-- END \1 -->", "", text,
                   flags=re.S).splitlines()
    return [a for a, b in itertools.pairwise(lines)
            if a.startswith("|") and b.startswith("|---")]


def stale_blocks(page: str, text: str, docs: Path = DOCS) -> list[str]:
    """The blocks of ``text`` (the page ``page``) that differ from what its script renders
    from the CSVs in ``docs``, and those the page lacks or has in excess."""
    found, rendered = marked_blocks(text), doc_numbers.doc_blocks(page, docs)
    return sorted({n for n in found.keys() | rendered.keys()
                   if found.get(n) != rendered.get(n)})


def test_marked_pages_are_every_results_page() -> None:
    assert sorted(p.name for p in DOCS.glob("results-*.md")) == MARKED_PAGES


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("results-*.md")))
def test_every_results_table_is_generated_or_listed_with_why(page: str) -> None:
    """Every table of every results page lies in a generated block, or is in UNGENERATED
    with the reason it is not (and nothing stale stays listed)."""
    headers = unmarked_tables((DOCS / page).read_text())
    listed = [h for (p, h) in UNGENERATED if p == page]
    for header in headers:
        assert any(header.startswith(h) for h in listed), (
            f"{page}: table {header[:60]!r} is neither generated nor listed with a reason")
    for h in listed:
        assert any(x.startswith(h) for x in headers), f"{page}: stale exemption {h[:40]!r}"


@pytest.mark.parametrize("page", MARKED_PAGES)
def test_every_generated_table_is_its_committed_csv_rendered(page: str) -> None:
    """Each block between ``<!-- BEGIN table:NAME -->`` markers equals what the sweep's own
    table code renders from the committed CSVs (no hand-edited or stale table)."""
    assert stale_blocks(page, (DOCS / page).read_text()) == []


def test_a_hand_edited_number_or_a_stray_table_is_caught() -> None:
    """The checks can fail: one number edited inside a generated block of a copy of a
    page is a stale block, and a table pasted outside the blocks is unmarked."""
    text = (DOCS / "results-wang.md").read_text()
    assert "| 3.2498 |" in text
    edited = text.replace("| 3.2498 |", "| 3.2499 |", 1)
    assert stale_blocks("results-wang.md", edited) == ["table:30k-main"]
    pasted = text + "\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert unmarked_tables(pasted) == ["| a | b |"]
    cw = (DOCS / "results-chen-wang.md").read_text()
    assert stale_blocks("results-chen-wang.md", cw.replace("| 0.741 |", "| 0.742 |", 1)) == [
        "table:cnn"]


def test_doc_blocks_see_a_changed_csv(tmp_path: Path) -> None:
    """The check can fail: one accuracy changed in a copy of the CSV changes the block."""
    import shutil

    for path in DOCS.glob("results-cnn*.csv"):
        shutil.copy(path, tmp_path / path.name)
    before = doc_numbers.doc_blocks("results-cnn.md", tmp_path)["table:cnn"]
    with open(tmp_path / "results-cnn.csv") as fh:
        rows = list(csv.reader(fh))
    rows[1][7] = "0.1"
    with open(tmp_path / "results-cnn.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    assert doc_numbers.doc_blocks("results-cnn.md", tmp_path)["table:cnn"] != before
    with pytest.raises(KeyError):
        doc_numbers.doc_blocks("results-no-such-page.md", tmp_path)


def test_cnn_noise_rows_follow_the_independent_closed_form() -> None:
    """Independent noise: ``‖b_{N−1}‖² = N``, so the ratio is ``σ·√(d/n)/√(N·B²)`` =
    ``σ·√(d/n)/√(M·B)`` for ``M = N·B`` images; σ from the public calibration."""
    pytest.importorskip("torch")
    from flwr_corrnoise import calibrate_mechanism

    rows = doc_numbers.cnn_noise_rows([40, 80], [1, 4], mechanisms=("independent",))
    assert len(rows) == 2 * 2 * 2
    for m_images, b, steps, cal, _, learners, d, ratio in rows:
        assert steps * b == m_images
        std = calibrate_mechanism(epsilon=2.0, delta=1e-3, clip_norm=1.0,
                                  mechanism="independent", steps=steps, method=cal).std
        expected = std * (d / learners) ** 0.5 / (m_images * b) ** 0.5
        assert float(ratio) == pytest.approx(expected, rel=1e-3)


def test_class_prior_rows_are_the_poker_laws_entropy() -> None:
    """The poker row against an independent computation: the law counts every 5-card hand
    once (C(52, 5)), and its loss is the law's entropy (scipy), below ln 10."""
    import math

    from scipy.stats import entropy

    from experiments.data.poker import CLASS_COUNTS

    poker = next(r for r in doc_numbers.class_prior_rows() if r[0] == "poker")
    assert int(CLASS_COUNTS.sum()) == math.comb(52, 5)
    assert float(poker[3]) == pytest.approx(entropy(CLASS_COUNTS), abs=1e-4)
    assert float(poker[2]) == pytest.approx(math.log(10), abs=1e-4)
    assert float(poker[3]) < float(poker[2])
    committed = {r["dataset"]: r for r in _read(DOCS / "results-wang-class-prior.csv")}
    assert committed["poker"]["class_prior_loss"] == poker[3]


#: reference pages (not results pages) whose measured tables are generated blocks
REFERENCE_MARKED = {"data.md": {"table:data-balance", "text:data-label-spread",
                                "table:data-drift", "table:data-noise"}}


@pytest.mark.parametrize("page", sorted(REFERENCE_MARKED))
def test_reference_pages_generated_blocks_are_their_csvs(page: str) -> None:
    """A reference page's measured tables are generated blocks equal to their committed
    CSVs rendered (the blocks listed are all there: a removed CSV or marker fails)."""
    text = (DOCS / page).read_text()
    assert set(marked_blocks(text)) == REFERENCE_MARKED[page]
    assert stale_blocks(page, text) == []


def test_data_balance_rows_against_the_generator() -> None:
    """Toy size: the +1 fractions, the majority and the learner-majority accuracies
    recomputed here from the public generator; the table's shares of nearly constant
    learners from those fractions."""
    import numpy as np

    from flwr_corrnoise.data import SyntheticConfig, SyntheticFederation

    rows = doc_numbers.data_balance_rows(["naive", "default"], [0, 1], points=50,
                                         test_size=100, learners=4, dim=5)
    for key, seed, points, size, best, major, lmajor, fracs in rows:
        fed = SyntheticFederation(SyntheticConfig(seed=seed, num_learners=4, dim=5,
                                                  **doc_numbers.DATA_CONFIGS[key][1]))
        plus = np.array([np.mean(fed.learner_batch(i, 0, points)[1] > 0) for i in range(4)])
        assert [float(f) for f in fracs.split(";")] == pytest.approx(plus, abs=1e-4)
        _, ty = fed.test_set(size)
        assert float(major) == pytest.approx(max(np.mean(ty > 0), np.mean(ty < 0)), abs=1e-4)
        own = np.array([1.0 if plus[j % 4] >= 0.5 else -1.0 for j in range(size)])
        assert float(lmajor) == pytest.approx(np.mean(own == ty), abs=1e-4)
        assert 0.0 <= float(best) <= 1.0
    header = doc_numbers.BALANCE_HEADER
    table = doc_numbers.balance_table([dict(zip(header, map(str, r), strict=True))
                                       for r in rows])
    naive = np.concatenate([[float(f) for f in r[7].split(";")] for r in rows
                            if r[0] == "naive"])
    share = f"{100 * np.mean((naive < 0.1) | (naive > 0.9)):.0f} %"
    assert f"| {share} / " in table.splitlines()[2]


def test_data_noise_rows_add_nothing_at_zero_and_change_the_run_otherwise() -> None:
    """std 0 is the noiseless in-process run of experiments.logreg (an independent path);
    std > 0 moves the final model."""

    from experiments.logreg import run_logreg_inprocess
    from flwr_corrnoise.apps.logreg_task import LogRegSetup, federation
    from flwr_corrnoise.metrics import accuracy

    rows = doc_numbers.data_noise_rows([0.0, 3.0], [0], rounds=3, test_size=200)
    setup = LogRegSetup(mechanism="none", eta=0.03, rounds=3, data_seed=0, seed=0)
    x = run_logreg_inprocess(setup).params[0]
    ta, ty = federation(setup).test_set(200)
    assert float(rows[0][-1]) == pytest.approx(accuracy(x, ta, ty), abs=1e-4)
    assert float(rows[1][-1]) != float(rows[0][-1])  # the noise reached the model
    text = doc_numbers.noise_table([dict(zip(doc_numbers.NOISE_HEADER, map(str, r),
                                             strict=True)) for r in rows])
    assert "| none | " in text and "N(0, 3²)" in text


def test_data_drift_rows_see_a_half_turn() -> None:
    """Toy size, against the closed form ``R(p)w = cos(drift·p)·w + sin(drift·p)·Kw``:
    a drift of ``π/late`` turns every model to ``−w`` at ``late`` (even ``d``), so the two
    fitted optima point apart and the early one mislabels the late test set."""
    import math

    (row,) = doc_numbers.data_drift_rows([math.pi / 4000], points=100, late=4000,
                                         test_at=4000, test_size=400, learners=4, dim=20)
    values = dict(zip(doc_numbers.DRIFT_HEADER, row, strict=True))
    assert float(values["cosine_early_late"]) < -0.5
    assert float(values["early_model_accuracy"]) < 0.5 < float(values["late_model_accuracy"])
    table = doc_numbers.drift_table([{k: str(v) for k, v in values.items()}])
    assert "| 8e-4 |" in table and "test@4000" in table
