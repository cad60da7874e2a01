"""Does ``plan`` tell the truth? Its predicted noise-to-signal and verdict beside measured
runs (issue 32 item 2).

The task is Zhang, Zhu, Fay & Johansson's ("Locally Differentially Private Online Federated
Learning With Correlated Noise") synthetic logistic regression, the library's reference app
(:mod:`flwr_corrnoise.apps.logreg_task`), run in process through the public API
(``experiments.logreg.run_logreg_inprocess``: the same learner and server code as the
Flower app): each learner's stream used once (``examples = rounds × τ``, batches of 1), the
noise added per step, per round (the learner's round update) or centrally. For every run
the plan is made from the run's own settings (:func:`flwr_corrnoise.plan.make_plan`) twice —
with the signal at its upper bound (the fallback) and with the signal measured at the
initial model (:func:`signal_sample`) — and the run's final test accuracy is measured (mean
over ``--seeds`` noise seeds). Then the levers: from the per-step base, change one thing at a
time (ε ×2, learners ×2, another mechanism, adaptive clipping) and compare the plan's
ranking (by end-of-run NSR, measured signal) with the measured one (by accuracy).

    python -m simulations.plan_check --docs   # docs/results-plan-check.csv and the page's table

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
from flwr_corrnoise.apps.logreg_task import (  # noqa: E402
    LogRegEvaluator,
    LogRegSetup,
    initial_parameters,
    logistic_gradient,
)
from flwr_corrnoise.mechanisms.participation import ONCE  # noqa: E402
from flwr_corrnoise.plan import (  # noqa: E402
    PlanInput,
    SignalEstimate,
    make_plan,
    signal_from_gradients,
    with_signal,
)
from simulations.marked import update_marked_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["name", "mode", "mechanism", "epsilon", "learners", "adaptive", "nsr_first",
          "nsr_final", "verdict", "signal", "alignment", "nsr_first_measured",
          "nsr_final_measured", "verdict_measured", "accuracy_mean", "accuracy_std",
          "seeds", "seconds"]
#: gradients (per-step) or noiseless round updates (per-round, central) sampled per learner
#: for the measured signal term
SIGNAL_SAMPLE = 64


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


def signal_sample(setup: LogRegSetup, per_learner: int = SIGNAL_SAMPLE) -> SignalEstimate:
    """The measured signal term of a run (:func:`flwr_corrnoise.plan.signal_from_gradients`)
    at the initial model, before training: per-step, each learner's first ``per_learner``
    per-example gradients, clipped at the clip norm; per-round and central, ``per_learner``
    noiseless local rounds (τ SGD steps from ``x⁰`` on consecutive data), clipped at the
    round clip. Pooled over the learners, so that it measures the signal of the *averaged*
    update — a deployed learner samples only its own data, and its figure leaves out how
    the learners disagree."""
    x0 = initial_parameters(setup)
    # the data the run itself uses (each datum once): at most its horizon's
    per_learner = min(per_learner, setup.horizon if setup.noise_at == "step" else setup.rounds)
    rows = []
    for learner in range(setup.num_learners):
        grad = logistic_gradient(setup, learner)
        for j in range(per_learner):
            if setup.noise_at == "step":
                rows.append(grad(x0, j)[0])
                continue
            x = x0[0].copy()
            for s in range(setup.tau):
                x = x - setup.eta * grad([x], j * setup.tau + s)[0]
            rows.append(x - x0[0])
    clip = setup.clip if setup.noise_at == "step" else setup.round_clip
    return signal_from_gradients(np.array(rows), clip)


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
        inputs = plan_for(setup, adaptive)
        plan = make_plan(inputs, levers=False)
        est = signal_sample(setup)
        measured = make_plan(with_signal(inputs, est), levers=False)
        row.update(nsr_first=f"{plan.nsr_first_round:.4g}", nsr_final=f"{plan.nsr_final:.4g}",
                   verdict=plan.verdict, signal=f"{est.fraction:.4g}",
                   alignment=f"{est.alignment:.4g}",
                   nsr_first_measured=f"{measured.nsr_first_round:.4g}",
                   nsr_final_measured=f"{measured.nsr_final:.4g}",
                   verdict_measured=measured.verdict)
    else:
        row.update(nsr_first="", nsr_final="", verdict="(no noise)", signal="",
                   alignment="", nsr_first_measured="", nsr_final_measured="",
                   verdict_measured="(no noise)")
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


def _short(verdict: str) -> str:
    return verdict.split(":")[0]


def table(rows: list[dict]) -> str:
    """The page's table: each run's plan with the upper-bound signal (the fallback) and
    with the measured one, beside its measured accuracy."""
    lines = ["| run | noise | end-of-run NSR, upper bound → verdict | measured signal "
             "(alignment) | NSR first round / end, measured signal → verdict | "
             "measured accuracy |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if not r["nsr_final"]:
            lines.append(f"| {r['name']} | — | — | — | — | "
                         f"{r['accuracy_mean']} ± {r['accuracy_std']} |")
            continue
        lines.append(
            f"| {r['name']} | {r['mode']} | {r['nsr_final']} → {_short(r['verdict'])} | "
            f"{r['signal']} ({r['alignment']}) | {r['nsr_first_measured']} / "
            f"{r['nsr_final_measured']} → {_short(r['verdict_measured'])} | "
            f"{r['accuracy_mean']} ± {r['accuracy_std']} |")
    return "\n".join(lines) + "\n"


#: the generated block of docs/results-plan-check.md (simulations/marked.py's markers)
BLOCK = "table:plan-check"


def render_blocks(docs: Path) -> dict[str, str]:
    """docs/results-plan-check.md's generated blocks from the committed CSVs alone
    (simulations/doc_numbers.py's ``doc_blocks`` asks for them): this table and the
    quickstart's (:mod:`simulations.plan_check_quickstart`)."""
    from simulations import plan_check_quickstart as quick

    rows = list(csv.DictReader((docs / "results-plan-check.csv").open()))
    qrows = list(csv.DictReader((docs / "results-plan-check-quickstart.csv").open()))
    return {BLOCK: table(rows).rstrip("\n"), quick.BLOCK: quick.table(qrows).rstrip("\n")}


def write_docs_table(rows: list[dict], page: Path) -> None:
    """Replace the page's :data:`BLOCK` with the table of ``rows`` (the CSV's), so the
    page's figures are the CSV's."""
    update_marked_section(page, BLOCK, table(rows).rstrip("\n"), append=False)


def lever_ranks(rows: list[dict]) -> str:
    """The levers ranked by the plan (lower NSR first) and by the measured accuracy."""
    levers = [r for r in rows if r["name"].startswith("lever") or r["name"] == "per-step"]
    by_plan = sorted(levers, key=lambda r: float(r["nsr_final_measured"]))
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
    if args.docs:
        write_docs_table(rows, ROOT / "docs" / "results-plan-check.md")
    text = table(rows) + "\n" + lever_ranks(rows)
    (out / "plan-check.md").write_text(text)
    print(text)
    return 0 if all(math.isfinite(float(r["accuracy_mean"])) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
