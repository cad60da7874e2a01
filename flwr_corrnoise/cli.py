"""The ``flwr-corrnoise`` command line: pick a mechanism, calibrate its noise, report a run.

``flwr-corrnoise mechanism --name optimized --steps 4000 --json`` prints the mechanism's
sensitivity, RMSE and max error at unit sensitivity and the seconds it took to build;
``flwr-corrnoise calibrate --epsilon 2 --delta 1e-3 --clip-norm 1 --mechanism toeplitz
--steps 4000 --json`` prints the noise std for that budget; ``flwr-corrnoise report
RESULTS_DIR`` prints the privacy each learner spent and plots it with the accuracy;
``flwr-corrnoise audit --mechanism blt --steps 16 --runs 2000`` runs the empirical privacy
auditor (:mod:`flwr_corrnoise.audit`) and exits 4 if it falsifies the claimed ε;
``flwr-corrnoise plan --model-size 200000 --examples 6000 --batch-size 32 --epochs 3
--learners 10`` says before a run whether the noise leaves any signal (:mod:`flwr_corrnoise.plan`).

Data used more than once: ``mechanism`` and ``calibrate`` take the participation —
``--epochs K`` (K passes in one fixed cyclic order, ``steps/K`` steps each),
``--min-sep B`` / ``--max-participations K`` (≤ K uses, ≥ B steps apart) — and report the
sensitivity under it (exact or a certified bound); ``blt`` is then built optimized for it.

Exit status (:data:`EXIT`), so that a script or CI step notices a failure: 0 success; 2 a
usage or configuration error (a bad option, an impossible budget, a missing results
directory: one line on stderr); 3 a run that stopped with
:class:`~flwr_corrnoise.flower.RunFailedError` (nothing released; its reason on stderr);
4 ``audit`` falsified the claimed ε; 1 any other failure (with its traceback: a bug to
report); 130 interrupted. One function per subcommand (``_mechanism``, ``_calibrate``, …),
each registered in :func:`build_parser`.

Start-up: this module imports at its top only what the parser needs (the mechanism
registry, for the ``--name``/``--mechanism`` choices and the build options, and the
calibration methods); each subcommand imports what it alone uses when it runs (the
learner's settings, the plan, the decentralized algorithms, the auditor, Flower, torch,
matplotlib), so that ``flwr-corrnoise mechanism …`` does not pay for ``simulate``'s
imports. ``tests/cli/test_cli_startup.py`` checks it; ``benchmarks/cli_startup.py`` measures
it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

# the parser's choices and options: every subcommand needs them before it runs
from .mechanisms import MECHANISMS, Param, get_mechanism
from .privacy import METHODS

if TYPE_CHECKING:
    from .mechanisms import Factorization
    from .mechanisms.participation import Participation

#: exit status by outcome (module docstring)
EXIT = {"ok": 0, "failed": 1, "usage": 2, "run-failed": 3, "falsified": 4, "interrupted": 130}


#: mechanism parameters the participation options set (not options of their own)
PARTICIPATION_PARAMS = ("min_sep", "max_participations")


def _participation(args: argparse.Namespace, steps: int) -> Participation:
    """``--epochs`` / ``--min-sep`` / ``--max-participations`` as a participation over
    ``steps`` steps (none of them: each datum once); ``--sampling-rate`` (with
    ``--sampling-cycle``, ``--relation``): cyclic Poisson sampling, calibrated to the
    amplified guarantee (:mod:`flwr_corrnoise.amplification`)."""
    from .mechanisms.participation import Participation, SampledParticipation

    rate = getattr(args, "sampling_rate", None)
    if rate is not None:
        if any(getattr(args, k, None) is not None
               for k in ("epochs", "min_sep", "max_participations")):
            raise SystemExit("flwr-corrnoise: --sampling-rate is a participation of its own; "
                             "drop --epochs / --min-sep / --max-participations")
        return SampledParticipation.cyclic_poisson(
            rate, args.sampling_cycle or 1, steps, 1.0, args.relation)

    return Participation.from_options(
        steps, epochs=getattr(args, "epochs", None), min_sep=getattr(args, "min_sep", None),
        max_participations=getattr(args, "max_participations", None))


def positive_int(text: str) -> int:
    """An argparse type: an integer ≥ 1 (``--epochs 0`` once returned the one-pass noise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean": a mistyped option (``--epsilom``) is named with its
    nearest option instead of argparse's "--epsilon is required"."""

    #: the command line being parsed (set by :func:`main`)
    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        known = set(self._option_string_actions)
        hints = []
        for token in self.argv:
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                hints.append(f"unknown option {name}" +
                             (f" (did you mean {close[0]}?)" if close else ""))
        if hints:
            message = "; ".join(hints) + f" — {message}"
        super().error(message)


def _add_participation(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "data used more than once (docs/privacy.md, multiple participations)")
    group.add_argument("--epochs", type=positive_int, default=None,
                       help="K passes over the data in one fixed cyclic order (steps/K "
                            "steps each)")
    group.add_argument("--min-sep", dest="min_sep", type=positive_int, default=None,
                       help="fewest steps between two uses of one datum")
    group.add_argument("--max-participations", dest="max_participations", type=positive_int,
                       default=None, help="most uses of one datum (default: as many as fit)")
    group.add_argument("--sampling-rate", type=float, default=None, metavar="Q",
                       help="cyclic Poisson sampling at rate Q (CyclicPoissonLoader): the "
                            "amplified calibration (a banded encoder of ≤ --sampling-cycle "
                            "bands)")
    group.add_argument("--sampling-cycle", type=positive_int, default=None, metavar="B",
                       help="with --sampling-rate: the sampler's groups (default 1: Poisson "
                            "sampling, DP-SGD); bandmf is built with this many bands")
    group.add_argument("--relation", default="replace-one",
                       choices=("replace-one", "add-remove"),
                       help="with --sampling-rate: the neighbouring relation of the ε")


def _build(name: str, steps: int, args: argparse.Namespace) -> tuple[Factorization, float]:
    """The factorization ``name`` at horizon ``steps`` with the build options given on
    the command line (``--gap``, ``--buffers``, …: the registered parameters ``name``
    takes; the others keep their defaults), showing a solver's progress, and the seconds
    it took. ``mechanism`` and ``calibrate`` build through it, so they take the same
    options; a mechanism that can be optimized for the participation (``blt``) is built
    for it, as a learner builds it (:meth:`PrivacySettings.mechanism_params`).

    The seconds are the build's alone: everything it uses is imported before the clock
    starts (``tests/cli/test_cli_startup.py`` checks that a build imports nothing)."""
    from .mechanisms import build_factorization
    from .settings import PrivacySettings

    mechanism = get_mechanism(name)
    given = {p.name: getattr(args, p.name, None) for p in mechanism.params
             if p.name not in PARTICIPATION_PARAMS}
    params = {k: v for k, v in given.items() if v is not None}
    params.update(PrivacySettings(mechanism=name, horizon=steps,
                                  participation=_participation(args, steps)
                                  ).mechanism_params())
    _show_solver_progress()  # a solve can take minutes at N in the thousands
    for module in mechanism.build_imports:  # imported in the builder's functions
        importlib.import_module(module)
    start = time.perf_counter()
    fact = build_factorization(name, steps, **params)
    return fact, time.perf_counter() - start


def _mechanism(args: argparse.Namespace) -> dict[str, object]:
    from .mechanisms import rmse_lower_bound
    from .mechanisms.blt import BufferedToeplitz
    from .mechanisms.optimized import Optimized

    fact, built = _build(args.name, args.steps, args)
    out: dict[str, object] = dict(fact.summary())
    participation = _participation(args, args.steps)
    if not participation.single:
        sens = fact.participation_sensitivity(participation)
        # sampled: the sensitivity of the same loop without amplification (the fallback);
        # `calibrate` gives the amplified noise
        tag = "_unamplified" if hasattr(participation, "sampling_rate") else ""
        out.update({"participation": participation.describe(),
                    f"participation_sensitivity{tag}": sens.value,
                    f"participation_sensitivity{tag}_exact": sens.exact,
                    f"participation_rmse{tag}": fact.participation_rmse(participation)})
        if tag:
            from .amplification import encoder_bands

            out["encoder_bands"] = encoder_bands(fact)
    out["build_seconds"] = built
    out["description"] = MECHANISMS[args.name]
    out["lower_bound_rmse"] = rmse_lower_bound(args.steps)
    if isinstance(fact, BufferedToeplitz):
        out["buffers"] = fact.buffers
        out["theta"] = fact.theta.tolist()
        out["omega"] = fact.omega.tolist()
    report = getattr(fact, "report", None)
    if isinstance(fact, Optimized) and report is not None:  # certified optimality gap
        out["lower_bound_rmse"] = fact.lower_bound_rmse  # type: ignore[attr-defined]
        out["optimality_gap"] = report["gap"]
        out["solve_seconds"] = report.get("seconds", 0.0)
        out["from_cache"] = "loaded_from" in report
    return out


def _show_solver_progress() -> None:
    """The solvers log each iteration at INFO and, for a long solve, a line with the time
    left at WARNING (``flwr_corrnoise.mechanisms``): show them on stderr, as
    ``  optimized: iteration 3, …``."""
    import logging

    logger = logging.getLogger("flwr_corrnoise.mechanisms")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _add_mechanism_parameters(parser: argparse.ArgumentParser) -> None:
    """One option per registered mechanism parameter (``--buffers``, ``--gap``, …): a new
    mechanism's parameters appear here without a change to the CLI."""
    owners: dict[str, list[str]] = {}
    declared: dict[str, Param] = {}
    for name in MECHANISMS:
        for p in get_mechanism(name).params:
            owners.setdefault(p.name, []).append(name)
            declared.setdefault(p.name, p)
    for pname, p in declared.items():
        if pname in PARTICIPATION_PARAMS:  # set by --epochs/--min-sep/--max-participations
            continue
        doc = p.doc.replace("%", "%%")  # argparse formats help with %
        kind = ({"action": argparse.BooleanOptionalAction} if p.kind is bool
                else {"type": p.kind})
        parser.add_argument(f"--{pname.replace('_', '-')}", dest=pname, default=None, **kind,
                            help=f"{', '.join(owners[pname])}: {doc} (default {p.default})")


def _calibrate(args: argparse.Namespace) -> dict[str, object]:
    from .privacy import calibrate_factorization

    fact, _ = _build(args.mechanism, args.steps, args)
    participation = _participation(args, args.steps)
    cal = calibrate_factorization(fact, args.epsilon, args.delta, args.clip_norm,
                                  args.method, participation)
    return dict(cal.as_dict())


def _plan(args: argparse.Namespace) -> dict[str, object]:
    """The plan before a run (:mod:`flwr_corrnoise.plan`): noise std, noise-to-signal of
    the averaged update, a verdict and the levers ranked."""
    from .plan import PlanInput, format_plan, make_plan

    _show_solver_progress()
    if args.compare_loops:  # fixed-order BLT vs amplified BandMF vs DP-SGD
        from .plan import choose_loop

        steps = -(-args.examples // args.batch_size)
        choice = choose_loop(args.epsilon, args.delta, steps, args.epochs)
        if args.json:
            return choice.as_dict()
        print(f"loop for ε = {args.epsilon:g}, δ = {args.delta:g}, {args.epochs} epochs of "
              f"{steps} steps (replace-one): {choice.best}"
              + (f", {choice.bands} bands" if choice.best.startswith("amplified") else "")
              + f"\n  why: {choice.reason}\n  prefix-sum noise RMSE × clip norm: "
              + ", ".join(f"{k} {v:.3g}" for k, v in choice.rmse.items()))
        return {}
    inputs = PlanInput(
        model_size=args.model_size, examples=args.examples, batch_size=args.batch_size,
        epochs=args.epochs, learners=args.learners, mechanism=args.mechanism,
        epsilon=args.epsilon, delta=args.delta, clip_norm=args.clip_norm, method=args.method,
        rounds=args.rounds, learning_rate=args.learning_rate, signal=args.signal,
        mode=args.mode, momentum=args.momentum, adaptive_quantile=args.adaptive_clip_quantile,
        adaptive_noise=args.adaptive_clip_noise)
    if args.grad_norm_sample:  # the measured signal term (a local file, never sent)
        from .plan import read_signal_sample, with_signal

        if args.signal != 1.0:
            raise ValueError("plan: give --signal or --grad-norm-sample, not both")
        inputs = with_signal(inputs, read_signal_sample(args.grad_norm_sample,
                                                        args.clip_norm))
    plan = make_plan(inputs, levers=not args.no_levers)
    if not args.json:
        print(format_plan(plan))
        return {}
    return plan.as_dict()


def _checkout_root() -> Path | None:
    """The flwr-corrnoise source checkout to take ``experiments/`` from: the one this package
    runs from (an editable install), else the working directory; ``None`` if neither is one
    (a checkout has ``experiments/`` beside a ``pyproject.toml`` naming this project)."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd().resolve()):
        project = root / "pyproject.toml"
        if ((root / "experiments" / "__init__.py").is_file() and project.is_file()
                and 'name = "flwr-corrnoise"' in project.read_text(errors="replace")):
            return root
    return None


def _experiments_module(name: str, command: str) -> ModuleType:
    """``experiments.<name>`` from the source checkout (:func:`_checkout_root`).

    Why: experiment code (the demo, the papers' data sets) is kept out of the installed
    package (docs/architecture.md, "What is library and what is experiment"). README's
    commands install the package editable from its checkout, whose root holds
    ``experiments/``; it is loaded from there by its path, without changing ``sys.path``.
    Without a checkout the error says what to do."""
    import importlib
    import importlib.util

    loaded = sys.modules.get("experiments")
    if loaded is None:
        root = _checkout_root()
        if root is None:
            raise ValueError(
                f"`{command}` runs experiment code that is not installed with the package "
                f"(the repository's experiments/): clone the repository, then from its root "
                f"run `pip install -e \".[plot]\"` and `flwr-corrnoise {command}`")
        package = root / "experiments"
        spec = importlib.util.spec_from_file_location(
            "experiments", package / "__init__.py", submodule_search_locations=[str(package)])
        if spec is None or spec.loader is None:  # pragma: no cover - a file we just found
            raise ValueError(f"cannot load {package}")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules["experiments"] = loaded
        spec.loader.exec_module(loaded)
    return importlib.import_module(f"experiments.{name}")


def _simulate(args: argparse.Namespace) -> dict[str, object]:
    """The demo (``experiments/demo.py``): every method on ``--seeds`` seeds in process,
    one of them (``--flower``) on Flower's simulation engine too; the figure."""
    import importlib.util

    missing = [m for m in ("ray", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:  # Ray (Flower's simulation engine) and matplotlib are extras
        raise ValueError(f"`simulate` needs {' and '.join(missing)}: from the repository's "
                         f"root, pip install -e \".[plot]\"")
    demo = _experiments_module("demo", "simulate")
    changes = {k: v for k, v in (("rounds", args.rounds), ("num_learners", args.learners),
                                 ("tau", args.local_steps), ("epsilon", args.epsilon),
                                 ("delta", args.delta)) if v is not None}
    out = Path(args.out)
    flower = None if args.flower == "off" else args.flower
    if flower is not None and flower not in args.methods:
        raise ValueError(f"--flower {flower} must be one of --methods {args.methods} (or off)")
    res = demo.run_demo(out, methods=tuple(args.methods), seeds=args.seeds, flower=flower,
                        base=demo.DEMO.with_(**changes))
    result: dict[str, object] = {}
    for method in res.curves:
        accs = res.final_accuracies(method)
        result[demo.label(method)] = (f"final accuracy {accs.mean():.3f} (min {accs.min():.3f}, "
                                      f"max {accs.max():.3f}, {len(accs)} seeds)")
    if res.flower_dir is not None:
        result["flower run"] = (f"{res.flower_method}, seed {res.flower_seed}: same final model "
                                f"as in process to {res.flower_difference:.1e} -> "
                                f"{res.flower_dir.resolve()}")
    result["plot"] = str((out / "accuracy.png").resolve())
    return result


def _decentralized(args: argparse.Namespace) -> dict[str, object]:
    """Small in-process run of a decentralized algorithm; ε per learner, loss, accuracy."""
    import numpy as np

    from .decentralized.engine import build_from_config, run
    from .decentralized.tasks import TASKS

    if args.task not in TASKS:  # the papers' data sets: experiment code, from a checkout
        with contextlib.suppress(ValueError):
            _experiments_module("tasks", "decentralized")
    config: dict[str, object] = {
        "algorithm": args.algorithm, "graph": args.graph, "num-nodes": args.nodes,
        "steps": args.steps, "seed": args.seed, "task": args.task, "dim": args.dim,
        "data-seed": args.seed,
    }
    if args.noise_scale is not None:
        config["noise-scale"] = args.noise_scale
    if args.data_path:
        config["data-path"] = args.data_path
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            config[key] = float(value)
        except ValueError:
            config[key] = value
    try:
        graph, algo = build_from_config(config)
    except (KeyError, OSError) as err:  # unknown task, missing data file: a clear error
        raise ValueError(str(err).strip("'\"")) from err
    res = run(algo, args.steps, args.seed)
    task = algo.task  # type: ignore[attr-defined]
    nodes = np.arange(graph.num_nodes)
    online = np.mean([task.loss(res.decisions[t], *task.batch(nodes, t)).mean()
                      for t in range(args.steps)]) if args.steps else float("nan")
    final = res.decisions[-1]
    result: dict[str, object] = {
        "algorithm": algo.name,
        "local-dp": bool(algo.local_dp),
        "graph": graph.name,
        "task": getattr(task, "name", args.task),
        "steps": args.steps,
        "average-online-loss": float(online),
        "consensus-error": float(np.linalg.norm(final - final.mean(0), axis=1).mean()),
    }
    if hasattr(task, "accuracy"):
        result["final-accuracy-mean"] = float(np.mean(task.accuracy(final)))
    for label, eps in res.epsilon(algo).items():
        result[f"epsilon [{label}]"] = [round(float(e), 6) for e in eps]
    if not algo.local_dp:
        result["note"] = ("messages are raw gossip sums: (ε, 0)-DP of the decisions with "
                          "trusted neighbours and relay, NOT local DP")
    return result


def _audit(args: argparse.Namespace) -> dict[str, object]:
    """Empirical privacy audit of one configuration (:mod:`flwr_corrnoise.audit`): the
    claimed ε beside the lower bound the runs prove; exit 4 if the bound exceeds it."""
    from .audit import FALSIFIED_EXIT, audit

    res = audit(args.mechanism, variant=args.variant, steps=args.steps, tau=args.tau,
                dim=args.dim, epsilon=args.epsilon, delta=args.delta, clip_norm=args.clip_norm,
                method=args.method, runs=args.runs, alpha=args.alpha,
                learners=args.learners, canary_step=args.canary_step, seed=args.seed,
                secure=args.secure, noise_scale=args.noise_scale,
                reuse_seed=args.reuse_seed, epochs=args.epochs, min_sep=args.min_sep,
                max_participations=args.max_participations, front_end=args.front_end,
                dtype=args.dtype, noise_runs=args.noise_runs,
                zero_noise_step=args.zero_noise_step, accounted_epochs=args.accounted_epochs,
                sampling_rate=args.sampling_rate, sampling_cycle=args.sampling_cycle,
                drawn_rate=args.drawn_rate)
    if res.falsified:
        args.exit_status = FALSIFIED_EXIT
    verdict = res.verdict
    first = ("mechanism", "variant", "epsilon_claimed", "epsilon_lower_bound",
             "epsilon_analytic", "epsilon_gaussian_fit", "law_rejected", "delta", "runs",
             "alpha")
    rest = res.as_dict()
    rest["epsilon_claimed"] = rest.pop("epsilon")
    out: dict[str, object] = {key: rest.pop(key) for key in first}
    out.update(rest)
    out["verdict"] = verdict
    return out


def _report(args: argparse.Namespace) -> dict[str, object]:
    from .report import report

    return report(Path(args.results_dir), Path(args.plot) if args.plot else None)


def _add_clip_norm(parser: argparse.ArgumentParser, help: str, *, required: bool = False,
                   default: float | None = None) -> None:
    """``--clip-norm`` (the config key ``clip-norm``, :attr:`PrivacySettings.clip_norm
    <flwr_corrnoise.settings.PrivacySettings.clip_norm>`): one spelling everywhere."""
    parser.add_argument("--clip-norm", dest="clip_norm", type=float, default=default,
                        required=required, help=help)


class _AlgorithmNames(Sequence[str]):
    """The registered decentralized algorithms, looked up the first time they are asked
    for (a value checked, a help text printed): ``argparse`` shows them as the choices of
    ``decentralized --algorithm`` as it would a list, but building the parser for another
    subcommand imports none of the algorithms."""

    def __init__(self) -> None:
        self._names: list[str] | None = None

    def _load(self) -> list[str]:
        if self._names is None:
            from .decentralized.engine import algorithm_names

            self._names = algorithm_names()
        return self._names

    def __getitem__(self, index: Any) -> Any:  # an int or a slice, as a list's
        return self._load()[index]

    def __len__(self) -> int:
        return len(self._load())

    def __contains__(self, value: object) -> bool:
        return value in self._load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flwr-corrnoise",
        description="Correlated-noise local DP for Flower: mechanisms and calibration.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    mech = sub.add_parser("mechanism", help="error and sensitivity of a factorization")
    mech.add_argument("--name", required=True, choices=sorted(MECHANISMS))
    mech.add_argument("--steps", required=True, type=int, help="horizon N = R·τ")
    _add_mechanism_parameters(mech)
    _add_participation(mech)
    mech.add_argument("--json", action="store_true", help="print JSON")
    mech.set_defaults(func=_mechanism)

    cal = sub.add_parser("calibrate", help="noise std for an (ε, δ) budget")
    cal.add_argument("--epsilon", required=True, type=float)
    cal.add_argument("--delta", required=True, type=float)
    _add_clip_norm(cal, "gradient clip norm B_g (Flower: clipping_norm, Opacus: max_grad_norm)",
                   required=True)
    cal.add_argument("--mechanism", required=True, choices=sorted(MECHANISMS))
    cal.add_argument("--steps", required=True, type=int, help="horizon N = R·τ")
    cal.add_argument("--method", default="exact", choices=METHODS)
    _add_mechanism_parameters(cal)  # the build options of `mechanism` (--gap, --buffers, …)
    _add_participation(cal)
    cal.add_argument("--json", action="store_true", help="print JSON")
    cal.set_defaults(func=_calibrate)

    pln = sub.add_parser(
        "plan", help="before a run: noise std, noise-to-signal of the averaged update, a "
                     "verdict and the levers ranked (per-step, per-round or central)")
    pln.add_argument("--model-size", type=int, required=True, help="parameters d")
    pln.add_argument("--examples", type=int, required=True, help="examples per learner")
    pln.add_argument("--batch-size", type=int, required=True)
    pln.add_argument("--epochs", type=int, default=1,
                     help="passes over each learner's data in the whole run "
                          "(rounds × local epochs)")
    pln.add_argument("--rounds", type=int, default=1, help="rounds (for the first round's "
                     "noise-to-signal)")
    pln.add_argument("--learners", type=int, default=1, help="learners averaged per round")
    pln.add_argument("--mechanism", default="blt", choices=sorted(MECHANISMS))
    pln.add_argument("--epsilon", type=float, default=2.0)
    pln.add_argument("--delta", type=float, default=1e-5)
    _add_clip_norm(pln, "clip norm B_g (default 1)", default=1.0)
    pln.add_argument("--method", default="exact", choices=METHODS)
    pln.add_argument("--learning-rate", type=float, default=None,
                     help="warn if the noise would blow the model up at this step size")
    pln.add_argument("--signal", type=float, default=1.0,
                     help="‖mean clipped gradient‖ / clip norm (default 1: its upper bound)")
    pln.add_argument("--grad-norm-sample", metavar="FILE", default=None,
                     help="measure the signal term from a local sample: per-example gradient "
                          "norms (one column) or gradients (one a row; .npy or text), "
                          "clipped at --clip-norm (for --mode round/central: round updates)")
    pln.add_argument("--mode", default="step", choices=("step", "round", "central"),
                     help="where the noise is added: every local step (default), the "
                          "learner's round update (CorrNoiseRoundMod; --rounds is the "
                          "horizon), or the server's average (central DP; --learners is "
                          "min-learners)")
    pln.add_argument("--momentum", type=float, default=0.0,
                     help="the local optimizer's momentum β (Flower's quickstart: 0.9)")
    pln.add_argument("--adaptive-clip-quantile", type=float, default=None,
                     help="adaptive clipping's quantile (its noised counts' cost included)")
    pln.add_argument("--adaptive-clip-noise", type=float, default=None,
                     help="σ_b of the noised counts (default: 10 %% of μ²)")
    pln.add_argument("--no-levers", action="store_true", help="skip the alternatives")
    pln.add_argument("--compare-loops", action="store_true",
                     help="which loop: a fixed order with BLT, cyclic Poisson sampling with "
                          "amplified BandMF (the bands chosen), or DP-SGD (Poisson, 1 band), "
                          "by the prefix-sum noise each gives, and why")
    pln.add_argument("--json", action="store_true", help="print JSON")
    pln.set_defaults(func=_plan)

    sim = sub.add_parser(
        "simulate", help="the demo: no noise, independent and correlated noise at one "
                         "(ε, δ), several seeds in process and one run on Flower's "
                         "simulation engine (Ray); a figure")
    sim.add_argument("--seeds", type=int, default=5, help="seeds per method (bands)")
    sim.add_argument("--methods", nargs="+", default=["none", "independent", "blt"],
                     choices=["none", *sorted(MECHANISMS)])
    sim.add_argument("--flower", default="blt", choices=["off", "none", *sorted(MECHANISMS)],
                     help="the method whose first seed also runs on Flower's simulation "
                          "engine (default blt; off: in process only)")
    sim.add_argument("--rounds", type=int, default=None, help="default 20")
    sim.add_argument("--learners", type=int, default=None, help="default 10")
    sim.add_argument("--local-steps", type=int, default=None, help="τ, default 50")
    sim.add_argument("--epsilon", type=float, default=None, help="default 2")
    sim.add_argument("--delta", type=float, default=None, help="default 1e-3")
    sim.add_argument("--out", default="results/demo")
    sim.add_argument("--json", action="store_true", help="print JSON")
    sim.set_defaults(func=_simulate)
    dec = sub.add_parser(
        "decentralized",
        help="small in-process run of a decentralized (graph) algorithm; prints ε per learner",
    )
    # its choices are set after add_argument, which formats them: they import the
    # algorithms, which only `decentralized` itself (or its --help, or a bad value) needs
    dec.add_argument("--algorithm", default="chen-wang").choices = _AlgorithmNames()
    dec.add_argument("--graph", default="ring", choices=["ring", "cycle", "complete",
                                                          "watts-strogatz"])
    dec.add_argument("--nodes", type=int, default=5)
    dec.add_argument("--steps", type=int, default=200)
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--task", default="synthetic-logreg",
                     help="synthetic-logreg, synthetic-multiclass (generated); from a source "
                          "checkout also the papers' data sets mushrooms (LIBSVM file or "
                          "Debian r-cran-cba), letter, poker (experiments/tasks.py); others "
                          "registered by extensions")
    dec.add_argument("--data-path", default=None, help="dataset file for --task")
    dec.add_argument("--dim", type=int, default=10, help="synthetic-logreg: features")
    dec.add_argument("--noise-scale", type=float, default=None,
                     help="every learner's base Laplace scale (default: the algorithm's)")
    dec.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="any algorithm/task config key (kebab-case), e.g. lambda0=0.5")
    dec.add_argument("--json", action="store_true", help="print JSON")
    dec.set_defaults(func=_decentralized)

    aud = sub.add_parser(
        "audit", help="empirical privacy audit: the real private step on neighbouring "
                      "streams over many noise keys; the ε lower bound beside the claimed ε")
    aud.add_argument("--mechanism", required=True, choices=sorted(MECHANISMS))
    aud.add_argument("--variant", default="step", choices=["step", "round", "central"],
                     help="noise at every local step (Zhang et al., LDP online FL), every "
                          "round on the learner (their arXiv version) or once per round on "
                          "the server (Zhang, Zhu & Johansson, central DP)")
    aud.add_argument("--steps", type=int, default=16,
                     help="horizon: local steps (step) or rounds (round, central)")
    aud.add_argument("--tau", type=int, default=1, help="step variant: local steps per round")
    aud.add_argument("--epsilon", type=float, default=2.0)
    aud.add_argument("--delta", type=float, default=1e-3)
    _add_clip_norm(aud, "clip norm B (default 1)", default=1.0)
    aud.add_argument("--method", default="exact", choices=METHODS)
    aud.add_argument("--runs", type=int, default=2000,
                     help="executions on each of the two neighbouring streams (phase 2)")
    aud.add_argument("--alpha", type=float, default=0.05,
                     help="the verdict errs with probability <= alpha (alpha/2 for the "
                          "bound, alpha/2 for the noise-law check)")
    aud.add_argument("--dim", type=int, default=2, help="model size d")
    aud.add_argument("--learners", type=int, default=2, help="central: min-learners")
    aud.add_argument("--epochs", type=int, default=1,
                     help="reused data: the canary is used once per epoch (steps/epochs "
                          "apart) and the learner calibrates for that participation")
    aud.add_argument("--min-sep", type=int, default=None,
                     help="min-sep participation: uses at least this many steps apart; the "
                          "canary is used as often as allowed, exactly this far apart")
    aud.add_argument("--max-participations", type=int, default=None,
                     help="min-sep participation: at most this many uses (default: as many "
                          "as fit)")
    aud.add_argument("--sampling-rate", type=float, default=None, metavar="Q",
                     help="cyclic Poisson sampling: the learner calibrates to the amplified "
                          "guarantee and each execution's sampler draws the canary at rate Q "
                          "at its group's steps")
    aud.add_argument("--sampling-cycle", type=int, default=None, metavar="B",
                     help="with --sampling-rate: the sampler's groups (default 4 for bandmf, "
                          "else 1)")
    aud.add_argument("--front-end", default="local-round",
                     choices=["local-round", "private-step", "torch"],
                     help="step variant: the learner round (NumPyClient, ClientApp helper, "
                          "engine), PrivateSteps' private_step, or the torch PrivateOptimizer")
    aud.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                     help="the noise stream's float type (step and round variants)")
    aud.add_argument("--canary-step", type=int, default=None,
                     help="the step (round) whose datum differs (default: the most exposed "
                          "under the noise the first phase measured)")
    aud.add_argument("--noise-runs", type=int, default=None,
                     help="executions on the all-zero data set that estimate the noise that "
                          "runs (default: --runs)")
    aud.add_argument("--seed", type=int, default=None,
                     help="derive every execution's noise key from this (reproducible); "
                          "default: OS entropy per execution")
    aud.add_argument("--secure", action="store_true",
                     help="audit the learners' secure noise (ChaCha20, grid)")
    faults = aud.add_argument_group(
        "fault injection", "deliberate faults, to show that the auditor fails them (each "
        "must exit 4)")
    faults.add_argument("--noise-scale", type=float, default=1.0,
                        help="FAULT: run with this multiple of the calibrated noise std "
                             "(< 1 must be caught)")
    faults.add_argument("--reuse-seed", action="store_true",
                        help="FAULT: one noise key for every execution (must be caught)")
    faults.add_argument("--zero-noise-step", type=int, default=None, metavar="K",
                        help="FAULT: no noise increment at step (round) K (must be caught)")
    faults.add_argument("--accounted-epochs", type=int, default=None, metavar="K",
                        help="FAULT with --epochs: the learner's settings declare K passes "
                             "while the canary is used --epochs times (1: one-pass "
                             "accounting on a multi-epoch loop; must be caught)")
    faults.add_argument("--drawn-rate", type=float, default=None, metavar="Q",
                        help="FAULT with --sampling-rate: the sampler draws at rate Q while "
                             "the settings claim --sampling-rate (1: a loop that ignores the "
                             "sampler; must be caught)")
    aud.add_argument("--json", action="store_true", help="print JSON")
    aud.set_defaults(func=_audit)

    rep = sub.add_parser(
        "report", help="privacy spent per learner and accuracy of a Flower run's results; "
                       "plots them (matplotlib)")
    rep.add_argument("results_dir", metavar="RESULTS_DIR",
                     help="a results directory (summary.json, history.csv, privacy.csv) or "
                          "a directory of them")
    rep.add_argument("--plot", default=None,
                     help="PNG to write (default RESULTS_DIR/privacy.png)")
    rep.add_argument("--json", action="store_true", help="print JSON")
    rep.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; the exit status is :data:`EXIT`'s (never 0 after an error)."""
    parser = build_parser()
    Parser.argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)  # a usage error exits 2 (argparse)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("flwr-corrnoise: interrupted", file=sys.stderr)
        return EXIT["interrupted"]
    except Exception as err:  # every failure exits non-zero
        return _failure(err)
    if args.json:
        print(json.dumps(result, indent=2))
    elif result:  # (a subcommand that printed its own text returns nothing more)
        width = max(len(k) for k in result)
        for key, value in result.items():
            shown = f"{value:.6g}" if isinstance(value, float) else value
            print(f"{key:<{width}}  {shown}")
    return int(getattr(args, "exit_status", 0))  # audit: 4 when the claim is falsified


def _failure(err: BaseException) -> int:
    """The exit status of a failed subcommand, and its message on stderr: one line for
    what the user can fix (a configuration, a budget, a failed run), the traceback for
    anything else (a bug)."""
    import traceback

    from .privacy import PrivacyBudgetError

    failed = _run_failed(err)
    if failed is not None:  # released nothing
        print(f"flwr-corrnoise: run failed: {failed}", file=sys.stderr)
        return EXIT["run-failed"]
    if isinstance(err, PrivacyBudgetError | ValueError | OSError):
        text = " ".join(str(err).split())
        print(f"flwr-corrnoise: error: {text}", file=sys.stderr)
        return EXIT["usage"]
    traceback.print_exception(err, file=sys.stderr)
    print(f"flwr-corrnoise: failed: {type(err).__name__}: {err}", file=sys.stderr)
    return EXIT["failed"]


def _run_failed(err: BaseException) -> BaseException | None:
    """The :class:`~flwr_corrnoise.flower.RunFailedError` in ``err``'s chain (Flower may
    wrap a ServerApp's exception), or ``None``."""
    if "flwr" not in sys.modules:  # no Flower run in this process: nothing to look for
        return None
    from .flower.monitor import RunFailedError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, RunFailedError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
