"""Paper 000, Sec. V-B (Fig. 4): the CNN under (2, 10⁻³)-LDP, τ ∈ {1, 2, 4} with R·τ fixed.

Reduced size (what docs/results-cnn.md reports; ≈ 25 min on 2 cores):

    python -m simulations.cnn --out results/cnn --docs

Full size (the paper's: one image per step, every learner's whole stream, R·τ = 3000;
needs ≈ 6 h per seed on 2 cores for the constant-memory mechanisms, and the optimized and
Toeplitz streams need N·d floats per learner — 7 GB each at d ≈ 3·10⁵, so only on a
machine with ≥ 100 GB):

    python -m simulations.cnn --steps 3000 --batch-size 1 --train-size 60000 \\
        --methods none independent tree blt optimized toeplitz --out results/cnn-full

Toy size (what the tests run, on IDX files they make):

    python -m simulations.cnn --data-root DIR --learners 2 --steps 4 --taus 1 2 ...

``--dataset mnist`` uses MNIST (IDX files under ``--data-root``, or ``torchvision``'s cache,
or ``--download``); the default is Fashion-MNIST from Debian's ``dataset-fashion-mnist``
(no network here). Every row of the outputs names its dataset. ``--flower`` also runs one
configuration on Flower's Ray simulation and checks it against the in-process run.
Outputs in ``--out``: ``runs.csv`` (``dataset,method,tau,rounds,epsilon,delta,seed,
final_accuracy`` and more), ``curves.csv`` (accuracy per round), ``accuracy.png`` (one
panel per τ); ``--docs`` copies them to ``docs/results-cnn.csv`` and ``docs/figures/`` and
puts the table into ``docs/results-cnn.md`` between its markers.
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


def plot(results: list[CNNResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = sorted({r.setup.tau for r in results})
    fig, axes = plt.subplots(1, len(taus), figsize=(4.2 * len(taus), 3.4), squeeze=False)
    for ax, tau in zip(axes[0], taus, strict=True):
        for method in dict.fromkeys(r.setup.mechanism for r in results):
            runs = [r for r in results if r.setup.tau == tau and r.setup.mechanism == method]
            if not runs:
                continue
            x = np.array([row["round"] for row in runs[0].rows])
            acc = np.array([[row["test-accuracy"] for row in r.rows] for r in runs])
            mean, std = acc.mean(axis=0), acc.std(axis=0)
            ax.plot(x, mean, label=NAMES.get(method, method))
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        s = results[0].setup
        ax.set_title(f"τ = {tau}, R = {s.steps // tau}")
        ax.set_xlabel("communication round")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"test accuracy ({results[0].setup.dataset})")
    axes[0][-1].legend(fontsize=8, loc="lower right")
    s = results[0].setup
    fig.suptitle(f"CNN, ({s.epsilon:g}, {s.delta:g})-LDP, {s.num_learners} learners, "
                 f"R·τ = {s.steps}, batch {s.batch_size}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[list]) -> str:
    """Mean ± std of the final accuracy per method (rows) and τ (columns)."""
    taus = sorted({int(r[2]) for r in rows})
    methods = list(dict.fromkeys(r[1] for r in rows))
    lines = ["| method | " + " | ".join(f"τ = {t}" for t in taus) + " |",
             "|---|" + "---|" * len(taus)]
    for m in methods:
        cells = []
        for t in taus:
            acc = [float(r[7]) for r in rows if r[1] == m and int(r[2]) == t]
            cells.append(f"{np.mean(acc):.3f} ± {np.std(acc):.3f}" if len(acc) > 1
                         else f"{acc[0]:.3f}" if acc else "")
        lines.append(f"| {NAMES.get(m, m)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    args = p.parse_args(argv)

    if args.download:
        from flwr_corrnoise.data.idx import load_dataset

        load_dataset(args.dataset, args.data_root, download=True)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = setups(args)
    results: list[CNNResult] = []
    start = time.perf_counter()
    with open(args.out / "runs.csv", "w", newline="") as fh:
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
    with open(args.out / "curves.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["dataset", "method", "tau", "seed", "round", "test_accuracy"])
        for res in results:
            for r in res.rows:
                writer.writerow([res.setup.dataset, res.setup.mechanism, res.setup.tau,
                                 res.setup.seed, int(r["round"]), round(r["test-accuracy"], 4)])
    plot(results, args.out / "accuracy.png")
    rows = [row(r) for r in results]
    text = table(rows)
    print(text)
    if args.flower:
        diff = flower_check(jobs[0], results[0])
        print(f"Flower Ray simulation of {jobs[0].label} τ={jobs[0].tau}: max |Δx| = {diff:.2e}")
        (args.out / "flower-check.txt").write_text(f"{jobs[0]}\nmax abs difference {diff}\n")
    if args.docs:
        shutil.copy(args.out / "runs.csv", ROOT / "docs" / "results-cnn.csv")
        (ROOT / "docs" / "figures").mkdir(exist_ok=True)
        shutil.copy(args.out / "accuracy.png", ROOT / "docs" / "figures" / "cnn-accuracy.png")
        update_marked_section(ROOT / "docs" / "results-cnn.md", "cnn", text)
    print(f"results in {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
