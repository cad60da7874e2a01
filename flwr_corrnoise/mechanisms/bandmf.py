"""BandMF: a banded lower-triangular Toeplitz encoder ``C`` — the mechanism that sampling
amplifies.

Why it exists (issue 35): with an encoder of ``w`` bands (``C[i, j] = 0`` for
``i − j ≥ w``) and cyclic Poisson sampling of cycle ``b ≥ w``
(:class:`~flwr_corrnoise.data.sampling.CyclicPoissonLoader`), the steps one example can be
used at are ``b`` apart, so the columns of ``C`` they touch have disjoint row supports, and
the release is a composition of Poisson-subsampled Gaussian mechanisms (Choquette-Choo,
Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A
unified approach to private training", NeurIPS 2023, Thm. 4; accounted in
:mod:`flwr_corrnoise.amplification`). ``w = 1`` is ``C = I``: DP-SGD. Without sampling it
is an ordinary factorization, and its multi-participation sensitivity is computed like
every other one's (:mod:`.participation`).

**The matrices.** ``C`` is Toeplitz with column 0 ``c(0) = 1, c(1), …, c(w−1), 0, …``; its
column ``j`` holds ``c(0..min(w, N−j)−1)``, so ``max_j ‖c_j‖ = ‖c‖``. ``C⁻¹`` is the
Toeplitz matrix of the impulse response ``r`` of ``1/c(x)``, so ``B = A·C⁻¹`` has column 0
``β = cumsum(r)`` and ``‖b_k‖² = Σ_{t≤k} β(t)²``; everything is O(N·w). The stream's
increment ``e = C⁻¹ξ`` is the recursion ``e[k] = ξ_k − Σ_{1≤i<w} c(i)·e[k−i]``: a state of
``w − 1`` rows of ``d`` floats (jax_privacy's ``inverse_as_streaming_matrix``, Algorithm 9
of the paper).

**The coefficients** minimize the per-query RMSE at unit sensitivity,
``‖c‖²·‖B‖_F²/N`` (the error the amplified calibration multiplies by its noise multiplier;
as jax_privacy's ``optimize_banded_toeplitz`` with its ``mean_loss``). They are searched
as reflection coefficients ``κ_i = tanh(u_i)`` (:func:`.banded.step_up`: every root of
``c(x)`` outside the unit disc, so ``C⁻¹``'s coefficients decay and no iterate blows up
over the horizon), by L-BFGS on the exact gradient: with ``ρ = r∗r`` and ``U = cumsum(ρ)``,
``∂β(t)/∂c(i) = −U(t−i)``, since ``∂C⁻¹/∂c(i) = −C⁻¹·Sⁱ·C⁻¹``. The start is the Toeplitz
square root's first ``w`` coefficients (Fichtenberger, Henzinger & Upadhyay 2023; what
jax_privacy starts from). Solved bands are cached on disk, and a stream restores the exact
band it started with through the write-once copy under its digest (as BLT's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cache
from .banded import encoder_coefficients, step_down, step_up
from .base import Factorization
from .participation import DENSE_LIMIT, Participation, Sensitivity, toeplitz_sensitivity
from .registry import Param, register
from .streaming import Array, ArrayOps, Draw, Saved, StreamKernel
from .toeplitz import sqrt_coefficients

NAME = "bandmf"
#: default bands when none is chosen for a sampler (:func:`~flwr_corrnoise.amplification.
#: choose_bands` picks them for a budget)
DEFAULT_BANDS = 4
CACHE_VERSION = 1


# -- the band's coefficients ---------------------------------------------------------------
def decoder_column(c: np.ndarray, n: int) -> np.ndarray:
    """``β(0..n−1)``: column 0 of ``B = A·C⁻¹`` (the running sums of ``1/c``'s impulse
    response)."""
    return np.cumsum(encoder_coefficients(c, n))


def rmse_squared(c: np.ndarray, n: int) -> float:
    """``‖c‖²·‖B‖_F²/N`` at horizon ``n`` (the objective; ``‖c‖`` over the first ``n``)."""
    c = np.asarray(c, dtype=float)[:n]
    beta = decoder_column(c, n)
    value = float(c @ c) * float((n - np.arange(n, dtype=float)) @ (beta * beta)) / n
    return value if math.isfinite(value) else math.inf


def step_up_jacobian(kappa: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``c = step_up(κ)`` and ``∂c/∂κ`` (``w × (w−1)``), by forward differentiation of the
    Levinson recursion ``c ← [c, 0] + κ_j·[c, 0]ᵀ`` (reversed)."""
    kappa = np.asarray(kappa, dtype=float)
    c = np.array([1.0])
    jac = np.zeros((1, kappa.size))
    for j, k in enumerate(kappa):
        padded = np.append(c, 0.0)
        jpad = np.vstack((jac, np.zeros((1, kappa.size))))
        new_jac = jpad + k * jpad[::-1]
        new_jac[:, j] += padded[::-1]
        c, jac = padded + k * padded[::-1], new_jac
    return c, jac


