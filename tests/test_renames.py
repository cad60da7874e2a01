"""The renamed API (``docs/changes.md``, issue 25 item 5): one spelling per concept.

Every old name still works for one release, raises a ``DeprecationWarning`` that names the
new one, and gives the *same* object or the same result as the new name. The library's own
paths use the new names only: running them records no deprecation warning of ours.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.serverapp.strategy import FedAvg

import flwr_corrnoise
from flwr_corrnoise import flower
from flwr_corrnoise._deprecation import REMOVED_IN
from flwr_corrnoise.audit import audit
from flwr_corrnoise.cli import build_parser, main
from flwr_corrnoise.engine import run_inprocess
from flwr_corrnoise.flower import (
    CorrNoiseCentralDPStrategy,
    CorrNoiseLocalDPStrategy,
    make_client_app,
)
from flwr_corrnoise.learner import PrivacySettings, clip_by_global_norm
from flwr_corrnoise.mechanisms import build_factorization
from flwr_corrnoise.privacy import (
    calibrate,
    calibrate_mechanism,
    delta_for_std,
    epsilon_for_std,
    epsilon_spent,
    l2_sensitivity,
)
from flwr_corrnoise.streams import NoiseStream
from flwr_corrnoise.variants import central_calibration, round_release

from .test_release_gate import LEARNER, message, np_gradient, round_mod
from .test_strategy import FakeGrid, task_identity  # noqa: F401  (autouse: message identity)


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The deprecation warnings our renames raise (they all end the same way)."""
    return [str(w.message) for w in caught
            if issubclass(w.category, DeprecationWarning) and REMOVED_IN in str(w.message)]


@contextmanager
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


# -- the clip norm: clip → clip_norm ------------------------------------------------------
def test_privacy_settings_takes_and_reads_the_old_spelling_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"PrivacySettings\(clip=\.\.\.\).*clip_norm"):
        old = PrivacySettings("blt", clip=1.5, horizon=8)
    new = PrivacySettings("blt", clip_norm=1.5, horizon=8)
    assert old.clip_norm == 1.5 and old == new and hash(old) == hash(new)
    with pytest.warns(DeprecationWarning, match=r"PrivacySettings\.clip is deprecated"):
        assert new.clip == 1.5
    # the position is the field's: a positional call is unchanged and does not warn
    with recorded() as caught:
        assert PrivacySettings("blt", 2.0, 1e-3, 0.7, 8).clip_norm == 0.7
    assert ours(caught) == []
    # the old spelling is validated like the new one, and both at once is ambiguous
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="clip norm"):
        PrivacySettings("blt", clip=-1.0)
    with pytest.raises(TypeError, match="clip_norm"):
        PrivacySettings("blt", clip=1.0, clip_norm=2.0)
    # the state binding and the server proposal keep their config keys
    assert old.binding()["clip-norm"] == 1.5 and old.proposal()["privacy-clip-norm"] == 1.5


def test_privacy_settings_is_exported_at_the_top_level() -> None:
    assert flwr_corrnoise.PrivacySettings is PrivacySettings
    assert flower.PrivacySettings is PrivacySettings


def test_calibration_reads_the_old_attribute_and_dumps_the_new_key() -> None:
    cal = calibrate(2.0, 1e-3, 0.5, 3.0)
    assert cal.clip_norm == 0.5
    with pytest.warns(DeprecationWarning, match=r"Calibration\.clip is deprecated"):
        assert cal.clip == 0.5
    assert "clip_norm" in cal.as_dict() and "clip" not in asdict(cal)


NOISE = dict(mechanism="toeplitz", horizon=6, shapes=[(3,)], std=0.7, seed=5)


def noise() -> NoiseStream:
    return NoiseStream.create(NOISE["mechanism"], NOISE["horizon"], NOISE["shapes"],
                              NOISE["std"], NOISE["seed"])


#: every public function whose ``clip`` keyword became ``clip_norm``: (function, the other
#: arguments as keywords, the clip norm)
CALLS: list[tuple[Callable[..., Any], dict[str, Any]]] = [
    (calibrate, dict(epsilon=2.0, delta=1e-3, sensitivity=3.0)),
    (calibrate_mechanism, dict(epsilon=2.0, delta=1e-3, mechanism="tree", steps=16)),
    (epsilon_for_std, dict(std=4.0, delta=1e-3, sensitivity=3.0)),
    (delta_for_std, dict(std=4.0, epsilon=2.0, sensitivity=3.0)),
    (epsilon_spent, dict(std=4.0, delta=1e-3, mechanism="tree", horizon=16, steps_done=5)),
    (l2_sensitivity, dict(sensitivity=3.0)),
    (central_calibration, dict(mechanism="blt", epsilon=2.0, delta=1e-3, rounds=8)),
    (clip_by_global_norm, dict(g=np.array([3.0, 4.0]))),
    (build_factorization("tree", 16).release, dict(std=4.0, steps=5)),
]


