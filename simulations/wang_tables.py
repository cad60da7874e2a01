"""The tables of docs/results-wang.md, rendered from the committed CSVs alone.

Issue 36: every table on a results page is the output of a command on a committed file, so
that no number can drift from the run that made it. ``python -m simulations.doc_numbers
blocks results-wang.md`` writes each table between its ``<!-- BEGIN table:NAME -->``
markers, and
tests/experiments/test_doc_numbers.py checks that the page equals :func:`render_blocks`.
``simulations.wang report`` prints the same tables from a run's output folder.

Experiment code (not installed); reads CSVs only.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

#: classes per data set: the multiclass logistic loss of the zero decision is ``ln k``
#: (every class scored 0), the level a private method must beat to have learned anything
CLASSES = {"letter": 26, "poker": 10}


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def dataset_label(name: str) -> str:
    """The page's short name of a data set row (its footnotes ¹ ² say where the rows came
    from; the CSV keeps the full provenance)."""
    if name.startswith("letter"):
        return "letter¹"
    if name.startswith("poker stand-in"):
        return "poker stand-in²"
    if name.startswith("poker"):
        return "poker²"
    return name


def zero_loss(name: str) -> float:
    """``ln k`` for the data set's ``k`` classes (:data:`CLASSES`)."""
    for key, k in CLASSES.items():
        if name.startswith(key):
            return math.log(k)
    raise KeyError(f"no class count for data set {name!r}")


def _header(cols: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def summary_table(rows: list[dict[str, str]]) -> str:
    """A ``main-summary.csv``: final AL, accuracy, wall ms per round and the ε of every
    accountant (Theorem 3.6's and the exact gossip sensitivity's for the blocked
    algorithms; basic composition and per-datum for PD-OGD)."""
    lines = _header(["dataset", "algorithm", "T", "C", "multiplier", "final AL", "accuracy",
                     "ms/round", "ε (paper)", "ε (exact)", "ε PD-OGD comp./per-datum"])
    for r in rows:
        head = (f"| {dataset_label(r['dataset'])} | {r['algorithm']} | {r['rounds']} | "
                f"{r['clip']} | {r['multiplier']} | {float(r['final_AL']):.4f} | "
                f"{float(r['accuracy']):.3f} | {float(r['ms_per_round']):.3f} | ")
        if r.get("eps exact-gossip-sensitivity"):
            lines.append(head + f"{float(r['eps paper-thm-3.6']):.3g} | "
                         f"{float(r['eps exact-gossip-sensitivity']):.3g} |")
        else:
            ogd = "/".join(f"{float(r[k]):.3g}" for k in ("eps paper-basic-composition",
                                                          "eps per-datum") if r.get(k))
            lines.append(head + f"– | – | {ogd} |")
    return "\n".join(lines)


def rerun_table(rows: list[dict[str, str]]) -> str:
    """The issue-24 rerun's reported runs: final AL beside the zero decision's ``ln k``,
    the best AL per data set in bold."""
    best = {d: min(float(r["final_AL"]) for r in rows if r["dataset"] == d)
            for d in dict.fromkeys(r["dataset"] for r in rows)}
    lines = _header(["dataset", "algorithm", "C", "multiplier", "final AL", "zero decision",
                     "accuracy", "ms/round"])
    for r in rows:
        al = float(r["final_AL"])
        cell = f"**{al:.4f}**" if al == best[r["dataset"]] else f"{al:.4f}"
        lines.append(f"| {dataset_label(r['dataset'])} | {r['algorithm']} | "
                     f"{float(r['clip']):g} | {float(r['multiplier']):g} | {cell} | "
                     f"{zero_loss(r['dataset']):.4f} | {float(r['accuracy']):.3f} | "
                     f"{float(r['ms_per_round']):.2f} |")
    return "\n".join(lines)


def tuning_table(rows: list[dict[str, str]]) -> str:
    """The full-horizon tuning (``tuning.csv``): AL per h multiplier at the chosen C, the
    other C evaluated at the chosen multiplier, and whether the chosen point is interior
    (a smaller and a larger multiplier were evaluated and both are worse)."""
    mults = sorted({float(r["multiplier"]) for r in rows})
    lines = _header(["dataset", "algorithm", "C", *[f"h × {m:g}" for m in mults], "chosen",
                     "optimum interior?"])
    groups = dict.fromkeys((r["dataset"], r["algorithm"]) for r in rows)
    for dataset, algo in groups:
        mine = [r for r in rows if (r["dataset"], r["algorithm"]) == (dataset, algo)]
        (pick,) = [r for r in mine if r["chosen"] == "True"]
        clip, mult = float(pick["clip"]), float(pick["multiplier"])
        at_clip = {float(r["multiplier"]): float(r["final_AL"]) for r in mine
                   if float(r["clip"]) == clip}
        others = [r for r in mine if float(r["clip"]) != clip
                  and float(r["multiplier"]) == mult]
        c_cell = f"{clip:g}"
        if others:
            same = all(f"{float(r['final_AL']):.4f}" == f"{float(pick['final_AL']):.4f}"
                       for r in others)
            listed = ", ".join(f"{float(r['clip']):g}" for r in
                               sorted(others, key=lambda r: float(r["clip"])))
            c_cell += (f" ({listed}: identical)" if same else
                       " (" + ", ".join(f"{float(r['clip']):g}: {float(r['final_AL']):.4f}"
                                        for r in others) + ")")
        cells = [("–" if m not in at_clip else f"**{at_clip[m]:.4f}**" if m == mult
                  else f"{at_clip[m]:.4f}") for m in mults]
        interior = "**yes**" if pick["optimum_interior"] == "True" else "no"
        if not others:
            interior += " (in h; C not searched)"
        lines.append(f"| {dataset_label(dataset)} | {algo} | {c_cell} | {' | '.join(cells)} "
                     f"| C {clip:g}, h × {mult:g} | {interior} |")
    return "\n".join(lines)


def seeds_table(rows: list[dict[str, str]]) -> str:
    """Final AL over seeds per algorithm: mean ± sample std (ddof 1), min – max."""
    lines = _header(["algorithm", "seeds", "final AL: mean ± std", "min – max"])
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        v = np.array([float(r["final_AL"]) for r in rows if r["algorithm"] == algo])
        seeds = " ".join(sorted((r["seed"] for r in rows if r["algorithm"] == algo), key=int))
        lines.append(f"| {algo} | {seeds} | {v.mean():.4f} ± {v.std(ddof=1):.4f} | "
                     f"{v.min():.4f} – {v.max():.4f} |")
    return "\n".join(lines)


def timing_table(rows: list[dict[str, str]]) -> str:
    lines = _header(["dataset", "algorithm", "horizon", "L", "CPU ms per round (9 learners)"])
    for r in rows:
        lines.append(f"| {dataset_label(r['dataset'])} | {r['algorithm']} | {r['horizon']} | "
                     f"{r['L']} | {float(r['cpu_ms_per_round']):.3f} |")
    return "\n".join(lines)


def sweeps_table(rows: list[dict[str, str]]) -> str:
    """One row per sweep point (``sweeps.csv`` repeats it once per curve point)."""
    lines = _header(["sweep", "algorithm", "graph", "n", "ε", "ρ", "L", "gossip steps",
                     "final AL"])
    seen = set()
    for r in rows:
        key = (r["sweep"], r["algorithm"], r["graph"], r["n"], r["epsilon"])
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| {r['sweep']} | {r['algorithm']} | {r['graph']} | {r['n']} | "
                     f"{r['epsilon']} | {float(r['rho']):.3f} | {r['L']} | "
                     f"{r['gossip_steps']} | {float(r['final_AL']):.4f} |")
    return "\n".join(lines)


