"""Why did the BLT CNN run collapse at τ = 4? Diagnostics on the first steps of that run.

    python -m simulations.cnn_collapse --steps 2000 --horizon 5000 --taus 1 4 \
        --methods blt none --eta 0.02 --out results/cnn-collapse

Replays the configuration of ``docs/results-cnn.md`` (paper CNN, 10 learners, one image
per step, η = 0.02, (2, 10⁻³)-LDP calibrated for ``--horizon`` = R·τ = 5000 steps, seed 0
— the same learners, data and noise as the reported run) but stops after ``--steps``
steps, and records what the accuracy table cannot show:

* on the global model ``x^r`` every ``--every`` steps: test accuracy and loss, the fraction
  of **dead ReLU units** per layer (a unit — a conv channel or an FC neuron — is dead if it
  outputs 0 on every one of ``--probe`` test images), the std of the logits across images
  (≈ 0: a constant prediction) and the norm of every layer's parameters;
* on the learners' **local iterates** ``z`` (at every local step): ``‖z‖`` and the drift
  ``‖z − x^r‖`` from the round's global model, and the norm of the raw gradient (before
  clipping), averaged over the learners and the steps since the last record.

Writes ``diagnostics.csv`` to ``--out`` and prints a table per run.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import torch

from experiments.cnn import CNNSetup, batch_stream, cnn_data, initial_model
from flwr_corrnoise.engine import run_inprocess
from flwr_corrnoise.settings import PrivacySettings
from flwr_corrnoise.torch import ModuleGradient, get_parameters, set_parameters

LAYERS = ("conv1", "conv2", "fc1")


class Recorder:
    """Wraps each learner's gradient oracle: local-iterate norms, drift, gradient norms."""

    def __init__(self, tau: int) -> None:
        self.tau = tau
        self.start: dict[int, np.ndarray] = {}
        self.acc: dict[str, list[float]] = {"z-norm": [], "drift": [], "grad-norm": []}

    def wrap(self, learner: int, grad: ModuleGradient):
        def oracle(params: list[np.ndarray], position: int) -> list[np.ndarray]:
            z = np.concatenate([p.ravel() for p in params])
            if position % self.tau == 0:  # every learner takes part in every round
                self.start[learner] = z
            self.acc["z-norm"].append(float(np.linalg.norm(z)))
            self.acc["drift"].append(float(np.linalg.norm(z - self.start[learner])))
            g = grad(params, position)
            self.acc["grad-norm"].append(float(np.sqrt(sum(np.sum(a * a) for a in g))))
            return g

        return oracle

    def flush(self) -> dict[str, float]:
        out = {k: float(np.mean(v)) if v else float("nan") for k, v in self.acc.items()}
        out["drift-max"] = float(np.max(self.acc["drift"])) if self.acc["drift"] else 0.0
        for v in self.acc.values():
            v.clear()
        return out


@torch.no_grad()
def global_diagnostics(model: torch.nn.Module, params: list[np.ndarray], x: torch.Tensor,
                       y: torch.Tensor) -> dict[str, float]:
    set_parameters(model, params)
    acts: dict[str, torch.Tensor] = {}
    h1 = torch.relu(model.conv1(x))
    acts["conv1"] = h1
    h2 = torch.relu(model.conv2(h1))
    acts["conv2"] = h2
    f1 = torch.relu(model.fc1(torch.nn.functional.max_pool2d(h2, 2).flatten(1)))
    acts["fc1"] = f1
    logits = model.fc2(f1)
    out = {
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        "loss": float(torch.nn.functional.cross_entropy(logits, y)),
        "logit-std": float(logits.std(dim=0).mean()),
    }
    for name in LAYERS:
        a = acts[name]
        alive = (a > 0).flatten(2).any(dim=2).any(dim=0) if a.dim() == 4 else (a > 0).any(0)
        out[f"dead-{name}"] = 1.0 - float(alive.float().mean())
    for name in (*LAYERS, "fc2"):
        layer = getattr(model, name)
        out[f"norm-{name}"] = float(torch.cat([layer.weight.flatten(),
                                               layer.bias.flatten()]).norm())
    return out


