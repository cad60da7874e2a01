"""The vectorized in-process engine (issue 22, item 3) equals the reference engine."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.logreg import run_logreg_inprocess
from flwr_corrnoise.apps.logreg_task import (
    LogRegSetup,
    initial_parameters,
    logistic_gradient,
)
from flwr_corrnoise.engine import run_inprocess, run_vectorized
from flwr_corrnoise.learner import StepCounts, local_round, local_rounds
from flwr_corrnoise.learner_state import LearnerState
from flwr_corrnoise.mechanisms import MECHANISMS
from flwr_corrnoise.settings import PrivacySettings
from simulations.logreg import (
    BatchGradient,
    Job,
    SweepEvaluator,
    chunks,
    run_vectorized_logreg,
    stream_data,
)

SMALL = LogRegSetup(num_learners=6, dim=12, rounds=15, tau=3, eta=0.1, test_size=50)


def assert_same_run(a, b) -> None:
    """Same global models (1e-12), learners and noise-stream states: the same noise
    consumed (generator position, step, levels and the ξ history exactly; the buffers a
    recurrence derives — BLT's, the tree's estimates — to 1e-12, as a product over L·d
    columns may round differently from one over d)."""
    assert len(a.models) == len(b.models)
    for xa, xb in zip(a.models, b.models, strict=True):
        np.testing.assert_allclose(xa[0], xb[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.params[0], b.params[0], rtol=0, atol=1e-12)
    assert a.participation == b.participation
    for sa, sb in zip(a.states, b.states, strict=True):
        assert (sa.step, sa.position, sa.rounds) == (sb.step, sb.position, sb.rounds)
        if sa.noise is not None:
            da, db = sa.noise.state_dict(), sb.noise.state_dict()
            assert da.keys() == db.keys()
            for key in da:
                if key == "rows" and sa.noise.kind != "dense" and sa.noise.kind != "toeplitz":
                    np.testing.assert_allclose(da[key], db[key], rtol=0, atol=1e-12)
                else:
                    np.testing.assert_array_equal(da[key], db[key])


def both(setup: LogRegSetup, settings=None, **kw):
    args = dict(initial=initial_parameters(setup),
                gradients=[logistic_gradient(setup, i) for i in range(setup.num_learners)],
                settings=settings or setup.settings(), rounds=setup.rounds, tau=setup.tau,
                eta=setup.eta, seed=setup.seed, keep_models=True, **kw)
    return run_inprocess(**args), run_vectorized(batch_gradient=BatchGradient(setup), **args)


@pytest.mark.parametrize("mechanism", [*sorted(MECHANISMS), "none"])
def test_equals_the_reference_engine(mechanism: str) -> None:
    """Every mechanism: the vectorized engine's stream groups (one recurrence for the
    round's learners, dense windows of up to 32 steps here) against one learner at a
    time."""
    ref, vec = both(SMALL.with_(mechanism=mechanism))
    assert_same_run(ref, vec)
    if mechanism != "none":  # the run has noise: the comparison has power
        noiseless, _ = both(SMALL.with_(mechanism="none"))
        assert np.abs(noiseless.params[0] - ref.params[0]).max() > 1e-3


def test_equals_the_reference_with_sampling_and_mixed_settings() -> None:
    """Learners sampled per round, and two settings groups stepped separately."""
    setup = SMALL.with_(mechanism="blt", num_learners=7)
    one = setup.settings()
    other = PrivacySettings("tree", 1.0, 1e-4, 0.5, horizon=setup.horizon)
    settings = [one if i % 3 else other for i in range(7)]
    ref, vec = both(setup, settings=settings, fraction_train=0.5)
    assert_same_run(ref, vec)
    assert any(len(p) < 7 for p in ref.participation)


def test_the_sweep_driver_uses_it_and_agrees_at_the_paper_defaults() -> None:
    """simulations/logreg.py's run (the Fig. 3 sweep's) equals the reference driver at the
    paper's n = 20, d = 100, τ = 4, a few rounds; the memoized regret is the evaluator's."""
    setup = LogRegSetup(mechanism="blt", rounds=6, test_size=100)
    ref = run_logreg_inprocess(setup).params[0]
    ev = SweepEvaluator(setup)
    vec = run_vectorized_logreg(setup, evaluate=ev).params[0]
    np.testing.assert_allclose(vec, ref, rtol=0, atol=1e-12)
    from flwr_corrnoise.apps.logreg_task import LogRegEvaluator

    plain = LogRegEvaluator(setup)
    run_logreg_inprocess(setup, evaluate=plain)
    assert ev.summary() == pytest.approx(plain.summary(), rel=1e-12, abs=1e-12)


def test_a_failing_batch_falls_back_to_each_learners_own_rule() -> None:
    """A batch that raises computes nothing: every learner computes its own datum (the
    result is the reference's). A non-finite row zeroes that learner's step only."""
    setup = SMALL.with_(mechanism="blt")
    ref, _ = both(setup)

    def raising(z, learners, positions):
        raise ValueError("a malformed datum somewhere in the batch")

    args = dict(initial=initial_parameters(setup),
                gradients=[logistic_gradient(setup, i) for i in range(setup.num_learners)],
                settings=setup.settings(), rounds=setup.rounds, tau=setup.tau,
                eta=setup.eta, seed=setup.seed, keep_models=True)
    assert_same_run(ref, run_vectorized(batch_gradient=raising, **args))
    # one learner's datum is non-finite: its step counts as zero, the others are untouched
    settings = setup.settings()
    shapes = [(setup.dim,)]
    x = [np.full(setup.dim, 0.01)]
    grads = [logistic_gradient(setup, i) for i in range(3)]
    batch = BatchGradient(setup)

    def poisoned(z, positions):  # local_rounds' batch: the learners are fixed
        rows = batch(z, [0, 1, 2], positions)
        rows[1] = np.nan
        return rows

    states = [LearnerState.create(settings, shapes, seed=i) for i in range(3)]
    outs = local_rounds(x, grads, states, settings, setup.tau, setup.eta, batch=poisoned)
    assert [o.diagnostics["nonfinite-steps"] for o in outs] == [0, setup.tau, 0]
    for i in (0, 2):  # the others equal their own one-learner round
        alone = local_round(x, grads[i], LearnerState.create(settings, shapes, seed=i),
                            settings, setup.tau, setup.eta)
        np.testing.assert_allclose(outs[i].update[0], alone.update[0], rtol=0, atol=1e-12)
    assert StepCounts().nonfinite == 0


def test_a_failed_lockstep_round_rolls_every_learner_back() -> None:
    setup = SMALL.with_(mechanism="banded-inverse")
    settings = setup.settings()
    states = [LearnerState.create(settings, [(setup.dim,)], seed=i) for i in range(3)]
    before = [s.to_bytes() for s in states]
    calls = []

    class Interrupted(BaseException):
        pass

    def batch(z, positions):
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted
        return np.zeros_like(z)

    with pytest.raises(Interrupted):
        local_rounds([np.zeros(setup.dim)], [logistic_gradient(setup, i) for i in range(3)],
                     states, settings, setup.tau, setup.eta, batch=batch)
    assert [s.to_bytes() for s in states] == before


def test_the_sweeps_data_are_the_federations() -> None:
    """stream_data (the data the sweep's batch gradient and evaluator read) is the
    federation's data at every position, and the evaluator's round data are the plain
    evaluator's (a second reading: learner_batch one learner and round at a time)."""
    setup = SMALL.with_(data_seed=7)
    feats, labels = stream_data(setup)
    from flwr_corrnoise.apps.logreg_task import LogRegEvaluator, federation

    fed = federation(setup)
    for i in (0, setup.num_learners - 1):
        a, b = fed.learner_batch(i, 0, setup.rounds * setup.tau)
        np.testing.assert_array_equal(feats[i], a)
        np.testing.assert_array_equal(labels[i], b)
    plain, sweep = LogRegEvaluator(setup), SweepEvaluator(setup)
    for r in (0, 4, setup.rounds - 1, setup.rounds + 2):  # the last: past the stored data
        for x, y in zip(plain.round_data(r), sweep.round_data(r), strict=True):
            np.testing.assert_array_equal(x, y)
    # the batch gradient reads the same data (positions past the stored ones too)
    batch = BatchGradient(setup)
    z = np.random.default_rng(1).normal(size=(2, setup.dim))
    end = setup.rounds * setup.tau
    rows = batch(z, [1, 3], [5, end + 1])
    for k, (i, p) in enumerate([(1, 5), (3, end + 1)]):
        ref = logistic_gradient(setup, i)([z[k]], p)[0]
        np.testing.assert_allclose(rows[k], ref, rtol=1e-13, atol=1e-15)


def test_the_sweep_runs_each_data_seeds_jobs_in_one_worker() -> None:
    """chunks(): every job exactly once; a chunk holds one data seed; a seed with fewer
    chunks than workers (the tuning's) is dealt out round-robin over the workers."""
    setups = [SMALL.with_(mechanism=m, eta=eta) for m in ("none", "blt", "toeplitz")
              for eta in (0.1, 0.2, 0.3)]
    tune = [Job(s.with_(seed=1000, data_seed=1000), "tune") for s in setups]
    evals = [Job(s.with_(seed=k, data_seed=k), "eval") for s in setups[:3] for k in range(4)]
    for jobs, workers, expected in ((tune, 2, 2), (evals, 2, 4), (evals + tune, 3, 5)):
        parts = chunks(jobs, workers)
        assert len(parts) == expected
        flat = [id(j) for part in parts for j in part]
        assert sorted(flat) == sorted(id(j) for j in jobs)
        assert all(len({j.setup.data_seed for j in part}) == 1 for part in parts)
    a, b = chunks(tune, 2)
    assert abs(len(a) - len(b)) <= 1 and {j.setup.mechanism for j in a} == {"none", "blt",
                                                                             "toeplitz"}


@pytest.mark.parametrize("setup", [
    LogRegSetup(rounds=6, test_size=150),  # the paper's n·τ = 80 ≤ d: certified optima
    SMALL.with_(rounds=5),  # n·τ = 18 > d = 12: every optimum from round_optimum
    SMALL.with_(rounds=4, drift=0.3),  # a test set per round
], ids=["paper", "more-points-than-d", "drift"])
def test_the_sweep_evaluators_rows_are_the_plain_evaluators(setup: LogRegSetup) -> None:
    """SweepEvaluator (rows computed for all rounds at once when read, optima from
    round_optima) against LogRegEvaluator (one round at a time, round_optimum per round):
    every key of every row, a non-finite model's row included."""
    from flwr_corrnoise.apps.logreg_task import LogRegEvaluator

    rng = np.random.default_rng(3)
    models = [rng.normal(scale=0.5 * r, size=setup.dim) for r in range(setup.rounds + 1)]
    models[2][0] = np.inf
    plain, sweep = LogRegEvaluator(setup), SweepEvaluator(setup)
    for r, x in enumerate(models):
        plain(r, [x])
        assert sweep(r, [x]) is None  # recorded; computed when read
    assert len(sweep.rows) == len(plain.rows) == setup.rounds + 1
    for a, b in zip(plain.rows, sweep.rows, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-12, atol=1e-14, err_msg=key)
    assert np.isnan(sweep.rows[2]["test-loss"]) and np.isnan(sweep.rows[2]["online-loss"])
    assert sweep.summary() == pytest.approx(plain.summary(), rel=1e-12, abs=1e-14, nan_ok=True)
    sweep(setup.rounds + 1, [models[0]])  # rows read earlier, then more recorded: appended
    assert [row["round"] for row in sweep.rows] == list(range(setup.rounds + 2))


def test_the_batched_separability_certificate_is_sound() -> None:
    """certified_separable accepts only rounds is_separable calls separable (its own
    candidate strictly separates them) and refuses a non-separable or degenerate one."""
    from flwr_corrnoise.metrics import is_separable, round_optimum
    from simulations.logreg import certified_separable, round_optima

    rng = np.random.default_rng(0)
    feats = rng.normal(size=(4, 5, 8))
    labels = rng.choice([-1.0, 1.0], size=(4, 5))
    feats[1, 1], labels[1, :2] = feats[1, 0], [1.0, -1.0]  # one point with both labels
    feats[2, 3] = 0.0  # a zero point: no strict margin
    ok = certified_separable(feats, labels)
    assert ok.tolist() == [True, False, False, True]
    assert [is_separable(f, y) for f, y in zip(feats, labels, strict=True)] == [
        True, False, False, True]
    assert not certified_separable(rng.normal(size=(2, 9, 8)), np.ones((2, 9))).any()
    # the sweep's optima are round_optimum's, round by round
    setup = LogRegSetup(rounds=5, test_size=10, data_seed=11)
    ev = SweepEvaluator(setup)
    expected = [round_optimum(*ev.round_data(r)) for r in range(setup.rounds)]
    np.testing.assert_array_equal(round_optima(setup), expected)


def test_softplus_is_the_logistic_losss_logaddexp() -> None:
    """The sweep evaluator's softplus equals logaddexp(0, z) (metrics.logistic_loss) to
    rounding, at every scale of z, with no overflow."""
    from simulations.logreg import softplus

    z = np.concatenate([[-1e308, -800.0, -40.0, -1e-300, 0.0, 1e-300, 40.0, 800.0, 1e308],
                        np.random.default_rng(0).normal(scale=30.0, size=1000)])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow is fine
        out = softplus(z)
    np.testing.assert_allclose(out, np.logaddexp(0.0, z), rtol=4e-16, atol=0)
