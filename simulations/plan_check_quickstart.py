"""The plan against Flower's own quickstart (issue 32 item 2): quickstart-pytorch's ``Net``
(as Flower writes it, ``tests/adoption/flower_quickstart``) on Fashion-MNIST, 2 learners,
3 rounds of one local epoch, batch 32, ``SGD(lr, momentum=0.9)`` rebuilt every round as
the quickstart's ``train()`` does — plain, and with the noise per step, per round and
central, at ε = 2, δ = 10⁻⁵, clip norm 1, BLT. For each private run the plan is made from
the run's settings with the upper-bound signal and with the signal measured at the
initial model (per step: :func:`flwr_corrnoise.torch.measure_signal` on 256 examples of
each learner; per round and central: the two learners' noiseless first-round updates, from
the plain run), beside the measured test accuracy.

Runs in process through the public API, the math the Flower front ends call: per step,
:class:`~flwr_corrnoise.torch.PrivateOptimizer` around the quickstart's SGD over a fixed
cyclic order (the participation :class:`~flwr_corrnoise.data.loader.CyclicLoader`
declares; the settings are the plan's own, :meth:`~flwr_corrnoise.plan.PlanInput.settings`);
per round, :func:`~flwr_corrnoise.variants.round_release` (what ``CorrNoiseRoundMod``
releases); central, :func:`~flwr_corrnoise.variants.central_calibration` and one stream on
the average (what ``CorrNoiseCentralDPStrategy`` adds). Fashion-MNIST is padded to
32×32 and repeated over 3 channels, so Flower's CIFAR ``Net`` runs unchanged (d = 62,006).

    python -m simulations.plan_check_quickstart --examples 6000 --docs

writes ``docs/results-plan-check-quickstart.csv`` (``--docs``: that partition size's rows
replaced, the other sizes' kept) and the quickstart table of docs/results-plan-check.md
from it (``--docs-table`` does only the latter), and prints each run's row.
Toy size (the test): ``--examples 64 --test-size 64 --signal-examples 16``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flwr_corrnoise.data.idx import read_idx  # noqa: E402
from flwr_corrnoise.mechanisms.participation import Participation  # noqa: E402
from flwr_corrnoise.plan import (  # noqa: E402
    PlanInput,
    SignalEstimate,
    make_plan,
    signal_from_gradients,
    with_signal,
)
from flwr_corrnoise.settings import PrivacySettings  # noqa: E402
from flwr_corrnoise.streams import NoiseStream  # noqa: E402
from flwr_corrnoise.torch import PrivateOptimizer, measure_signal  # noqa: E402
from flwr_corrnoise.variants import (  # noqa: E402
    central_calibration,
    central_noise_std,
    round_release,
)

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tests" / "adoption" / "flower_quickstart" / "pytorchexample" / "task.py"
FASHION = Path("/usr/share/datasets/fashion-mnist")
FIELDS = ["name", "mode", "examples", "learning_rate", "nsr_final", "verdict", "signal",
          "nsr_first_measured", "nsr_final_measured", "verdict_measured",
          "safe_learning_rate", "accuracy", "seconds"]
ROUNDS, LEARNERS, BATCH, MOMENTUM = 3, 2, 32, 0.9


def quickstart_net() -> type[torch.nn.Module]:
    """Flower's quickstart ``Net``, from the copy of the quickstart the tests adopt."""
    spec = importlib.util.spec_from_file_location("quickstart_task", TASK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net


def fashion(split: str, root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST as 3×32×32 images normalized to [-1, 1] (the quickstart's
    ``Normalize((0.5,)*3, (0.5,)*3)``) and labels."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    x = torch.from_numpy(np.pad(images, ((0, 0), (2, 2), (2, 2))))[:, None].repeat(1, 3, 1, 1)
    return (x - 0.5) / 0.5, torch.from_numpy(labels)


def partitions(x: torch.Tensor, y: torch.Tensor, examples: int
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two IID partitions of ``examples`` each, in a fixed order (a cyclic loader's)."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(42))
    return [(x[order[i * examples:(i + 1) * examples]], y[order[i * examples:(i + 1) * examples]])
            for i in range(LEARNERS)]


def batches(data: tuple[torch.Tensor, torch.Tensor]):  # type: ignore[no-untyped-def]
    x, y = data
    for i in range(0, len(x), BATCH):
        yield x[i:i + BATCH], y[i:i + BATCH]


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def load_flat(model: torch.nn.Module, values: np.ndarray) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(torch.from_numpy(values[offset:offset + n]).reshape(p.shape).to(p.dtype))
            offset += n


def accuracy(model: torch.nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def local_epoch(model: torch.nn.Module, data, lr: float,  # type: ignore[no-untyped-def]
                private: PrivacySettings | None = None, state=None, seed: int = 0):
    """The quickstart's ``train()`` for one epoch: a fresh SGD with momentum 0.9, wrapped
    in a PrivateOptimizer when ``private`` (its learner state carried across rounds)."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    if private is None:
        for x, y in batches(data):
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sgd.step()
        return None
    opt = (PrivateOptimizer(sgd, model, private, seed=seed) if state is None else
           PrivateOptimizer(sgd, model, private, state=state))
    for x, y in batches(data):
        opt.zero_grad()
        opt.backward(x, y)
        opt.step()
    return opt.state


def run(mode: str, args: argparse.Namespace, parts, test, net_cls,  # type: ignore[no-untyped-def]
        settings: PrivacySettings | None) -> tuple[float, list[np.ndarray]]:
    """Test accuracy after 3 rounds, and the first round's updates (plain: the signal)."""
    torch.manual_seed(0)
    global_model = net_cls()
    x = flat(global_model)
    d = x.size
    states: list = [None] * LEARNERS
    streams, central = [], None
    if mode == "round":
        assert settings is not None
        std = settings.calibration().std  # type: ignore[union-attr]
        streams = [NoiseStream.create(settings.mechanism, ROUNDS, d, std, seed=None,
                                      factorization=settings.factorization())
                   for _ in range(LEARNERS)]
    if mode == "central":
        cal = central_calibration(args.mechanism, args.epsilon, args.delta, args.clip,
                                  ROUNDS, participation=Participation.every_step(ROUNDS))
        central = NoiseStream.create(args.mechanism, ROUNDS, d,
                                     central_noise_std(cal, LEARNERS), seed=None)
    first: list[np.ndarray] = []
    for r in range(ROUNDS):
        updates = []
        for i, data in enumerate(parts):
            model = net_cls()
            load_flat(model, x)
            states[i] = local_epoch(model, data, args.learning_rate,
                                    settings if mode == "step" else None, states[i],
                                    seed=None if mode == "step" else 0)
            delta = flat(model) - x
            if mode == "round":
                delta = round_release(delta, args.clip, streams[i])[0]
            elif mode == "central":
                norm = float(np.linalg.norm(delta))
                delta = delta * min(1.0, args.clip / norm) if norm > 0 else delta
            updates.append(delta)
        if r == 0:
            first = updates
        mean = np.mean(updates, axis=0)
        x = x + (central.add_next(mean) if central is not None else mean)
    load_flat(global_model, x)
    return accuracy(global_model, test), first


def plan_inputs(mode: str, args: argparse.Namespace, d: int) -> PlanInput:
    if mode == "step":
        return PlanInput(model_size=d, examples=args.examples, batch_size=BATCH,
                         epochs=ROUNDS, learners=LEARNERS, mechanism=args.mechanism,
                         epsilon=args.epsilon, delta=args.delta, clip_norm=args.clip,
                         rounds=ROUNDS, momentum=MOMENTUM, learning_rate=args.learning_rate)
    return PlanInput(model_size=d, examples=1, batch_size=1, epochs=1, learners=LEARNERS,
                     mechanism=args.mechanism, epsilon=args.epsilon, delta=args.delta,
                     clip_norm=args.clip, rounds=ROUNDS, mode=mode,
                     round_participation=Participation.every_step(ROUNDS))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=24000, help="training examples per learner")
    p.add_argument("--test-size", type=int, default=10000)
    p.add_argument("--learning-rate", type=float, default=0.02)
    p.add_argument("--mechanism", default="blt")
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--signal-examples", type=int, default=256, help="per learner")
    p.add_argument("--modes", nargs="+", default=["plain", "step", "round", "central"])
    p.add_argument("--data", default=str(FASHION))
    p.add_argument("--out", default="results/plan-check-quickstart")
    p.add_argument("--docs", action="store_true",
                   help="write docs/results-plan-check-quickstart.csv")
    p.add_argument("--docs-table", action="store_true",
                   help="only regenerate the page's table from the docs CSV (no run)")
    args = p.parse_args(argv)
    if args.docs_table:
        write_docs_table()
        return 0
    torch.set_num_threads(1)
    net_cls = quickstart_net()
    xs, ys = fashion("train", Path(args.data))
    xt, yt = fashion("test", Path(args.data))
    parts = partitions(xs, ys, args.examples)
    test = (xt[:args.test_size], yt[:args.test_size])
    d = sum(q.numel() for q in net_cls().parameters())
    rows, first = [], None
    for mode in ["plain"] + [m for m in args.modes if m != "plain"]:
        start = time.perf_counter()
        row: dict = {"name": mode, "mode": mode, "examples": args.examples,
                     "learning_rate": args.learning_rate}
        settings = None
        if mode != "plain":
            inputs = plan_inputs(mode, args, d)
            upper = make_plan(inputs, levers=False)
            settings = inputs.settings()
            est = signal_estimate(mode, args, parts, net_cls, first)
            measured = make_plan(with_signal(inputs, est), levers=False)
            row.update(nsr_final=f"{upper.nsr_final:.4g}", verdict=upper.verdict,
                       signal=f"{est.fraction:.4g}",
                       nsr_first_measured=f"{measured.nsr_first_round:.4g}",
                       nsr_final_measured=f"{measured.nsr_final:.4g}",
                       verdict_measured=measured.verdict,
                       safe_learning_rate=f"{upper.safe_learning_rate:.4g}")
        acc, updates = run(mode, args, parts, test, net_cls, settings)
        if mode == "plain":
            first = updates
        row.update(accuracy=f"{acc:.4f}", seconds=f"{time.perf_counter() - start:.0f}")
        rows.append(row)
        print(f"  {mode}: {row}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "plan-check-quickstart.csv", rows)
    if args.docs:  # one CSV for every partition size run: this size's rows replaced
        docs = ROOT / "docs" / "results-plan-check-quickstart.csv"
        kept = ([r for r in csv.DictReader(docs.open()) if int(r["examples"]) != args.examples]
                if docs.exists() else [])
        write_csv(docs, sorted(kept + rows, key=lambda r: int(r["examples"])))
        write_docs_table()
    return 0


#: the generated block of docs/results-plan-check.md (simulations/marked.py's markers)
BLOCK = "table:quickstart"


def table(rows: list[dict]) -> str:
    """The page's quickstart table, from the CSV's rows."""
    lines = ["| examples per learner | run | end-of-run NSR, upper bound → verdict | "
             "measured signal | NSR first round / end, measured signal → verdict | "
             "safe lr (plan) | measured accuracy |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["nsr_final"]:
            lines.append(f"| {r['examples']} | {r['name']} (lr {r['learning_rate']}) | — | — | "
                         f"— | — | {r['accuracy']} |")
            continue
        lines.append(
            f"| {r['examples']} | {r['name']} | {r['nsr_final']} → "
            f"{r['verdict'].split(':')[0]}: {r['verdict'].split(': ')[1].split(',')[0]} | "
            f"{r['signal']} | {r['nsr_first_measured']} / {r['nsr_final_measured']} → "
            f"{r['verdict_measured'].split(':')[0]}: "
            f"{r['verdict_measured'].split(': ')[1].split(',')[0]} | "
            f"{r['safe_learning_rate']} | {r['accuracy']} |")
    return "\n".join(lines) + "\n"


def write_docs_table() -> None:
    """docs/results-plan-check.md's quickstart block from the docs CSV."""
    from simulations.marked import update_marked_section

    rows = list(csv.DictReader((ROOT / "docs" / "results-plan-check-quickstart.csv").open()))
    update_marked_section(ROOT / "docs" / "results-plan-check.md", BLOCK,
                          table(rows).rstrip("\n"), append=False)


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def signal_estimate(mode: str, args: argparse.Namespace, parts, net_cls,  # type: ignore[no-untyped-def]
                    first: list[np.ndarray] | None) -> SignalEstimate:
    """Per step: the initial model's clipped per-example gradients, pooled over both
    learners' first ``--signal-examples``; per round and central: the plain run's two
    first-round updates (each learner's noiseless local epoch), clipped at the clip norm."""
    if mode != "step":
        assert first is not None
        return signal_from_gradients(np.array(first), args.clip)
    torch.manual_seed(0)
    model = net_cls()
    k = args.signal_examples
    pooled = (torch.cat([x[:k] for x, _ in parts]), torch.cat([y[:k] for _, y in parts]))
    return measure_signal(model, torch.nn.functional.cross_entropy, batches(pooled),
                          args.clip, max_examples=LEARNERS * k)


if __name__ == "__main__":
    sys.exit(main())
