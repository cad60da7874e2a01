"""Does ``plan`` tell the truth? Its predicted noise-to-signal and verdict beside measured
runs (issue 32 item 2).

The task is Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated
Learning With Correlated Noise") synthetic logistic regression, the library's reference app
(:mod:`flwr_corrnoise.apps.logreg_task`), run in process through the public API
(``experiments.logreg.run_logreg_inprocess``: the same learner and server code as the
Flower app): each learner's stream used once (``examples = rounds × τ``, batches of 1), the
noise added per step, per round (the learner's round update) or centrally. For every run
the plan is made from the run's own settings (:func:`flwr_corrnoise.plan.make_plan`, the
signal at its upper bound) and the run's final test accuracy is measured (mean over
``--seeds`` noise seeds). Then the levers: from the per-step base, change one thing at a
time (ε ×2, learners ×2, another mechanism, adaptive clipping) and compare the plan's
ranking (by end-of-run NSR) with the measured one (by accuracy).

    python -m simulations.plan_check --docs          # docs/results-plan-check.csv, plan.md

Toy size (what the test runs): ``--rounds 6 --learners 3 --seeds 1 --out /tmp/pc``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from experiments.logreg import run_logreg_inprocess  # noqa: E402
from flwr_corrnoise.apps.logreg_task import LogRegEvaluator, LogRegSetup  # noqa: E402
from flwr_corrnoise.mechanisms.participation import ONCE  # noqa: E402
from flwr_corrnoise.plan import PlanInput, make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["name", "mode", "mechanism", "epsilon", "learners", "adaptive", "nsr_first",
          "nsr_final", "verdict", "accuracy_mean", "accuracy_std", "seeds", "seconds"]


def plan_for(setup: LogRegSetup, adaptive: float | None) -> PlanInput:
    """The plan of one run, from the run's own settings."""
    if setup.mechanism == "none":
        raise ValueError("no plan without noise")
    mode = {"step": "step", "round": "round", "server": "central"}[setup.noise_at]
    if mode == "step":
        return PlanInput(model_size=setup.dim, examples=setup.horizon, batch_size=1,
                         epochs=1, learners=setup.num_learners, mechanism=setup.mechanism,
                         epsilon=setup.epsilon, delta=setup.delta, clip_norm=setup.clip,
                         rounds=setup.rounds, adaptive_quantile=adaptive)
    return PlanInput(model_size=setup.dim, examples=1, batch_size=1, epochs=1,
                     learners=setup.num_learners, mechanism=setup.mechanism,
                     epsilon=setup.epsilon, delta=setup.delta, clip_norm=setup.round_clip,
                     rounds=setup.rounds, mode=mode, round_participation=ONCE)


def measure(setup: LogRegSetup, seeds: int) -> tuple[float, float, float]:
    """Final test accuracy (mean, std over noise seeds) and seconds."""
    start = time.perf_counter()
    accs = []
    for seed in range(seeds):
        run = dataclasses.replace(setup, seed=seed)
        evaluator = LogRegEvaluator(run, regret=False)
        result = run_logreg_inprocess(run)
        accs.append(evaluator(run.rounds, result.params)["test-accuracy"])
    arr = np.array(accs, dtype=float)
    return float(np.mean(arr)), float(np.std(arr)), time.perf_counter() - start


def runs(args: argparse.Namespace) -> list[tuple[str, LogRegSetup, float | None]]:
    base = LogRegSetup(num_learners=args.learners, dim=args.dim, rounds=args.rounds,
                       tau=args.tau, eta=args.eta, mechanism="blt", epsilon=args.epsilon,
                       delta=args.delta, clip=args.clip, test_size=args.test_size)
    return [
        ("plain", dataclasses.replace(base, mechanism="none"), None),
        ("clip only (ε = 10⁴)", dataclasses.replace(base, epsilon=1e4), None),
        ("per-step", base, None),
        ("per-round", dataclasses.replace(base, noise_at="round"), None),
        ("central", dataclasses.replace(base, noise_at="server"), None),
        ("lever: ε ×2", dataclasses.replace(base, epsilon=2 * args.epsilon), None),
        ("lever: learners ×2", dataclasses.replace(base, num_learners=2 * args.learners),
         None),
        ("lever: independent noise", dataclasses.replace(base, mechanism="independent"),
         None),
        ("lever: adaptive clipping γ = 0.5", base, 0.5),
    ]


