"""simulations/chen_wang.py (issue 24): the θ* solver's stopping rule cannot fail at
convergence, and the r × row-normalisation sensitivity part runs at toy size."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import minimize

from simulations import chen_wang as sim


def _one_hot(m: int, attrs: int, levels: int, seed: int, unit: bool
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.zeros((m, attrs * levels))
    X[np.arange(m)[:, None], np.arange(attrs) * levels + rng.integers(0, levels, (m, attrs))] = 1
    if unit:
        X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = (rng.random(m) < 1 / (1 + np.exp(-X @ rng.normal(size=X.shape[1]) * 3))).astype(float)
    w = rng.integers(1, 4, m) / 3.0
    return X, y, w / w.sum()


@pytest.mark.parametrize("unit", [True, False])
@pytest.mark.parametrize("reg", [0.01, 0.1, 1.0])
def test_newton_converges_to_the_minimum(unit: bool, reg: float) -> None:
    X, y, w = _one_hot(400, 8, 4, seed=int(reg * 100) + unit, unit=unit)

    def f(v: np.ndarray) -> float:
        z = X @ v
        return float(np.sum(w * (np.logaddexp(0, z) - y * z)) + 0.5 * reg * v @ v)

    def grad(v: np.ndarray) -> np.ndarray:
        s = 1 / (1 + np.exp(-(X @ v)))
        return X.T @ (w * (s - y)) + reg * v

    th = sim.newton_minimize(X, y, w, reg, np.zeros(X.shape[1]))
    assert np.linalg.norm(grad(th)) <= 1e-9
    ref = minimize(f, np.zeros(X.shape[1]), jac=grad, method="BFGS",
                   options={"gtol": 1e-11, "maxiter": 10_000}).x
    # F is reg-strongly convex: ‖θ − θ*‖ ≤ ‖∇F(θ)‖ / reg for both points
    assert np.linalg.norm(th - ref) <= 2e-9 / reg + 1e-7
    # started at the solution (the warm start of the next t): returns at once, no raise
    again = sim.newton_minimize(X, y, w, reg, th)
    assert np.linalg.norm(again - th) <= 1e-9


def test_newton_still_reports_real_failure() -> None:
    X, y, w = _one_hot(300, 6, 3, seed=5, unit=False)
    with pytest.raises(RuntimeError, match="Newton steps"):
        sim.newton_minimize(X, y, w, 1e-4, np.full(X.shape[1], 50.0), max_iter=1)


@pytest.mark.slow
def test_sensitivity_part_toy(tmp_path: Path) -> None:
    out = tmp_path / "sens"
    assert sim.main(["--parts", "sensitivity", "--steps", "25", "--sens-seeds", "1",
                     "--sens-regs", "0.1", "1", "--synthetic", "--small-standin",
                     "--out", str(out)]) == 0
    with open(out / "sensitivity.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["rows"], float(r["reg"])) for r in rows] == [
        ("unit-norm", 0.1), ("unit-norm", 1.0), ("raw one-hot", 0.1), ("raw one-hot", 1.0)]
    for r in rows:
        assert float(r["error_noise_off_mean"]) <= float(r["error_paper_noise_mean"])
        assert np.isfinite(float(r["eps tight (eq. 22) mean"]))
    assert (out / "sensitivity.png").exists()


def test_merge_keeps_sections_not_rerun() -> None:
    old = ("# T\n\nProduced by:\n\n    nice -n 10 python -m simulations.chen_wang --old\n\n"
           "## Fig. 1\n\nold fig\n\n## Table I\n\nold table\n")
    new = "# T\n\nProduced by:\n\n    nice -n 10 python -m simulations.chen_wang --new\n\n" \
          "## Fig. 1\n\nnew fig\n"
    out = sim.merge_sections(old, new)
    assert "new fig" in out and "old fig" not in out and "old table" in out
    assert "--old" in out and "--new" in out  # the kept section still names its command
    assert out.index("## Fig. 1") < out.index("## Table I")


def test_overflowing_bound_reads_inf_not_an_error() -> None:
    """Raw rows with a large λ₀: eq. (22)'s factor exceeds 1 for long enough to overflow
    float64; ε must read inf from there on (the accountant refuses inf sensitivities)."""
    import warnings

    from flwr_corrnoise.decentralized.chen_wang import StepSizes
    from flwr_corrnoise.decentralized.chen_wang_privacy import TIGHT, chen_wang_epsilon

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        eps = chen_wang_epsilon(2000, StepSizes(64, 0.77, 1, 0.65), w_self=0.6, L=5.51,
                                C=2 * 22**0.5, dim=117, noise_scale=1, exponent=0.11,
                                accountant=TIGHT, w_bar=0.6)
    assert eps.shape == (2000,)
    k = int(np.argmax(np.isinf(eps)))
    assert k > 0 and np.all(np.isinf(eps[k:])) and np.all(np.isfinite(eps[:k]))
    assert np.all(np.diff(eps[:k]) >= 0)
