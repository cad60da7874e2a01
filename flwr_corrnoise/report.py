"""``flwr-corrnoise report RESULTS_DIR``: the privacy each learner spent, and the accuracy.

Reads what the Flower apps of :mod:`flwr_corrnoise.apps` write (``summary.json``,
``history.csv``, ``privacy.csv``) — in ``RESULTS_DIR`` itself or in each of its
sub-directories (``flwr-corrnoise simulate`` writes one per method) — prints ε spent per
learner and, if matplotlib is installed, plots ε per learner and the test accuracy against
the round into one PNG. Why a report: Flower's log shows each round's metrics as they come;
after the run, one look should say whether every learner stayed within its budget and what
that budget bought.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunReport:
    """One results directory: final per-learner privacy, accuracy and ε by round."""

    path: Path
    label: str
    learners: dict[str, dict[str, float]]
    accuracy: list[tuple[int, float]] = field(default_factory=list)
    #: learner → [(round, ε spent after it)]
    epsilon: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: the mechanism (``"none"``: a noiseless run), which picks the colour
    method: str = ""


def find_runs(root: Path) -> list[Path]:
    """``root`` if it holds a ``summary.json``, else its sub-directories that do."""
    if (root / "summary.json").exists():
        return [root]
    runs = sorted(p.parent for p in root.glob("*/summary.json"))
    if not runs:
        raise ValueError(f"no summary.json in {root} or its sub-directories: not a results "
                         f"directory of a flwr-corrnoise app")
    return runs


#: one colour per mechanism, shared by every plot of runs (this report, the demo's
#: accuracy figure), so that a method looks the same in both
COLOURS = {
    "noiseless": "black", "none": "black", "independent": "tab:red", "blt": "tab:blue",
    "optimized": "tab:green", "toeplitz": "tab:purple", "tree": "tab:orange",
    "efficient-tree": "tab:brown",
}
_SPARE = ("tab:pink", "tab:olive", "tab:cyan", "tab:gray")


def colour(method: str) -> str:
    """The colour of a mechanism (``"none"``/``"noiseless"``: black) in every plot; a
    name not in :data:`COLOURS` gets a fixed spare colour (by a stable hash)."""
    if method in COLOURS:
        return COLOURS[method]
    return _SPARE[sum(method.encode()) % len(_SPARE)]


def load_run(path: Path) -> RunReport:
    summary = json.loads((path / "summary.json").read_text())
    setup = summary.get("setup", {})
    label = path.name
    run_method = str(setup.get("mechanism", path.name)) if setup else path.name
    if setup and run_method == "none":
        label = f"{path.name}: no noise (not private)"
    elif setup:
        label = (f"{path.name}: {run_method} (ε={setup.get('epsilon', '?')}, "
                 f"δ={setup.get('delta', '?')})")
    learners = {str(k): {m: float(v) for m, v in rec.items()}
                for k, rec in summary.get("learners", {}).items()}
    run = RunReport(path=path, label=label, learners=learners, method=run_method)
    history = path / "history.csv"
    if history.exists():
        with open(history, newline="") as fh:
            for row in csv.DictReader(fh):
                if row.get("test-accuracy") not in (None, ""):
                    run.accuracy.append((int(float(row["round"])), float(row["test-accuracy"])))
    privacy = path / "privacy.csv"
    if privacy.exists():
        with open(privacy, newline="") as fh:
            for row in csv.DictReader(fh):
                run.epsilon.setdefault(row["learner"], []).append(
                    (int(float(row["round"])), float(row["epsilon-spent"])))
    return run


def summarize(run: RunReport) -> dict[str, Any]:
    """What the command prints for one run."""
    out: dict[str, Any] = {}
    for who, rec in sorted(run.learners.items(), key=lambda kv: _order(kv[0])):
        if "epsilon-spent" not in rec:  # a noiseless learner releases no ε: it has none
            text = "no noise: not private (no ε)"
        else:
            text = f"ε spent {rec['epsilon-spent']:.4g}"
        if "epsilon" in rec:
            text += f" of {rec['epsilon']:g} (δ = {rec.get('delta', float('nan')):g})"
        if "steps" in rec and "horizon" in rec:
            text += f", {int(rec['steps'])}/{int(rec['horizon'])} steps"
        out[f"learner {who}"] = text
    if not run.learners:
        out["learners"] = "no privacy reports (noiseless run, or no learner answered)"
    if run.accuracy:
        out["final accuracy"] = run.accuracy[-1][1]
    return out


def _order(key: str) -> tuple[int, str]:
    tail = key.rsplit("-", 1)[-1]
    return (int(tail), key) if tail.isdigit() else (1 << 62, key)


def plot(runs: list[RunReport], path: Path) -> Path | None:
    """ε per learner and accuracy against the round, one PNG; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = draw(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw(runs: list[RunReport]) -> Any:
    """The report's figure (a matplotlib ``Figure``): ε of every learner, one colour and
    one legend entry per run; the accuracy of each run in the same colour."""
    import matplotlib.pyplot as plt

    fig, (ax_eps, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        c = colour(run.method or run.path.name)
        # one legend entry per run, however many learners: each learner is a thin line
        # in the run's colour (they overlap when every learner takes every round)
        learners = sorted(run.epsilon.items(), key=lambda kv: _order(kv[0]))
        for i, (_, points) in enumerate(learners):
            rounds, eps = zip(*points, strict=True)
            ax_eps.plot(rounds, eps, color=c, lw=1, alpha=0.6,
                        label=f"{run.path.name} ({len(learners)} learners)" if i == 0 else None)
        if run.accuracy:
            rounds, acc = zip(*run.accuracy, strict=True)
            ax_acc.plot(rounds, acc, color=c, label=run.label)
    if not any(run.epsilon for run in runs):
        ax_eps.text(0.5, 0.5, "no ε: noiseless runs only", ha="center", va="center",
                    transform=ax_eps.transAxes)
    ax_eps.set(xlabel="round", ylabel="ε spent", title="privacy spent, every learner")
    ax_acc.set(xlabel="round", ylabel="test accuracy", title="accuracy")
    for ax in (ax_eps, ax_acc):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def report(root: Path, png: Path | None = None) -> dict[str, Any]:
    """The ``report`` command's result: per run, ε per learner and accuracy; the plot."""
    runs = [load_run(p) for p in find_runs(root)]
    out: dict[str, Any] = {}
    for run in runs:
        out.update({(f"{run.path.name}: {k}" if len(runs) > 1 else k): v
                    for k, v in summarize(run).items()})
    written = plot(runs, png or root / "privacy.png")
    out["plot"] = str(written.resolve()) if written else "matplotlib not installed: no plot"
    return out