@pytest.mark.parametrize("func, kwargs", CALLS, ids=[f.__qualname__ for f, _ in CALLS])
def test_clip_keyword_is_the_old_spelling_of_clip_norm(func, kwargs) -> None:
    with recorded() as caught:
        new = func(**kwargs, clip_norm=0.5)
    assert ours(caught) == []
    with pytest.warns(DeprecationWarning, match=r"\(clip=\.\.\.\) is deprecated: use clip_norm"):
        old = func(**kwargs, clip=0.5)
    assert repr(old) == repr(new)  # the same value (arrays, dataclasses and floats alike)
    assert repr(func(**kwargs, clip_norm=0.25)) != repr(new)  # the keyword is not ignored
    with pytest.raises(TypeError, match="deprecated spelling 'clip'"):
        func(**kwargs, clip=0.5, clip_norm=0.5)


def test_round_release_takes_the_old_spelling() -> None:
    delta = np.array([3.0, 0.0, 4.0])
    with pytest.warns(DeprecationWarning, match="clip_norm"):
        old, norm_old = round_release(delta, clip=1.0, noise=noise())
    new, norm_new = round_release(delta, clip_norm=1.0, noise=noise())
    np.testing.assert_array_equal(old, new)
    assert norm_old == norm_new == 5.0


def test_audit_takes_the_old_spelling() -> None:
    run = dict(variant="round", steps=4, runs=20, seed=3, epsilon=2.0)
    with pytest.warns(DeprecationWarning, match=r"audit\(clip=\.\.\.\)"):
        old = audit("blt", clip=0.5, **run)
    new = audit("blt", clip_norm=0.5, **run)
    same = ("epsilon_lower_bound", "mu", "noise_std", "threshold", "mu_empirical")
    assert [getattr(old, k) for k in same] == [getattr(new, k) for k in same]
    # the keyword is not ignored: the calibrated std scales with the clip norm (μ does not)
    assert audit("blt", clip_norm=2.0, **run).noise_std == pytest.approx(4 * new.noise_std)


def test_cli_clip_is_a_hidden_deprecated_alias_of_clip_norm(capsys) -> None:
    args = ["calibrate", "--epsilon", "2", "--delta", "1e-3", "--mechanism", "tree",
            "--steps", "16", "--json"]
    assert main([*args, "--clip-norm", "0.5"]) == 0
    new = capsys.readouterr()
    with pytest.warns(DeprecationWarning, match="--clip is deprecated"):
        assert main([*args, "--clip", "0.5"]) == 0
    old = capsys.readouterr()
    assert json.loads(old.out) == json.loads(new.out)
    assert json.loads(new.out)["clip_norm"] == 0.5
    assert "--clip is deprecated: use --clip-norm" in old.err and new.err == ""
    calibrate_help = build_parser()._subparsers._group_actions[0].choices["calibrate"]
    assert "--clip-norm" in calibrate_help.format_help()
    assert "--clip " not in calibrate_help.format_help()
    with pytest.raises(SystemExit):  # both spellings at once: a usage error
        main([*args, "--clip-norm", "0.5", "--clip", "0.5"])
    capsys.readouterr()


