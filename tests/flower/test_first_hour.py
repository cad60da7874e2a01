"""A new user's first hour (issue 23): no silent waits, failures on one line, client-side
evaluation that stops asking once the learners refuse it, a report on a noiseless run."""

from __future__ import annotations

import io
import logging
import re
import time

import numpy as np
import pytest
from flwr.app import Error, Message, Metadata, MetricRecord, RecordDict
from flwr.common import MessageType

from flwr_corrnoise.mechanisms import build_factorization, optimized
from flwr_corrnoise.mechanisms.optimized import Optimized, expected_iterations


@pytest.fixture
def show_progress_now(monkeypatch):
    """The thresholds of a long solve, lowered so that a solve of about a second shows
    what a solve of minutes shows."""
    monkeypatch.setattr(optimized, "SLOW_N", 100)
    monkeypatch.setattr(optimized, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(optimized, "PROGRESS_EVERY", 0.0)


def test_a_long_build_shows_progress_and_an_estimate(show_progress_now, caplog) -> None:
    """The optimized solve at N = 400 (about a second): a first line saying what is solved
    and about how many iterations, then one line per iteration with the gap and the time
    left, at WARNING (shown without any logging set up). The estimate is checked against
    the solve itself: the announced iteration count, and the time left it announced against
    the time the solve then took."""
    with caplog.at_level(logging.WARNING, logger="flwr_corrnoise.mechanisms"):
        start = time.perf_counter()
        fact = Optimized(400, use_cache=False)
        took = time.perf_counter() - start
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("flwr_corrnoise")]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    iterations = int(fact.report["iterations"])
    announced = expected_iterations(1e-4)
    assert lines[0].startswith("flwr-corrnoise: solving the optimized factorization for "
                               f"N = 400 to a certified gap of 0.01 % (about {announced} "
                               "iterations")
    assert "'blt'" in lines[0]  # what to use instead
    assert abs(announced - iterations) <= 3  # the law the estimate uses holds here
    progress = lines[1:]
    assert len(progress) == iterations - 1  # every iteration but the one that met the gap
    stamps = []
    for i, line in enumerate(progress, 1):
        m = re.search(r"iteration (\d+), certified gap ([\d.e+-]+) % \(target 0.01 %\), "
                      r"(\d+) s so far \(([\d.]+) s per iteration\), about ([\d.]+) (s|min) "
                      r"left", line)
        assert m is not None, line
        assert int(m.group(1)) == i
        stamps.append(float(m.group(5)) * (60 if m.group(6) == "min" else 1))
    # the first estimate is within a factor of 4 of the time the rest of the solve took
    per_iteration = took / iterations
    rest = per_iteration * (iterations - 1)
    assert stamps[0] <= 4 * rest + 2 and stamps[0] >= rest / 4 - 2


def test_a_short_build_is_silent(caplog, monkeypatch) -> None:
    """A solve below N = 1000 that ends before SHOW_AFTER seconds says nothing at WARNING
    (SHOW_AFTER raised here: a loaded test machine may take 3 s for anything)."""
    monkeypatch.setattr(optimized, "SHOW_AFTER", 1e9)
    assert optimized.SLOW_N == 1000
    with caplog.at_level(logging.WARNING, logger="flwr_corrnoise.mechanisms"):
        Optimized(64, use_cache=False)
    assert caplog.records == []


def test_the_default_mechanism_builds_fast_and_near_the_optimum() -> None:
    """The default (`blt`) against the optimized factorization, solved here to a certified
    0.01 % gap: within 5 % of its RMSE; and the default settings name it."""
    from flwr_corrnoise.mechanisms.blt import BufferedToeplitz
    from flwr_corrnoise.settings import PrivacySettings
    from flwr_corrnoise.settings_keys import KEYS

    assert PrivacySettings().mechanism == KEYS["mechanism"].default == "blt"
    for n in (64, 128):
        start = time.process_time()
        blt = BufferedToeplitz(n, use_cache=False)
        assert time.process_time() - start < 5.0
        best = build_factorization("optimized", n)
        assert best.rmse <= blt.rmse <= 1.05 * best.rmse


# -- failures on one line -----------------------------------------------------------------

def _flower_log(exc: BaseException) -> str:
    """What Flower's runner logs for a ServerApp that raised ``exc`` (its own call)."""
    from flwr.common.logger import log

    import flwr_corrnoise.flower  # noqa: F401  (puts the filter on Flower's logger)

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        try:
            raise exc
        except Exception as ex:  # as flwr/superlink/runtime/run_serverapp.py does
            log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=ex)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_configuration_error_is_logged_on_one_line() -> None:
    from flwr_corrnoise.flower import RunFailedError
    from flwr_corrnoise.settings import PrivacyConfigError
    from flwr_corrnoise.settings_keys import ConfigKeyError

    for exc in (ConfigKeyError("'epsilom' in the run config is not a flwr-corrnoise key: "
                               "did you mean 'epsilon'?"),
                PrivacyConfigError("unknown mechanism 'blt2'"),
                RunFailedError("nothing was released for 3 consecutive round(s);\nlast …")):
        text = _flower_log(exc)
        assert text.count("\n") == 1 and "Traceback" not in text, text
        assert text.startswith(f"ERROR ServerApp raised an exception: {type(exc).__name__}: ")
        assert " ".join(str(exc).split()) in text
    # anything else keeps its traceback: a bug needs it
    assert "Traceback" in _flower_log(KeyError("x"))