def slopes(rows: list[dict[str, str]]) -> dict[tuple[str, str, str], float]:
    """Least-squares slope of log regret vs log T per (algorithm, ε, h multiplier)."""
    out = {}
    groups = dict.fromkeys((r["algorithm"], r["epsilon"], r["h_multiplier"]) for r in rows)
    for key in groups:
        sel = [r for r in rows if (r["algorithm"], r["epsilon"], r["h_multiplier"]) == key]
        Ts = sorted({int(r["T"]) for r in sel})
        reg = [np.mean([float(r["regret_mean"]) for r in sel if int(r["T"]) == T]) for T in Ts]
        if len(Ts) >= 2 and min(reg) > 0:
            out[key] = float(np.polyfit(np.log(Ts), np.log(reg), 1)[0])
    return out


def rate_table(rows: list[dict[str, str]]) -> str:
    """The regret check: each (T, ε, h) point against its corollary bound."""
    lines = _header(["algorithm", "ε", "h multiplier", "T", "L", "regret (mean over learners)",
                     "corollary bound", "regret / bound"])
    for r in rows:
        lines.append(f"| {r['algorithm']} | {r['epsilon']} | {r['h_multiplier']} | {r['T']} | "
                     f"{r['L']} | {float(r['regret_mean']):.4g} | {float(r['bound']):.4g} | "
                     f"{float(r['regret_mean']) / float(r['bound']):.2e} |")
    return "\n".join(lines)


def slope_table(rows: list[dict[str, str]]) -> str:
    lines = _header(["algorithm", "ε", "h multiplier", "slope of log regret vs log T"])
    for (alg, eps, mult), sl in slopes(rows).items():
        lines.append(f"| {alg} | {eps} | {mult} | {sl:.3f} |")
    return "\n".join(lines)


#: docs/results-wang.md's blocks: name → (committed CSV, renderer)
BLOCKS: dict[str, tuple[str, Callable[[list[dict[str, str]]], str]]] = {
    "table:30k-tuning": ("results-wang-30k-tuning.csv", tuning_table),
    "table:30k-main": ("results-wang-30k-main-summary.csv", rerun_table),
    "table:main": ("results-wang-main-summary.csv", summary_table),
    "table:seeds": ("results-wang-seeds-main-summary.csv", seeds_table),
    "table:150": ("results-wang-150-main-summary.csv", summary_table),
    "table:timing": ("results-wang-timing.csv", timing_table),
    "table:sweeps": ("results-wang-sweeps.csv", sweeps_table),
    "table:rate": ("results-wang-rate.csv", slope_table),
}


def render_blocks(docs: Path = ROOT / "docs") -> dict[str, str]:
    """Every block of docs/results-wang.md from the committed CSVs in ``docs``."""
    return {name: fn(read_csv(docs / path)) for name, (path, fn) in BLOCKS.items()}


def report(out: Path) -> str:
    """The tables of whatever CSVs a run's ``--out`` folder holds."""
    parts = [fn(read_csv(out / name)) for name, fn in (
        ("main-summary.csv", summary_table), ("timing.csv", timing_table),
        ("sweeps.csv", sweeps_table), ("rate.csv", rate_table), ("rate.csv", slope_table))
        if (out / name).exists()]
    tuning = read_csv(out / "tuning.csv") if (out / "tuning.csv").exists() else []
    if tuning and "chosen" in tuning[0]:  # the full-horizon tuning marks its choice
        parts.insert(1, tuning_table(tuning))
    return "\n\n".join(parts)
