"""Sampling in the learner's loop (issue 35): a learner whose loop draws its batches by
cyclic Poisson sampling (:class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`) is
calibrated to the amplified guarantee of Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization", and releases nothing that depends on what a step drew.

Each claim against a second computation: the learner's noise std and ε spent against
``dp_accounting``'s PLD on the same events (both neighbouring relations); the device step
against a hand computation of ``(Σ clip(g_i) + e)/m`` with ``m`` the expected batch size;
the Flower front end's replies on neighbouring datasets against each other; refusals.
"""

from __future__ import annotations

import functools
import math
from functools import partial

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant as DpaPLD
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from flwr_corrnoise.data.sampling import CyclicPoissonLoader
from flwr_corrnoise.flower import PrivateSteps
from flwr_corrnoise.flower.config import settings_from_config
from flwr_corrnoise.mechanisms.participation import (
    Participation,
    ParticipationError,
    SampledParticipation,
)
from flwr_corrnoise.settings import PrivacyConfigError, PrivacySettings
from flwr_corrnoise.torch import PrivateOptimizer

from ..flower.test_strategy import task_identity  # noqa: F401  (autouse: Flower message identity)
from ..flower_helpers import fingerprint
from ..messages import flower_message

RELATIONS = {"replace-one": dpa.NeighboringRelation.REPLACE_ONE,
             "add-remove": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE}


@functools.lru_cache(maxsize=16)
def _dpa_step(sigma: float, q: float, relation: str) -> dpa_pld.PrivacyLossDistribution:
    """dp_accounting's PLD of one Poisson-subsampled Gaussian step, as its PLDAccountant
    builds it for a ``PoissonSampledDpEvent`` (the same call and discretization); kept, so
    that ε after several step counts costs one build and a self-composition each."""
    return dpa_pld.from_gaussian_mechanism(standard_deviation=sigma,
                                           value_discretization_interval=1e-4, sampling_prob=q,
                                           neighboring_relation=RELATIONS[relation])


def dpa_epsilon(sigma: float, q: float, steps: int, delta: float, relation: str) -> float:
    return float(_dpa_step(sigma, q, relation).self_compose(steps).get_epsilon_for_delta(delta))


def test_the_cached_step_is_dp_accountings_accountant() -> None:
    """:func:`dpa_epsilon` equals dp_accounting's own PLDAccountant on the same event (both
    relations take one path there; the accountant composes with an identity PLD first,
    which moves ε by about 1e-11), and more steps spend more."""
    acc = DpaPLD(RELATIONS["add-remove"], value_discretization_interval=1e-4)
    acc.compose(dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(2.5)), 7)
    seven = dpa_epsilon(2.5, 0.25, 7, 1e-5, "add-remove")
    assert seven == pytest.approx(float(acc.get_epsilon(1e-5)), rel=1e-9)
    assert dpa_epsilon(2.5, 0.25, 8, 1e-5, "add-remove") > seven


@pytest.mark.parametrize("relation", sorted(RELATIONS))
@pytest.mark.parametrize(("mechanism", "bands"), [("independent", 1), ("bandmf", 1),
                                                  ("bandmf", 3)])
