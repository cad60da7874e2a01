"""Logistic-regression losses and the dynamic regret of Zhang, Zhu, Fay & Johansson, "Locally
Differentially Private Online Federated Learning With Correlated Noise", eq. (1).

Conventions (Zhang et al., Sec. V-A): a model ``x ∈ ℝ^d`` (no separate intercept), data
``(a, b) ∈ ℝ^d × {−1, +1}``, per-datum loss ``f(x) = log(1 + exp(−b·⟨x, a⟩))`` (natural
log). All functions take ``features`` of shape ``(m, d)`` and ``labels`` of shape ``(m,)``
and work with *means* over the ``m`` points, so values do not grow with the batch size.

Dynamic regret, eq. (1)::

    Regret_d = Σ_{r<R} Σ_{t<τ} (1/n) Σ_i ( f_i^{r,t}(x^r) − (f^r)* ),
    f^r(x)   = (1/(nτ)) Σ_i Σ_t f_i^{r,t}(x),     (f^r)* = min_x f^r(x).

Because ``(1/n) Σ_i Σ_t f_i^{r,t}(x^r) = τ·f^r(x^r)``, each round contributes
``τ·(f^r(x^r) − (f^r)*)``, where ``f^r(x^r)`` is the **mean** loss of the round's model over
the round's ``n·τ`` data points. :func:`dynamic_regret` takes exactly those per-round means.

Pure numpy/scipy: this module must not import Flower or torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.special import expit


def _check_data(x: np.ndarray, features: np.ndarray, labels: np.ndarray) -> tuple:
    x = np.asarray(x, dtype=float)
    features = np.asarray(features, dtype=float)
    labels = np.asarray(labels, dtype=float)
    if features.ndim != 2:
        raise ValueError(f"features must have shape (m, d), got {features.shape}")
    if labels.shape != (features.shape[0],):
        raise ValueError(f"labels must have shape ({features.shape[0]},), got {labels.shape}")
    if x.shape != (features.shape[1],):
        raise ValueError(f"x must have shape ({features.shape[1]},), got {x.shape}")
    if features.shape[0] == 0:
        raise ValueError("at least one data point is needed (the loss is a mean)")
    return x, features, labels


def logistic_loss(x: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    """Mean of ``log(1 + exp(−y·⟨x, a⟩))`` over the rows ``a`` of ``features``.

    Computed as ``logaddexp(0, −y·⟨x, a⟩)`` so that large margins of either sign neither
    overflow nor lose the small tail (``log1p(exp(z))`` overflows for ``z ≳ 710``).
    """
    x, features, labels = _check_data(x, features, labels)
    return float(np.mean(np.logaddexp(0.0, -labels * (features @ x))))


def logistic_grad(x: np.ndarray, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Gradient of :func:`logistic_loss` with respect to ``x``, shape ``(d,)``.

    ``∇ = −(1/m) Σ_j y_j σ(−y_j⟨x, a_j⟩) a_j`` with the logistic ``σ`` (``scipy.special.expit``,
    stable for all arguments).
    """
    x, features, labels = _check_data(x, features, labels)
    weights = -labels * expit(-labels * (features @ x))
    return features.T @ weights / features.shape[0]