def test_cli_audit_takes_clip_norm(capsys) -> None:
    base = ["audit", "--mechanism", "blt", "--variant", "round", "--steps", "4", "--runs",
            "20", "--seed", "3", "--json"]
    assert main([*base, "--clip-norm", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = audit("blt", variant="round", steps=4, runs=20, seed=3, clip_norm=2.0)
    assert out["noise_std"] == pytest.approx(expected.noise_std)
    with pytest.warns(DeprecationWarning, match="--clip is deprecated"):
        assert main([*base, "--clip", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["noise_std"] == pytest.approx(expected.noise_std)


# -- the strategy wrappers: …Strategy ------------------------------------------------------
@pytest.mark.parametrize("old, new, module", [
    ("CorrNoiseLocalDP", CorrNoiseLocalDPStrategy, "flwr_corrnoise.flower.local_dp"),
    ("CorrNoiseCentralDP", CorrNoiseCentralDPStrategy, "flwr_corrnoise.flower.central_dp"),
])
def test_old_strategy_names_are_the_same_class_with_a_warning(old, new, module) -> None:
    import importlib

    for where in (flower, importlib.import_module(module)):
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use .*{new.__name__}"):
            assert getattr(where, old) is new
    with pytest.warns(DeprecationWarning, match=old):
        exec(f"from flwr_corrnoise.flower import {old} as got", namespace := {})
    assert namespace["got"] is new
    assert new.__name__ in flower.__all__ and old not in flower.__all__
    with pytest.raises(AttributeError, match="NoSuchStrategy"):
        flower.NoSuchStrategy  # noqa: B018


def test_a_star_import_gives_the_new_names_without_a_warning() -> None:
    with recorded() as caught:
        exec("from flwr_corrnoise.flower import *", namespace := {})
    assert ours(caught) == []
    assert namespace["CorrNoiseLocalDPStrategy"] is CorrNoiseLocalDPStrategy
    assert "CorrNoiseLocalDP" not in namespace and "CorrNoiseCentralDP" not in namespace


def test_old_strategy_names_build_the_same_strategy() -> None:
    run = {"num-server-rounds": 3, "local-steps": 2, "mechanism": "blt", "epsilon": 2.0,
           "delta": 1e-3, "clip-norm": 0.5, "data-reuse": "once", "min-learners": 2}
    with pytest.warns(DeprecationWarning):
        old_local = flower.CorrNoiseLocalDP(FedAvg(), run)
    with pytest.warns(DeprecationWarning):
        old_central = flower.CorrNoiseCentralDP.from_run_config(FedAvg(), run, seed=1)
    assert old_local.proposal == CorrNoiseLocalDPStrategy(FedAvg(), run).proposal
    new_central = CorrNoiseCentralDPStrategy.from_run_config(FedAvg(), run, seed=1)
    assert old_central.calibration == new_central.calibration
    assert new_central.calibration.clip_norm == 0.5


# -- the library itself uses no old name ---------------------------------------------------
def test_the_library_paths_raise_no_deprecation_warning_of_ours() -> None:
    """Every front end and tool on a toy problem, every warning recorded: none is one of
    our renames' (a library path still using ``clip`` or an old class name would be)."""
    x = np.full((1, 4), 0.2)
    with recorded() as caught:
        settings = PrivacySettings("blt", 2.0, 1e-3, 1.0, horizon=6)
        run_inprocess(initial=[np.zeros(3)], gradients=[lambda p, k: [p[0] - 1.0]] * 2,
                      settings=settings, rounds=3, tau=2, eta=0.1, seed=0)
        from flwr.app import Context, RecordDict

        def node() -> Context:
            return Context(run_id=1, node_id=1, node_config=dict(LEARNER), state=RecordDict(),
                           run_config={})

        app = make_client_app(lambda c: np_gradient("small"))
        step_reply = app(message(MessageType.TRAIN, x, 1), node())
        mod_reply = round_mod("small")(message(MessageType.TRAIN, x, 1), node())
        assert not step_reply.has_error() and not mod_reply.has_error()
        run = {"num-server-rounds": 3, "local-steps": 3, "learning-rate": 0.1,
               "mechanism": "blt", "min-learners": 1, "data-reuse": "once"}
        local = CorrNoiseLocalDPStrategy(FedAvg(fraction_evaluate=0.0), run)
        list(local.configure_train(1, ArrayRecord([x]), ConfigRecord({}), FakeGrid()))
        central = CorrNoiseCentralDPStrategy.from_run_config(FedAvg(fraction_evaluate=0.0),
                                                             run, seed=1)
        central.summary()
        audit("blt", variant="step", steps=4, runs=20, seed=1)
        audit("blt", variant="central", steps=4, runs=20, seed=1)
        settings.calibration(), settings.epsilon_spent(3)
    assert ours(caught) == [], ours(caught)


def test_the_torch_optimizer_raises_no_deprecation_warning_of_ours() -> None:
    torch = pytest.importorskip("torch")
    from flwr_corrnoise.torch import PrivateOptimizer

    model = torch.nn.Linear(3, 2).double()
    xb = torch.randn(4, 3, dtype=torch.float64) * 5
    yb = torch.tensor([0, 1, 0, 1])
    with recorded() as caught:
        opt = PrivateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               PrivacySettings("blt", clip_norm=0.5, horizon=4), seed=0)
        opt.backward(xb, yb)
        opt.step()
    assert ours(caught) == [], ours(caught)