def _objective(u: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """``ln(‖c‖²·‖B‖_F²/N)`` and its gradient in ``u`` (``κ = tanh u``)."""
    kappa = np.tanh(u)
    c, jac = step_up_jacobian(kappa)
    with np.errstate(over="ignore", invalid="ignore"):
        r = encoder_coefficients(c, n)
        beta = np.cumsum(r)
        wb = (n - np.arange(n, dtype=float)) * beta
        S = float(wb @ beta)
    norm2 = float(c @ c)
    if not (math.isfinite(S) and S > 0):
        return 1e300, np.zeros_like(u)
    size = 1 << (2 * n - 1).bit_length()
    rho = np.fft.irfft(np.fft.rfft(r, size) ** 2, size)[:n]
    U = np.cumsum(rho)
    w = c.size
    dS = np.array([-2.0 * float(wb[i:] @ U[: n - i]) for i in range(w)])
    dF_dc = 2.0 * c / norm2 + dS / S
    grad = (jac.T @ dF_dc) * (1.0 - kappa * kappa)
    return math.log(norm2 * S / n), grad


def start_band(bands: int) -> np.ndarray:
    """Reflection coefficients of the Toeplitz square root's first ``bands`` coefficients
    (positive and decreasing: every root outside the closed unit disc, Eneström–Kakeya;
    damped slightly should one fall on the circle)."""
    h = sqrt_coefficients(bands)
    for damp in (1.0, 0.999, 0.99, 0.9):
        kappa = step_down(h * damp ** np.arange(bands))
        if kappa is not None:
            return kappa
    return np.zeros(bands - 1)


def optimize_band(n: int, bands: int) -> tuple[np.ndarray, dict[str, Any]]:
    """The band ``c(0..w−1)`` (``w = min(bands, n)``, ``c(0) = 1``) minimizing the RMSE at
    unit sensitivity for horizon ``n`` (module docstring), with the optimizer's report."""
    w = min(int(bands), int(n))
    if w == 1:
        return np.ones(1), {"rmse": math.sqrt(rmse_squared(np.ones(1), n)), "bands": 1}
    from scipy.optimize import minimize  # lazily: scipy.optimize costs ≈ 0.4 s to import

    start = np.arctanh(np.clip(start_band(w), -0.999999, 0.999999))
    res = minimize(_objective, start, args=(n,), jac=True, method="L-BFGS-B",
                   options={"maxiter": 1000})
    c = step_up(np.tanh(res.x))
    c[0] = 1.0
    return c, {"rmse": math.sqrt(rmse_squared(c, n)), "bands": w,
               "iterations": int(res.nit), "converged": bool(res.success)}


# -- the factorization ----------------------------------------------------------------------
class BandedToeplitz(Factorization):
    """``A = B·C`` with ``C`` lower-triangular Toeplitz of ``bands`` diagonals, optimized
    for the horizon; pass ``band`` to use given coefficients (``c(0) = 1``)."""

    name = NAME
    stream_kind = "banded-encoder"

    def __init__(self, n: int, bands: int = DEFAULT_BANDS, band: np.ndarray | None = None,
                 use_cache: bool = True) -> None:
        super().__init__(n)
        if band is None:
            w = min(int(bands), self.n)
            key = f"{NAME}-v{CACHE_VERSION}-w{w}-N{self.n}"
            stored = cache.load(key, ("band",)) if use_cache else None
            if stored is not None and stored["band"].size == w:
                band, self.report = stored["band"], {"loaded": True}
            else:
                band, self.report = optimize_band(self.n, w)
                if use_cache:
                    cache.store(key, band=band)
        else:
            self.report = {"given": True}
        band = np.asarray(band, dtype=np.float64).ravel()[: self.n]
        if band.size < 1 or band[0] != 1.0 or not np.all(np.isfinite(band)):
            raise ValueError("a band starts with c(0) = 1 and holds finite coefficients")
        self.band = band
        if use_cache:  # write-once copy under the digest: streams restore exactly this one
            cache.store_once(cache.digest_key(self.name, self.n, self.digest), band=self.band)
        self.r = encoder_coefficients(self.band, self.n)  # column 0 of C⁻¹
        self._beta = np.cumsum(self.r)
        if not np.all(np.isfinite(self._beta)):
            raise ValueError("this band's inverse C⁻¹ overflows over the horizon")
        self._cum_c = np.cumsum(self.band**2)

    @property
    def bands(self) -> int:
        """``w``: the diagonals of ``C`` (a sampler's cycle must be at least this long)."""
        return int(self.band.size)

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"band": self.band}

    def column_norms(self) -> np.ndarray:
        # column j holds c(0..min(w, N−j)−1)
        lengths = np.minimum(self.bands, self.n - np.arange(self.n))
        return np.sqrt(self._cum_c[lengths - 1])

    @property
    def sensitivity(self) -> float:
        return float(np.sqrt(self._cum_c[-1]))

    def prefix_sensitivity(self, k: int) -> float:
        # rows 0..k−1 of column 0 hold c(0..min(w, k)−1), the largest released column
        return float(np.sqrt(self._cum_c[min(self._check_prefix(k), self.bands) - 1]))

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        if self.n <= DENSE_LIMIT:  # the dense |X| computation (exact where it says so)
            return super()._participation_sensitivity(participation, steps)
        return toeplitz_sensitivity(self.band, steps or self.n, participation)

    def row_errors(self) -> np.ndarray:
        return np.cumsum(self._beta**2)

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        from scipy.linalg import toeplitz

        column = np.zeros(self.n)
        column[: self.bands] = self.band
        return np.tril(toeplitz(self._beta)), np.tril(toeplitz(column))

    def noising_matrix(self) -> np.ndarray:
        from scipy.linalg import toeplitz

        return np.tril(toeplitz(self.r))

    def _make_stream_kernel(self) -> StreamKernel:
        return BandedEncoderKernel(self.band)


