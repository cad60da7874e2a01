"""Zhang, Zhu, Fay & Johansson, "Locally Differentially Private Online Federated Learning With
Correlated Noise", Sec. V-B (Fig. 4): the CNN under (2, 10⁻³)-LDP, τ ∈ {1, 2, 4} with R·τ fixed.

What docs/results-cnn.md reports: the paper's protocol (its zCDP calibration, one η for
every method and τ) and the tuned grid (the exact calibration, η tuned per method and τ):

    python -m simulations.cnn --steps 100 --batch-size 10 --taus 1 2 4 --methods none \\
        independent blt --calibration zcdp --eta 0.1 --seeds 3 --workers 2 \\
        --out results/issue36/paper --docs --docs-table paper
    python -m simulations.cnn --steps 5000 --batch-size 1 --taus 1 2 4 --methods none \\
        independent blt --tune-etas 0.01 0.02 0.04 --tune-scale tau --seeds 3 --workers 2 \\
        --out results/fig4 --docs

``--shared-eta`` with ``--tune-etas`` picks the one η on the noiseless run (tuning seed)
instead of stating it; ``--docs-table batch`` adds a run's τ = 1 rows to the batch sweep's
table (images per step at fixed images per learner).

Full size (every method and τ; the optimized and Toeplitz streams need N·d floats per
learner — 12 GB each at N = 5000, d ≈ 3·10⁵ — so only on a machine with ≥ 150 GB):

    python -m simulations.cnn --steps 5000 --batch-size 1 --taus 1 2 4 \\
        --methods none independent tree optimized toeplitz blt --eta 0.02 --out results/cnn-full

Toy size (what the tests run, on IDX files they make):

    python -m simulations.cnn --data-root DIR --learners 2 --steps 4 --taus 1 2 ...

``--dataset mnist`` uses MNIST (IDX files under ``--data-root``, or ``torchvision``'s cache,
or ``--download``); the default is Fashion-MNIST from Debian's ``dataset-fashion-mnist``
(no network here). Every row of the outputs names its dataset. ``--flower`` also runs one
configuration on Flower's Ray simulation and checks it against the in-process run.
Outputs in ``--out``: ``runs.csv`` (``dataset,method,tau,rounds,epsilon,delta,seed,
final_accuracy`` and more), ``curves.csv`` (accuracy per round), ``accuracy.png`` (one
panel per τ); ``--docs`` merges the rows into ``docs/results-cnn.csv`` (a rerun replaces
its configurations' rows), copies the plot to ``docs/figures/`` and rewrites the tables of
``docs/results-cnn.md``; ``--from-runs`` redoes plot, table and docs from ``--out``'s CSVs.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from experiments.cnn import CNNResult, CNNSetup, run_cnn
from flwr_corrnoise.mechanisms import check_mechanism, mechanism_names
from flwr_corrnoise.privacy import METHODS as CALIBRATIONS
from flwr_corrnoise.settings import NOISELESS
from simulations import marked

ROOT = Path(__file__).resolve().parents[1]
#: Fig. 4's methods (a deliberate subset of the registry, checked against it)
METHODS = [NOISELESS, *(check_mechanism(m) for m in ("independent", "tree", "blt"))]
#: the tables' order: the paper's mechanisms, then any other registered one
ORDER = [NOISELESS, *mechanism_names(["independent", "tree", "optimized", "toeplitz", "blt"])]
NAMES = {
    "none": "noiseless",
    "independent": "independent noise",
    "tree": "binary tree (MF i)",
    "optimized": "optimized (MF ii)",
    "toeplitz": "Toeplitz (MF iii)",
    "blt": "BLT, 4 buffers",
}
HEADER = ["dataset", "method", "tau", "rounds", "epsilon", "delta", "seed", "final_accuracy",
          "steps", "batch_size", "eta", "train_size", "seconds", "engine", "calibration"]


def base_setup(args: argparse.Namespace) -> CNNSetup:
    return CNNSetup(
        dataset=args.dataset, data_root=args.data_root, num_learners=args.learners,
        steps=args.steps, batch_size=args.batch_size, epsilon=args.epsilon, delta=args.delta,
        clip=args.clip, eta=args.eta, eta_g=args.eta_g, train_size=args.train_size,
        iid_size=args.iid_size, test_size=args.test_size, eval_every=args.eval_every,
        threads=args.threads, engine=args.engine, calibration=args.calibration,
    )


def setups(args: argparse.Namespace, etas: dict[tuple[str, int], float] | None = None
           ) -> list[CNNSetup]:
    """The evaluation runs: seeds ``0 … --seeds−1`` of every method and τ, at the η that
    tuning picked for the cell (``etas``) or ``--eta``."""
    base = base_setup(args)
    return [base.with_(mechanism=m, tau=t, seed=s, data_seed=s,
                       eta=(etas or {}).get((m, t), args.eta),
                       eval_every=args.eval_every or max(1, args.steps // t // args.eval_points))
            for s in range(args.seeds) for t in args.taus for m in args.methods]


def tune_eta(c: float, tau: int, scale: str) -> float:
    """Grid point ``c`` at ``τ``: ``c/τ`` with ``--tune-scale tau`` (the local drift grows
    with ``η·τ``, see docs/results-cnn.md), else ``c``."""
    return float(f"{c / tau if scale == 'tau' else c:.10g}")


def tuning_setups(args: argparse.Namespace) -> list[CNNSetup]:
    """One run per method, τ and grid point on the tuning seed ``--tune-seed`` (its model
    initialization, noise and data partition are those of no evaluation seed). With
    ``--shared-eta`` only the noiseless run at the first τ is tuned."""
    base = base_setup(args)
    if args.tune_seed < args.seeds:
        raise ValueError(f"the tuning seed {args.tune_seed} is one of the evaluation seeds "
                         f"0 … {args.seeds - 1}")
    methods, taus = ([NOISELESS], args.taus[:1]) if args.shared_eta else (args.methods,
                                                                          args.taus)
    return [base.with_(mechanism=m, tau=t, seed=args.tune_seed, data_seed=args.tune_seed,
                       eta=tune_eta(c, t, args.tune_scale),
                       eval_every=args.steps // t)  # tuning needs the final accuracy only
            for t in taus for m in methods for c in args.tune_etas]


def shared_eta(tuning: list[list], methods: list[str], taus: list[int]
               ) -> dict[tuple[str, int], float]:
    """The paper's protocol ("for all the algorithms, we use the same step sizes",
    Zhang, Zhu, Fay & Johansson, Sec. V-B): the noiseless run's best η on the tuning
    seed, for every method and τ."""
    best = best_etas([r for r in tuning if r[1] == NOISELESS])
    if len(best) != 1:
        raise ValueError(f"--shared-eta needs the noiseless tuning of one τ, got {best}")
    (eta,) = best.values()
    return {(m, t): eta for m in methods for t in taus}


def best_etas(rows: list[list]) -> dict[tuple[str, int], float]:
    """Per (method, τ): the η with the highest final accuracy on the tuning seed (a
    diverged run, NaN, ranks last; ties go to the smaller η)."""
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for r in rows:
        key, eta, acc = (r[1], int(r[2])), float(r[10]), float(r[7])
        acc = acc if np.isfinite(acc) else -1.0
        if key not in best or (acc, -eta) > (best[key][1], -best[key][0]):
            best[key] = (eta, acc)
    return {k: v[0] for k, v in best.items()}


def tuning_table(rows: list[list]) -> str:
    """Final accuracy on the tuning seed per method and τ (rows) and grid point ``η·τ``
    (columns), one table per dataset, horizon and batch size; the chosen η in bold."""
    out = []
    for group in dict.fromkeys((r[0], r[8], r[9], calibration(r)) for r in rows):
        sub = [r for r in rows if (r[0], r[8], r[9], calibration(r)) == group]
        chosen = best_etas(sub)
        cells = sorted(dict.fromkeys((r[1], int(r[2])) for r in sub),
                       key=lambda k: (k[1], order(k[0])))
        grid = sorted({round(float(r[10]) * int(r[2]), 10) for r in sub})
        lines = [f"**{group[0]}, R·τ = {group[1]} steps of {group[2]} image(s), {group[3]} "
                 f"calibration**, final test accuracy on tuning seed {sub[0][6]}:", "",
                 "| method | τ | " + " | ".join(f"η·τ = {c:g}" for c in grid) + " |",
                 "|---|---|" + "---|" * len(grid)]
        for m, t in cells:
            cols = []
            for c in grid:
                hit = [r for r in sub if (r[1], int(r[2])) == (m, t)
                       and round(float(r[10]) * t, 10) == c]
                text = f"{float(hit[0][7]):.3f}" if hit else ""
                cols.append(f"**{text}**" if hit and chosen[(m, t)] == float(hit[0][10])
                            else text)
            lines.append(f"| {NAMES.get(m, m)} | {t} | " + " | ".join(cols) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def row(res: CNNResult) -> list:
    s = res.setup
    return [s.dataset, s.mechanism, s.tau, s.rounds, s.epsilon, s.delta, s.seed,
            round(res.final_accuracy, 4), s.steps, s.batch_size, s.eta,
            s.train_size or 60000, round(res.seconds, 1), s.engine, s.calibration]


def curve_rows(results: list[CNNResult]) -> list[list]:
    return [[r.setup.dataset, r.setup.mechanism, r.setup.tau, r.setup.seed, int(row["round"]),
             round(row["test-accuracy"], 4), r.setup.eta] for r in results for row in r.rows]


def plot(curves: list[list], runs: list[list], path: Path) -> None:
    """Accuracy vs round, one panel per τ, mean ± std over seeds (from curves.csv rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = sorted({int(c[2]) for c in curves})
    fig, axes = plt.subplots(1, len(taus), figsize=(4.2 * len(taus), 3.4), squeeze=False)
    first = runs[0]
    for ax, tau in zip(axes[0], taus, strict=True):
        for method in sorted(dict.fromkeys(c[1] for c in curves), key=order):
            sub = [c for c in curves if int(c[2]) == tau and c[1] == method]
            if not sub:
                continue
            seeds = sorted({c[3] for c in sub})
            # the rounds every seed evaluated (runs may differ in --eval-points)
            common = set.intersection(*({int(c[4]) for c in sub if c[3] == s} for s in seeds))
            x = np.array(sorted(common))
            acc = np.array([[float(c[5]) for c in sorted(sub, key=lambda c: int(c[4]))
                             if c[3] == s and int(c[4]) in common] for s in seeds])
            mean, std = acc.mean(axis=0), acc.std(axis=0)
            ax.plot(x, mean, label=NAMES.get(method, method))
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        ax.set_title(f"τ = {tau}, R = {int(first[8]) // tau}")
        ax.set_xlabel("communication round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"test accuracy ({first[0]})")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"CNN, ({first[4]}, {first[5]})-LDP ({calibration(first)} calibration), "
                 f"R·τ = {first[8]}, batch {first[9]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_csv(path: Path) -> list[list]:
    with open(path) as fh:
        return list(csv.reader(fh))[1:]


def table(rows: list[list]) -> str:
    """Mean (± std over seeds) final accuracy per method (rows) and τ (columns), one
    table per dataset, horizon and batch size."""
    out = []
    groups = dict.fromkeys((r[0], int(r[8]), int(r[9]), calibration(r)) for r in rows)
    for dataset, steps, batch, cal in groups:
        sub = [r for r in rows
               if (r[0], int(r[8]), int(r[9]), calibration(r)) == (dataset, steps, batch, cal)]
        taus = sorted({int(r[2]) for r in sub})
        methods = sorted(dict.fromkeys(r[1] for r in sub), key=order)
        etas_all = sorted({float(r[10]) for r in sub})
        step = (f"one η = {etas_all[0]:g} for every method and τ" if len(etas_all) == 1
                else "η tuned per method and τ (in brackets)")
        seeds = sorted({int(r[6]) for r in sub})
        lines = [f"**{dataset}, R·τ = {steps} steps of {batch} image(s), {cal} calibration, "
                 f"{step}**; final test accuracy, {over_seeds(seeds)} "
                 f"(ε = {sub[0][4]}, δ = {sub[0][5]}):", "",
                 "| method | " + " | ".join(f"τ = {t}, R = {steps // t}" for t in taus) + " |",
                 "|---|" + "---|" * len(taus)]
        for m in methods:
            cells = []
            for t in taus:
                acc = [float(r[7]) for r in sub if r[1] == m and int(r[2]) == t]
                cell = accuracy_cell(acc, len(seeds))
                etas = sorted({float(r[10]) for r in sub if r[1] == m and int(r[2]) == t})
                if acc and len({float(r[10]) for r in sub}) > 1:  # η tuned per cell
                    cell += " (η = " + ", ".join(f"{e:g}" for e in etas) + ")"
                cells.append(cell)
            lines.append(f"| {NAMES.get(m, m)} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def calibration(r: list) -> str:
    """A row's calibration (rows written before the column existed used the exact one)."""
    return r[14] if len(r) > 14 else "exact"


def order(method: str) -> int:
    return ORDER.index(method) if method in ORDER else len(ORDER)


def snr_table(horizons: list[int], learners: int = 10) -> str:
    """``final_noise_to_signal`` of every mechanism at the given horizons for the CNN."""
    from experiments.cnn import PaperCNN, final_noise_to_signal

    d = sum(p.numel() for p in PaperCNN().parameters())
    mechs = [check_mechanism(m) for m in ("independent", "tree", "optimized", "toeplitz", "blt")]
    lines = ["| R·τ | " + " | ".join(NAMES[m] for m in mechs) + " |",
             "|---|" + "---|" * len(mechs)]
    for n in horizons:
        cells = []
        for m in mechs:
            if m == "optimized" and n > 1000:  # a dense N×N solve; ≈ Toeplitz anyway
                cells.append("(≈ Toeplitz)")
                continue
            setup = CNNSetup(mechanism=m, steps=n, num_learners=learners)
            cells.append(f"{final_noise_to_signal(setup, d):.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n(d = {d:,}, n = {learners} learners, ε = 2, δ = 10⁻³.)"


def merge_docs_rows(path: Path, new: list[list],
                    key: tuple[int, ...] = (0, 1, 2, 6, 8, 9, 14)) -> list[list]:
    """The docs CSV keeps every run; a rerun replaces the rows of the same configuration
    (columns ``key`` of a row: dataset, method, τ, seed, steps, batch, calibration; the
    tuning CSV adds η)."""
    same = {tuple(str(r[i]) for i in key) for r in new}
    old: list[list] = []
    if path.exists():
        with open(path) as fh:
            reader = csv.reader(fh)
            next(reader, None)
            old = [r for r in reader if tuple(r[i] for i in key) not in same]
    return old + [[str(x) for x in r] for r in new]


def update_marked_section(path: Path, name: str, text: str) -> None:
    """The ``table:NAME`` block of a page that must already hold it
    (:func:`simulations.marked.update_marked_section`)."""
    marked.update_marked_section(path, f"table:{name}", text, append=False)


#: ``--docs-table``: the docs CSV a run's rows are merged into (its tuning rows go to
#: ``<name>-tuning.csv``), each rendered into the blocks of docs/results-cnn.md by
#: :func:`render_blocks`
DOCS_TABLES = {"cnn": "results-cnn", "paper": "results-cnn-paper", "batch": "results-cnn-batch"}
#: the page's block names per docs table (runs, tuning)
DOCS_BLOCKS = {"cnn": ("cnn", "tuning"), "paper": ("paper", "paper-tuning"),
               "batch": ("batch", None)}


def render_blocks(docs: Path = ROOT / "docs") -> dict[str, str]:
    """Every generated block of docs/results-cnn.md, rendered from the committed CSVs
    alone: what ``--docs`` writes, and what tests/experiments/test_doc_numbers.py compares with the
    page (so no table can drift from its file)."""
    blocks: dict[str, str] = {}
    for name, stem in DOCS_TABLES.items():
        runs_block, tuning_block = DOCS_BLOCKS[name]
        if (docs / f"{stem}.csv").exists():
            rows = read_csv(docs / f"{stem}.csv")
            blocks[runs_block] = batch_table(rows) if name == "batch" else table(rows)
        if tuning_block and (docs / f"{stem}-tuning.csv").exists():
            blocks[tuning_block] = tuning_table(read_csv(docs / f"{stem}-tuning.csv"))
    if (docs / "results-cnn-collapse.csv").exists():
        from simulations.cnn_collapse import collapse_table

        with open(docs / "results-cnn-collapse.csv", newline="") as fh:
            blocks["collapse"] = collapse_table(list(csv.DictReader(fh)))
    cnn = read_csv(docs / "results-cnn.csv")
    blocks["snr"] = snr_table(sorted({300, 1000, 5000, *(int(r[8]) for r in cnn)}))
    return blocks


def write_docs(args: argparse.Namespace, rows: list[list], tuning: list[list]) -> None:
    """Merge the rows into ``docs/<DOCS_TABLES[--docs-table]>.csv`` (the batch sweep keeps
    its τ = 1 rows only), copy the plot, and rewrite every block of docs/results-cnn.md
    from the CSVs."""
    docs = ROOT / "docs"
    stem = DOCS_TABLES[args.docs_table]
    if args.docs_table == "batch":
        rows = [r for r in rows if int(r[2]) == 1]
    merged = merge_docs_rows(docs / f"{stem}.csv", rows)
    with open(docs / f"{stem}.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([HEADER, *merged])
    if tuning and args.docs_table != "batch":
        merged_tuning = merge_docs_rows(docs / f"{stem}-tuning.csv", tuning,
                                        key=(0, 1, 2, 6, 8, 9, 10, 14))
        with open(docs / f"{stem}-tuning.csv", "w", newline="") as fh:
            csv.writer(fh).writerows([HEADER, *merged_tuning])
    if args.docs_table != "batch":
        (docs / "figures").mkdir(exist_ok=True)
        cal = calibration(rows[0])
        suffix = "" if cal == "exact" else f"-{cal}"
        shutil.copy(args.out / "accuracy.png", docs / "figures" /
                    f"cnn-accuracy-{args.steps}x{args.batch_size}{suffix}.png")
    for name, text in render_blocks(docs).items():
        update_marked_section(docs / "results-cnn.md", name, text)


def batch_table(rows: list[list], learners: int = 10) -> str:
    """The batch sweep: final accuracy per batch ``B`` (rows) and method at a fixed number
    of images per learner ``N·B`` and τ = 1, beside each private method's final
    noise-to-signal ratio. A step adds its noise to the *sum* of ``B`` clipped gradients
    (the sensitivity is ``2·B_g`` whatever ``B``), so the ratio is
    :func:`~experiments.cnn.final_noise_to_signal` at ``N`` steps divided by ``B``."""
    from experiments.cnn import PaperCNN, final_noise_to_signal

    d = sum(p.numel() for p in PaperCNN().parameters())
    out = []
    groups = dict.fromkeys((r[0], int(r[8]) * int(r[9]), calibration(r)) for r in rows)
    for dataset, images, cal in groups:
        sub = [r for r in rows
               if (r[0], int(r[8]) * int(r[9]), calibration(r)) == (dataset, images, cal)]
        methods = sorted(dict.fromkeys(r[1] for r in sub), key=order)
        private = [m for m in methods if m != NOISELESS]
        seeds = sorted({int(r[6]) for r in sub})
        lines = [f"**{dataset}, {images} images per learner (N·B), τ = 1, {cal} "
                 f"calibration, one η per B for every method**; final test accuracy, "
                 f"{over_seeds(seeds)} (ε = {sub[0][4]}, δ = {sub[0][5]}), and the final "
                 f"noise-to-signal ratio:", "",
                 "| B (images per step) | N = R (steps) | η | "
                 + " | ".join(NAMES.get(m, m) for m in methods) + " | "
                 + " | ".join(f"noise/signal, {NAMES.get(m, m)}" for m in private) + " |",
                 "|---|---|---|" + "---|" * (len(methods) + len(private))]
        for b in sorted({int(r[9]) for r in sub}):
            here = [r for r in sub if int(r[9]) == b]
            steps = int(here[0][8])
            etas = ", ".join(f"{e:g}" for e in sorted({float(r[10]) for r in here}))
            cells = [accuracy_cell([float(r[7]) for r in here if r[1] == m], len(seeds))
                     for m in methods]
            ratios = [final_noise_to_signal(CNNSetup(
                mechanism=m, steps=steps, num_learners=learners, epsilon=float(sub[0][4]),
                delta=float(sub[0][5]), calibration=cal), d) / b for m in private]
            lines.append(f"| {b} | {steps} | {etas} | " + " | ".join(cells) + " | "
                         + " | ".join(f"{x:.2f}" for x in ratios) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def over_seeds(seeds: list[int]) -> str:
    """The caption's seeds: one seed is a single run, not a mean."""
    if len(seeds) == 1:
        return f"one seed ({seeds[0]}), no spread"
    return f"mean ± std over seeds {', '.join(map(str, seeds))}"


def accuracy_cell(acc: list[float], seeds: int) -> str:
    """``mean ± std`` over the seeds (a cell with fewer seeds than its table says so)."""
    if not acc:
        return ""
    text = f"{np.mean(acc):.3f} ± {np.std(acc):.3f}" if len(acc) > 1 else f"{acc[0]:.3f}"
    return text + (f" [{len(acc)} seed{'s' * (len(acc) > 1)}]" if len(acc) != seeds else "")


def flower_check(setup: CNNSetup, reference: CNNResult, client_cpus: float = 1.0) -> float:
    """Run ``setup`` on Flower's Ray simulation; return the largest parameter difference
    to the in-process run (the same learners, seeds and server step). ``client_cpus`` is
    Flower's ``client_resources.num_cpus``: Ray runs (its CPUs) / ``client_cpus`` ClientApp
    actors, each a process that imports torch, Flower and the app."""
    from flwr.simulation import run_simulation

    from experiments.cnn import cnn_apps

    out: list[CNNResult] = []
    server, client = cnn_apps(setup, progress=True, on_finish=out.append)
    run_simulation(server_app=server, client_app=client, num_supernodes=setup.num_learners,
                   backend_config={"client_resources": {"num_cpus": client_cpus}},
                   verbose_logging=False)
    if not out:
        raise RuntimeError("the Flower run did not finish")
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(out[0].params, reference.params, strict=True))


CURVES_HEADER = ["dataset", "method", "tau", "seed", "round", "test_accuracy", "eta"]


def run_key(r: list) -> tuple[str, ...]:
    """What identifies a run in runs.csv: dataset, method, τ, seed, steps, batch, η, engine,
    calibration."""
    return tuple(str(r[i]) for i in (0, 1, 2, 6, 8, 9, 10, 13, 14))


def setup_key(s: CNNSetup) -> tuple[str, ...]:
    """:func:`run_key` of the row a setup will write."""
    return tuple(str(x) for x in (s.dataset, s.mechanism, s.tau, s.seed, s.steps,
                                  s.batch_size, s.eta, s.engine, s.calibration))


def _one(setup: CNNSetup) -> tuple[list, list[list]]:
    """One run (in a worker process): its runs.csv row and curves.csv rows."""
    res = run_cnn(setup, progress=True)
    return [str(x) for x in row(res)], [[str(x) for x in c] for c in curve_rows([res])]


def run_jobs(jobs: list[CNNSetup], out: Path, name: str = "runs", workers: int = 1
             ) -> tuple[list[list], list[list]]:
    """Run every setup in process, ``workers`` at a time (each in its own process with
    one torch thread), appending to ``<name>.csv`` and ``<name>-curves.csv`` (``runs``:
    ``curves.csv``) as each finishes; progress on stderr. Runs already in the CSV (same
    dataset, method, τ, seed, horizon, batch, η, engine) are not run again, so an
    interrupted sweep resumes. Returns the jobs' rows and curves in job order."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    runs_path = out / f"{name}.csv"
    curves_path = out / ("curves.csv" if name == "runs" else f"{name}-curves.csv")
    done: dict[tuple[str, ...], list] = {}
    curves_done: list[list] = []
    if runs_path.exists() and curves_path.exists():
        done = {run_key(r): r for r in read_csv(runs_path) if len(r) == len(HEADER)}
        curves_done = [c for c in read_csv(curves_path) if len(c) == len(CURVES_HEADER)]
    else:
        for path, header in ((runs_path, HEADER), (curves_path, CURVES_HEADER)):
            with open(path, "w", newline="") as fh:
                csv.writer(fh).writerow(header)
    todo = [j for j in jobs if setup_key(j) not in done]
    if len(todo) < len(jobs):
        print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already in {runs_path}",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    new_curves: list[list] = []

    def record(k: int, setup: CNNSetup, got: tuple[list, list[list]]) -> None:
        r, c = got
        done[run_key(r)] = r
        new_curves.extend(c)
        with open(runs_path, "a", newline="") as fh:
            csv.writer(fh).writerow(r)
        with open(curves_path, "a", newline="") as fh:
            csv.writer(fh).writerows(c)
        print(f"[{k}/{len(todo)}] {setup.label} τ={setup.tau} η={setup.eta:g} "
              f"seed={setup.seed}: final accuracy {float(r[7]):.3f} ({float(r[12]):.0f} s; "
              f"{time.perf_counter() - start:.0f} s in all)", file=sys.stderr, flush=True)

    if workers <= 1:
        for k, setup in enumerate(todo, 1):
            print(f"[{k}/{len(todo)}] {setup.dataset} {setup.label} τ={setup.tau} "
                  f"R={setup.rounds} η={setup.eta:g} seed={setup.seed}", file=sys.stderr,
                  flush=True)
            record(k, setup, _one(setup))
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(_one, j.with_(threads=1)): j for j in todo}
            for k, fut in enumerate(as_completed(futures), 1):
                record(k, futures[fut], fut.result())
    keys = [setup_key(j) for j in jobs]
    rows = [done[k] for k in keys]
    wanted = {(k[0], k[1], k[2], k[3], k[6]) for k in keys}
    curves = [c for c in curves_done + new_curves
              if (c[0], c[1], c[2], c[3], c[6]) in wanted]
    return rows, curves


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    p.add_argument("--data-root", default=None, help="a directory with the 4 IDX files")
    p.add_argument("--download", action="store_true", help="allow torchvision to download")
    p.add_argument("--learners", type=int, default=10)
    p.add_argument("--steps", type=int, default=600, help="R·τ, local steps per learner")
    p.add_argument("--taus", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--batch-size", type=int, default=5, help="images per local step")
    p.add_argument("--methods", nargs="+", default=METHODS,
                   choices=ORDER)
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--calibration", default="exact", choices=list(CALIBRATIONS),
                   help="exact: the analytic Gaussian (tight); zcdp: the paper's zCDP "
                        "calibration (noise multiplier 1.98 at (2, 1e-3))")
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument("--eta-g", type=float, default=1.0)
    p.add_argument("--train-size", type=int, default=None, help="default: all 60,000")
    p.add_argument("--iid-size", type=int, default=None, help="default: half the training set")
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--eval-every", type=int, default=0,
                   help="rounds between test evaluations (0: see --eval-points)")
    p.add_argument("--eval-points", type=int, default=20,
                   help="test evaluations per run besides round 0 (each costs a pass over "
                        "the test set)")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--workers", type=int, default=1,
                   help="runs side by side, each in its own process with one torch thread")
    p.add_argument("--engine", default="device", choices=["device", "host"],
                   help="device: the private step on the model's device (PrivateOptimizer); "
                        "host: the NumPy reference round (slow)")
    p.add_argument("--tune-etas", type=float, nargs="+", default=None,
                   help="tune η per method and τ on this grid (see --tune-scale) first")
    p.add_argument("--tune-scale", default="tau", choices=["tau", "none"],
                   help="tau: grid point c means η = c/τ; none: η = c")
    p.add_argument("--shared-eta", action="store_true",
                   help="the paper's protocol: tune η on the noiseless run at the first τ "
                        "only and use it for every method and τ")
    p.add_argument("--tune-seed", type=int, default=100,
                   help="the tuning runs' seed (not an evaluation seed)")
    p.add_argument("--flower", action="store_true",
                   help="also run the first configuration on Flower's Ray simulation")
    p.add_argument("--flower-client-cpus", type=float, default=1.0,
                   help="with --flower: Flower's client_resources.num_cpus (Ray runs its "
                        "CPUs / this many ClientApp actors)")
    p.add_argument("--out", type=Path, default=Path("results/cnn"))
    p.add_argument("--docs", action="store_true", help="write docs/results-cnn.csv etc.")
    p.add_argument("--docs-table", default="cnn", choices=sorted(DOCS_TABLES),
                   help="with --docs: which docs CSV the rows join (cnn: the tuned grid, "
                        "paper: the paper's protocol, batch: the batch sweep, τ = 1 rows)")
    p.add_argument("--from-runs", action="store_true",
                   help="do not run: redo the plot, table and docs from --out's CSVs")
    args = p.parse_args(argv)

    if args.download:
        from experiments.data.mnist import load_dataset

        load_dataset(args.dataset, args.data_root, download=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tuning: list[list] = []
    if args.from_runs:  # redo the plot, table and docs from an earlier run's CSVs
        rows, curves = read_csv(args.out / "runs.csv"), read_csv(args.out / "curves.csv")
        args.steps, args.batch_size = int(rows[0][8]), int(rows[0][9])
        if (args.out / "tuning.csv").exists():
            tuning = read_csv(args.out / "tuning.csv")
        jobs = []
    else:
        etas = None
        if args.tune_etas:
            tuning, _ = run_jobs(tuning_setups(args), args.out, "tuning", args.workers)
            etas = (shared_eta(tuning, args.methods, args.taus) if args.shared_eta
                    else best_etas(tuning))
            print(tuning_table(tuning))
        jobs = setups(args, etas)
        rows, curves = run_jobs(jobs, args.out, "runs", args.workers)
    plot(curves, rows, args.out / "accuracy.png")
    text = table(rows)
    print(text)
    if args.flower and jobs:
        diff = flower_check(jobs[0], run_cnn(jobs[0], progress=False), args.flower_client_cpus)
        print(f"Flower Ray simulation of {jobs[0].label} τ={jobs[0].tau}: max |Δx| = {diff:.2e}")
        (args.out / "flower-check.txt").write_text(f"{jobs[0]}\nmax abs difference {diff}\n")
    if args.docs:
        write_docs(args, rows, tuning)
    print(f"results in {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
