"""Participation from the loop (issue 21 item 3): the cyclic loader, and the per-step front
end that calibrates to it and refuses a step it did not hand a batch for.

Independent computations: each example's actual uses are read off the batches the loader
hands out and their sensitivity is summed from the materialized encoder ``C``; the ε the
learner reports is checked against dp_accounting's PLD accountant at that sensitivity.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Context,
    Message,
    RecordDict,
)
from flwr.clientapp import ClientApp

from flwr_corrnoise.data.loader import CyclicLoader
from flwr_corrnoise.flower import PrivateSteps
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.mechanisms import build_factorization

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)
from ..messages import flower_message

N_EX, BATCH, EPOCHS, ROUNDS, DIM = 10, 4, 2, 3, 4
RNG = np.random.default_rng(5)
X = RNG.normal(size=(N_EX, DIM))
Y = RNG.normal(size=N_EX)
CFG = {"partition-id": 0, "mechanism": "blt", "epsilon": 2.0, "delta": 1e-5,
       "clip-norm": 1.0, "num-server-rounds": ROUNDS, "seed": 4}


def loader() -> CyclicLoader:
    return CyclicLoader(N_EX, BATCH, rounds=ROUNDS, local_epochs=EPOCHS, order_seed=7)


def test_every_example_once_per_epoch_in_one_fixed_slot() -> None:
    ld = loader()
    assert (ld.steps_per_epoch, ld.local_steps, ld.horizon, ld.epochs) == (3, 6, 18, 6)
    seen = np.zeros((ld.epochs, N_EX), dtype=int)
    slots: dict[int, set[int]] = {}
    for step in range(ld.horizon):
        for i in ld.indices(step):
            seen[step // ld.steps_per_epoch, i] += 1
            slots.setdefault(int(i), set()).add(step % ld.steps_per_epoch)
    assert np.all(seen == 1)
    assert all(len(s) == 1 for s in slots.values())
    # every example's uses are one of the fixed-epoch patterns the accounting enumerates
    patterns = {tuple(p) for p in ld.participation.patterns(ld.horizon)}
    for i in range(N_EX):
        assert tuple(ld.uses(i)) in patterns
    # the same order whenever the loader is rebuilt (a ClientApp is rebuilt every round)
    np.testing.assert_array_equal(loader().order, ld.order)
    with pytest.raises(IndexError):
        ld.indices(ld.horizon)


def message(x: np.ndarray, server_round: int) -> Message:
    return flower_message(x, server_round=server_round)


def app(*, skip_batch: bool = False) -> ClientApp:
    client = ClientApp(mods=[PrivateSteps.guard()])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        private = PrivateSteps(msg, context, loader=loader())
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        if skip_batch:  # a step whose data did not come from the loader
            w = w - 0.1 * private.step(np.ones(DIM))
        for idx in private.batches():
            grad = X[idx].T @ (X[idx] @ w - Y[idx]) / len(idx)
            w = w - 0.1 * private.step(grad)
        return private.reply([w])

    return client


def context(**extra: Any) -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                   run_config={**CFG, **extra})


def test_the_loader_sets_horizon_and_participation_and_the_pld_confirms_the_epsilon(
        simulated: None) -> None:
    from dp_accounting.dp_event import GaussianDpEvent
    from dp_accounting.pld import PLDAccountant

    ctx = context()
    x = np.zeros(DIM)
    spent = []
    for r in range(1, ROUNDS + 1):
        reply = app()(message(x, r), ctx)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        metrics = reply.content["metrics"]
        assert metrics["steps"] == r * loader().local_steps
        spent.append(metrics["epsilon-spent"])
        x = reply.content["arrays"].to_numpy_ndarrays()[0]
    assert spent == sorted(spent) and spent[-1] == pytest.approx(2.0)

    settings = settings_from_config({**CFG, **loader().config()})
    cal = settings.calibration()
    assert cal.participation == "6 epochs of 3 steps (fixed cyclic order)"
    # independent: the worst example's uses, as the loader handed them out, summed on the
    # materialized encoder (BLT's X ≥ 0: every use in the same direction is the worst case)
    # (the BLT the learner streams is the one optimized for this participation)
    fact = settings.factorization()
    assert fact is build_factorization("blt", 18, min_sep=3, max_participations=6)
    _, C = fact.matrices()
    ld = loader()
    sens = max(np.linalg.norm(C[:, ld.uses(i)].sum(axis=1)) for i in range(N_EX))
    assert cal.sensitivity == pytest.approx(sens, rel=1e-12)
    assert sens > 2 * fact.sensitivity  # reusing data costs
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(GaussianDpEvent(noise_multiplier=cal.std / (2 * 1.0 * sens)))
    pld_eps = acc.get_epsilon(1e-5)
    assert pld_eps == pytest.approx(2.0, rel=1e-3)  # the two accountants agree


def test_a_step_without_a_batch_from_the_loader_is_refused(simulated: None) -> None:
    ctx = context()
    reply = app(skip_batch=True)(message(np.zeros(DIM), 1), ctx)
    assert reply.has_error()
    # nothing was released and nothing moved: the next round runs from step 0
    reply = app()(message(np.zeros(DIM), 1), ctx)
    assert not reply.has_error() and reply.content["metrics"]["steps"] == loader().local_steps


@pytest.mark.parametrize("extra", [{"local-steps": 5}, {"horizon": 30}, {"epochs": 2},
                                   {"num-server-rounds": 4}])
def test_a_config_that_disagrees_with_the_loader_is_refused(
        simulated: None, extra: dict[str, int]) -> None:
    reply = app()(message(np.zeros(DIM), 1), context(**extra))
    assert reply.has_error()


def test_the_horizon_ends_with_the_loader(simulated: None) -> None:
    ctx = context()
    x = np.zeros(DIM)
    for r in range(1, ROUNDS + 1):
        assert not app()(message(x, r), ctx).has_error()
    reply = app()(message(x, ROUNDS + 1), ctx)
    assert reply.has_error()  # the accounted participation is used up


def test_the_first_round_logs_the_plan(simulated: None, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="flwr_corrnoise"):
        assert not app()(message(np.zeros(DIM), 1), context()).has_error()
    text = caplog.text
    assert "participation: 6 epochs of 3 steps (fixed cyclic order)" in text
    assert "noise-to-signal" in text and "verdict:" in text