def test_settings_calibrate_the_amplified_mechanism(relation: str, mechanism: str,
                                                    bands: int) -> None:
    """The learner's std is ``σ·ζ·B_g`` with ``σ`` the smallest noise multiplier for which
    ``⌈N/b⌉`` Poisson-subsampled Gaussian steps meet (ε, δ) by dp_accounting's PLD under
    the stated relation (1 % less noise breaks it); ε spent after ``k`` steps is
    dp_accounting's on ``⌈k/b⌉`` of them. ``bands = 1`` is DP-SGD's noise multiplier."""
    n, q, eps, delta, clip = 24, 0.25, 2.0, 1e-5, 0.7
    part = SampledParticipation.cyclic_poisson(q, bands, n, 4.0, relation)
    st = PrivacySettings(mechanism, eps, delta, clip, n, participation=part)
    cal = st.calibration()
    fact = st.factorization()
    cycles = -(-n // bands)
    sigma = cal.std / (fact.sensitivity * clip)
    assert cal.relation == relation and cal.accountant == f"pld ({relation})"
    if bands == 1:
        assert fact.sensitivity == pytest.approx(1.0)
    assert dpa_epsilon(sigma, q, cycles, delta, relation) <= eps * (1 + 1e-3)
    assert dpa_epsilon(0.99 * sigma, q, cycles, delta, relation) > eps
    for k in (1, bands + 1, n // 2, n):
        want = dpa_epsilon(sigma, q, -(-k // bands), delta, relation)
        assert st.epsilon_spent(k) == pytest.approx(min(want, eps), rel=2e-3)
    assert st.binding()["participation"]["relation"] == relation


def test_the_sampled_participation_keeps_the_unamplified_bound() -> None:
    """Its base fields are the fixed-epoch pattern of the same loop (``⌈N/b⌉`` uses, ``b``
    apart), so code that ignores the sampling computes a sensitivity that holds whatever
    was drawn; it round-trips through a binding; bad values are refused."""
    part = SampledParticipation.cyclic_poisson(0.5, 4, 18, 2.0)
    assert isinstance(part, Participation)
    assert (part.max_participations, part.min_sep, part.fixed_epoch) == (5, 4, True)
    assert Participation.from_dict(part.as_dict()) == part
    assert part != Participation.epochs(5, 4)
    for bad in ({"sampling_rate": 0.0}, {"sampling_rate": 1.5}, {"bands": 0},
                {"expected_batch_size": math.nan}, {"relation": "swap"}):
        args = {"sampling_rate": 0.5, "bands": 4, "horizon": 18, "expected_batch_size": 2.0,
                **bad}
        with pytest.raises(ParticipationError):
            SampledParticipation.cyclic_poisson(**args)


def test_a_non_banded_encoder_is_refused() -> None:
    """BLT's encoder is dense: one example's uses share rows of ``C·G``, Thm. 4 does not
    apply, and the calibration refuses rather than print an ε that may not hold."""
    part = SampledParticipation.cyclic_poisson(0.25, 2, 16, 4.0)
    with pytest.raises(ValueError, match="bands"):
        PrivacySettings("blt", 2.0, 1e-5, 1.0, 16, participation=part).calibration()


def test_the_loader_tells_the_config_its_participation() -> None:
    """The loader's config keys give settings whose participation is the loader's."""
    ld = CyclicPoissonLoader(64, 8, rounds=2, key=7, local_epochs=1, bands=2)
    cfg = {"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5, **ld.config()}
    st = settings_from_config(cfg)
    assert st.participation == ld.participation
    assert st.mechanism_params() == {"bands": 2}
    with pytest.raises(PrivacyConfigError, match="declare one"):
        settings_from_config({**cfg, "epochs": 2})
    with pytest.raises(PrivacyConfigError, match="expected-batch-size"):
        settings_from_config({k: v for k, v in cfg.items() if k != "expected-batch-size"})



def test_the_config_states_the_relation() -> None:
    """``sampling-relation`` (default replace-one) reaches the calibration: with
    ``add-remove``, DP-SGD's noise multiplier (1 band, Poisson at q = 1/4, 8 steps) gives
    ε = 2 by dp_accounting's PLD for add/remove and more for replace-one, and the ε is
    labelled with it; an unknown relation is refused."""
    cfg = {"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5, "clip-norm": 1.0,
           "horizon": 8, "sampling-rate": 0.25, "sampling-cycle": 1,
           "expected-batch-size": 4.0, "calibration": "exact"}
    assert settings_from_config(cfg).participation.relation == "replace-one"
    assert settings_from_config({**cfg, "sampling-relation": " Replace-One "}
                                ).participation.relation == "replace-one"
    cal = settings_from_config({**cfg, "sampling-relation": "add-remove"}).calibration()
    assert cal.relation == "add-remove" and "add-remove" in cal.participation

    def dpa_epsilon(relation) -> float:
        acc = DpaPLD(relation, value_discretization_interval=1e-3)
        acc.compose(dpa.PoissonSampledDpEvent(0.25, dpa.GaussianDpEvent(
            cal.noise_multiplier)), 8)
        return acc.get_epsilon(1e-5)

    assert dpa_epsilon(dpa.NeighboringRelation.ADD_OR_REMOVE_ONE) == pytest.approx(
        2.0, abs=5e-3)
    assert dpa_epsilon(dpa.NeighboringRelation.REPLACE_ONE) > 3.0
    with pytest.raises(PrivacyConfigError, match="relation"):
        settings_from_config({**cfg, "sampling-relation": "add-one"})

# -- the device step --------------------------------------------------------------------

def _optimizer(settings: PrivacySettings, seed: int) -> PrivateOptimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False).double()
    return PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, settings,
                            seed=seed)


def test_the_device_step_divides_by_the_expected_batch_size() -> None:
    """``(Σ clip(g_i) + e)/m`` with ``m`` the expected batch size whatever the step drew
    (0, 1 or 5 examples): the noise ``e/m`` is read off a twin that drew nothing, the sum
    of clipped per-example gradients is computed by hand."""
    part = SampledParticipation.cyclic_poisson(0.5, 1, 8, 2.5)
    st = PrivacySettings("bandmf", 4.0, 1e-5, 0.3, 8, participation=part)
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    y = torch.tensor([0, 1, 1, 0, 1])
    for size in (1, 5):
        empty, full = _optimizer(st, 11), _optimizer(st, 11)
        empty.zero_grad()
        empty.backward(x[:0], y[:0])
        empty.step()
        full.zero_grad()
        full.backward(x[:size], y[:size])
        full.step()
        clipped = torch.zeros(2, 3, dtype=torch.float64)
        w = full.model.weight.detach() + 0.1 * full.model.weight.grad  # before the step
        for i in range(size):
            wi = w.clone().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy((x[i:i + 1] @ wi.T), y[i:i + 1])
            (g,) = torch.autograd.grad(loss, wi)
            clipped += g * min(1.0, 0.3 / float(g.norm()))
        got = (full.model.weight.grad - empty.model.weight.grad) * 2.5
        torch.testing.assert_close(got, clipped)
        assert empty.diagnostics()["failed-examples"] == 0.0  # drawing nothing is no failure
        assert empty.metrics() == full.metrics()


# -- the Flower front end ---------------------------------------------------------------

N_EX, BATCH, ROUNDS, D = 12, 3, 3, 4


def dataset(kind: str) -> tuple[np.ndarray, np.ndarray]:
    x = 0.5 * np.sin(np.arange(N_EX * D, dtype=float)).reshape(N_EX, D) + 0.2
    y = np.arange(N_EX) % 2
    if kind == "odd":
        x[5] = 40.0  # the neighbouring dataset: example 5 replaced
        y[5] = 0
    return x, y


def loader(key: int = 99) -> CyclicPoissonLoader:
    return CyclicPoissonLoader(N_EX, BATCH, rounds=ROUNDS, key=key, bands=2)


def app(kind: str, skip_draw: bool = False, batch_mean: bool | str = False) -> ClientApp:
    """The user's NumPy loop over the loader's sampled batches: each step passes the
    batch's per-example gradients (the library clips each, noises the sum and divides by
    the expected batch size)."""
    client = ClientApp(mods=[PrivateSteps.guard()])
    x, y = dataset(kind)

    @client.train()
    def train(msg: Message, ctxt: Context) -> Message:
        ld = loader()
        private = PrivateSteps(msg, ctxt, loader=ld)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        batches = private.batches()
        for t in range(ld.local_steps):
            idx = next(batches) if not (skip_draw and t == 1) else np.arange(0)
            grads = [partial(example_gradient, w, x[i], y[i]) for i in idx]
            if batch_mean:  # the batch's mean: one example could move it by 2·B_g
                grads = sum((g() for g in grads), np.zeros(D)) / ld.expected_batch_size
                if batch_mean == "row":  # shaped as a Linear(D, 1) weight's, 1 × D
                    grads = grads[None, :]
            w = w - 0.1 * private.step(grads)
        return private.reply([w])

    return client


def example_gradient(w: np.ndarray, xi: np.ndarray, yi: float) -> np.ndarray:
    """One example's gradient of the toy model (the test's user code)."""
    return np.outer(np.tanh(xi @ w) - yi, xi).sum(axis=0)


def message(w: np.ndarray, server_round: int) -> Message:
    return flower_message(w, server_round=server_round)


def conversation(client: ClientApp) -> list[dict]:
    ctxt = Context(run_id=1, node_id=1, node_config={
        "mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5, "noise-seed": 5,
        "partition-id": 0}, state=RecordDict(), run_config={})
    w, prints = np.zeros(D), []
    for r in range(1, ROUNDS + 1):
        reply = client(message(w, r), ctxt)
        prints.append(fingerprint(reply))
        if not reply.has_error():
            w = reply.content["arrays"].to_numpy_ndarrays()[0]
    return prints


def test_neighbouring_datasets_give_the_same_replies(simulated: None) -> None:
    """Two learners with the same key whose data differ in one example: every non-array
    part of every reply is identical (no batch size, nothing drawn-dependent), and ε spent
    is the amplified one."""
    same, odd = conversation(app("same")), conversation(app("odd"))
    assert same == odd
    metrics = same[-1]["metrics"]
    assert "error" not in same[-1] and metrics["steps"] == loader().horizon
    st = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                               **loader().config()})
    assert metrics["epsilon-spent"] == pytest.approx(st.epsilon_spent(loader().horizon))
    assert metrics["num-examples"] == 1.0  # the FedAvg weight, the same for every learner
    assert not any("batch" in k for k in metrics)


def test_a_step_outside_the_sampler_s_schedule_is_refused(simulated: None) -> None:
    """A step taken without the loader's batch for it: an error reply, nothing released."""
    prints = conversation(app("same", skip_draw=True))
    assert all("error" in p for p in prints)


def test_a_sampled_step_takes_per_example_gradients(simulated: None) -> None:
    """With a sampler, PrivateSteps.step takes the batch's per-example gradients (it clips
    each: the amplified accounting's one-example change ``B_g``); a batch mean or sum,
    which it could only clip as a whole (a change of up to ``2·B_g``), is refused in every
    round whatever the data."""
    assert all("error" in p for p in conversation(app("same", batch_mean=True)))
    assert all("error" in p for p in conversation(app("odd", batch_mean=True)))
    # the same mean as a 1 × D array (a Linear(D, 1) weight's gradient) is no batch of rows
    assert all("error" in p for p in conversation(app("same", batch_mean="row")))


def test_one_example_moves_a_secure_sampled_release_by_at_most_its_clip_norm() -> None:
    """A secure stream releases ``trunc_g(Σ) + e`` on its grid. With the sum truncated as a
    whole, an example of norm exactly ``B_g`` moves the release by ``B_g + 2·10⁻⁹`` here
    (the other example's fractional part carries every coordinate across a multiple of
    ``g``), beyond the bound the amplified accounting uses. Each example truncated to the
    grid before the sum keeps it within ``B_g``: the difference of two neighbouring steps'
    releases, with the same noise (forks of one state), is the truncated example exactly."""
    from flwr_corrnoise.learner import StepCounts, private_sampled_steps
    from flwr_corrnoise.learner_state import LearnerState
    from flwr_corrnoise.secure_noise import granularity

    d = 10
    ld = CyclicPoissonLoader(64, 8, rounds=2, key=None, bands=2)
    st = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                               "clip-norm": 1.0, "calibration": "exact", **ld.config()})
    state = LearnerState.create(st, [(d,)], None, secure=True)
    g = granularity(state.noise.std)
    a = 1 / math.sqrt(d)  # the example: norm B_g = 1, no multiple of g a coordinate
    rest = float(np.fmod(a, g))
    assert 0 < rest < g
    other = np.full(d, g - rest / 2)  # below g; with a, every coordinate crosses a multiple

    def release(drawn: list[np.ndarray]) -> np.ndarray:
        out = private_sampled_steps([state.fork()], st, d, [StepCounts()], [drawn],
                                    ld.expected_batch_size)
        return out[0] * ld.expected_batch_size

    moved = release([other, np.full(d, a)]) - release([other])
    assert np.linalg.norm(moved) <= 1.0
    np.testing.assert_allclose(moved, np.full(d, a - rest), rtol=1e-12)