def run(setup: CNNSetup, horizon: int, every: int, probe: int) -> list[dict[str, float]]:
    data = cnn_data(setup)
    model = initial_model(setup)
    rec = Recorder(setup.tau)
    grads = [rec.wrap(i, ModuleGradient(model, torch.nn.functional.cross_entropy,
                                        batch_stream(data, i, setup.batch_size)))
             for i in range(setup.num_learners)]
    probe_x, probe_y = data.test_x[:probe], data.test_y[:probe]
    eval_model = initial_model(setup)
    rows: list[dict[str, float]] = []
    start = time.perf_counter()
    every_rounds = max(1, every // setup.tau)

    def evaluate(r: int, params: list[np.ndarray]) -> None:
        if r % every_rounds and r != setup.rounds:
            return
        row = {"step": float(r * setup.tau), "round": float(r)}
        row.update(global_diagnostics(eval_model, params, probe_x, probe_y))
        row.update(rec.flush())
        rows.append(row)
        print(f"  [{setup.label} τ={setup.tau}] step {r * setup.tau:>5} acc {row['accuracy']:.3f} "
              f"dead fc1 {row['dead-fc1']:.2f} conv2 {row['dead-conv2']:.2f} drift "
              f"{row['drift']:.2f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
              flush=True)

    settings = (PrivacySettings(mechanism=setup.mechanism, epsilon=setup.epsilon,
                                delta=setup.delta, clip_norm=setup.clip, horizon=horizon)
                if setup.mechanism != "none" else setup.settings())
    run_inprocess(initial=get_parameters(model), gradients=grads, settings=settings,
                  rounds=setup.rounds, tau=setup.tau, eta=setup.eta, eta_g=setup.eta_g,
                  seed=setup.seed, evaluate=evaluate)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="local steps to run (R·τ so far)")
    p.add_argument("--horizon", type=int, default=5000, help="N the noise is calibrated for")
    p.add_argument("--taus", type=int, nargs="+", default=[1, 4])
    p.add_argument("--methods", nargs="+", default=["blt", "none"])
    p.add_argument("--etas", type=float, nargs="+", default=[0.02])
    p.add_argument("--learners", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--every", type=int, default=100, help="steps between records")
    p.add_argument("--probe", type=int, default=1000, help="test images for the probes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "mnist"])
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", type=Path, default=Path("results/cnn-collapse"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "diagnostics.csv"
    fields: list[str] | None = None
    with path.open("w", newline="") as f:
        for method in args.methods:
            for tau in args.taus:
                for eta in args.etas:
                    setup = CNNSetup(dataset=args.dataset, data_root=args.data_root,
                                     num_learners=args.learners, steps=args.steps, tau=tau,
                                     batch_size=args.batch_size, mechanism=method, eta=eta,
                                     test_size=args.probe)
                    rows = run(setup, args.horizon, args.every, args.probe)
                    for row in rows:
                        full = {"method": setup.label, "tau": tau, "eta": eta, **row}
                        if fields is None:
                            fields = list(full)
                            writer = csv.DictWriter(f, fieldnames=fields)
                            writer.writeheader()
                        writer.writerow(full)
                        f.flush()
                    print(f"\n{setup.label}, τ = {tau}, η = {eta}")
                    print("| step | acc | logit std | dead conv1 | dead conv2 | dead fc1 | "
                          "‖z‖ | drift ‖z − x^r‖ (mean / max) | raw ‖g‖ | ‖fc1‖ | ‖fc2‖ |")
                    print("|---|---|---|---|---|---|---|---|---|---|---|")
                    for r in rows:
                        print(f"| {r['step']:.0f} | {r['accuracy']:.3f} | {r['logit-std']:.3f} "
                              f"| {r['dead-conv1']:.2f} | {r['dead-conv2']:.2f} | "
                              f"{r['dead-fc1']:.2f} | {r['z-norm']:.1f} | {r['drift']:.2f} / "
                              f"{r['drift-max']:.2f} | {r['grad-norm']:.2f} | "
                              f"{r['norm-fc1']:.1f} | {r['norm-fc2']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


#: the steps of each run that docs/results-cnn.md's collapse table shows
DOC_STEPS = (200, 1000, 2000)


def collapse_table(rows: list[dict[str, str]], steps: tuple[int, ...] = DOC_STEPS) -> str:
    """docs/results-cnn.md's collapse table from ``diagnostics.csv`` rows (the committed
    ``docs/results-cnn-collapse.csv``): per run (in the CSV's order) and step, the global
    model's accuracy, logit spread, dead conv2/fc1 units and first-FC-layer norm, and the
    local iterates' mean drift and raw gradient norm since the previous record."""
    lines = ["| run (Fashion-MNIST, 10 learners, 1 image/step) | step | accuracy | logit spread "
             "| dead conv2 / fc1 | mean local drift ‖z − x^r‖ | raw ‖g‖ at the iterates "
             "| ‖fc1‖ of x^r |", "|" + "---|" * 8]
    runs = dict.fromkeys((r["method"], r["tau"], r["eta"]) for r in rows)
    for method, tau, eta in runs:
        label = f"{'BLT' if method == 'blt' else method} τ = {tau}, η = {float(eta):g}"
        for r in rows:
            if (r["method"], r["tau"], r["eta"]) != (method, tau, eta) or \
                    int(float(r["step"])) not in steps:
                continue
            drift = float(r["drift"])
            lines.append(
                f"| {label} | {int(float(r['step']))} | {float(r['accuracy']):.3f} | "
                f"{float(r['logit-std']):.3f} | {float(r['dead-conv2']):.2f} / "
                f"{float(r['dead-fc1']):.2f} | "
                f"{'0' if drift == 0 else f'{drift:.2f}' if drift < 1 else f'{drift:.1f}'} | "
                f"{float(r['grad-norm']):.1f} | {float(r['norm-fc1']):.1f} |")
            label = ""
    return "\n".join(lines)