def run_one(name: str, setup: LogRegSetup, adaptive: float | None, seeds: int) -> dict:
    row: dict = {"name": name, "mode": setup.noise_at, "mechanism": setup.mechanism,
                 "epsilon": setup.epsilon, "learners": setup.num_learners,
                 "adaptive": "" if adaptive is None else adaptive}
    if setup.mechanism != "none":
        plan = make_plan(plan_for(setup, adaptive), levers=False)
        row.update(nsr_first=f"{plan.nsr_first_round:.4g}", nsr_final=f"{plan.nsr_final:.4g}",
                   verdict=plan.verdict)
    else:
        row.update(nsr_first="", nsr_final="", verdict="(no noise)")
    if adaptive is not None:  # the adaptive run: the learners' settings carry the quantile
        setup = _adaptive(setup, adaptive)
    mean, std, secs = measure(setup, seeds)
    row.update(accuracy_mean=f"{mean:.4f}", accuracy_std=f"{std:.4f}", seeds=seeds,
               seconds=f"{secs:.1f}")
    return row


class _AdaptiveSetup(LogRegSetup):
    """The reference setup whose learners clip adaptively (the settings are the learners'
    own: :class:`~flwr_corrnoise.settings.PrivacySettings` with ``adaptive``)."""

    quantile: float = 0.5

    def settings(self):  # type: ignore[no-untyped-def]
        from flwr_corrnoise.adaptive_clipping import AdaptiveClipping

        return dataclasses.replace(super().settings(),
                                   adaptive=AdaptiveClipping(self.quantile, lr=0.01))


def _adaptive(setup: LogRegSetup, quantile: float) -> LogRegSetup:
    out = _AdaptiveSetup(**{f.name: getattr(setup, f.name)
                            for f in dataclasses.fields(LogRegSetup)})
    object.__setattr__(out, "quantile", quantile)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| run | noise | plan: NSR first / final | plan's verdict | measured accuracy |",
             "|---|---|---|---|---|"]
    for r in rows:
        nsr = f"{r['nsr_first']} / {r['nsr_final']}" if r["nsr_final"] else "—"
        lines.append(f"| {r['name']} | {r['mode'] if r['mechanism'] != 'none' else '—'} | "
                     f"{nsr} | {r['verdict']} | {r['accuracy_mean']} ± {r['accuracy_std']} |")
    return "\n".join(lines) + "\n"


def lever_ranks(rows: list[dict]) -> str:
    """The levers ranked by the plan (lower NSR first) and by the measured accuracy."""
    levers = [r for r in rows if r["name"].startswith("lever") or r["name"] == "per-step"]
    by_plan = sorted(levers, key=lambda r: float(r["nsr_final"]))
    by_acc = sorted(levers, key=lambda r: -float(r["accuracy_mean"]))
    return ("plan, best first: " + "; ".join(r["name"] for r in by_plan) + "\n"
            + "measured, best first: " + "; ".join(r["name"] for r in by_acc) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--learners", type=int, default=10)
    p.add_argument("--dim", type=int, default=20)
    p.add_argument("--tau", type=int, default=4)
    p.add_argument("--eta", type=float, default=0.05)
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--test-size", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default="results/plan-check")
    p.add_argument("--docs", action="store_true",
                   help="write docs/results-plan-check.csv and the table in "
                        "docs/results-plan-check.md")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, setup, adaptive in runs(args):
        rows.append(run_one(name, setup, adaptive, args.seeds))
        print(f"  {name}: NSR {rows[-1]['nsr_final'] or '—'}, accuracy "
              f"{rows[-1]['accuracy_mean']} ({rows[-1]['seconds']} s)", flush=True)
    paths = [out / "plan-check.csv"] + ([ROOT / "docs" / "results-plan-check.csv"]
                                        if args.docs else [])
    for path in paths:
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    text = table(rows) + "\n" + lever_ranks(rows)
    (out / "plan-check.md").write_text(text)
    print(text)
    return 0 if all(math.isfinite(float(r["accuracy_mean"])) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
