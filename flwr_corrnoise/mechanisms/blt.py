"""Buffered linear Toeplitz (BLT) factorizations (Dvijotham et al. 2024), optimized per horizon.

A BLT encoder ``C`` is lower-triangular Toeplitz with coefficients

    c(0) = 1,   c(t) = Σ_i ω_i·θ_i^(t−1)  (t ≥ 1),   0 < θ_i < 1, ω_i > 0,

for ``k`` "buffers" ``i``. Why it is the mechanism to use at long horizons:

* **Streaming in constant memory.** The noise a learner adds is ``e = C⁻¹ξ``. Writing
  ``C e = ξ`` as a recursion gives, with ``k`` buffer vectors ``r_i`` (``r = 0`` at start)::

      e[t]   = ξ[t] − Σ_i ω_i·r_i
      r_i   ← θ_i·r_i + e[t]

  so the stream holds ``k·d`` floats whatever ``N`` is (the Toeplitz square root and the
  dense optimized factorization need every past ``ξ`` row: ``N·d``).
* **Closed forms.** Every column of ``C`` is a prefix of column 0, so the sensitivity is
  ``‖c‖`` over ``N`` coefficients, a sum of geometric series:
  ``‖c‖² = 1 + Σ_ij ω_i ω_j (1 − (θ_iθ_j)^(N−1)) / (1 − θ_iθ_j)``. The recursion above
  shows that ``C⁻¹`` is again a BLT, with the decays ``λ`` of the state matrix
  ``A' = diag(θ) − 1ωᵀ``: ``g(t) = −ωᵀA'^(t−1)1``. So ``B = A·C⁻¹`` is Toeplitz with
  ``b = cumsum(g)``, ``‖b_t‖² = Σ_{s≤t} b(s)²``, and ``‖B‖_F² = Σ_t (N − t)·b(t)²`` is a
  finite sum of geometric-type series in ``λ`` (:meth:`BLTParams.total_error`). Nothing
  is ``N×N``; the coefficients cost O(N·k), the error and sensitivity O(k³).
* **Near-optimal.** The parameters ``(θ, ω)`` are optimized for the horizon by L-BFGS on
  the squared RMSE at unit sensitivity, ``sens²·‖B‖_F²/N``, a smooth function of ``2k``
  numbers evaluated in closed form. With 4 buffers the RMSE is ≈ 3 % above the dense
  optimum and below the Toeplitz square root's at every N we measured
  (``docs/benchmarks.md``).

Optimized parameters are memoized and cached on disk (``cache.py``), like the dense
optimized factorization.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from . import cache
from .base import Factorization
from .participation import (
    ONCE,
    Participation,
    Sensitivity,
    majorant_norm2,
    toeplitz_sensitivity,
)
from .registry import Param, register
from .streaming import Array, ArrayOps, Draw, Saved, StreamKernel, shared_base

#: default number of buffers: 4 is within 0.1 % of 5 or 6 at N ≤ 10⁵ (docs/benchmarks.md)
DEFAULT_BUFFERS = 4
#: from this horizon on, building the coefficients takes seconds: a line says so
LARGE_N = 2_000_000
log = logging.getLogger(__name__)
CACHE_VERSION = 1


@dataclass(frozen=True)
class BLTParams:
    """``θ`` (decays, in (0, 1)) and ``ω`` (weights, > 0) of a BLT encoder."""

    theta: np.ndarray
    omega: np.ndarray

    def __post_init__(self) -> None:
        theta = np.asarray(self.theta, dtype=float).ravel()
        omega = np.asarray(self.omega, dtype=float).ravel()
        if theta.shape != omega.shape:
            raise ValueError("θ and ω must have the same length (one pair per buffer)")
        if not (np.all(np.isfinite(theta)) and np.all((theta > 0) & (theta < 1))):
            raise ValueError(f"every θ must lie in (0, 1), got {theta}")
        if not (np.all(np.isfinite(omega)) and np.all(omega > 0)):
            raise ValueError(f"every ω must be > 0, got {omega}")
        object.__setattr__(self, "theta", theta)
        object.__setattr__(self, "omega", omega)

    @property
    def buffers(self) -> int:
        return int(self.theta.size)

    def encoder_coefficients(self, n: int) -> np.ndarray:
        """``c(0..n−1)``: column 0 of ``C``."""
        t = np.arange(n - 1, dtype=float)
        tail = (self.omega[None, :] * self.theta[None, :] ** t[:, None]).sum(axis=1)
        return np.concatenate(([1.0], tail))

    def noising_coefficients(self, n: int) -> np.ndarray:
        """``g(0..n−1)``: column 0 of ``C⁻¹``, ``g(t) = −ωᵀA'^(t−1)1`` (``A'`` below).

        Evaluated in blocks of 256 steps with precomputed powers of the ``k×k`` matrix
        ``A'``: the same real arithmetic as the stream's recursion, vectorized. (A rational
        filter ``Q/P`` loses ≈ 1e-10 per coefficient at N = 10⁵, which the prefix sums of
        ``B`` amplify.)
        """
        k = self.buffers
        a = self._state_matrix()
        block = min(n, 256)
        powers = np.empty((block, k, k))
        powers[0] = np.eye(k)
        for j in range(1, block):
            powers[j] = a @ powers[j - 1]
        out = np.empty(n)
        out[0] = 1.0
        s = np.ones(k)
        t = 1
        while t < n:
            m = min(block, n - t)
            states = powers[:m] @ s  # A'^(t−1+j)·1 for j < m
            out[t : t + m] = -(states @ self.omega)
            s = a @ states[m - 1]
            t += m
        return out

    def _state_matrix(self) -> np.ndarray:
        """``A' = diag(θ) − 1ωᵀ``: one step of ``r ← θ⊙r + e`` with ``e = −ωᵀr``."""
        return np.diag(self.theta) - np.outer(np.ones_like(self.theta), self.omega)

    def sensitivity_squared(self, n: int) -> float:
        """``‖c‖²`` over ``n`` coefficients, in closed form (geometric series)."""
        prod = np.outer(self.theta, self.theta)
        geo = -np.expm1((n - 1) * np.log(prod)) / (1.0 - prod)
        return float(1.0 + self.omega @ geo @ self.omega)

    def inverse(self) -> tuple[np.ndarray, np.ndarray]:
        """``(λ, γ)`` with ``g(0) = 1, g(t) = −Σ_i γ_i λ_i^(t−1)``: ``C⁻¹`` is again a BLT.

        From the recursion ``e = ξ − ωᵀr, r ← θ⊙r + e``: the state matrix is
        ``A' = diag(θ) − 1ωᵀ`` and ``g(t) = −ωᵀA'^(t−1)1``; diagonalizing ``A'`` gives
        ``λ`` (its eigenvalues, possibly complex) and ``γ``.
        """
        lam, vecs = np.linalg.eig(self._state_matrix())
        u = np.linalg.solve(vecs, np.ones(self.buffers, dtype=complex))
        return lam, (self.omega @ vecs) * u

    def total_error(self, n: int) -> float:
        """``‖B‖_F² = Σ_t (N − t)·b(t)²`` in closed form, O(buffers²) for any ``N``.

        ``b(t) = β_0 + Σ_i β_i λ_i^t`` with ``β_i = γ_i/(1 − λ_i)``, ``β_0 = 1 − Σβ_i``,
        so the sum is ``Σ_ab β_a β_b F(μ_a μ_b)`` with ``μ = (1, λ)`` and
        ``F(z) = Σ_{t<N} (N − t) z^t = ((N+1)(1−z) + z^(N+1) − 1)/(1 − z)²``, evaluated
        with ``expm1``/``log1p`` (and its Taylor expansion next to ``z = 1``) so that decays
        within ``1/N`` of 1 keep full precision. Unstable inverses (``|λ| ≥ 1``) give ∞.
        """
        lam, gam = self.inverse()
        if np.any(np.abs(lam) >= 1.0) or np.any(np.abs(1.0 - lam) < 1e-14):
            return math.inf
        beta = gam / (1.0 - lam)
        coef = np.concatenate(([1.0 - beta.sum()], beta))
        mu = np.concatenate(([1.0 + 0j], lam))
        z = np.outer(mu, mu).ravel()
        q = 1.0 - z
        f = np.empty_like(z)
        near = np.abs(q) * n < 1e-6
        f[near] = n * (n + 1) / 2 - q[near] * (n - 1) * n * (n + 1) / 6
        far = ~near
        f[far] = ((n + 1) * q[far] + np.expm1((n + 1) * np.log1p(-q[far]))) / q[far] ** 2
        value = coef @ f.reshape(mu.size, mu.size) @ coef
        return float(value.real) if np.isfinite(value) else math.inf