def test_truncate_to_grid_is_exact_and_shrinks() -> None:
    """``secure_noise.truncate_to_grid`` against an independent form (sign · floor of the
    magnitude, in exact rationals): on the grid, toward zero, never larger in magnitude."""
    from fractions import Fraction

    from flwr_corrnoise.secure_noise import truncate_to_grid

    g = 2.0**-20
    x = np.random.default_rng(5).standard_normal(200) * 1e-4
    x[:3] = [0.0, -g, 3 * g]
    t = truncate_to_grid(x, g)
    for xi, ti in zip(x.tolist(), t.tolist(), strict=True):
        q = Fraction(xi) / Fraction(g)
        want = (1 if q >= 0 else -1) * (abs(q.numerator) // q.denominator) * Fraction(g)
        assert Fraction(ti) == want and abs(ti) <= abs(xi)


# -- the auditor with the sampler ---------------------------------------------------------

def test_the_auditor_runs_the_amplified_mechanism_with_its_sampler() -> None:
    """BandMF (2 bands) under cyclic Poisson sampling at q = 1/16, claimed ε = 1: the
    empirical lower bound stays below the claim and the noise law holds. Fault: a loop
    that ignores the sampler (the canary at every eligible step, ``drawn_rate = 1``) while
    the settings claim the amplification — the auditor proves ε > 1 (lower bound ≈ 2.4
    from 200 runs; at q = 1/4 the same fault needs 1000 runs, 5× the time)."""
    from flwr_corrnoise.audit import audit

    kwargs = {"steps": 16, "sampling_rate": 0.0625, "sampling_cycle": 2, "epsilon": 1.0,
              "delta": 1e-5, "runs": 200, "seed": 3}
    honest = audit("bandmf", **kwargs)
    assert not honest.falsified and honest.epsilon_lower_bound < 1.0
    assert "cyclic Poisson" in honest.participation
    fault = audit("bandmf", drawn_rate=1.0, **kwargs)
    assert fault.exceeds_claim, fault.verdict


# -- the CLI and the loop choice ----------------------------------------------------------

def test_cli_calibrate_takes_the_sampling(capsys: pytest.CaptureFixture[str]) -> None:
    """``calibrate --sampling-rate --sampling-cycle --relation`` is the learner's
    calibration; a sampling rate beside --epochs is refused."""
    import json

    from flwr_corrnoise.cli import main

    assert main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
                 "--mechanism", "bandmf", "--steps", "24", "--sampling-rate", "0.25",
                 "--sampling-cycle", "2", "--relation", "add-remove", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    part = SampledParticipation.cyclic_poisson(0.25, 2, 24, 1.0, "add-remove")
    cal = PrivacySettings("bandmf", 2.0, 1e-5, 1.0, 24, participation=part).calibration()
    assert out["std"] == pytest.approx(cal.std) and out["relation"] == "add-remove"
    assert out["encoder_bands"] == 2
    with pytest.raises(SystemExit):
        main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--clip-norm", "1",
              "--mechanism", "bandmf", "--steps", "24", "--sampling-rate", "0.25",
              "--epochs", "2"])