def accuracy(x: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of points whose label equals ``sign(⟨x, a⟩)``, with ``sign(0) = +1``.

    Treating 0 as +1 makes the all-zero model predict +1 everywhere (the majority-style
    baseline when +1 is the majority), instead of being "wrong" on every point.
    """
    x, features, labels = _check_data(x, features, labels)
    predictions = np.where(features @ x >= 0.0, 1.0, -1.0)
    return float(np.mean(predictions == labels))


def is_separable(features: np.ndarray, labels: np.ndarray) -> bool:
    """Whether some ``x`` has ``y_j⟨x, a_j⟩ > 0`` for every point (strict linear separation
    through the origin).

    Decided by the LP feasibility problem ``y_j⟨x, a_j⟩ ≥ 1`` (HiGHS); by scaling ``x`` the
    margin 1 is no restriction, so the LP is feasible exactly when the data are strictly
    separable. Then the logistic loss tends to 0 along ``s·x`` as ``s → ∞``.

    Fast path first: the least-squares solution of ``⟨x, a_j⟩ = y_j`` is tried as a
    certificate (it interpolates the labels whenever the ``m`` points are linearly
    independent, e.g. the paper's 80 points in ``d = 100``). It is accepted only if every
    margin is clearly positive relative to ``‖x‖·‖a_j‖``, so the answer stays exact; the LP
    (≈ 50 ms at 80×100, against ≈ 1 ms) runs only when the certificate fails.
    """
    features = np.asarray(features, dtype=float)
    labels = np.asarray(labels, dtype=float)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError("features must be (m, d) and labels (m,)")
    candidate = np.linalg.lstsq(features, labels, rcond=None)[0]
    margins = labels * (features @ candidate)
    scale = np.linalg.norm(candidate) * np.linalg.norm(features, axis=1)
    if np.all(margins > 1e-8 * scale) and np.all(scale > 0):
        return True
    return _separable_by_lp(features, labels)


def _separable_by_lp(features: np.ndarray, labels: np.ndarray) -> bool:
    """The exact test: is ``{x : y_j⟨x, a_j⟩ ≥ 1 ∀j}`` non-empty (HiGHS)?"""
    m, d = features.shape
    from scipy.optimize import linprog  # lazily: scipy.optimize costs ≈ 0.4 s to import
    res = linprog(
        c=np.zeros(d),
        A_ub=-(labels[:, None] * features),
        b_ub=-np.ones(m),
        bounds=[(None, None)] * d,
        method="highs",
    )
    if res.status == 0:
        return True
    if res.status == 2:
        return False
    raise RuntimeError(f"separability LP failed: status {res.status}, {res.message}")


def fit_logistic(
    features: np.ndarray,
    labels: np.ndarray,
    l2: float = 0.0,
    x0: np.ndarray | None = None,
    gtol: float = 1e-10,
    maxiter: int = 20_000,
) -> np.ndarray:
    """Minimizer of ``logistic_loss + (l2/2)‖x‖²`` by L-BFGS with the analytic gradient.

    With ``l2 = 0`` on separable data there is no minimizer (the loss → 0 as ``‖x‖ → ∞``);
    use ``l2 > 0`` there (e.g. to get "the best global model" for an accuracy ceiling).
    """
    features = np.asarray(features, dtype=float)
    labels = np.asarray(labels, dtype=float)
    start = np.zeros(features.shape[1]) if x0 is None else np.asarray(x0, dtype=float)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        return (
            logistic_loss(x, features, labels) + 0.5 * l2 * float(x @ x),
            logistic_grad(x, features, labels) + l2 * x,
        )

    from scipy.optimize import minimize  # lazily: scipy.optimize costs ≈ 0.4 s to import
    res = minimize(
        fun,
        start,
        jac=True,
        method="L-BFGS-B",
        options={"gtol": gtol, "ftol": 1e-15, "maxiter": maxiter, "maxcor": 30},
    )
    return np.asarray(res.x)


def round_optimum(features: np.ndarray, labels: np.ndarray) -> float:
    """``(f^r)* = min_x f^r(x)``: the smallest mean logistic loss over one round's data.

    ``features``/``labels`` are the round's ``n·τ`` points (all learners, all local steps).

    Why the separability check: with ``n·τ = 80`` points in ``d = 100`` the points are
    almost always linearly separable through the origin, so the infimum is 0 and is *not
    attained*; an iterative solver would stop at an arbitrary small positive value that
    depends on its tolerance and iteration cap. So we decide separability exactly
    (:func:`is_separable`) and return ``0.0`` in that case. Otherwise the problem is
    convex with a finite infimum, solved by L-BFGS with the analytic gradient and tight
    tolerances (``gtol = 1e-10``). (In the measure-zero "quasi-separable" case, where some
    points can only be put *on* the separating hyperplane, the value still converges to
    the infimum although ``x`` diverges.)
    """
    features = np.asarray(features, dtype=float)
    labels = np.asarray(labels, dtype=float)
    if features.ndim != 2 or labels.shape != (features.shape[0],) or features.shape[0] == 0:
        raise ValueError("features must be (m, d) with m ≥ 1 and labels (m,)")
    if is_separable(features, labels):
        return 0.0
    x = fit_logistic(features, labels)
    return max(0.0, logistic_loss(x, features, labels))


def dynamic_regret(online_losses: Sequence[float], optima: Sequence[float], tau: int) -> float:
    """Dynamic regret of Zhang et al., eq. (1): ``Σ_r τ·(f^r(x^r) − (f^r)*)``.

    Args:
        online_losses: ``f^r(x^r)`` for every round ``r``, the **mean** loss of the model
            used in round ``r`` over that round's ``n·τ`` points.
        optima: ``(f^r)*`` for every round (:func:`round_optimum` of the same points).
        tau: local steps per round ``τ``. Eq. (1) sums over the ``τ`` steps and averages
            over the ``n`` learners, so a round weighs ``τ`` times its mean excess loss.
    """
    losses = np.asarray(online_losses, dtype=float)
    best = np.asarray(optima, dtype=float)
    if losses.ndim != 1 or losses.shape != best.shape:
        raise ValueError(
            f"online_losses and optima must be 1-D of equal length, got {losses.shape}, "
            f"{best.shape}"
        )
    if isinstance(tau, bool) or not isinstance(tau, int | np.integer) or tau < 1:
        raise ValueError(f"tau must be a positive integer, got {tau!r}")
    return float(tau * np.sum(losses - best))


def dynamic_regret_curve(
    online_losses: Sequence[float], optima: Sequence[float], tau: int
) -> np.ndarray:
    """Cumulative dynamic regret after each round (for plots): entry ``r`` is eq. (1)
    summed over rounds ``0..r``; the last entry equals :func:`dynamic_regret`."""
    dynamic_regret(online_losses, optima, tau)  # validation
    losses = np.asarray(online_losses, dtype=float)
    return tau * np.cumsum(losses - np.asarray(optima, dtype=float))