def participation_sensitivity_squared(params: BLTParams, n: int,
                                      participation: Participation) -> float:
    """``sens²`` under ``participation`` for the BLT encoder over ``n`` steps: the Toeplitz
    closed form on the non-increasing non-negative majorant of ``c`` (exact when
    ``Σω ≤ 1``, an upper bound otherwise: :func:`.participation.toeplitz_sensitivity`), so
    the optimizer can never score a BLT below its certified sensitivity. O(N·buffers)."""
    if participation.single:
        return params.sensitivity_squared(n)
    return majorant_norm2(params.encoder_coefficients(n), n, participation)


def rmse_squared(params: BLTParams, n: int, participation: Participation = ONCE) -> float:
    """``sens² · ‖B‖_F² / N``: the squared RMSE at unit sensitivity (the objective), with
    the sensitivity under ``participation``."""
    return participation_sensitivity_squared(params, n, participation) * \
        params.total_error(n) / n


def _unpack(z: np.ndarray, k: int) -> BLTParams:
    theta = 0.5 * (1.0 + np.tanh(0.5 * z[:k]))  # logistic, without overflow
    theta = np.clip(theta, 1e-12, 1.0 - 1e-15)
    return BLTParams(theta, np.exp(np.clip(z[k:], -700, 700)))