def test_choose_loop_picks_the_smallest_noise() -> None:
    """The three loops' prefix-sum RMSE: DP-SGD's is ``σ·√mean(t)`` with ``σ`` meeting
    the budget by dp_accounting (and 1 % less not), BLT's is the fixed-epoch calibration's;
    the pick is the smallest."""
    from flwr_corrnoise.plan import AMPLIFIED_BANDMF, DP_SGD, FIXED_ORDER_BLT, choose_loop
    from flwr_corrnoise.privacy import calibrate_mechanism

    s, k, eps, delta = 4, 3, 4.0, 1e-5
    choice = choose_loop(eps, delta, s, k, candidates=[1, 2, 4])
    n = s * k
    sigma = choice.rmse[DP_SGD] / math.sqrt(np.mean(np.arange(1, n + 1)))
    assert dpa_epsilon(sigma, 1 / s, n, delta, "replace-one") <= eps * (1 + 1e-3)
    assert dpa_epsilon(0.99 * sigma, 1 / s, n, delta, "replace-one") > eps
    cal = calibrate_mechanism(eps, delta, 1.0, "blt", n,
                              participation=Participation.epochs(k, s),
                              params={"min_sep": s, "max_participations": k})
    from flwr_corrnoise.mechanisms import build_factorization

    blt = build_factorization("blt", n, min_sep=s, max_participations=k)
    assert choice.rmse[FIXED_ORDER_BLT] == pytest.approx(
        cal.std * math.sqrt(np.mean(blt.row_errors())))
    assert choice.rmse[AMPLIFIED_BANDMF] <= choice.rmse[DP_SGD]
    assert choice.rmse[choice.best] == min(choice.rmse.values()) and choice.reason