# -- client-side evaluation the learners refuse -------------------------------------------

@pytest.fixture
def task_identity():
    """Outside a running ServerApp, Flower needs a task identity to build messages."""
    from flwr.supercore.task_identity import TaskIdentity

    keys = ("_run_id", "_node_id", "_task_id")
    saved = {k: TaskIdentity.__dict__.get(k) for k in keys}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    for k, v in saved.items():
        setattr(TaskIdentity, k, v)


def _evaluate_reply(node: int, code: int | None) -> Message:
    md = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                  reply_to_message_id="x", group_id="1", created_at=time.time(), ttl=3600.0,
                  message_type=MessageType.EVALUATE)
    if code is not None:
        return Message(error=Error(code=code, reason="refused"), metadata=md)
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 4,
                                                               "accuracy": 0.5})}),
                   metadata=md)


def test_refused_client_evaluation_is_logged_once_and_then_off(task_identity, caplog) -> None:
    """A FedAvg with client-side evaluation, around which the local-DP wrapper runs, whose
    learners did not opt in: the first round's refusals (code 4106) give one warning that
    points to server-side evaluation, and no evaluate message is sent after it."""
    from flwr.serverapp.strategy import FedAvg

    from flwr_corrnoise.flower import CorrNoiseLocalDPStrategy
    from flwr_corrnoise.flower.monitor import EVALUATE_REFUSED

    assert EVALUATE_REFUSED == 4106
    run = {"num-server-rounds": 3, "local-steps": 2, "mechanism": "blt"}
    wrapper = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=1.0), run)
    with caplog.at_level(logging.WARNING):
        for rnd in (1, 2):
            replies = [_evaluate_reply(n, EVALUATE_REFUSED) for n in (1, 2)]
            assert wrapper.aggregate_evaluate(rnd, replies) is None
    warned = [r.getMessage() for r in caplog.records if "refuse client-side" in r.getMessage()]
    assert len(warned) == 1 and "2 of 2 learner(s)" in warned[0]
    assert "evaluate_fn" in warned[0] and "off for the rest of the run" in warned[0]
    assert wrapper.evaluation_refused
    assert list(wrapper.configure_evaluate(3, None, None, None)) == []  # type: ignore[arg-type]

    # some learners opted in: theirs is aggregated, the refusals are left out
    mixed = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=1.0), run)
    agg = mixed.aggregate_evaluate(1, [_evaluate_reply(1, EVALUATE_REFUSED),
                                       _evaluate_reply(2, None)])
    assert agg is not None and agg["accuracy"] == pytest.approx(0.5)
    assert not mixed.evaluation_refused


# -- report on a noiseless run ------------------------------------------------------------

@pytest.mark.slow
def test_report_on_a_noiseless_and_a_private_run(tmp_path, capsys) -> None:
    """Two real (tiny) Flower runs, noiseless and BLT, reported together: the noiseless
    learners have no ε (not "nan"), its label names no ε, one legend entry per run, and
    each run in its method's colour — the colour of the demo's accuracy plot."""
    from flwr_corrnoise.apps.logreg import logreg_apps
    from flwr_corrnoise.apps.logreg_task import LogRegSetup
    from flwr_corrnoise.cli import main
    from flwr_corrnoise.report import colour, draw, find_runs, load_run

    from ..flower_helpers import simulate

    base = LogRegSetup(num_learners=2, dim=4, rounds=2, tau=2, test_size=100, seed=1,
                       data_seed=2)
    for name, mech in (("noiseless", "none"), ("blt", "blt")):
        setup = base.with_(mechanism=mech)
        simulate(*logreg_apps(setup, str(tmp_path / name), progress=False), 2)
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--json"]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    for who in ("0", "1"):
        assert printed[f"noiseless: learner {who}"].startswith("no noise: not private (no ε)")
        assert "nan" not in printed[f"noiseless: learner {who}"]
        assert printed[f"blt: learner {who}"].startswith("ε spent 2 of 2 ")
    runs = [load_run(p) for p in find_runs(tmp_path)]
    labels = {r.path.name: r.label for r in runs}
    assert labels["noiseless"] == "noiseless: no noise (not private)"
    assert labels["blt"] == "blt: blt (ε=2.0, δ=0.001)"
    fig = draw(runs)
    ax_eps, ax_acc = fig.axes
    assert [t.get_text() for t in ax_eps.get_legend().get_texts()] == ["blt (2 learners)"]
    assert len(ax_acc.get_legend().get_texts()) == 2
    from matplotlib.colors import to_hex

    for line in ax_acc.get_lines():
        method = "none" if line.get_label().startswith("noiseless") else "blt"
        assert to_hex(line.get_color()) == to_hex(colour(method))
    assert np.isfinite([r.accuracy[-1][1] for r in runs]).all()