def _objective(z: np.ndarray, n: int, k: int, participation: Participation = ONCE) -> float:
    try:
        value = rmse_squared(_unpack(z, k), n, participation)
    except (ValueError, np.linalg.LinAlgError):
        return 1e300
    return value if math.isfinite(value) else 1e300


def optimize_blt(n: int, buffers: int = DEFAULT_BUFFERS, starts: int = 4,
                 participation: Participation = ONCE) -> tuple[BLTParams, dict]:
    """BLT parameters minimizing the RMSE at unit sensitivity for horizon ``n``, with the
    sensitivity under ``participation`` (one datum used up to ``k`` times, ``b`` apart: the
    ``(k, b)`` of jax_privacy's ``buffered_toeplitz.optimize``).

    Why multi-start: the objective is smooth but not convex in ``(θ, ω)``; starts spread
    the decays geometrically between ``1/2`` and ``1 − 1/N`` (the time scales a prefix
    sum of length up to ``N`` needs) and keep the best local optimum.
    """
    if buffers < 1:
        raise ValueError(f"a BLT needs at least one buffer, got {buffers}")
    start = time.perf_counter()
    best_z, best_val = None, math.inf
    for s in range(starts):
        hi = max(math.log10(n) - 0.3, 0.5)
        gaps = np.logspace(-0.3 - 0.2 * s, -hi, buffers)  # 1 − θ
        theta0 = np.clip(1.0 - gaps, 1e-3, 1 - 1e-9)
        omega0 = np.full(buffers, 0.5 / buffers)
        z0 = np.concatenate((np.log(theta0 / (1 - theta0)), np.log(omega0)))
        from scipy.optimize import minimize  # lazily: scipy.optimize costs ≈ 0.4 s to import
        res = minimize(_objective, z0, args=(n, buffers, participation), method="L-BFGS-B",
                       options={"maxiter": 2000})
        if res.fun < best_val:
            best_z, best_val = res.x, float(res.fun)
    assert best_z is not None
    params = _unpack(best_z, buffers)
    report = {"rmse": math.sqrt(best_val), "seconds": time.perf_counter() - start,
              "buffers": buffers, "starts": starts,
              "participation": participation.describe()}
    return params, report


