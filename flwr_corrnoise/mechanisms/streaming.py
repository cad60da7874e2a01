"""Streaming kernels: each mechanism's noise recurrence, once, for any array library.

A noise stream hands out the increments ``e = C⁻¹ξ`` one step at a time. What differs
between mechanisms is only the recurrence that turns the next standard-normal rows into
``e[k]`` and the little state it keeps; where the normals come from (the keyed Philox of
:mod:`~flwr_corrnoise.noise_keys`, a ChaCha20 keystream) and what array type holds the state do not
change the math. So, as in jax_privacy's ``StreamingMatrix(init, next)``, every
:class:`~flwr_corrnoise.mechanisms.base.Factorization` supplies a :class:`StreamKernel`:

* ``init(ops, dim, levels, rows)`` → the kernel's own state (fresh, or rebuilt from the
  serialized ``levels``/``rows`` that ``save`` wrote);
* ``next(state, step, draw, ops)`` → ``(e[step], state')``: the unit-std increment as a
  fresh array and the next state. **Pure**: ``state`` is never changed, so a caller that
  keeps it can step it again — undoing a failed round is not writing its states back,
  with no checkpoint or rollback in any kernel. Cheap all the same: ``state'`` shares
  what ``state`` will never read again (the rows a dense history appends past its count,
  the node estimates the tree replaces, never edits), and what a step rewrites (BLT's
  buffers, the banded ring) goes to a new array, the same floats as in place;
* ``save``, ``check``, ``peak_rows``: what the state is to a stream — what to serialize
  (its rows are the state's memory), how to reject a tampered state, the most rows it
  holds over a horizon;
* ``stack``/``unstack``: ``L`` streams' states side by side as one state of dimension
  ``L·d`` (:class:`flwr_corrnoise.stream_group.StreamGroup`). Why that is exact: every
  recurrence is linear column by column, with coefficients that depend on the step only,
  so ``next`` on the stacked state (its draw the ``L`` streams' rows side by side) is
  ``next`` on each stream's state — one recurrence for all ``L``, not a second copy of it.

A stream never reads the state's fields, so each kernel keeps the state its recurrence
needs (:class:`HistoryState` here; the tree's, BLT's and independent noise's live with
their mechanisms in ``tree.py``, ``blt.py``, ``independent.py``).

``ops`` (:class:`ArrayOps`) is the array namespace: allocation, constants, copies. The
kernels use only Python operators (``+=``, ``*=``, ``@``, slicing) beyond it, which NumPy
arrays and torch tensors share, so the NumPy stream (:class:`flwr_corrnoise.streams.
NoiseStream`) and the device-resident torch stream (:mod:`flwr_corrnoise.torch.streams`)
run the *same* code; a test feeds both the same normals and compares the increments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

#: an array of the stream's namespace (``np.ndarray`` or ``torch.Tensor``)
Array = Any
#: draws one fresh length-``d`` vector of i.i.d. N(0, 1) in the stream's namespace
Draw = Callable[[], Array]


class ArrayOps(Protocol):
    """What a kernel needs from an array library besides its operators."""

    def zeros(self, rows: int, dim: int) -> Array:
        """A ``rows×dim`` array of zeros in the stream's dtype and device."""

    def empty(self, rows: int, dim: int) -> Array:
        """A ``rows×dim`` array in the stream's dtype and device, to be overwritten whole
        (no pass to zero it first)."""

    def const(self, values: np.ndarray) -> Array:
        """Mechanism coefficients (float64 NumPy) as an array of the stream's dtype/device."""

    def copy(self, a: Array) -> Array:
        """A copy of ``a`` that owns its memory."""

    def subtract(self, a: Array, b: Array, out: Array) -> Array:
        """``out = a − b`` in one pass (``out`` may alias ``b``)."""

    def sub_matvec(self, e: Array, w: Array, r: Array) -> None:
        """``e −= w @ r`` in place (``w``: ``k`` weights, ``r``: ``k×m`` rows)."""

    def blt_step(self, r: Array, theta: Array, omega: Array, e: Array, out: Array) -> None:
        """One step of BLT's recurrence over its ``k×d`` buffers ``r``: ``e −= ω @ r`` in
        place, then ``out ← θ⊙r + e`` (``θ``: ``k×1``; ``out`` a fresh ``k×d`` array, never
        ``r``). One operation, not two, so that an implementation can fuse it into one
        pass over the buffers (:class:`NumpyOps`: the compiled kernel)."""


