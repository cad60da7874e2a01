"""No ε that may not hold, and no noise released twice (issues 31 and 32).

* how often a datum is used must be declared (no "once" by default), and zero or negative
  participation options are errors;
* a round past the declared uses (``data-reuse = "every-round"``) is refused before
  anything is released;
* a loader whose order differs from the one the learner trained in is refused;
* one release per learner per round: a second train message for a round (or an older
  one) is refused, and in Flower's real simulation engine two messages to one node in one
  round release the noise once.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from flwr_corrnoise.cli import main
from flwr_corrnoise.data.loader import CyclicLoader
from flwr_corrnoise.flower import PrivateSteps, make_client_app
from flwr_corrnoise.flower import session as session_module
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.flower.release_ledger import RoundReplayError, SimulationReleaseLedger
from flwr_corrnoise.mechanisms.participation import Participation, ParticipationError
from flwr_corrnoise.settings import PrivacyConfigError

from ..flower_helpers import backend_config, simulate
from ..messages import flower_message
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

DIM = 3
BASE = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-5,
        "clip-norm": 1.0, "seed": 4}


def message(server_round: int, x: np.ndarray | None = None, node: int = 1) -> Message:
    return flower_message(np.zeros(DIM) if x is None else x, server_round=server_round,
                          dst=node, config={"local-steps": 2, "learning-rate": 0.1})


def steps_app(loader_seed: int | None = None, steps: int = 2) -> ClientApp:
    """A PrivateSteps app: ``steps`` steps a round, or the loader's batches."""
    client = ClientApp(mods=[PrivateSteps.guard()])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        loader = (None if loader_seed is None else
                  CyclicLoader(8, 4, rounds=3, local_epochs=1, order_seed=loader_seed))
        private = PrivateSteps(msg, context, loader=loader)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        batches = private.batches() if loader is not None else range(steps)
        for _ in batches:
            w = w - 0.1 * private.step(np.ones(DIM))
        return private.reply([w])

    return client


def context(**cfg: Any) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                   run_config={**BASE, **cfg})


def code(reply: Message) -> int:
    return int(reply.error.code) if reply.has_error() else 0


# -- participation: declared, never a default ------------------------------------------------
def test_a_config_without_a_declared_participation_is_refused() -> None:
    cfg = {"mechanism": "blt", "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0,
           "horizon": 12}
    with pytest.raises(PrivacyConfigError, match="must be declared"):
        settings_from_config(cfg)
    assert settings_from_config({**cfg, "data-reuse": "once"}).participation.single
    every = settings_from_config({**cfg, "data-reuse": "every-round",
                                         "num-server-rounds": 3})
    assert every.participation == Participation.min_separation(1, 3)
    assert every.max_rounds == 3
    with pytest.raises(PrivacyConfigError, match="declare one participation"):
        settings_from_config({**cfg, "data-reuse": "once", "epochs": 2})


def test_the_user_loop_without_a_declaration_releases_nothing(simulated: None) -> None:
    reply = steps_app()(message(1), context(**{"horizon": 8}))
    assert code(reply) == 4101
    assert "must be declared" in reply.error.reason


def test_the_strict_stream_mode_declares_once_itself(simulated: None) -> None:
    """make_client_app addresses data by stream position: "once" is enforced there."""
    app = make_client_app(lambda ctx: (lambda params, position: [np.ones(DIM)]))
    reply = app(message(1), context(**{"num-server-rounds": 2, "local-steps": 2}))
    assert code(reply) == 0, reply.error.reason if reply.has_error() else ""


@pytest.mark.parametrize("options", [{"epochs": 0}, {"epochs": -3}, {"min_sep": 0},
                                     {"max_participations": 0}, {"min_sep": -1},
                                     {"epochs": 2.5}])
def test_participation_options_reject_zero_and_negatives(options: dict[str, Any]) -> None:
    with pytest.raises(ParticipationError, match="positive integer"):
        Participation.from_options(120, **options)


@pytest.mark.parametrize("flag", [("--epochs", "0"), ("--epochs", "-3"), ("--min-sep", "0")])
def test_cli_refuses_zero_participation(flag: tuple[str, str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    try:
        status = main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
                       "--mechanism", "blt", "--steps", "120", *flag])
    except SystemExit as stop:
        status = stop.code  # type: ignore[assignment]
    assert status not in (0, None)
    assert "positive integer" in capsys.readouterr().err