class BufferedToeplitz(Factorization):
    """The BLT factorization ``B = A·C⁻¹`` with ``C`` BLT, optimized for the horizon.

    ``report`` holds the optimizer's ``rmse``, ``seconds`` (0 when loaded from the cache)
    and ``buffers``. Pass ``params`` to use given parameters instead of optimizing.
    ``min_sep``/``max_participations`` (``b``, ``k``): optimize for a datum used up to
    ``k`` times at least ``b`` steps apart (the learner passes its participation); the
    defaults (once) give the single-participation BLT.
    """

    name = "blt"
    stream_kind = "blt"

    def __init__(
        self,
        n: int,
        buffers: int = DEFAULT_BUFFERS,
        params: BLTParams | None = None,
        use_cache: bool = True,
        min_sep: int = 1,
        max_participations: int = 1,
    ) -> None:
        super().__init__(n)
        self.target = Participation.min_separation(min_sep, max_participations)
        if params is None:
            key = f"blt-v{CACHE_VERSION}-k{buffers}-N{self.n}"
            if not self.target.single:
                key += f"-b{self.target.min_sep}-p{self.target.participations(self.n)}"
            stored = cache.load(key, ("theta", "omega")) if use_cache else None
            if stored is not None:
                try:
                    params = BLTParams(stored["theta"], stored["omega"])
                    self.report = {"buffers": buffers, "seconds": 0.0, "loaded": True}
                except ValueError:
                    params = None
            if params is None:
                params, self.report = optimize_blt(self.n, buffers,
                                                   participation=self.target)
                if use_cache:
                    cache.store(key, theta=params.theta, omega=params.omega)
        else:
            self.report = {"buffers": params.buffers, "seconds": 0.0, "given": True}
        self.params = params
        if use_cache:  # write-once copy under the digest: streams restore exactly this one
            cache.store_once(cache.digest_key(self.name, self.n, self.digest),
                             theta=params.theta, omega=params.omega)
        if np.max(np.abs(params.inverse()[0])) >= 1.0:
            # the noise e = C⁻¹ξ would grow without bound over the horizon
            raise ValueError("these BLT parameters have an unstable inverse (C⁻¹ diverges)")
        if self.n >= LARGE_N:  # O(N) coefficients: seconds at N = 10⁷, never silent
            log.warning("flwr-corrnoise: blt N = %d: computing its %d coefficients "
                        "(≈ %.0f s at 2·10⁶ per second)", self.n, 2 * self.n, self.n / 2e6)
        self.c = params.encoder_coefficients(self.n)
        self.g = params.noising_coefficients(self.n)
        self._b = np.cumsum(self.g)
        self._cum_c = np.cumsum(self.c * self.c)
        # the closed forms must agree with the coefficients (guards the eigendecomposition)
        direct = float((self.n - np.arange(self.n, dtype=float)) @ (self._b * self._b))
        if not math.isclose(self.total_error, direct, rel_tol=1e-6):
            raise ValueError(f"BLT closed-form error {self.total_error} disagrees with the "
                             f"coefficient sum {direct}; parameters are ill-conditioned")

    @property
    def buffers(self) -> int:
        return self.params.buffers

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"theta": self.theta, "omega": self.omega}

    @property
    def theta(self) -> np.ndarray:
        return self.params.theta

    @property
    def omega(self) -> np.ndarray:
        return self.params.omega

    def column_norms(self) -> np.ndarray:
        # column j holds c(0..N−1−j)
        return np.sqrt(self._cum_c[::-1])

    @property
    def sensitivity(self) -> float:
        return math.sqrt(self.params.sensitivity_squared(self.n))

    @property
    def rmse(self) -> float:
        return math.sqrt(rmse_squared(self.params, self.n))

    def prefix_sensitivity(self, k: int) -> float:
        return float(np.sqrt(self._cum_c[self._check_prefix(k) - 1]))

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        # exact when Σω ≤ 1 (then c is non-increasing); a certified bound otherwise
        return toeplitz_sensitivity(self.c, steps or self.n, participation)

    def row_errors(self) -> np.ndarray:
        return np.cumsum(self._b * self._b)

    @property
    def total_error(self) -> float:
        return self.params.total_error(self.n)

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        from scipy.linalg import toeplitz

        return np.tril(toeplitz(self._b)), np.tril(toeplitz(self.c))

    def noising_matrix(self) -> np.ndarray:
        from scipy.linalg import toeplitz

        return np.tril(toeplitz(self.g))

    def _make_stream_kernel(self) -> StreamKernel:
        return BLTKernel(self.theta, self.omega)


@dataclass
class BLTState:
    """The ``buffers×d`` array ``r`` (serialized as ``rows``); ``consts``: ``θ`` and ``ω``
    in the stream's namespace (derived, never saved)."""

    buf: Array
    consts: dict[str, Array] = field(default_factory=dict)
    #: the stacked state whose columns ``buf`` is (``streaming.shared_base``)
    shared: tuple[BLTState, int, int] | None = None


