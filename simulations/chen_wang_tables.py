"""The tables of the docs/results-chen-wang*.md pages, rendered from CSVs alone.

Issue 36: every table on a results page is the output of a command on a committed file.
``simulations.chen_wang --docs`` renders each table from the CSVs its run wrote and places
it between ``<!-- BEGIN table:NAME -->`` markers; :func:`render_blocks` renders the same
tables from the committed ``docs/results-chen-wang[-TAG]-*.csv``, and
tests/experiments/test_doc_numbers.py checks that every page equals it.

Experiment code (not installed); reads CSVs only.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: the learners of every mushrooms run (5 on a ring)
N = 5
NAMES = {"chen-wang": "Algorithm 1 (Chen & Wang)", "chen-wang-tuned": "Algorithm 1, λ₀ tuned",
         "dsgd": "DSGD", "dola": "DOLA [inferred form]", "pdop": "PDOP [inferred form]"}
#: Chen & Wang's Table I: noise multiplier → (cumulative privacy budget, iterations to ≤ 1)
PAPER_TABLE1 = {1.0: (23.34, 8), 1.5: (16.59, 11), 2.0: (12.65, 12), 2.5: (11.97, 34),
                3.0: (11.54, 127), 3.5: (10.50, 269), 4.0: (9.64, 575), 4.5: (8.79, 934),
                5.0: (7.98, 1119), 5.5: (7.47, 2292), 6.0: (7.03, 4999)}


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _last(rows: list[dict[str, str]], key: tuple[str, ...], time: str
          ) -> dict[tuple[str, ...], dict[str, str]]:
    """Per group (in the CSV's order), the row at the largest ``time``."""
    out: dict[tuple[str, ...], dict[str, str]] = {}
    for r in rows:
        k = tuple(r[c] for c in key)
        if k not in out or int(r[time]) > int(out[k][time]):
            out[k] = r
    return out


def fig1_table(rows: list[dict[str, str]]) -> str:
    """``fig1.csv`` at ``t = T``: tracking error and regret, mean ± std over seeds."""
    lines = ["| algorithm | noise | step₀ | seeds | ‖θ−θ*‖² | regret |",
             "|---|---|---|---|---|---|"]
    for (name, noise), r in _last(rows, ("algorithm", "noise"), "t").items():
        s0 = float(r["step0"]) if r["step0"] else None
        lines.append(f"| {NAMES[name]} | {noise} | {s0 if s0 else 'paper'} | {r['seeds']} | "
                     f"{float(r['tracking_error_mean']):.4g} ± "
                     f"{float(r['tracking_error_std']):.2g} | {float(r['regret_mean']):.4g} ± "
                     f"{float(r['regret_std']):.2g} |")
    return "\n".join(lines)


def epsilon_table(rows: list[dict[str, str]]) -> str:
    """``epsilon.csv`` at ``T``: each accountant's ε, mean and range over the learners."""
    lines = ["| algorithm | accountant | ε(T) mean | min–max |", "|---|---|---|---|"]
    for (name, acc), r in _last(rows, ("algorithm", "accountant"), "T").items():
        v = np.array([float(r[f"learner{i + 1}"]) for i in range(N)])
        lines.append(f"| {NAMES[name]} | {acc} | {v.mean():.4g} | {v.min():.4g}–{v.max():.4g} |")
    return "\n".join(lines)


def table1_table(rows: list[dict[str, str]]) -> str:
    """``table1.csv`` beside Chen & Wang's own Table I row (:data:`PAPER_TABLE1`)."""
    lines = ["| multiplier m | ε tight (mean) | ε Thm 5(i) (mean) | ε best (mean) | iterations | "
             "‖mean θ − θ*‖ at T | paper ε | paper iterations |", "|" + "---|" * 8]
    for r in rows:
        m = float(r["multiplier"])
        pe, pi = PAPER_TABLE1.get(m, ("–", "–"))
        lines.append(f"| {m:g} | {float(r['epsilon_tight_mean']):.4g} | "
                     f"{float(r['epsilon_thm5_mean']):.4g} | {float(r['epsilon_best_mean']):.4g} "
                     f"| {float(r['iterations_mean']):.0f} | "
                     f"{float(r['final_distance_mean']):.3g} | {pe} | {pi} |")
    return "\n".join(lines)


def sensitivity_table(rows: list[dict[str, str]]) -> str:
    """``sensitivity.csv``: Algorithm 1 per row normalisation and ``r``."""
    lines = ["| rows | r | ‖θ*_T‖ | ‖θ−θ*‖² Fig. 1 noise | ‖θ−θ*‖² noise off | "
             "‖mean θ − θ*‖ at T | first t ≤ 1, Fig. 1 noise | first t ≤ 1, Table I noise | "
             "ε tight (eq. 22) | ε contractive |", "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {float(r['reg']):g} | {np.sqrt(float(r['theta_star_sq'])):.3g} "
            f"| {float(r['error_paper_noise_mean']):.4g} ± "
            f"{float(r['error_paper_noise_std']):.2g} | {float(r['error_noise_off_mean']):.3g} "
            f"| {float(r['mean_distance_T']):.3g} | {r['first_t_mean_distance_le_threshold']} "
            f"| {r['table1_noise_first_t_le_threshold']} "
            f"| {float(r.get('eps tight (eq. 22) mean') or 'nan'):.4g} "
            f"| {float(r.get('eps contractive (convex, unclipped) mean') or 'nan'):.4g} |")
    return "\n".join(lines)


def cnn_table(rows: list[dict[str, str]]) -> str:
    """``cnn.csv`` (``simulations.chen_wang_cnn``) at its last iteration: accuracy, mean over
    learners, per algorithm."""
    lines = ["| algorithm | noise multiplier | iteration | train | test |", "|---|---|---|---|---|"]
    for (name, mult), r in _last(rows, ("algorithm", "noise_multiplier"), "step").items():
        lines.append(f"| {NAMES[name]} | {float(mult):g} | {r['step']} | "
                     f"{float(r['train_accuracy']):.3f} | {float(r['test_accuracy']):.3f} |")
    return "\n".join(lines)


def dlg_table(rows: list[dict[str, str]]) -> str:
    """``dlg.csv``: the DLG error per (algorithm, noise, multiplier, attacked step), mean
    over the attacked learners, beside an all-black guess's."""
    groups: dict[tuple, list[dict[str, str]]] = {}
    for r in rows:
        key = (r["algorithm"], r["noise"], float(r["noise_multiplier"]), int(r["attacked_step"]))
        groups.setdefault(key, []).append(r)
    lines = ["| algorithm | noise | × | attacked step t | learners | DLG error (MSE, mean over "
             "learners) | MSE of an all-black guess |", "|---|---|---|---|---|---|---|"]
    for (name, noise, m, t), rs in groups.items():
        lines.append(f"| {NAMES[name]} | {noise} | {m:g} | {t} | "
                     f"{' '.join(r['learner'] for r in rs)} | "
                     f"{np.mean([float(r['dlg_mse']) for r in rs]):.3f} | "
                     f"{np.mean([float(r['mse_of_black_image']) for r in rs]):.3f} |")
    return "\n".join(lines)


#: block name → (the CSV's part name, renderer); a page holds the blocks whose CSV exists
PARTS: dict[str, tuple[str, Callable[[list[dict[str, str]]], str]]] = {
    "table:fig1": ("fig1", fig1_table),
    "table:epsilon": ("epsilon", epsilon_table),
    "table:table1": ("table1", table1_table),
    "table:sensitivity": ("sensitivity", sensitivity_table),
}
#: the CNN script's blocks, on the untagged page only
CNN_PARTS = {"table:cnn": ("cnn", cnn_table), "table:dlg": ("dlg", dlg_table)}


def page_tag(page: str) -> str:
    """``results-chen-wang-raw.md`` → ``-raw``; ``results-chen-wang.md`` → ``""``."""
    stem = page.removesuffix(".md")
    if not stem.startswith("results-chen-wang"):
        raise KeyError(f"{page} is not a Chen & Wang results page")
    return stem.removeprefix("results-chen-wang")


def render_blocks(page: str, docs: Path = ROOT / "docs") -> dict[str, str]:
    """Every block of a Chen & Wang page from the committed ``results-chen-wang[TAG]-*.csv``."""
    tag = page_tag(page)
    parts = {**PARTS, **(CNN_PARTS if not tag else {})}
    return {name: fn(read_csv(docs / f"results-chen-wang{tag}-{part}.csv"))
            for name, (part, fn) in parts.items()
            if (docs / f"results-chen-wang{tag}-{part}.csv").exists()}