# -- the torch ClientApp (private_training) ------------------------------------------------

def torch_app(kind: str, criterion: bool = True) -> ClientApp:
    """Flower's quickstart shape: the app's DataLoader, ``private_training`` with a
    sampling cycle, the loop over its batches with ``private_optimizer``."""
    from torch.utils.data import DataLoader, TensorDataset

    from flwr_corrnoise.flower import private_optimizer, private_training

    client = ClientApp(mods=[PrivateSteps.guard()])
    x, y = dataset(kind)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))

    @client.train()
    def train(msg: Message, ctxt: Context) -> Message:
        model = torch.nn.Linear(D, 2, bias=False)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        with torch.no_grad():
            model.weight.copy_(torch.as_tensor(w.reshape(2, D)))
        loader = private_training(msg, ctxt, model, DataLoader(data, batch_size=BATCH),
                                  epochs=1, sampling_cycle=2)
        loss = torch.nn.CrossEntropyLoss()
        opt = private_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                loss if criterion else None)
        for xb, yb in loader:
            opt.zero_grad()
            loss(model(xb), yb).backward()
            opt.step()
        return loader.reply(ArrayRecord([model.weight.detach().numpy()]))

    return client


def torch_conversation(client: ClientApp) -> list[dict]:
    ctxt = Context(run_id=1, node_id=1, node_config={
        "mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5, "noise-seed": 5,
        "partition-id": 0}, state=RecordDict(), run_config={"num-server-rounds": ROUNDS})
    w, prints = np.zeros((2, D), dtype=np.float32), []
    for r in range(1, ROUNDS + 1):
        reply = client(message(w, r), ctxt)
        prints.append(fingerprint(reply))
        if not reply.has_error():
            w = reply.content["arrays"].to_numpy_ndarrays()[0]
    return prints