class BLTKernel(StreamKernel):
    """``C·e = ξ`` for a BLT encoder as a recursion in ``buffers·d`` floats::

        e = ξ − Σ_i ω_i·r_i,    r_i ← θ_i·r_i + e
    """

    kind = "blt"
    adopts_rows = True

    def __init__(self, theta: np.ndarray, omega: np.ndarray) -> None:
        self.theta = np.asarray(theta, dtype=np.float64)
        self.omega = np.asarray(omega, dtype=np.float64)

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> BLTState:
        if getattr(rows, "ndim", 1) == 2:  # handed over as one array (adopts_rows)
            state = BLTState(buf=rows)
        else:
            state = BLTState(buf=ops.zeros(len(rows) if len(rows) else self.theta.size, dim))
            for i, r in enumerate(rows):
                state.buf[i] = r
        state.consts = {"theta": ops.const(self.theta[:, None]), "omega": ops.const(self.omega)}
        return state

    def next(self, state: BLTState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, BLTState]:
        r = state.buf
        e = draw()
        theta, omega = state.consts["theta"], state.consts["omega"]
        # the new buffers in a fresh array (``state`` keeps its own): ``θ⊙r + e`` straight
        # into it, the same floats as in place and no extra pass over memory
        out = ops.empty(r.shape[0], r.shape[1])
        ops.blt_step(r, theta, omega, e, out)
        return e, BLTState(buf=out, consts=state.consts)

    has_steps = True

    def steps(self, state: BLTState, step: int, rows: Array,
              ops: ArrayOps) -> tuple[Array, BLTState]:
        theta, omega = state.consts["theta"], state.consts["omega"]
        out = ops.empty(state.buf.shape[0], state.buf.shape[1])
        ops.blt_steps(state.buf, theta, omega, rows, out)  # type: ignore[attr-defined]
        return rows, BLTState(buf=out, consts=state.consts)

    def save(self, state: BLTState) -> Saved:
        return [], [state.buf[i] for i in range(state.buf.shape[0])]

    def rows_view(self, state: BLTState) -> Array:
        return state.buf

    def check(self, state: BLTState, step: int, dim: int) -> None:
        if tuple(state.buf.shape) != (self.theta.size, dim):
            raise ValueError("BLT noise state does not have one buffer per BLT buffer")
        # the sum is finite iff every element is, barring an overflow of the sum, which
        # fails closed; an elementwise isfinite costs a restore more than the rest of it
        # (torch on a CPU; NumPy's makes and scans a mask: benchmarks/stream_state_io.py)
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(state.buf.sum())
        if not math.isfinite(total):
            raise ValueError("BLT noise state holds non-finite values")

    def stack(self, ops: ArrayOps, states: list[BLTState], dim: int) -> BLTState:
        """The buffers side by side (``buffers × L·d``); no copy when ``states`` are the
        column views :meth:`unstack` handed out and none has moved since."""
        base = shared_base(states)
        if base is not None:  # never written in place: the columns are still the base's
            return base
        out = BLTState(buf=ops.zeros(self.theta.size, len(states) * dim),
                       consts=states[0].consts)
        for i, s in enumerate(states):
            out.buf[:, i * dim:(i + 1) * dim] = s.buf
        return out

    def unstack(self, ops: ArrayOps, state: BLTState, count: int, dim: int) -> list[BLTState]:
        return [BLTState(buf=state.buf[:, i * dim:(i + 1) * dim], consts=state.consts,
                         shared=(state, i, count))
                for i in range(count)]

    def peak_rows(self, horizon: int) -> int:
        return int(self.theta.size)


def _restore(n: int, digest: str) -> BufferedToeplitz | None:
    """The BLT whose parameters were cached under ``digest`` when it was built."""
    stored = cache.load(cache.digest_key("blt", n, digest), ("theta", "omega"))
    if stored is None:
        return None
    return BufferedToeplitz(n, params=BLTParams(stored["theta"], stored["omega"]),
                            use_cache=False)


register(
    "blt",
    "buffered linear Toeplitz, optimized per horizon (Dvijotham et al. 2024); "
    "near-optimal, O(buffers·d) stream state at any N",
    build=lambda n, buffers, min_sep, max_participations: BufferedToeplitz(
        n, buffers=buffers, min_sep=min_sep, max_participations=max_participations),
    params=[Param("buffers", int, DEFAULT_BUFFERS,
                  "number of buffers: stream state buffers·d floats (4 is within 0.1 % of "
                  "5 or 6 at N ≤ 10⁵)", valid=lambda k: k >= 1, constraint="≥ 1"),
            Param("min_sep", int, 1, "optimize for uses of one datum ≥ this many steps "
                  "apart (with max_participations)", valid=lambda b: b >= 1,
                  constraint="≥ 1"),
            Param("max_participations", int, 1, "optimize for up to this many uses of one "
                  "datum (1: the paper's one-pass stream)", valid=lambda k: k >= 1,
                  constraint="≥ 1")],
    restore=_restore,
    build_imports=("scipy.optimize",),
)
