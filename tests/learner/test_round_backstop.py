"""The data-independent backstop of ``data-reuse = 'every-round'`` (issue 32,
docs/threat-model.md), through Flower's ClientApp call path: with ``local-examples = n``
declared, a PrivateSteps round of more than ``n`` steps is refused before its step n + 1
releases anything, alike on neighbouring datasets, and a round of at most n steps
releases as before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from flwr_corrnoise.flower import PrivateSteps
from flwr_corrnoise.flower.session import STATE_KEY

from ..flower import test_neighbouring_frontends as nb
from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)
from ..flower_helpers import fingerprint

N = 3
NODE = {"mechanism": "toeplitz", "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0,
        "data-reuse": "every-round", "num-server-rounds": 2, "horizon": 8,
        "local-examples": N, "noise-seed": 5, "partition-id": 0}


def app(steps: int, data: list[float]) -> ClientApp:
    """A user's loop over its local data: ``steps`` steps a round, cycling through
    ``data`` (passes past the data reuse examples within the round)."""
    guarded = ClientApp(mods=[PrivateSteps.guard()])

    @guarded.train()
    def train(msg: Message, ctxt: Context) -> Message:
        private = PrivateSteps(msg, ctxt)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        for t in range(steps):
            x = data[t % len(data)]
            w = w - 0.1 * private.step(lambda w=w, x=x: w - x)
        return private.reply([w])

    return guarded


def context(**over: Any) -> Context:
    return Context(run_id=1, node_id=1, node_config={**NODE, **over}, state=RecordDict(),
                   run_config={})


def round_one(steps: int, data: list[float], ctxt: Context) -> Message:
    return app(steps, data)(nb.message(MessageType.TRAIN, np.zeros((nb.K, nb.D)), 1), ctxt)


def test_one_pass_releases(simulated: None) -> None:
    reply = round_one(N, [0.1, 0.2, 0.3], context())
    assert not reply.has_error()
    assert reply.content["metrics"]["steps"] == N


@pytest.mark.parametrize("steps", [N + 1, 2 * N])
def test_a_second_pass_in_a_round_is_refused_alike_on_neighbours(steps: int,
                                                                 simulated: None) -> None:
    ctxt = context()
    reply = round_one(steps, [0.1, 0.2, 0.3], ctxt)
    assert reply.has_error() and reply.error.code == 4101
    assert "local-examples = 3" in reply.error.reason
    assert STATE_KEY not in ctxt.state  # nothing was released, nothing stored
    neighbour = round_one(steps, [0.1, 99.0, 0.3], context())
    assert fingerprint(neighbour) == fingerprint(reply)


def test_without_the_declaration_or_with_another_participation_no_bound(
        simulated: None) -> None:
    assert not round_one(N + 1, [0.1], context(**{"local-examples": None})).has_error()
    once = context(**{"data-reuse": "once"})
    assert not round_one(N + 1, [0.1, 0.2, 0.3, 0.4], once).has_error()


def test_delta_at_least_one_over_the_declared_n_is_refused(simulated: None) -> None:
    reply = round_one(1, [0.1], context(delta=0.5))
    assert reply.has_error() and "1/n" in reply.error.reason