def test_private_training_samples_and_neighbours_get_the_same_replies(
        simulated: None) -> None:
    """``private_training(..., sampling_cycle=2)``: the learner's sampler keyed by its
    noise seed, ε spent the amplified one, neighbouring datasets the same replies apart
    from the arrays; without per-example clipping the sampled round is refused."""
    same, odd = torch_conversation(torch_app("same")), torch_conversation(torch_app("odd"))
    assert same == odd and "error" not in same[-1]
    ld = CyclicPoissonLoader(N_EX, BATCH, rounds=ROUNDS, key=None, bands=2)
    st = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                               **ld.config()})
    assert same[-1]["metrics"]["epsilon-spent"] == pytest.approx(st.epsilon_spent(ld.horizon))
    refused = torch_conversation(torch_app("same", criterion=False))
    assert all("error" in p for p in refused)


# -- the in-process engines ------------------------------------------------------------------

def engine_run(kind: str, learners: int = 1, seed: int = 5, vectorized: bool = False,
               **overrides):
    """The in-process engine's sampled run of the toy task (the same data, loader and
    model as the PrivateSteps app above): each learner's calls ``(step model, example)``
    recorded, and the result."""
    from flwr_corrnoise.engine import run_inprocess, run_vectorized

    x, y = dataset(kind)
    calls: list[list[tuple[bytes, int]]] = [[] for _ in range(learners)]

    def gradient_of(i: int):
        def gradient(params: list[np.ndarray], example: int) -> np.ndarray:
            calls[i].append((params[0].tobytes(), int(example)))
            return example_gradient(params[0], x[example], y[example])
        return gradient

    ld = CyclicPoissonLoader(N_EX, BATCH, rounds=ROUNDS, key=None, bands=2)
    st = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                               **ld.config()})
    kwargs = {"initial": [np.zeros(D)], "gradients": [gradient_of(i) for i in range(learners)],
              "settings": st, "rounds": ROUNDS, "tau": ld.local_steps, "eta": 0.1,
              "seed": seed, "keep_models": True, "loaders": [ld] * learners, **overrides}
    if vectorized:
        def never(*_):  # a sampled run computes each drawn example through gradients[i]
            raise AssertionError("batch_gradient called in a sampled run")
        result = run_vectorized(batch_gradient=never, **kwargs)
    else:
        result = run_inprocess(**kwargs)
    return result, calls, st


