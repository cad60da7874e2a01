"""Paper 000, Sec. V-B (Fig. 4): the CNN under (2, 10⁻³)-LDP, τ ∈ {1, 2, 4} with R·τ fixed.

What docs/results-cnn.md reports (the paper's horizon, R·τ = 5000 steps of one image,
the methods whose streams fit in memory; ≈ 60 min per τ on one core):

    python -m simulations.cnn --steps 5000 --batch-size 1 --taus 1 --methods none independent \\
        blt --eta 0.02 --threads 1 --out results/cnn-long     # and --taus 2, --taus 4

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

from flwr_corrnoise.cnn import CNNResult, CNNSetup, run_cnn

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["none", "independent", "tree", "blt"]
NAMES = {
    "none": "noiseless",
    "independent": "independent noise",
    "tree": "binary tree (MF i)",
    "optimized": "optimized (MF ii)",
    "toeplitz": "Toeplitz (MF iii)",
    "blt": "BLT, 4 buffers",
}
HEADER = ["dataset", "method", "tau", "rounds", "epsilon", "delta", "seed", "final_accuracy",
          "steps", "batch_size", "eta", "train_size", "seconds"]


def setups(args: argparse.Namespace) -> list[CNNSetup]:
    base = CNNSetup(
        dataset=args.dataset, data_root=args.data_root, num_learners=args.learners,
        steps=args.steps, batch_size=args.batch_size, epsilon=args.epsilon, delta=args.delta,
        clip=args.clip, eta=args.eta, eta_g=args.eta_g, train_size=args.train_size,
        iid_size=args.iid_size, test_size=args.test_size, eval_every=args.eval_every,
        threads=args.threads,
    )
    return [base.with_(mechanism=m, tau=t, seed=s, data_seed=s)
            for s in range(args.seeds) for t in args.taus for m in args.methods]


def row(res: CNNResult) -> list:
    s = res.setup
    return [s.dataset, s.mechanism, s.tau, s.rounds, s.epsilon, s.delta, s.seed,
            round(res.final_accuracy, 4), s.steps, s.batch_size, s.eta,
            s.train_size or 60000, round(res.seconds, 1)]


def curve_rows(results: list[CNNResult]) -> list[list]:
    return [[r.setup.dataset, r.setup.mechanism, r.setup.tau, r.setup.seed, int(row["round"]),
             round(row["test-accuracy"], 4)] for r in results for row in r.rows]


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
            x = np.array(sorted({int(c[4]) for c in sub}))
            acc = np.array([[float(c[5]) for c in sub if c[3] == s] for s in seeds])
            mean, std = acc.mean(axis=0), acc.std(axis=0)
            ax.plot(x, mean, label=NAMES.get(method, method))
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        ax.set_title(f"τ = {tau}, R = {int(first[8]) // tau}")
        ax.set_xlabel("communication round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"test accuracy ({first[0]})")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"CNN, ({first[4]}, {first[5]})-LDP, R·τ = {first[8]}, "
                 f"batch {first[9]}", fontsize=10)
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
    groups = dict.fromkeys((r[0], int(r[8]), int(r[9])) for r in rows)
    for dataset, steps, batch in groups:
        sub = [r for r in rows if (r[0], int(r[8]), int(r[9])) == (dataset, steps, batch)]
        taus = sorted({int(r[2]) for r in sub})
        methods = sorted(dict.fromkeys(r[1] for r in sub), key=order)
        lines = [f"**{dataset}, R·τ = {steps} steps of {batch} image(s)**, final test "
                 f"accuracy (ε = {sub[0][4]}, δ = {sub[0][5]}):", "",
                 "| method | " + " | ".join(f"τ = {t}, R = {steps // t}" for t in taus) + " |",
                 "|---|" + "---|" * len(taus)]
        for m in methods:
            cells = []
            for t in taus:
                acc = [float(r[7]) for r in sub if r[1] == m and int(r[2]) == t]
                cells.append(f"{np.mean(acc):.3f} ± {np.std(acc):.3f}" if len(acc) > 1
                             else f"{acc[0]:.3f}" if acc else "")
            lines.append(f"| {NAMES.get(m, m)} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def order(method: str) -> int:
    keys = ["none", "independent", "tree", "optimized", "toeplitz", "blt"]
    return keys.index(method) if method in keys else len(keys)


def snr_table(horizons: list[int], learners: int = 10) -> str:
    """``final_noise_to_signal`` of every mechanism at the given horizons for the CNN."""
    from flwr_corrnoise.cnn import PaperCNN, final_noise_to_signal

    d = sum(p.numel() for p in PaperCNN().parameters())
    mechs = ["independent", "tree", "optimized", "toeplitz", "blt"]
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


def merge_docs_rows(path: Path, new: list[list]) -> list[list]:
    """The docs CSV keeps every run; a rerun replaces the rows of the same configuration."""
    same = {tuple(str(x) for x in (r[0], r[1], r[2], r[6], r[8], r[9])) for r in new}
    old: list[list] = []
    if path.exists():
        with open(path) as fh:
            reader = csv.reader(fh)
            next(reader, None)
            old = [r for r in reader
                   if tuple(r[i] for i in (0, 1, 2, 6, 8, 9)) not in same]
    return old + [[str(x) for x in r] for r in new]


def update_marked_section(path: Path, name: str, text: str) -> None:
    begin, end = f"<!-- BEGIN table:{name} -->", f"<!-- END table:{name} -->"
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise ValueError(f"{path} has no {begin} … {end} section")
    head, rest = doc.split(begin, 1)
    path.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])


def flower_check(setup: CNNSetup, reference: CNNResult) -> float:
    """Run ``setup`` on Flower's Ray simulation; return the largest parameter difference
    to the in-process run (the same learners, seeds and server step)."""
    from flwr.simulation import run_simulation

    from flwr_corrnoise.cnn import cnn_apps

    out: list[CNNResult] = []
    server, client = cnn_apps(setup, progress=True, on_finish=out.append)
    run_simulation(server_app=server, client_app=client, num_supernodes=setup.num_learners,
                   backend_config={"client_resources": {"num_cpus": 1}}, verbose_logging=False)
    if not out:
        raise RuntimeError("the Flower run did not finish")
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(out[0].params, reference.params, strict=True))


def run_jobs(jobs: list[CNNSetup], out: Path, results: list[CNNResult]
             ) -> tuple[list[list], list[list]]:
    """Run every setup in process, writing runs.csv as it goes (progress on stderr)."""
    start = time.perf_counter()
    with open(out / "runs.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        for k, setup in enumerate(jobs, 1):
            print(f"[{k}/{len(jobs)}] {setup.dataset} {setup.label} τ={setup.tau} "
                  f"R={setup.rounds} seed={setup.seed}", file=sys.stderr, flush=True)
            res = run_cnn(setup, progress=True)
            results.append(res)
            writer.writerow(row(res))
            fh.flush()
            print(f"[{k}/{len(jobs)}] final accuracy {res.final_accuracy:.3f} "
                  f"({res.seconds:.0f} s; {time.perf_counter() - start:.0f} s in all)",
                  file=sys.stderr, flush=True)
    curves = curve_rows(results)
    with open(out / "curves.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["dataset", "method", "tau", "seed", "round", "test_accuracy"])
        writer.writerows(curves)
    return [[str(x) for x in row(r)] for r in results], [[str(x) for x in c] for c in curves]


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
                   choices=["none", "independent", "tree", "optimized", "toeplitz", "blt"])
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument("--eta-g", type=float, default=1.0)
    p.add_argument("--train-size", type=int, default=None, help="default: all 60,000")
    p.add_argument("--iid-size", type=int, default=None, help="default: half the training set")
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--flower", action="store_true",
                   help="also run the first configuration on Flower's Ray simulation")
    p.add_argument("--out", type=Path, default=Path("results/cnn"))
    p.add_argument("--docs", action="store_true", help="write docs/results-cnn.csv etc.")
    p.add_argument("--from-runs", action="store_true",
                   help="do not run: redo the plot, table and docs from --out's CSVs")
    args = p.parse_args(argv)

    if args.download:
        from flwr_corrnoise.data.idx import load_dataset

        load_dataset(args.dataset, args.data_root, download=True)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = setups(args)
    results: list[CNNResult] = []
    if args.from_runs:  # redo the plot, table and docs from an earlier run's CSVs
        rows, curves = read_csv(args.out / "runs.csv"), read_csv(args.out / "curves.csv")
        args.steps, args.batch_size = int(rows[0][8]), int(rows[0][9])
    else:
        rows, curves = run_jobs(jobs, args.out, results)
    plot(curves, rows, args.out / "accuracy.png")
    text = table(rows)
    print(text)
    if args.flower and results:
        diff = flower_check(jobs[0], results[0])
        print(f"Flower Ray simulation of {jobs[0].label} τ={jobs[0].tau}: max |Δx| = {diff:.2e}")
        (args.out / "flower-check.txt").write_text(f"{jobs[0]}\nmax abs difference {diff}\n")
    if args.docs:
        docs = ROOT / "docs"
        merged = merge_docs_rows(docs / "results-cnn.csv", rows)
        with open(docs / "results-cnn.csv", "w", newline="") as fh:
            csv.writer(fh).writerows([HEADER, *merged])
        (docs / "figures").mkdir(exist_ok=True)
        shutil.copy(args.out / "accuracy.png",
                    docs / "figures" / f"cnn-accuracy-{args.steps}x{args.batch_size}.png")
        update_marked_section(docs / "results-cnn.md", "cnn", table(merged))
        horizons = sorted({300, 1000, 5000, *(int(r[8]) for r in merged)})
        update_marked_section(docs / "results-cnn.md", "snr", snr_table(horizons))
    print(f"results in {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
