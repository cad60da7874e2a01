"""A banded-inverse factorization whose stream state is a row index, not ``d``-rows.

For memory-bound simulations (thousands of virtual learners at ``d`` ≈ 10⁶, issue 22): the
noising matrix ``M = C⁻¹`` is lower-triangular Toeplitz with only ``w`` ("``bands``")
nonzero diagonals ``m(0) = 1, m(1), …, m(w−1)``, so the increment of step ``k`` is

    e[k] = Σ_{i<w} m(i)·ξ_{k−i},

a combination of the ``w`` latest rows of ``ξ``. The stream does not keep the ``w − 1``
older rows: it **regenerates** them. Its generator is the AES-128-CTR kernel
(:mod:`~flwr_corrnoise.cipher_noise`), whose row ``t`` is a pure function of the key and
``t``, and the stream draws one row a step: to use rows ``k−w+1 … k−1`` again it goes back
``w − 1`` rows (:meth:`~flwr_corrnoise.streams.RowCursor.rows_back`) and draws them again, bit
for bit, which puts the generator back where it stood. So the state keeps **no buffer and no
generator position**: the stream's generator (its key and row counter, shipped with every
stream) and the index of the oldest live row — a few words at any ``d`` (BLT: ``4·d``
floats, 32 MB per learner at ``d = 10⁶`` in float64). What it costs is compute: ``w`` draws of
``d`` normals per step instead of one (``benchmarks/banded_stream.py``).

Streams whose rows are not addressable by counter — a noise-state format-2 stream's Philox
(NumPy's ziggurat takes a variable number of words per normal, so where row ``j`` starts is
not a function of ``j``) and a secure stream's ChaCha20 — keep, besides the row index, the
generator position where that row began (:meth:`~flwr_corrnoise.streams.RowCursor.tell`/
``seek``): it holds no key words, so a restored state can only move the generator within its
own keystream, and a position that does not lead back to the generator's current one after
the ``w − 1`` replays is refused.

**The coefficients.** ``B = A·M`` is Toeplitz with ``b(t) = Σ_{i≤min(t, w−1)} m(i)``, so
``‖b_k‖² = Σ_{t≤k} b(t)²``; ``C = M⁻¹`` is the lower-triangular Toeplitz matrix of the
impulse response ``c`` of ``1/m(x)`` (the recursion ``c(t) = −Σ_{i≥1} m(i)·c(t−i)``), and
every column of ``C`` is a prefix of column 0: ``sens² = Σ_{t<N} c(t)²``. Both cost
O(N·w). The ``w − 1`` free coefficients minimize the squared RMSE at unit sensitivity
``sens²·‖B‖_F²/N`` for the horizon (L-BFGS, like BLT's). They are parametrized by
reflection coefficients ``κ_i = tanh(u_i) ∈ (−1, 1)`` (the Levinson step-up recursion),
which give exactly the polynomials ``m`` whose inverse filter is stable, so no iterate has a
``C`` that blows up over the horizon. The starts: the ``w`` leading coefficients of the
Toeplitz square root's inverse ``(1 − x)^{1/2}`` (the closed-form candidate: best at small
``N``, but it leaves ``b(t) = Σm ≈ 0.1–0.2`` for ever, so its error grows like ``N²``), and
the same with the first reflection coefficient pushed towards −1 (a near-unit root: what
the optimum has at long horizons). The optimized band is 1.1–1.5× BLT's RMSE at
``w = 4`` and ``N = 256–4000``; wider bands close the gap (``docs/mechanisms.md``).

Solved parameters are cached on disk, and a stream restores the exact band it started with
through the write-once copy under its digest (as BLT's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import cache
from .base import Factorization
from .participation import DENSE_LIMIT, Participation, Sensitivity, toeplitz_sensitivity
from .registry import Param, register
from .streaming import Array, ArrayOps, Draw, Saved, StreamKernel
from .toeplitz import inverse_sqrt_coefficients

NAME = "banded-inverse"
#: default band: 4 draws per step, 1.1–1.5× BLT's RMSE at N = 256–4000 (docs/mechanisms.md)
DEFAULT_BANDS = 4
CACHE_VERSION = 1


# -- the band's coefficients ---------------------------------------------------------------
def step_up(kappa: np.ndarray) -> np.ndarray:
    """``m(0..w−1)`` (``m(0) = 1``) from ``w − 1`` reflection coefficients (Levinson).

    Why: ``|κ_i| < 1`` for all ``i`` exactly when every root of ``m`` lies outside the unit
    disc (Schur–Cohn), i.e. when ``C = M⁻¹``'s coefficients decay; the optimizer then
    searches only stable bands.
    """
    m = np.array([1.0])
    for k in np.asarray(kappa, dtype=float):
        padded = np.append(m, 0.0)
        m = padded + k * padded[::-1]
    return m


def step_down(m: np.ndarray) -> np.ndarray | None:
    """The inverse of :func:`step_up`, or ``None`` if ``m`` has a root in the unit disc."""
    m = np.asarray(m, dtype=float)
    kappa = []
    while m.size > 1:
        k = float(m[-1])
        if not abs(k) < 1.0:
            return None
        kappa.append(k)
        m = ((m - k * m[::-1]) / (1.0 - k * k))[:-1]
    return np.array(kappa[::-1])


def encoder_coefficients(m: np.ndarray, n: int) -> np.ndarray:
    """``c(0..n−1)``: column 0 of ``C = M⁻¹`` (the impulse response of ``1/m``)."""
    impulse = np.zeros(n)
    impulse[0] = 1.0
    from scipy.signal import lfilter  # here: scipy.signal costs ≈ 0.9 s to import

    return lfilter([1.0], np.asarray(m, dtype=float), impulse)


def decoder_coefficients(m: np.ndarray, n: int) -> np.ndarray:
    """``b(0..n−1)``: column 0 of ``B = A·M``, the running sums of ``m``."""
    padded = np.zeros(n)
    k = min(n, len(m))
    padded[:k] = m[:k]
    return np.cumsum(padded)


def rmse_squared(m: np.ndarray, n: int) -> float:
    """``sens²·‖B‖_F²/N`` for the band ``m`` at horizon ``n`` (the objective), O(N·w)."""
    c = encoder_coefficients(m, n)
    b = decoder_coefficients(m, n)
    value = float(c @ c) * float((n - np.arange(n, dtype=float)) @ (b * b)) / n
    return value if math.isfinite(value) else math.inf


def _objective(u: np.ndarray, n: int) -> float:
    value = rmse_squared(step_up(np.tanh(u)), n)
    return math.log(value) if 0.0 < value < math.inf else 1e300


def optimize_band(n: int, bands: int) -> tuple[np.ndarray, dict[str, Any]]:
    """The band ``m(0..w−1)`` (``w = min(bands, n)``) minimizing the RMSE at unit
    sensitivity for horizon ``n``, with the optimizer's report (multi-start, see the
    module docstring: the objective is smooth, not convex)."""
    w = min(bands, n)
    if w == 1:  # C = I: independent noise
        return np.ones(1), {"rmse": math.sqrt(rmse_squared(np.ones(1), n)), "bands": 1}
    closed = step_down(inverse_sqrt_coefficients(w))
    assert closed is not None  # (1 − x)^{1/2}'s coefficients: every root outside the disc
    starts = [closed]
    for pushed in (0.9, 0.99, 0.999):
        start = closed.copy()
        start[0] = -pushed
        starts.append(start)
    best = None
    for kappa in starts:
        from scipy.optimize import minimize  # lazily: scipy.optimize costs ≈ 0.4 s to import
        res = minimize(_objective, np.arctanh(kappa), args=(n,), method="L-BFGS-B",
                       options={"maxiter": 500})
        if best is None or res.fun < best.fun:
            best = res
    assert best is not None
    m = step_up(np.tanh(best.x))
    m[0] = 1.0
    return m, {"rmse": math.sqrt(rmse_squared(m, n)), "bands": w, "starts": len(starts)}


# -- the factorization ----------------------------------------------------------------------
class BandedInverse(Factorization):
    """``A = B·C`` with ``C⁻¹ = M`` banded lower-triangular Toeplitz (``bands`` diagonals),
    optimized for the horizon; pass ``band`` to use given coefficients (``m(0) = 1``)."""

    name = NAME
    stream_kind = "regenerated"

    def __init__(self, n: int, bands: int = DEFAULT_BANDS, band: np.ndarray | None = None,
                 use_cache: bool = True) -> None:
        super().__init__(n)
        if band is None:
            key = f"{NAME}-v{CACHE_VERSION}-w{min(bands, self.n)}-N{self.n}"
            stored = cache.load(key, ("band",)) if use_cache else None
            if stored is not None and stored["band"].size == min(bands, self.n):
                band, self.report = stored["band"], {"loaded": True}
            else:
                band, self.report = optimize_band(self.n, bands)
                if use_cache:
                    cache.store(key, band=band)
        else:
            self.report = {"given": True}
        band = np.asarray(band, dtype=np.float64).ravel()
        if band.size < 1 or band[0] != 1.0 or not np.all(np.isfinite(band)):
            raise ValueError("a band starts with m(0) = 1 and holds finite coefficients")
        self.band = band[: self.n]
        if use_cache:  # write-once copy under the digest: streams restore exactly this one
            cache.store_once(cache.digest_key(self.name, self.n, self.digest), band=self.band)
        self.c = encoder_coefficients(self.band, self.n)
        self._b = decoder_coefficients(self.band, self.n)
        self._cum_c = np.cumsum(self.c * self.c)
        if not np.all(np.isfinite(self._cum_c)):
            raise ValueError("this band's inverse C = M⁻¹ overflows over the horizon")

    @property
    def bands(self) -> int:
        return int(self.band.size)

    def defining_arrays(self) -> dict[str, np.ndarray]:
        return {"band": self.band}

    def column_norms(self) -> np.ndarray:
        # column j of the Toeplitz C holds c(0..N−1−j)
        return np.sqrt(self._cum_c[::-1])

    @property
    def sensitivity(self) -> float:
        return float(np.sqrt(self._cum_c[-1]))

    def prefix_sensitivity(self, k: int) -> float:
        return float(np.sqrt(self._cum_c[self._check_prefix(k) - 1]))

    def _participation_sensitivity(self, participation: Participation,
                                   steps: int | None) -> Sensitivity:
        if self.n <= DENSE_LIMIT:  # the dense |X| computation (exact where it says so)
            return super()._participation_sensitivity(participation, steps)
        # beyond it: the Toeplitz closed form on c's majorant (a certified upper bound)
        return toeplitz_sensitivity(self.c, steps or self.n, participation)

    def row_errors(self) -> np.ndarray:
        return np.cumsum(self._b * self._b)

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        from scipy.linalg import toeplitz

        return np.tril(toeplitz(self._b)), np.tril(toeplitz(self.c))

    def noising_matrix(self) -> np.ndarray:
        from scipy.linalg import toeplitz

        column = np.zeros(self.n)
        column[: self.bands] = self.band
        return np.tril(toeplitz(column))

    def _make_stream_kernel(self) -> StreamKernel:
        return RegeneratingKernel(self.band)


# -- its stream kernel ----------------------------------------------------------------------
@dataclass
class RegenState:
    """``mark``: the oldest row the next step uses (``None`` before step 0) and, for a
    generator whose rows are not addressable by counter, the position where it began,
    saved as ``levels`` (the row, then the words).
    ``rows``: only when the draw cannot seek (a plain callable, e.g. a test feeding given
    rows): the last ``bands − 1`` rows, kept instead of regenerated."""

    mark: tuple[int, ...] | None = None
    rows: list[Array] = field(default_factory=list)


class RegeneratingKernel(StreamKernel):
    """``e[k] = Σ_{i<w} m(i)·ξ_{k−i}``, the ``w − 1`` older rows drawn again from the
    stream's generator (:class:`~flwr_corrnoise.streams.RowCursor`'s ``rows_back``, or
    ``tell``/``seek`` where rows have no counter)."""

    kind = "regenerated"

    def __init__(self, band: np.ndarray) -> None:
        self.band = [float(x) for x in band]

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> RegenState:
        if levels and rows:
            raise ValueError("a regenerated noise state holds a position or rows, not both")
        mark = tuple(int(x) for x in levels) if levels else None
        return RegenState(mark=mark, rows=list(rows))

    def next(self, state: RegenState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, RegenState]:
        w = len(self.band)
        first = max(0, step - w + 1)  # the oldest row e[step] uses
        keep = max(0, step - w + 2)   # the oldest row e[step + 1] will use
        acc = None
        back = getattr(draw, "rows_back", None)
        if back is not None and back(0):  # rows by counter: go back, keep no position
            if step > 0 and (state.mark is None or state.mark[0] != first):
                raise ValueError("regenerated noise state does not match its step")
            back(step - first)  # the stream drew one row a step: row j is `step − j` back
            for j in range(first, step):
                row = draw()
                row *= self.band[step - j]  # a fresh row: scaled in place
                acc = row if acc is None else _add(acc, row)
            fresh = draw()  # row `step`, where the generator stood before
            state = RegenState(mark=(keep,), rows=list(state.rows))
        elif hasattr(draw, "seek"):  # a cursor of saved positions: rows first..step−1
            here = draw.tell()  # type: ignore[attr-defined]
            mark = _position(0, here) if step == 0 else state.mark
            if mark is None or mark[0] != first:
                raise ValueError("regenerated noise state does not match its step")
            if step > first:
                draw.seek(np.array(mark[1:], dtype=np.int64).view(np.uint64))  # type: ignore[attr-defined]
            for j in range(first, step):
                if j == keep:
                    mark = _position(j, draw.tell())  # type: ignore[attr-defined]
                row = draw()
                row *= self.band[step - j]  # a fresh row: scaled in place
                acc = row if acc is None else _add(acc, row)
            if not np.array_equal(draw.tell(), here):  # type: ignore[attr-defined]
                raise ValueError("the regenerated noise state's position does not lead "
                                 "back to its generator: refusing to draw noise from a "
                                 "tampered state")
            fresh = draw()
            if keep == step + 1:  # w = 1: the next step starts after this row
                mark = _position(keep, draw.tell())  # type: ignore[attr-defined]
            elif keep == step:
                mark = _position(keep, here)
            state = RegenState(mark=mark, rows=list(state.rows))
        else:  # a plain callable (given rows): keep the last w − 1 rows instead
            kept = state.rows[len(state.rows) - (step - first):] if step > first else []
            for j, row in zip(range(first, step), kept, strict=True):
                term = row * self.band[step - j]
                acc = term if acc is None else _add(acc, term)
            fresh = draw()
            state = RegenState(mark=state.mark, rows=(
                [*state.rows, ops.copy(fresh)][-(w - 1):] if w > 1 else list(state.rows)))
        if acc is None:
            return fresh, state  # m(0) = 1
        return _add(acc, fresh), state

    def save(self, state: RegenState) -> Saved:
        return ([] if state.mark is None else list(state.mark)), list(state.rows)

    def check(self, state: RegenState, step: int, dim: int) -> None:
        if step == 0 and (state.mark is not None or state.rows):
            raise ValueError("regenerated noise state does not match its step (step 0 "
                             "holds no position)")
        if step > 0 and (state.mark is None or not state.mark
                         or state.mark[0] != max(0, step - len(self.band) + 1)):
            raise ValueError("regenerated noise state does not match its step (no "
                             "generator position, or one of another row)")
        if state.rows:
            raise ValueError("a stream's regenerated noise state holds no rows")

    def peak_rows(self, horizon: int) -> int:
        return 0  # a stream's draw seeks: no row is ever stored

    def stack_levels(self, levels: list[list[int]]) -> list[int]:
        """The oldest live row (the same at the same step) and every stream's generator
        position after it, in order: a group's cursor (:class:`~flwr_corrnoise.stream_group.
        StreamGroup`) tells and seeks the streams' positions side by side."""
        if not levels[0]:
            if any(levels):
                raise ValueError("streams at different steps cannot be stacked")
            return []
        if any(len(lv) != len(levels[0]) or lv[0] != levels[0][0] for lv in levels):
            raise ValueError("streams at different steps cannot be stacked")
        return [levels[0][0], *(w for lv in levels for w in lv[1:])]

    def split_levels(self, levels: list[int], count: int) -> list[list[int]]:
        if not levels:
            return [[] for _ in range(count)]
        words = levels[1:]
        if len(words) % count:
            raise ValueError("a stacked regenerated state's positions do not split evenly")
        size = len(words) // count
        return [[levels[0], *words[i * size:(i + 1) * size]] for i in range(count)]


def _add(acc: Array, row: Array) -> Array:
    acc += row
    return acc


def _position(row: int, words: np.ndarray) -> tuple[int, ...]:
    """Row ``row`` began at generator position ``words`` (uint64): the int64 ``levels``
    a state stores."""
    return (row, *(int(x) for x in np.asarray(words, dtype=np.uint64).view(np.int64)))


register(
    NAME,
    "banded C⁻¹ (`bands` diagonals) optimized per horizon; its older noise rows are "
    "regenerated from the keyed generator: O(1) stream state, `bands` draws per step",
    build=lambda n, bands: BandedInverse(n, bands=bands),
    params=[Param("bands", int, DEFAULT_BANDS,
                  "nonzero diagonals of C⁻¹: Gaussian draws per step (4: 1.1–1.5× BLT's "
                  "RMSE at N = 256–4000)", valid=lambda w: w >= 1, constraint="≥ 1")],
    restore=cache.band_restorer(
        NAME, lambda n, band: BandedInverse(n, band=band, use_cache=False)),
    build_imports=("scipy.optimize", "scipy.signal"),
)