class NumpyOps:
    """:class:`ArrayOps` for NumPy arrays of one float dtype (the host stream): float64,
    or float32 for a float32 model (:data:`NUMPY_OPS32`; half the state, half the memory
    traffic of the recurrence)."""

    #: columns per chunk of the NumPy path's :meth:`blt_step` (4 buffers × 32k floats
    #: ≤ 1 MB: each chunk's passes stay in cache)
    chunk = 1 << 15

    def __init__(self, dtype: type[np.floating] = np.float64) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"a NumPy noise stream is float32 or float64, not {self.dtype}")

    def zeros(self, rows: int, dim: int) -> np.ndarray:
        return np.zeros((rows, dim), dtype=self.dtype)

    def empty(self, rows: int, dim: int) -> np.ndarray:
        return np.empty((rows, dim), dtype=self.dtype)

    def const(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=self.dtype)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def subtract(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        return np.subtract(a, b, out=out)

    def sub_matvec(self, e: np.ndarray, w: np.ndarray, r: np.ndarray) -> None:
        e -= w @ r

    def blt_step(self, r: np.ndarray, theta: np.ndarray, omega: np.ndarray, e: np.ndarray,
                 out: np.ndarray) -> None:
        """The recurrence in one fixed order of IEEE operations, each rounded to the
        stream's dtype: ``s = ω₀r₀``, ``s = s + ωᵢrᵢ`` for ``i = 1 … k−1``, ``e = e − s``,
        ``outᵢ = θᵢrᵢ + e``. The compiled kernel (``cn_blt_steps32``/``64`` in
        ``noise_kernel.c``, one step) runs exactly these operations in one pass over the
        buffers (at d = 10⁵ the NumPy passes, even in cache-sized chunks, were ≈ 14 % of a
        float32 learner message); without it, or for a layout it does not take, NumPy runs them in
        cache-sized column chunks. Either way the same floats on every machine — a BLAS
        ``ω @ r`` would sum in an order of its own (and with FMA where it likes)."""
        k, dim = r.shape
        if self._compiled_steps(r, theta, omega, e[None, :], out, k, dim):  # a view
            return
        for lo in range(0, dim, self.chunk):
            sl = slice(lo, lo + self.chunk)
            part, el = r[:, sl], e[sl]
            if k:
                s = np.multiply(part[0], omega[0])
                for i in range(1, k):
                    s += part[i] * omega[i]
                el -= s
            np.multiply(part, theta, out=out[:, sl])
            out[:, sl] += el

    def blt_steps(self, r: np.ndarray, theta: np.ndarray, omega: np.ndarray,
                  rows: np.ndarray, out: np.ndarray) -> None:
        """``len(rows)`` :meth:`blt_step` s at once: ``rows`` (steps × d) holds the draws
        and receives the increments, ``out`` the buffers after the last step. Compiled
        (``cn_blt_steps32``/``64``): one pass over the buffers, the steps done block by
        block while the block is in cache; the same floats as step by step, which is the
        NumPy path. Either compiled function runs when the kernel is built and the layout
        is its own (unit column strides, ``out`` apart from ``r`` and ``rows``)."""
        k, dim = r.shape
        if self._compiled_steps(r, theta, omega, rows, out, k, dim):
            return
        current = r
        for i in range(rows.shape[0]):
            nxt = out if i == rows.shape[0] - 1 else np.empty_like(out)
            self.blt_step(current, theta, omega, rows[i], nxt)
            current = nxt
        if rows.shape[0] == 0:
            out[...] = r

    def _compiled_steps(self, r: np.ndarray, theta: np.ndarray, omega: np.ndarray,
                        rows: np.ndarray, out: np.ndarray, k: int, dim: int) -> bool:
        """The compiled steps (``cn_blt_steps32``/``64``) when the kernel is built and the
        layout is its own (unit column strides, ``out`` apart from ``r`` and ``rows``);
        ``False``: the NumPy path runs."""
        from .. import compiled_kernel  # the noise kernel's library (no Flower, no torch)

        dll = compiled_kernel.kernel()
        item = self.dtype.itemsize
        if (dll is None or not dim or not k or not rows.shape[0]
                or any(a.dtype != self.dtype for a in (r, out, rows))
                or any(a.strides[1] != item for a in (r, out, rows))
                or np.may_share_memory(r, out) or np.may_share_memory(rows, r)
                or np.may_share_memory(rows, out)):
            return False
        th = np.ascontiguousarray(theta, dtype=self.dtype).ravel()
        om = np.ascontiguousarray(omega, dtype=self.dtype)
        steps = dll.cn_blt_steps32 if item == 4 else dll.cn_blt_steps64
        addr = compiled_kernel.addr
        steps(addr(r), r.strides[0] // item, addr(out), out.strides[0] // item, addr(rows),
              rows.strides[0] // item, addr(th), addr(om), k, dim, rows.shape[0])
        return True


NUMPY_OPS = NumpyOps()
NUMPY_OPS32 = NumpyOps(np.float32)


def numpy_ops(dtype: Any) -> NumpyOps:
    """The shared :class:`NumpyOps` of ``dtype`` (float64 or float32): one object per
    dtype, so that streams of one dtype can share a group (``stream_group.group_key``)."""
    dtype = np.dtype(dtype)
    if dtype == NUMPY_OPS32.dtype:
        return NUMPY_OPS32
    if dtype == NUMPY_OPS.dtype:
        return NUMPY_OPS
    raise ValueError(f"a NumPy noise stream is float32 or float64, not {dtype}")


#: what a kernel serializes: ``(levels, rows)``, the ``levels`` and ``rows`` entries of
#: :meth:`flwr_corrnoise.streams.NoiseStream.state_dict` (integers and ``d``-vectors)
Saved = tuple[list[int], list[Array]]


def shared_base(states: list[Any]) -> Any | None:
    """The stacked state whose columns ``states`` are, all of them and in order, or
    ``None``. A kernel whose :meth:`StreamKernel.unstack` hands out column views marks each
    state ``shared = (stacked, slot, count)``, and the state a step of it alone returns has
    no mark; so stacking the same streams again (the vectorized engine's next
    round) can take the stacked state back as it is, with no copy."""
    mark = getattr(states[0], "shared", None)
    if mark is None:
        return None
    base = mark[0]
    for i, state in enumerate(states):
        mark = getattr(state, "shared", None)
        if mark is None or mark[0] is not base or mark[1:] != (i, len(states)):
            return None
    return base


class StreamKernel(ABC):
    """One mechanism's streaming recurrence for ``e = C⁻¹ξ`` and the state it keeps: the
    stream contract, ``init`` and ``next`` over states passed in and out, as jax_privacy's
    ``StreamingMatrix(init_multiply, multiply_next)`` (Google DeepMind's JAX Privacy,
    ``matrix_factorization/streaming_matrix.py``), plus ``save``/``check``/``peak_rows``.

    The state is the kernel's own object: :class:`~flwr_corrnoise.streams.NoiseStream`
    holds it and passes it back, and learns everything else through the methods below.
    A new mechanism's stream is one kernel (a subclass here, in the mechanism's module)
    and a test that its increments are ``C⁻¹ξ`` (``tests/mechanisms/test_mechanism_registry.py``
    runs every registered kernel through the same checks).
    """

    #: the stream kind recorded in states and shown in docs
    kind: str = ""
    #: whether :meth:`init` may take ``rows`` as one ``rows×dim`` array and keep it as its
    #: state (no copy; the caller hands the array over: a state file read into a fresh
    #: buffer). Kernels that do not say so get a list of rows and copy them.
    adopts_rows: bool = False

    def rows_view(self, state: Any) -> Array | None:
        """The rows :meth:`save` would return, as one ``rows×dim`` array that *is* the
        state (no copy), where the kernel keeps them so; ``None`` otherwise. Why: a state
        written to a file straight away (:mod:`~flwr_corrnoise.state_offload`) need not
        be copied first; anything that keeps the rows must copy them (``next`` updates
        them in place)."""
        return None

    @abstractmethod
    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> Any:
        """The state at step 0 (``levels`` and ``rows`` empty) or rebuilt from what
        :meth:`save` wrote."""

    @abstractmethod
    def next(self, state: Any, step: int, draw: Draw, ops: ArrayOps) -> tuple[Array, Any]:
        """``(e[step], state')``: the increment at unit std, a fresh array the caller may
        modify, and the state after it. ``state`` itself is never changed (see the module
        docstring: a kept state can be stepped again, which is how a failed round is
        undone)."""

    #: whether :meth:`steps` is implemented (a kernel whose steps draw one row each and
    #: can share one pass over its state)
    has_steps: bool = False

    def steps(self, state: Any, step: int, rows: Array, ops: ArrayOps) -> tuple[Array, Any]:
        """``len(rows)`` steps at once: ``rows`` holds their draws (one row a step, in
        order) and receives their increments in place; returns ``(rows, state')`` — the
        same floats and state as :meth:`next` step after step. Only where
        :attr:`has_steps` (BLT: a learner's round reads and writes its buffers once
        instead of once a step); other kernels draw through their cursor step by step."""
        raise NotImplementedError(f"{type(self).__name__} steps one step at a time")

    @abstractmethod
    def save(self, state: Any) -> Saved:
        """``(levels, rows)``: whatever :meth:`init` needs to rebuild the state (its
        ``rows`` are the state's memory, ``len(rows)`` rows of ``d`` floats)."""

    @abstractmethod
    def check(self, state: Any, step: int, dim: int) -> None:
        """Reject (``ValueError``) a restored state that does not match its step."""

    def peak_rows(self, horizon: int) -> int:
        """The most rows of ``d`` floats the state holds over ``horizon`` steps.

        Why: the benchmarks quote a learner's memory at horizons too long to stream
        through. This default measures it (a ``d = 1`` run on zeros); kernels with a
        closed form override it, and a test holds every kernel's answer to the measured
        one.
        """
        state = self.init(NUMPY_OPS, 1, [], [])
        peak = 0
        for step in range(horizon):
            _, state = self.next(state, step, lambda: np.zeros(1), NUMPY_OPS)
            peak = max(peak, len(self.save(state)[1]))
        return peak

    # -- groups: L streams at the same step as one state of dimension L·d ------------------
    def stack(self, ops: ArrayOps, states: list[Any], dim: int) -> Any:
        """One state of dimension ``len(states)·dim`` whose columns ``i·dim … (i+1)·dim − 1``
        are ``states[i]`` (all at the same step). ``next`` on it, with a draw that returns
        the streams' rows side by side, advances every stream at once; :meth:`unstack`
        gives the streams their states back. This default goes through :meth:`save` and
        :meth:`init` (a copy of the saved rows); a kernel whose state is large may share
        memory instead (:class:`HistoryKernel`)."""
        saved = [self.save(state) for state in states]
        levels = self.stack_levels([list(lv) for lv, _ in saved])
        counts = {len(rows) for _, rows in saved}
        if len(counts) != 1:
            raise ValueError("streams whose states hold different numbers of rows cannot "
                             "be stacked (they are not at the same step)")
        rows = []
        for j in range(counts.pop()):
            row = ops.zeros(1, len(states) * dim)[0]
            for i, (_, kept) in enumerate(saved):
                row[i * dim:(i + 1) * dim] = kept[j]
            rows.append(row)
        return self.init(ops, len(states) * dim, levels, rows)

    def unstack(self, ops: ArrayOps, state: Any, count: int, dim: int) -> list[Any]:
        """The ``count`` streams' states of a :meth:`stack` ed ``state``, after any number of
        ``next`` on it (the inverse of :meth:`stack`)."""
        levels, rows = self.save(state)
        per = self.split_levels(list(levels), count)
        return [self.init(ops, dim, per[i], [r[i * dim:(i + 1) * dim] for r in rows])
                for i in range(count)]

    def stack_levels(self, levels: list[list[int]]) -> list[int]:
        """The saved ``levels`` of the stacked state. By default they describe the step
        only (the tree's cover), so the streams' must agree."""
        if any(lv != levels[0] for lv in levels):
            raise ValueError("streams whose states differ in their levels cannot be stacked")
        return list(levels[0])

    def split_levels(self, levels: list[int], count: int) -> list[list[int]]:
        """Each stream's ``levels`` from the stacked state's (inverse of :meth:`stack_levels`)."""
        return [list(levels) for _ in range(count)]


#: the most increments a stacked dense state sums ahead (:class:`HistoryKernel`) ...
AHEAD_ROWS = 1024
#: ... and the most floats they may take (16 MB): a wider state sums fewer
AHEAD_FLOATS = 1 << 21


@dataclass
class HistoryState:
    """Every ``ξ`` row drawn so far: ``buf[:count]`` (``buf`` grows by doubling); ``consts``:
    the noising coefficients already in the stream's namespace (derived, never saved).

    ``acc``: the part of the increments of the window ``acc_start … acc_start + acc_rows −
    1`` that a stacked state has already summed (everything up to time ``acc_upto``, see
    :class:`HistoryKernel`); derived from rows that are never rewritten, never saved, and
    ``acc_start = −1`` until the next step starts a window. ``shared``: the stacked state
    (:meth:`HistoryKernel.stack`) whose columns ``buf`` and ``acc`` are, and the slot, so
    that stacking the same streams again copies nothing (a step's new state has none).

    ``line``/``gen``: the states stepped from one another share ``buf`` (each appends a
    row past its ``count``, which no older state reads) and ``acc``; ``line[0]`` is the
    ``gen`` of the newest. Stepping an older state again (a failed round's start, kept
    and stepped once more) first copies its rows to a buffer of its own and starts a new
    window, so the newer states stay as they were: :meth:`HistoryKernel.next` never
    changes a state it is given."""

    buf: Array
    count: int
    consts: dict[str, Array] = field(default_factory=dict)
    acc: Array | None = None
    acc_start: int = -1
    acc_rows: int = 0
    acc_upto: int = -1
    #: the largest window: 1 for a stream (every step one product, so that a restored
    #: stream continues bit for bit), :meth:`HistoryKernel.max_window` for a stacked state
    window: int = 1
    shared: tuple[HistoryState, int, int] | None = None
    line: list[int] = field(default_factory=lambda: [0])
    gen: int = 0


class HistoryKernel(StreamKernel):
    """``e[k] = Σ_{j≤k} M[k, j]·ξ_j`` for a dense lower-triangular noising matrix ``M``:
    every past row is kept (``k·d`` floats).

    The shared base of the dense mechanisms (``toeplitz``, ``optimized``) and the default
    kernel of any square factorization. Give either ``toeplitz_g`` (``M`` Toeplitz with
    first column ``g``: a block of ``M`` is then a window of one reversed array, no ``N×N``
    matrix) or ``matrix`` (a function returning the dense ``M``, called once per stream).

    **A stream** takes one product ``M[k, :k+1] @ ξ[:k+1]`` per step: it reads its whole
    history every step, and its increments are a function of the step alone, so a
    restored stream continues bit for bit. **A stacked state** (``L`` learners' streams,
    :meth:`stack`) would read ``L`` histories per step (``N²·L·d/2`` floats over the
    horizon: most of a dense sweep's time), so its steps go in windows ``[t, t + a)``: at
    ``t`` one product ``M[t:t+a, :t] @ ξ[:t]`` sums every older row's part of the window's
    ``a`` increments (into ``acc``), and the pairs inside the window are the dyadic tiles
    of its triangle — at offset ``o`` (``2^b`` the largest power of two dividing ``o``)
    the rows ``[t+o−2^b, t+o)`` go into the next ``2^b`` increments — so every pair
    ``j < k`` is summed exactly once, each row as soon as it is drawn (nothing is drawn
    ahead), and ``e[k] = acc[k − t] + M[k, k]·ξ_k``. ``a`` doubles from 1 while the state
    runs on, up to :meth:`max_window`, and starts again at 1 when an older state is stepped
    again (:class:`HistoryState`); the history
    is then read a few times in large products instead of once per step. The same sums
    in another order: the increments equal a stream's to rounding (≤ 1e-15 relative;
    ``tests/noise/test_stream_group.py``)."""

    def __init__(self, kind: str, horizon: int, toeplitz_g: np.ndarray | None = None,
                 matrix: Callable[[], np.ndarray] | None = None) -> None:
        if (toeplitz_g is None) == (matrix is None):
            raise ValueError("give either the Toeplitz coefficients or the matrix")
        self.kind = kind
        self.horizon = horizon
        self._g_reversed = (None if toeplitz_g is None
                            else np.ascontiguousarray(np.asarray(toeplitz_g)[::-1]))
        self._matrix = matrix
        #: ``M[k, k]`` on the host (a device stream reads no scalar back per step)
        self._diagonal: np.ndarray | None = None

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> HistoryState:
        state = HistoryState(buf=ops.zeros(len(rows), dim), count=len(rows))
        for i, r in enumerate(rows):
            state.buf[i] = r
        if self._g_reversed is not None:
            state.consts["g_reversed"] = ops.const(self._g_reversed)
        else:
            matrix = np.asarray(self._matrix(), dtype=np.float64)  # type: ignore[misc]
            self._diagonal = np.diagonal(matrix).copy()
            state.consts["matrix"] = ops.const(matrix)
        return state

    def max_window(self, dim: int) -> int:
        """The largest window ``a`` for rows of ``dim`` floats (a power of two)."""
        rows = max(1, min(AHEAD_ROWS, AHEAD_FLOATS // max(1, dim)))
        return 1 << (rows.bit_length() - 1)

    def _block(self, state: HistoryState, k0: int, k1: int, j0: int, j1: int,
               ops: ArrayOps) -> Array:
        """``M[k0:k1, j0:j1]`` in the stream's namespace (``j1 ≤ k0 + 1``)."""
        if "matrix" in state.consts:
            return state.consts["matrix"][k0:k1, j0:j1]
        n = self.horizon
        if k1 == k0 + 1:  # one row: g(k0 − j0) … g(k0 − j1 + 1), a contiguous slice
            return state.consts["g_reversed"][None, n - 1 - k0 + j0: n - 1 - k0 + j1]
        # M[k, j] = g(k − j) = g_rev[N − 1 − k + j]: row k is a window of g_rev, and the
        # rows of consecutive k are windows one to the left
        windows = np.lib.stride_tricks.sliding_window_view(self._g_reversed, j1 - j0)
        return ops.const(np.ascontiguousarray(windows[n - k1 + j0: n - k0 + j0][::-1]))

    def _diag(self, k: int) -> float:
        if self._diagonal is not None:
            return float(self._diagonal[k])
        return float(self._g_reversed[self.horizon - 1])  # type: ignore[index]

    def next(self, state: HistoryState, step: int, draw: Draw,
             ops: ArrayOps) -> tuple[Array, HistoryState]:
        if state.line[0] == state.gen:  # the newest of its line: append to the shared rows
            state = replace(state, shared=None, gen=state.gen + 1)
        else:  # an older state stepped again: its own copy of the rows, a new window
            buf = ops.zeros(state.buf.shape[0], state.buf.shape[1])
            buf[: state.count] = state.buf[: state.count]
            state = replace(state, buf=buf, shared=None, acc=None, acc_start=-1,
                            line=[0], gen=1)
        state.line[0] = state.gen
        e = self._step(state, step, draw, ops)
        return e, state

    def _step(self, state: HistoryState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        """One step on ``state``, a new object of its own (its rows past ``count`` and its
        window's sums are the line's, see :class:`HistoryState`)."""
        dim = state.buf.shape[1]
        if state.count == state.buf.shape[0]:
            # doubling, but never past the horizon: at d ≈ 3·10⁵ (a CNN) the rows are
            # the learner's whole memory, and a buffer of 2N rows would double it
            grown = ops.zeros(min(self.horizon, max(16, 2 * state.count)), dim)
            grown[: state.count] = state.buf[: state.count]
            state.buf = grown
        k, t = step, state.acc_start
        if t >= 0 and t < k < t + state.acc_rows and state.acc_upto == k - 1:
            # inside the window: the rows [k − w, k) go into the next w increments
            w = (k - t) & -(k - t)
            end = min(k + w, t + state.acc.shape[0])  # type: ignore[union-attr]
            state.acc[k - t: end - t] += (  # type: ignore[index]
                self._block(state, k, end, k - w, k, ops) @ state.buf[k - w: k])
        else:
            grow = t >= 0 and k == t + state.acc_rows and state.acc_upto == k - 1
            rows = min(2 * state.acc_rows, state.window) if grow else 1
            state.acc_start, state.acc_rows, state.acc_upto = k, rows, k
            if rows == 1:  # a window of one step: the plain dense step, one product
                state.acc = None
                state.buf[state.count] = draw()
                state.count += 1
                return self._block(state, k, k + 1, 0, k + 1, ops)[0] @ state.buf[: k + 1]
            # a new window at k: every older row's part of its increments in one product
            span = min(rows, self.horizon - k)
            state.acc = self._block(state, k, k + span, 0, k, ops) @ state.buf[:k]
        state.acc_upto = k
        state.buf[state.count] = draw()
        state.count += 1
        e = state.buf[k] * self._diag(k)
        e += state.acc[k - state.acc_start]  # type: ignore[index]
        return e

    def stack(self, ops: ArrayOps, states: list[HistoryState], dim: int) -> HistoryState:
        """Side by side without a copy when ``states`` are the columns of one stacked
        state already (the same learners stacked again next round: its window goes on);
        else one copy of the rows, and windows start again at one step."""
        base = shared_base(states)
        if base is not None:
            return base
        count = states[0].count
        if any(s.count != count for s in states):
            raise ValueError("streams at different steps cannot be stacked")
        width = len(states) * dim
        out = HistoryState(buf=ops.zeros(count, width), count=count, consts=states[0].consts,
                           window=self.max_window(width), line=[0])
        for i, s in enumerate(states):
            out.buf[:, i * dim:(i + 1) * dim] = s.buf[:count]
        return out

    def unstack(self, ops: ArrayOps, state: HistoryState, count: int,
                dim: int) -> list[HistoryState]:
        """Column views of the stacked state (no copy), marked as its columns; each is a
        stream's state again (a window of one step: the plain dense step)."""
        out = []
        for i in range(count):
            cols = slice(i * dim, (i + 1) * dim)
            out.append(HistoryState(buf=state.buf[:, cols], count=state.count,
                                    consts=state.consts, shared=(state, i, count)))
        return out

    def save(self, state: HistoryState) -> Saved:
        return [], [state.buf[i] for i in range(state.count)]

    def check(self, state: HistoryState, step: int, dim: int) -> None:
        if state.count != step:
            raise ValueError("noise state history does not match its step")

    def peak_rows(self, horizon: int) -> int:
        return horizon
