"""A malicious server, one test per attack in ``docs/threat-model.md``: each gains nothing.

The learners run under the real-SuperNode rules (a direct ClientApp call outside Flower's
simulation engine), through Flower's real ClientApp call path.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import mpmath
import numpy as np
import pytest
from flwr.app import Context, MessageType, RecordDict

from flwr_corrnoise.flower import CorrNoiseRoundMod, make_client_app
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import build_factorization, cache
from flwr_corrnoise.mechanisms.optimized import Optimized
from flwr_corrnoise.persistence import STATE_FILE, StateBusyError, StateStore
from flwr_corrnoise.privacy import calibrate
from flwr_corrnoise.settings import PrivacySettings

from .test_release_gate import DIM, LEARNER, message, np_gradient, round_mod
from .test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)

X = np.full((1, DIM), 0.2)


def node(tmp_path: Path | None = None, run: dict[str, Any] | None = None, **cfg: Any) -> Context:
    config = {**LEARNER, **cfg}
    if tmp_path is not None:
        config["state-dir"] = str(tmp_path)
    return Context(run_id=1, node_id=1, node_config=config, state=RecordDict(),
                   run_config=dict(run or {}))


def train(app, context: Context, r: int = 1, **config: Any):
    msg = message(MessageType.TRAIN, X, r)
    for k, v in config.items():
        msg.content["config"][k] = v
    return app(msg, context)


APP = make_client_app(lambda c: np_gradient("small"))


def test_data_dependent_metrics_never_leave() -> None:
    reply = train(APP, node())
    assert not {"clipped-fraction", "train-loss", "update-clipped"} & set(
        reply.content["metrics"].keys())
    reply = train(round_mod("small"), node())
    assert set(reply.content.keys()) == {"arrays", "metrics"}


@pytest.mark.parametrize("app", [APP, round_mod("small")], ids=["per-step", "round-mod"])
def test_evaluate_and_query_messages_are_refused(app) -> None:
    for kind in (MessageType.EVALUATE, MessageType.QUERY):
        try:
            reply = app(message(kind, X, 1), node())
        except ValueError:  # the user's app registers no query function: Flower refuses
            continue
        assert reply.has_error() and reply.error.code == 4106


def test_server_cannot_weaken_the_budget_through_the_run_config() -> None:
    """On a real SuperNode the run config is only a proposal: weaker keys are refused, and
    keys the node config omits are *not* filled from it (the app's defaults are)."""
    reply = train(APP, node(run={"epsilon": 1000.0}))
    assert reply.has_error() and reply.error.code == 4101 and "ε 1000" in reply.error.reason
    context = node(run={"delta": 0.5})
    context.node_config.pop("delta")
    reply = train(APP, context)
    assert reply.has_error() and "δ 0.5" in reply.error.reason


def test_server_cannot_know_or_set_a_seed() -> None:
    """A run-config seed is ignored on a real SuperNode: two learners with the same run
    config draw independent noise; a node-config noise-seed is refused outright."""
    a, b = (train(APP, node(run={"seed": 1})) for _ in range(2))
    xa, xb = (r.content["arrays"].to_numpy_ndarrays()[0] for r in (a, b))
    assert not np.allclose(xa, xb)
    reply = train(APP, node(**{"noise-seed": 3}))
    assert reply.has_error() and reply.error.code == 4101 and "noise-seed" in reply.error.reason


def test_wiped_state_never_replays_noise(tmp_path: Path) -> None:
    """A wiped state directory makes a new learner with a fresh OS-entropy seed."""
    first = train(APP, node(tmp_path)).content["arrays"].to_numpy_ndarrays()[0]
    for p in tmp_path.iterdir():
        p.unlink()
    again = train(APP, node(tmp_path)).content["arrays"].to_numpy_ndarrays()[0]
    assert not np.allclose(first, again)


def test_restore_under_other_settings_is_refused(tmp_path: Path) -> None:
    assert not train(APP, node(tmp_path)).has_error()
    reply = train(APP, node(tmp_path, epsilon=8.0), r=2)
    assert reply.has_error() and reply.error.code == 4101
    assert "epsilon: stored 2.0, now 8.0" in reply.error.reason
    reply = train(APP, node(tmp_path, mechanism="tree"), r=2)
    assert reply.has_error() and "mechanism: stored 'blt', now 'tree'" in reply.error.reason
    assert not train(APP, node(tmp_path), r=2).has_error()  # the old settings still work


def test_the_cache_cannot_change_an_in_flight_stream(tmp_path: Path, monkeypatch) -> None:
    """A later, different solve written to the cache does not change the noise of a stream
    made before it: the stream restores its own factorization by digest."""
    monkeypatch.setenv("FLWR_CORRNOISE_CACHE", str(tmp_path / "cache"))
    build_factorization.cache_clear()
    settings = PrivacySettings("optimized", 2.0, 1e-3, 1.0, horizon=16)
    state = LearnerState.create(settings, [(3,)], seed=1)
    state.noise.next()
    state.step += 1
    data = state.to_bytes()
    replay = LearnerState.from_bytes(data).noise.next()
    # another solve (a looser gap: another dual point) replaces the cache entry for N = 16
    other = Optimized(16, gap=0.5, use_cache=False)
    assert other.digest != state.noise.factorization.digest
    cache.store(other._cache_key(), v=other.dual, report='{"gap": 0.0}')
    build_factorization.cache_clear()
    assert build_factorization("optimized", 16).digest == other.digest
    restored = LearnerState.from_bytes(data)
    assert restored.noise.factorization.digest == state.noise.factorization.digest
    np.testing.assert_array_equal(restored.noise.next(), replay)
    # without the write-once copy the stream refuses, naming old and new
    for p in (tmp_path / "cache").glob("*sha256*"):
        p.unlink()
    build_factorization.cache_clear()
    with pytest.raises(Exception, match="digest"):
        LearnerState.from_bytes(data)
    build_factorization.cache_clear()


def test_two_executions_cannot_share_a_state_directory(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with StateStore(tmp_path).lock():
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    try:
        with pytest.raises(StateBusyError, match="in use by another execution"), store.lock():
            pass
        reply = train(APP, node(tmp_path))
        assert reply.has_error() and reply.error.code == 4105
    finally:
        release.set()
        t.join()
    assert not train(APP, node(tmp_path)).has_error()
    assert (tmp_path / STATE_FILE).exists()


def test_round_mod_keeps_a_ledger(tmp_path: Path) -> None:
    app = round_mod("small")
    for r in (1, 2):
        assert not train(app, node(tmp_path), r=r).has_error()
    ledger = StateStore(tmp_path / "round-mod").ledger()
    assert [e["first-step"] for e in ledger] == [0, 1]
    assert [e["server-round"] for e in ledger] == [1, 2]


def test_diagnostics_stay_on_the_learner(tmp_path: Path) -> None:
    app = make_client_app(lambda c: np_gradient("huge"))
    reply = train(app, node(tmp_path), r=1)
    reply = train(app, node(tmp_path), r=2)
    assert not reply.has_error()
    lines = [json.loads(x) for x in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    # the huge datum (round 2) is clipped; others may be too (the noisy iterate is random)
    assert len(lines) == 2 and lines[1]["clipped-steps"] >= 1.0
    assert "clipped-steps" not in dict(reply.content["metrics"])


def test_calibration_is_on_the_safe_side() -> None:
    """δ(ε, σ) ≤ δ exactly (60 digits) for the returned float σ, for many budgets."""
    for eps in (0.1, 0.5, 1.0, 2.0, 8.0, 64.0):
        for delta in (1e-3, 1e-5, 1e-9):
            cal = calibrate(eps, delta, 1.0, 1.3)
            with mpmath.workdps(80):  # Balle & Wang's δ(ε, μ), μ = Δ/σ without rounding
                mu = mpmath.mpf(cal.l2_sensitivity) / mpmath.mpf(cal.std)
                e = mpmath.mpf(eps)
                exact = mpmath.ncdf(mu / 2 - e / mu) - mpmath.exp(e) * mpmath.ncdf(-mu / 2 - e / mu)
                assert exact <= mpmath.mpf(delta)
    settings = PrivacySettings("toeplitz", 2.0, 1e-3, 1.0, horizon=64)
    assert settings.epsilon_spent(64) <= 2.0


def test_round_mod_at_function_level_guards_train_only() -> None:
    """Documented limit: attached with ``@app.train(mods=...)`` the mod cannot see evaluate
    messages — which is why the docs attach it to the whole app."""
    from flwr.app import Message, MetricRecord
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"loss": 1.0})}), reply_to=msg)

    app.train(mods=[CorrNoiseRoundMod()])(lambda m, c: m)
    assert not app(message(MessageType.EVALUATE, X, 1), node()).has_error()
    guarded = ClientApp(mods=[CorrNoiseRoundMod()])
    guarded.evaluate()(evaluate)
    assert guarded(message(MessageType.EVALUATE, X, 1), node()).error.code == 4106