def test_the_engine_s_sampled_run_equals_private_steps(simulated: None) -> None:
    """With the same key (the engine's learner 0 of run seed 5 is the Flower learner of
    ``seed = 5``, ``partition-id = 0``), the engine trains step for step what the
    PrivateSteps loop trains: the same examples at the same step models, in the same
    order, and the same model after every round (one learner: the global model is its
    local model)."""
    result, calls, st = engine_run("same")
    steps_calls: list[tuple[bytes, int]] = []
    x, y = dataset("same")
    client = ClientApp(mods=[PrivateSteps.guard()])

    def recorded(w: np.ndarray, i: int) -> np.ndarray:
        steps_calls.append((w.tobytes(), int(i)))
        return example_gradient(w, x[i], y[i])

    @client.train()
    def train(msg: Message, ctxt: Context) -> Message:
        ld = loader(key=None)  # keyed by PrivateSteps with the learner's noise seed
        private = PrivateSteps(msg, ctxt, loader=ld)
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        for idx in private.batches():
            w = w - 0.1 * private.step([partial(recorded, w, i) for i in idx])
        return private.reply([w])

    ctxt = Context(run_id=1, node_id=1, node_config={
        "mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5, "seed": 5, "partition-id": 0},
        state=RecordDict(), run_config={})
    w, models = np.zeros(D), []
    for r in range(1, ROUNDS + 1):
        reply = client(message(w, r), ctxt)
        assert not reply.has_error()
        w = reply.content["arrays"].to_numpy_ndarrays()[0]
        models.append(w)
        assert reply.content["metrics"]["epsilon-spent"] == pytest.approx(
            st.epsilon_spent(r * loader().local_steps))
    assert len(calls[0]) == len(steps_calls) > 0
    assert [i for _, i in calls[0]] == [i for _, i in steps_calls]
    for (a, _), (b, _) in zip(calls[0], steps_calls, strict=True):
        np.testing.assert_allclose(np.frombuffer(a), np.frombuffer(b), rtol=0, atol=1e-12)
    for got, want in zip(result.models[1:], models, strict=True):
        np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-12)
    assert result.states[0].step == loader().horizon


def test_a_sampled_engine_step_is_the_clipped_sum_over_the_expected_batch() -> None:
    """One step of the engine, by hand: ``(Σ_j clip(g_j, B_g) + e)/m`` over the examples the
    learner's sampler drew (big gradients, so every one is clipped), ``e/m`` read off a
    twin whose gradients are zero, ``m`` the expected batch size whatever was drawn."""
    from flwr_corrnoise.engine import run_inprocess
    from flwr_corrnoise.settings import derive_seed

    ld = CyclicPoissonLoader(N_EX, BATCH, rounds=ROUNDS, key=None, bands=2)
    st = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                               "clip-norm": 0.5, **ld.config()})
    big = 10.0 + np.arange(N_EX * D, dtype=float).reshape(N_EX, D)
    keyed = ld.keyed(derive_seed(3, 0))

    def run(scale: float) -> list[np.ndarray]:
        out = run_inprocess(initial=[np.zeros(D)], gradients=[lambda p, j: scale * big[j]],
                            settings=st, rounds=1, tau=ld.local_steps, eta=1.0, seed=3,
                            keep_models=True, loaders=[ld])
        return out.models

    noisy, noise_only = run(1.0), run(0.0)
    # with η = 1 and one learner the round's model is −Σ_t release_t
    total = -(noisy[1][0] - noise_only[1][0])
    want = np.zeros(D)
    for t in range(ld.local_steps):
        for j in keyed.indices(t):
            want += big[j] * min(1.0, 0.5 / np.linalg.norm(big[j]))
    sizes = [keyed.indices(t).size for t in range(ld.local_steps)]
    assert len(set(sizes)) > 1  # the draws vary; the divisor does not
    np.testing.assert_allclose(total * ld.expected_batch_size, want, rtol=1e-10)