# -- declared reuse bounds are enforced -------------------------------------------------------
def test_a_round_past_the_declared_rounds_is_refused(simulated: None) -> None:
    """every-round over 2 rounds: a third round (the horizon would allow it) is refused."""
    ctx = context(**{"data-reuse": "every-round", "num-server-rounds": 2, "horizon": 12})
    app = steps_app()
    assert [code(app(message(r), ctx)) for r in (1, 2, 3)] == [0, 0, 4102]


def test_a_reshuffled_loader_order_is_refused(simulated: None) -> None:
    ctx = context()
    assert code(steps_app(loader_seed=7)(message(1), ctx)) == 0
    reply = steps_app(loader_seed=8)(message(2), ctx)  # reshuffled between rounds
    assert code(reply) == 4101 and "order" in reply.error.reason
    assert code(steps_app(loader_seed=7)(message(2), ctx)) == 0  # the same order: fine


# -- one release per learner per round --------------------------------------------------------
def test_a_second_message_for_a_round_or_an_older_one_is_refused(simulated: None) -> None:
    ctx = context(**{"data-reuse": "once", "horizon": 12})
    app = steps_app()
    first = app(message(1), ctx)
    assert code(first) == 0
    steps = first.content["metrics"]["steps"]
    assert code(app(message(1), ctx)) == 4107
    assert code(app(message(0), ctx)) == 4107
    assert code(app(message(2), ctx)) == 0
    # the refused messages took no step and released nothing
    assert app(message(3), ctx).content["metrics"]["steps"] == steps + 4


def test_the_ledger_refuses_a_stale_copy_of_the_state(
        simulated: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What Flower's simulation engine does with two overlapping messages for one node:
    both get the node's context as it was. The second must not release the same noise."""
    monkeypatch.setattr(session_module, "in_ray_actor", lambda: True)
    monkeypatch.setattr(session_module, "SimulationReleaseLedger",
                        lambda run, node, key: SimulationReleaseLedger(run, node, key, tmp_path))
    ctx = context(**{"data-reuse": "once", "horizon": 12})
    app = steps_app()
    fresh = copy.deepcopy(ctx)  # a copy taken before the learner's first commit
    assert code(app(message(1), ctx)) == 0
    assert code(app(message(1), fresh)) == 4107  # a fresh state for a learner that trained
    stale = copy.deepcopy(ctx)
    assert code(app(message(2), ctx)) == 0
    assert code(app(message(3), stale)) == 4107  # loaded before round 2 was committed
    assert code(app(message(3), ctx)) == 0


def test_the_ledger_entry_names_the_latest_commit(tmp_path: Path) -> None:
    ledger = SimulationReleaseLedger(5, 2, "k", tmp_path)
    with ledger.locked():
        ledger.check(None, 0)  # nothing recorded: a fresh learner may start
        ledger.record("ab" * 16, 1, 4, 1)
    with ledger.locked():
        ledger.check("ab" * 16, 1)
        with pytest.raises(RoundReplayError):
            ledger.check("ab" * 16, 0)
        with pytest.raises(RoundReplayError):
            ledger.check(None, 0)
    assert oct(ledger.path.stat().st_mode & 0o777) == oct(0o600)


def test_two_messages_to_one_node_in_one_round_release_once_in_flowers_simulation(
        tmp_path: Path) -> None:
    """Through Flower's real simulation engine (Ray): a ServerApp that sends one node two
    train messages for the same round gets one update and one refusal (4107); the update's
    noise leaves the learner once."""
    client_app = make_client_app(lambda ctx: (lambda params, position: [np.ones(DIM)]),
                                 config_defaults={"mechanism": "blt", "epsilon": 2.0,
                                                  "delta": 1e-5, "clip-norm": 1.0,
                                                  "num-server-rounds": 2, "local-steps": 2,
                                                  "seed": 3})
    server_app = ServerApp()
    seen: dict[str, Any] = {}

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        while not (nodes := list(grid.get_node_ids())):
            time.sleep(0.1)
        node = nodes[0]
        content = RecordDict({"arrays": ArrayRecord([np.zeros(DIM)]),
                              "config": ConfigRecord({"server-round": 1, "local-steps": 2,
                                                      "learning-rate": 0.1})})
        msgs = [Message(content=copy.deepcopy(content), dst_node_id=node,
                        message_type=MessageType.TRAIN) for _ in range(2)]
        seen["replies"] = list(grid.send_and_receive(msgs, timeout=120))

    simulate(server_app, client_app, 1, backend_config(actors=2))
    replies = seen["replies"]
    assert len(replies) == 2
    assert sorted(code(r) for r in replies) == [0, 4107]