# -- its stream kernel ----------------------------------------------------------------------
@dataclass
class BandedState:
    """The last ``filled ≤ w − 1`` increments in a ring of ``w − 1`` rows, the newest at
    ``head`` (``(k − 1) mod (w − 1)`` after ``k`` steps; saved as ``levels``)."""

    buf: Array
    head: int
    filled: int


class BandedEncoderKernel(StreamKernel):
    """``e[k] = ξ_k − Σ_{1≤i<w} c(i)·e[k−i]`` (solving ``C·e = ξ`` row by row), in
    ``w − 1`` rows of ``d`` floats."""

    kind = "banded-encoder"

    def __init__(self, band: np.ndarray) -> None:
        self.band = np.asarray(band, dtype=np.float64)
        self.size = int(self.band.size) - 1  # rows of history

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> BandedState:
        m = self.size
        if len(rows) > m or len(levels) > 1 or bool(rows) != bool(levels):
            raise ValueError("banded noise state does not match its step (rows and ring "
                             "position do not fit the band)")
        head = int(levels[0]) if levels else -1
        if rows and not 0 <= head < m:
            raise ValueError("banded noise state does not match its step (ring position "
                             "outside the ring)")
        buf = ops.zeros(m, dim)
        for j, row in enumerate(rows):  # oldest first, into the slots they were drawn in
            buf[(head - len(rows) + 1 + j) % m] = row
        return BandedState(buf=buf, head=head, filled=len(rows))

    def next(self, state: BandedState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, BandedState]:
        e = draw()
        m = self.size
        if m == 0:
            return e, state
        if state.filled:
            weights = np.zeros(m)
            newest = np.arange(state.filled)  # e[k−1−i] sits at ring slot head − i
            weights[(state.head - newest) % m] = self.band[1 + newest]
            ops.sub_matvec(e, ops.const(weights), state.buf)
        # the new ring in a copy (``state`` keeps its own): the same slots, so the sums of
        # the next step run in the same order
        head = (state.head + 1) % m
        buf = ops.copy(state.buf)
        buf[head] = e
        return e, BandedState(buf=buf, head=head, filled=min(state.filled + 1, m))

    def save(self, state: BandedState) -> Saved:
        """The ring position and the kept rows, oldest first. The rows go back into the
        same slots on restore, so the sums of a restored stream run in the same order and
        its increments continue bit for bit."""
        if not state.filled:
            return [], []
        m = self.size
        order = [(state.head - state.filled + 1 + j) % m for j in range(state.filled)]
        return [state.head], [state.buf[i] for i in order]

    def check(self, state: BandedState, step: int, dim: int) -> None:
        m = self.size
        head = (step - 1) % m if m and step else -1
        if tuple(state.buf.shape) != (m, dim) or state.filled != min(step, m) \
                or (state.filled and state.head != head):
            raise ValueError("banded noise state does not match its step")
        finite = state.buf.isfinite().all() if hasattr(state.buf, "isfinite") else (
            np.all(np.isfinite(state.buf)))
        if not bool(finite):
            raise ValueError("banded noise state holds non-finite values")

    def peak_rows(self, horizon: int) -> int:
        return min(int(horizon), self.size)


register(
    NAME,
    "banded Toeplitz encoder C (`bands` diagonals) optimized per horizon (BandMF, "
    "Choquette-Choo et al. 2023): amplified by cyclic Poisson sampling of cycle ≥ bands "
    "(bands = 1: DP-SGD); O(bands·d) stream state",
    build=lambda n, bands: BandedToeplitz(n, bands=bands),
    params=[Param("bands", int, DEFAULT_BANDS,
                  "diagonals of the encoder C (a cyclic Poisson sampler's cycle must be ≥ "
                  "bands for amplification; 1 = DP-SGD)", valid=lambda w: w >= 1,
                  constraint="≥ 1")],
    restore=cache.band_restorer(
        NAME, lambda n, band: BandedToeplitz(n, band=band, use_cache=False)),
    build_imports=("scipy.optimize", "scipy.signal"),
)
