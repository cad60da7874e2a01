"""Flower's own quickstart-pytorch, made private per step by a ≤ 10-line diff (issue 32
item 4).

``tests/adoption/flower_quickstart`` is Flower's ``examples/quickstart-pytorch``
(Apache-2.0) as Flower writes it — ``Net``, ``train()`` building its own
``SGD(momentum=0.9)`` over a ``DataLoader(shuffle=True)``, client-side evaluation,
``global_evaluate`` on the server, the run config of its ``pyproject.toml`` — with only
its data loading made offline (a CIFAR-10-shaped stand-in, 50 examples per partition).
``tests/adoption/flower-quickstart-per-step.diff`` adopts it: ``private_training`` in the
ClientApp, ``private_optimizer(SGD(...), net, criterion)`` in ``task.py`` (its loop
unchanged), ``CorrNoiseLocalDPStrategy`` on the server, and one config line
(``delta``). The diff is applied with ``patch``, counted, shown verbatim in
docs/adopt.md, and run on Flower's simulation engine with Flower's defaults (2
SuperNodes here, 3 rounds, 1 local epoch, batches of 32); the ε every learner reports is
an independent accountant's for the loop that ran, and ``train_loss`` stays home.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    Context,
    Message,
    RecordDict,
)
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.config import get_fused_config_from_dir  # noqa: E402

from flwr_corrnoise import Participation, PrivacySettings  # noqa: E402
from flwr_corrnoise.flower import (  # noqa: E402
    CorrNoiseLocalDPStrategy,
    PrivateSteps,
    private_optimizer,
)
from flwr_corrnoise.settings import PrivacyConfigError  # noqa: E402

from ..adoption import harness  # noqa: E402
from ..flower_helpers import fingerprint  # noqa: E402
from ..messages import flower_message  # noqa: E402
from .test_strategy import task_identity  # noqa: E402, F401  (autouse: message identity)

ROOT = Path(__file__).resolve().parents[2]
VARIANT = "flower-quickstart-per-step"
#: the loop the adopted quickstart runs: 40 training examples (80% of 50), batches of 32,
#: 1 local epoch, 3 rounds — 2 steps a round, each example used once a round
TRAIN, BATCH, EPOCHS, ROUNDS = 40, 32, 1, 3
STEPS = -(-TRAIN // BATCH)

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def diff_text() -> str:
    return harness.diff_path(VARIANT).read_text()


def changed_by_file(diff: str) -> dict[str, int]:
    """Changed lines (added + removed) of a multi-file unified diff, by file."""
    out: dict[str, int] = {}
    name = ""
    for line in diff.splitlines():
        if line.startswith("+++ "):
            name = line[4:].split("/", 1)[1]
        elif line.startswith(("+", "-")) and not line.startswith("--- "):
            out[name] = out.get(name, 0) + 1
    return out


def test_the_diff_is_ten_code_lines_and_one_config_line_shown_in_the_docs() -> None:
    by_file = changed_by_file(diff_text())
    code = sum(n for f, n in by_file.items() if f.endswith(".py"))
    config = sum(n for f, n in by_file.items() if not f.endswith(".py"))
    assert code <= 10, by_file
    assert (code, config) == (10, 1), by_file  # the figures docs/adopt.md and README state
    assert by_file == {"pyproject.toml": 1, "pytorchexample/client_app.py": 4,
                       "pytorchexample/server_app.py": 3, "pytorchexample/task.py": 3}
    doc = (ROOT / "docs" / "adopt.md").read_text()
    assert diff_text() in doc
    # the training loop itself is not touched: only the optimizer line of task.py's train()
    removed = [ln for ln in diff_text().splitlines()
               if ln.startswith("-") and not ln.startswith("---")]
    assert not any("backward" in ln or "for " in ln for ln in removed)


#: docs/adopt.md § 6's per-round and central diffs of the same example, changed lines by file
MODE_DIFFS = {
    "flower-quickstart-per-round": {"pyproject.toml": 2, "pytorchexample/client_app.py": 3,
                                    "pytorchexample/server_app.py": 3},
    "flower-quickstart-central": {"pyproject.toml": 2, "pytorchexample/server_app.py": 3}}


@pytest.mark.parametrize("variant", sorted(MODE_DIFFS))
def test_per_round_and_central_diffs_apply_are_counted_and_shown(variant: str,
                                                                 tmp_path: Path) -> None:
    """The per-round and central diffs apply to Flower's example as it is, change the lines
    docs/adopt.md counts (6 + 2 config, 3 + 2 config), are shown there verbatim, and
    declare the participation their ε accounts for (every round) and δ = 1e-5."""
    diff = harness.diff_path(variant).read_text()
    assert changed_by_file(diff) == MODE_DIFFS[variant]
    assert diff in (ROOT / "docs" / "adopt.md").read_text()
    app = harness.adopt(variant, tmp_path / "app")
    cfg = get_fused_config_from_dir(app, {})
    assert (cfg["data-reuse"], cfg["delta"]) == ("every-round", 1e-5)
    server = (app / "pytorchexample" / "server_app.py").read_text()
    assert ("per_round=True" in server) == variant.endswith("per-round")
    assert "train_fn(" in (app / "pytorchexample" / "client_app.py").read_text()


def adopted(tmp_path: Path, name: str = "app", **run_config: Any) -> Path:
    return harness.adopt(VARIANT, tmp_path / name, run_config=run_config or None)


def expected_settings(**over: Any) -> PrivacySettings:
    """The learner's settings, written out independently of the app: the defaults but
    δ = 1e-5 (the diff's config line), the horizon and participation of 3 rounds × 1
    epoch of 2 fixed-order batches."""
    return PrivacySettings(**{"mechanism": "blt", "epsilon": 2.0, "delta": 1e-5,
                              "clip_norm": 1.0, "horizon": ROUNDS * EPOCHS * STEPS,
                              "participation": Participation.epochs(ROUNDS * EPOCHS, STEPS),
                              **over})


@pytest.mark.slow
def test_flower_quickstart_adopted_runs_privately_on_flower(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = adopted(tmp_path)
    client, server = harness.load_package(app)
    results: list[Any] = []
    start = CorrNoiseLocalDPStrategy.start

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        results.append(start(self, *args, **kwargs))
        return results[-1]

    monkeypatch.setattr(CorrNoiseLocalDPStrategy, "start", recorded)
    monkeypatch.chdir(tmp_path)  # the quickstart saves final_model.pt in the working dir
    harness.simulate(app, SimpleNamespace(client_app=client.app, server_app=server.app),
                     ray=True)
    (result,) = results
    reused, once = expected_settings(), expected_settings(participation=Participation())
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    for r in (1, 2, 3):
        metrics = dict(result.train_metrics_clientapp[r])
        spent = {k: v for k, v in metrics.items() if k.startswith("epsilon-spent.")}
        assert set(spent) == {"epsilon-spent.learner-0", "epsilon-spent.learner-1"}, metrics
        want = reused.epsilon_spent(r * STEPS)
        assert list(spent.values()) == pytest.approx([want] * 2, rel=1e-9)
        if r < ROUNDS:  # the one-pass accounting would print another ε
            assert abs(once.epsilon_spent(r * STEPS) - want) > 1e-3
        assert not any("train_loss" in k or k == "loss" for k in metrics), metrics
    assert want == pytest.approx(2.0)  # the whole budget, at the horizon
    assert reused.calibration().std > once.calibration().std  # type: ignore[union-attr]
    final = [np.asarray(a) for a in result.arrays.to_numpy_ndarrays()]
    assert all(np.all(np.isfinite(a)) for a in final)
    assert set(result.evaluate_metrics_serverapp) == {0, 1, 2, 3}  # global_evaluate ran
    assert (tmp_path / "final_model.pt").exists()


# -- in-process: Flower's ClientApp call path, under the simulation rules -------------------
def train_message(arrays: ArrayRecord, server_round: int, dst: int = 1) -> Message:
    return flower_message(arrays, server_round=server_round, dst=dst, config={"lr": 0.1})


def learner_context(app: Path, **node: Any) -> Context:
    return Context(run_id=1, node_id=1, state=RecordDict(),
                   node_config={"partition-id": 0, "num-partitions": 2, **node},
                   run_config=get_fused_config_from_dir(app, {}))


def conversation(client: ModuleType, ctxt: Context, rounds: int = 2) -> list[Any]:
    """``rounds`` train messages, each from the model the learner released."""
    torch.manual_seed(0)
    arrays = ArrayRecord(client.Net().state_dict())
    replies = []
    for r in range(1, rounds + 1):
        reply = client.app(train_message(arrays, r), ctxt)
        replies.append(reply)
        if not reply.has_error():
            arrays = reply.content["arrays"]
    return replies


def odd(kind: str, load_data: Any) -> Any:
    """The quickstart's ``load_data`` with one training example changed."""
    def load(partition_id: int, num_partitions: int, batch_size: int) -> Any:
        trainloader, testloader = load_data(partition_id, num_partitions, batch_size)
        example = dict(trainloader.dataset[5])
        if kind == "label":  # out of range: CrossEntropyLoss raises in the user's loop
            example["label"] = 10
        elif kind == "nan":
            example["img"] = torch.full_like(example["img"], float("nan"))
        elif kind == "other":
            example["img"] = -example["img"]
        trainloader.dataset[5] = example
        return trainloader, testloader
    return load


def test_neighbouring_datasets_get_identical_replies_and_train_loss_stays(
        tmp_path: Path, simulated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two learners whose training sets differ in one example — another image, a NaN
    image, a label the user's ``criterion`` raises on — send replies that differ in the
    noised arrays only (the same reply kind, records, metric names and values), round
    after round; the quickstart's ``train_loss`` never leaves."""
    app = adopted(tmp_path)
    client, _ = harness.load_package(app)
    plain = client.load_data
    prints = {}
    for kind in ("same", "other", "nan", "label"):
        monkeypatch.setattr(client, "load_data", plain if kind == "same" else odd(kind, plain))
        replies = conversation(client, learner_context(app))
        prints[kind] = [fingerprint(r) for r in replies]
    assert prints["other"] == prints["nan"] == prints["label"] == prints["same"]
    reused = expected_settings()
    for r, print_ in enumerate(prints["same"], start=1):
        metrics = print_["metrics"]
        assert "train_loss" not in metrics and "error" not in print_
        assert metrics["steps"] == r * STEPS
        assert metrics["epsilon-spent"] == pytest.approx(reused.epsilon_spent(r * STEPS))


def edited(tmp_path: Path, name: str, path: str, old: str, new: str) -> ModuleType:
    app = adopted(tmp_path, name)
    target = app / path
    text = target.read_text()
    assert text.count(old) == 1, old
    target.write_text(text.replace(old, new))
    client, _ = harness.load_package(app)
    return client


@pytest.mark.parametrize(("name", "path", "old", "new", "why"), [
    # task.py left as Flower wrote it: batches drawn, no private step
    ("plain-optimizer", "pytorchexample/task.py",
     "private_optimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), net, "
     "criterion)", "torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)",
     "took no private step"),
    # a loop of 1 epoch declared as 2: the ε would be another loop's
    ("epochs", "pytorchexample/client_app.py",
     "private_training(msg, context, model, trainloader)",
     "private_training(msg, context, model, trainloader, epochs=2)",
     "the loop took 2 of the round's 4 steps"),
    # the reply carries another model than the one the private optimizer trained
    ("other-model", "pytorchexample/client_app.py",
     "model_record = ArrayRecord(model.state_dict())",
     "model_record = ArrayRecord(Net().state_dict())", "not the state of the model"),
])
def test_a_loop_the_epsilon_does_not_cover_is_refused(
        tmp_path: Path, simulated: None, name: str, path: str, old: str, new: str,
        why: str) -> None:
    client = edited(tmp_path, name, path, old, new)
    (reply,) = conversation(client, learner_context(tmp_path / name), rounds=1)
    assert reply.has_error() and reply.error.code == 4101, reply.error
    assert why in reply.error.reason


def test_whole_batch_clipping_without_the_criterion_and_an_explicit_reply(
        tmp_path: Path, simulated: None) -> None:
    """``private_optimizer(sgd, net)`` (no loss module): the step's gradient is clipped as
    a whole; ``trainloader.reply(...)`` builds the reply through the gate itself."""
    app = adopted(tmp_path)
    for path, old, new in [
        ("pytorchexample/task.py", "momentum=0.9), net, criterion)", "momentum=0.9), net)"),
        ("pytorchexample/client_app.py", "return Message(content=content, reply_to=msg)",
         "return trainloader.reply(model_record, metric_record)"),
    ]:
        target = app / path
        target.write_text(target.read_text().replace(old, new))
    client, _ = harness.load_package(app)
    replies = conversation(client, learner_context(app))
    assert [r.has_error() for r in replies] == [False, False], [r.error for r in replies]
    assert [r.content["metrics"]["steps"] for r in replies] == [STEPS, 2 * STEPS]
    assert "train_loss" not in replies[-1].content["metrics"]


def test_private_optimizer_outside_a_private_round_is_refused() -> None:
    net = torch.nn.Linear(3, 2)
    with pytest.raises(PrivacyConfigError, match="found no private round open"):
        private_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net)


def test_a_per_step_learner_without_a_participation_is_refused_clearly(
        tmp_path: Path, simulated: None) -> None:
    """The quickstart per step without ``private_training`` (the optimizer wrapped on the
    message, no loader) and without a declaration: refused before anything is released,
    and the reason says what to declare."""
    app = adopted(tmp_path)
    client, _ = harness.load_package(app)
    plain = ClientApp(mods=[PrivateSteps.guard()])

    @plain.train()
    def train(msg: Message, context: Context) -> Message:
        net = client.Net()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        optimizer = private_optimizer(msg, context, torch.optim.SGD(net.parameters(), lr=0.1),
                                      net)
        return optimizer.reply(ArrayRecord(net.state_dict()))

    ctxt = learner_context(app)
    ctxt.run_config["local-steps"] = STEPS  # a horizon, but no participation
    reply = plain(train_message(ArrayRecord(client.Net().state_dict()), 1), ctxt)
    assert reply.has_error() and reply.error.code == 4101
    assert "how often each datum is used must be declared" in reply.error.reason
    assert "data-reuse" in reply.error.reason