def test_the_engines_refuse_a_step_outside_the_sampler_s_schedule() -> None:
    """Refused before any step (a function of settings, loaders and counters): τ other than
    the loader's local steps, settings whose participation is not the loader's (another
    cycle, or the fixed order), a round that does not start on the loader's boundary, and
    rounds past the loader's horizon."""
    from flwr_corrnoise.learner import local_rounds
    from flwr_corrnoise.learner_state import LearnerState
    from flwr_corrnoise.streams import HorizonExhaustedError

    with pytest.raises(PrivacyConfigError, match="local steps"):
        engine_run("same", tau=CyclicPoissonLoader(N_EX, BATCH, ROUNDS, None).local_steps - 1)
    other = CyclicPoissonLoader(N_EX, BATCH, rounds=ROUNDS, key=None, bands=1)
    with pytest.raises(PrivacyConfigError, match="participation"):
        engine_run("same", loaders=[other])
    fixed = settings_from_config({"mechanism": "bandmf", "epsilon": 2.0, "delta": 1e-5,
                                  "horizon": loader().horizon, "epochs": ROUNDS})
    with pytest.raises(PrivacyConfigError, match="participation"):
        engine_run("same", settings=fixed)
    with pytest.raises(HorizonExhaustedError):
        engine_run("same", rounds=ROUNDS + 1)
    ld = loader(key=1)
    _, _, st = engine_run("same", rounds=1)
    state = LearnerState.create(st, [(D,)], 1)
    state.step = 1  # mid-round: its next batch is not a round's first
    with pytest.raises(PrivacyConfigError, match="schedule"):
        local_rounds([np.zeros(D)], [lambda p, j: np.zeros(D)], [state], st, ld.local_steps,
                     0.1, loaders=[ld])


@pytest.mark.parametrize("vectorized", [False, True])
def test_neighbouring_data_give_the_engine_the_same_states(vectorized: bool) -> None:
    """Two learners, neighbouring datasets (example 5 replaced), the same keys: every
    learner's state after the run — counters, the noise stream's saved state — is
    identical byte for byte but for the learner's random identity (nothing a step drew or
    computed reaches it), the draws are
    the same (a function of the key), only the models differ; the vectorized engine gives
    the same run."""
    same, same_calls, _ = engine_run("same", learners=2, vectorized=vectorized)
    odd, odd_calls, _ = engine_run("odd", learners=2, vectorized=vectorized)
    for a, b in zip(same.states, odd.states, strict=True):
        b.learner_id = a.learner_id  # 128 bits of OS entropy per created learner
    assert [s.to_bytes() for s in same.states] == [s.to_bytes() for s in odd.states]
    assert [[i for _, i in c] for c in same_calls] == [[i for _, i in c] for c in odd_calls]
    assert same_calls[0] != same_calls[1]  # each learner's own key
    # learners whose samplers drew different batches keep the same counters: the number
    # drawn is never recorded
    assert len({(s.step, s.position, s.rounds) for s in same.states}) == 1
    assert not np.allclose(same.params[0], odd.params[0])
    if vectorized:
        plain, _, _ = engine_run("same", learners=2)
        np.testing.assert_allclose(same.params[0], plain.params[0], rtol=0, atol=1e-12)
