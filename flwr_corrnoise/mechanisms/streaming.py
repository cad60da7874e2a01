"""Streaming kernels: each mechanism's noise recurrence, once, for any array library.

A noise stream hands out the increments ``e = C⁻¹ξ`` one step at a time. What differs
between mechanisms is only the recurrence that turns the next standard-normal rows into
``e[k]`` and the little state it keeps; where the normals come from (the keyed Philox of
:mod:`~flwr_corrnoise.noise_keys`, a ChaCha20 keystream) and what array type holds the state do not
change the math. So, as in jax_privacy's ``StreamingMatrix(init, next)``, every
:class:`~flwr_corrnoise.mechanisms.base.Factorization` supplies a :class:`StreamKernel`:

* ``init(ops, dim, levels, rows)`` → a :class:`KernelState` (fresh, or rebuilt from a
  serialized one);
* ``next(state, step, draw, ops)`` → the unit-std increment ``e[step]`` as a fresh array,
  the state advanced in place (in place because at ``d`` ≈ 10⁶ a copy per step is the cost).

``ops`` (:class:`ArrayOps`) is the array namespace: allocation, constants, copies. The
kernels use only Python operators (``+=``, ``*=``, ``@``, slicing) beyond it, which NumPy
arrays and torch tensors share, so the NumPy stream (:class:`flwr_corrnoise.streams.
NoiseStream`) and the device-resident torch stream (:mod:`flwr_corrnoise.torch_streams`)
run the *same* code; a test feeds both the same normals and compares the increments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

#: an array of the stream's namespace (``np.ndarray`` or ``torch.Tensor``)
Array = Any
#: draws one fresh length-``d`` vector of i.i.d. N(0, 1) in the stream's namespace
Draw = Callable[[], Array]


class ArrayOps(Protocol):
    """What a kernel needs from an array library besides its operators."""

    #: columns per chunk of a buffer update (``None``: whole rows; chunking keeps NumPy's
    #: ``k×d`` BLT buffers in cache, and would only add kernel launches on a GPU)
    chunk: int | None

    def zeros(self, rows: int, dim: int) -> Array:
        """A ``rows×dim`` array of zeros in the stream's dtype and device."""

    def const(self, values: np.ndarray) -> Array:
        """Mechanism coefficients (float64 NumPy) as an array of the stream's dtype/device."""

    def copy(self, a: Array) -> Array:
        """A copy of ``a`` that owns its memory."""

    def subtract(self, a: Array, b: Array, out: Array) -> Array:
        """``out = a − b`` in one pass (``out`` may alias ``b``)."""

    def sub_matvec(self, e: Array, w: Array, r: Array) -> None:
        """``e −= w @ r`` in place (``w``: ``k`` weights, ``r``: ``k×m`` rows)."""

    def decay_add(self, r: Array, theta: Array, e: Array) -> None:
        """``r ← θ⊙r + e`` in place (``θ``: ``k×1``, ``e`` broadcast over the rows)."""


class NumpyOps:
    """:class:`ArrayOps` for float64 NumPy arrays (the host stream)."""

    chunk: int | None = 1 << 15  # 4 buffers × 32k floats = 1 MB: stays in cache

    def zeros(self, rows: int, dim: int) -> np.ndarray:
        return np.zeros((rows, dim))

    def const(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy()

    def subtract(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
        return np.subtract(a, b, out=out)

    def sub_matvec(self, e: np.ndarray, w: np.ndarray, r: np.ndarray) -> None:
        e -= w @ r

    def decay_add(self, r: np.ndarray, theta: np.ndarray, e: np.ndarray) -> None:
        r *= theta
        r += e


NUMPY_OPS = NumpyOps()


@dataclass
class KernelState:
    """A stream's memory of past rows besides its generator and step.

    ``levels``/``rows``: the tree's dyadic cover (levels, largest first, and their node
    estimates); ``buf``/``count``: the history of ``ξ`` rows (Toeplitz, dense) or the BLT
    buffers; ``consts``: the mechanism's coefficients already in the stream's namespace
    (derived, never serialized).
    """

    levels: list[int] = field(default_factory=list)
    rows: list[Array] = field(default_factory=list)
    buf: Array = None
    count: int = 0
    consts: dict[str, Array] = field(default_factory=dict)


class StreamKernel(ABC):
    """One mechanism's streaming recurrence for ``e = C⁻¹ξ`` (see the module docstring)."""

    #: the stream kind recorded in states and shown in docs
    kind: str = ""
    #: whether ``next`` modifies ``buf`` in place (then a checkpoint must copy it)
    mutates_buffer: bool = False

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> KernelState:
        """The state at step 0 (``rows`` empty) or rebuilt from serialized ``rows``."""
        return KernelState(levels=list(levels), rows=list(rows))

    @abstractmethod
    def next(self, state: KernelState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        """``e[step]`` at unit std, a fresh array the caller may modify; advances ``state``."""

    def saved_rows(self, state: KernelState) -> list[Array]:
        """The rows to serialize (whatever ``init`` needs to rebuild the state)."""
        return list(state.rows)

    def check(self, state: KernelState, step: int, dim: int) -> None:
        """Reject a state that does not match its step (corruption, tampering)."""
        if state.rows:
            raise ValueError(f"{self.kind} noise state must not hold buffers")

    def state_floats(self, state: KernelState) -> int:
        """Rows of ``d`` floats the state holds (its memory, in units of ``d``)."""
        return len(state.rows) + state.count


class IndependentKernel(StreamKernel):
    """``e[k] = ξ_k``: no memory at all."""

    kind = "independent"

    def next(self, state: KernelState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        return draw()


class HistoryKernel(StreamKernel):
    """``e[k] = Σ_{j≤k} M[k, j]·ξ_j`` for a dense lower-triangular noising matrix ``M``:
    every past row is kept (``k·d`` floats).

    Give either ``toeplitz_g`` (``M`` Toeplitz with first column ``g``: row ``k`` is then
    the contiguous slice ``g(k), …, g(0)`` of one reversed array, no ``N×N`` matrix) or
    ``matrix`` (a function returning the dense ``M``, called once per stream)."""

    def __init__(self, kind: str, horizon: int, toeplitz_g: np.ndarray | None = None,
                 matrix: Callable[[], np.ndarray] | None = None) -> None:
        if (toeplitz_g is None) == (matrix is None):
            raise ValueError("give either the Toeplitz coefficients or the matrix")
        self.kind = kind
        self.horizon = horizon
        self._g_reversed = (None if toeplitz_g is None
                            else np.ascontiguousarray(np.asarray(toeplitz_g)[::-1]))
        self._matrix = matrix

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> KernelState:
        state = KernelState(count=len(rows))
        state.buf = ops.zeros(len(rows), dim)
        for i, r in enumerate(rows):
            state.buf[i] = r
        if self._g_reversed is not None:
            state.consts["g_reversed"] = ops.const(self._g_reversed)
        else:
            state.consts["matrix"] = ops.const(self._matrix())  # type: ignore[misc]
        return state

    def next(self, state: KernelState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        if state.count == state.buf.shape[0]:
            # doubling, but never past the horizon: at d ≈ 3·10⁵ (a CNN) the rows are
            # the learner's whole memory, and a buffer of 2N rows would double it
            grown = ops.zeros(min(self.horizon, max(16, 2 * state.count)), state.buf.shape[1])
            grown[: state.count] = state.buf[: state.count]
            state.buf = grown
        state.buf[state.count] = draw()
        state.count += 1
        if "g_reversed" in state.consts:
            # g(k), g(k−1), …, g(0) as a contiguous slice (a reversed view is 2× slower)
            coef = state.consts["g_reversed"][self.horizon - 1 - step :]
        else:
            coef = state.consts["matrix"][step, : step + 1]
        return coef @ state.buf[: state.count]

    def saved_rows(self, state: KernelState) -> list[Array]:
        return [state.buf[i] for i in range(state.count)]

    def check(self, state: KernelState, step: int, dim: int) -> None:
        if state.count != step:
            raise ValueError("noise state history does not match its step")


class TreeKernel(StreamKernel):
    """The binary tree's dyadic cover (vanilla or Honaker's efficient estimator).

    Leaf ``step`` completes, then every ancestor whose interval ends there. The efficient
    tree draws each one's own noise in that order (the node order of
    ``BinaryTree.matrices()``); the vanilla tree draws only the largest, the one node that
    enters the dyadic cover (``BinaryTree.drawn_nodes`` says why). State: at most
    ``⌊log₂N⌋ + 1`` node estimates.
    """

    kind = "tree"

    def __init__(self, efficient: bool, alpha: np.ndarray) -> None:
        self.efficient = efficient
        self.alpha = [float(a) for a in alpha]

    def next(self, state: KernelState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        est = draw() if self.efficient else None
        level = 0
        removed: Array = None
        while state.levels and state.levels[-1] == level:
            state.levels.pop()
            left = state.rows.pop()
            if removed is None:
                removed = ops.copy(left)
            else:
                removed += left
            if self.efficient:
                own = draw()
                alpha = self.alpha[level + 1]
                est += left
                est *= 1.0 - alpha
                own *= alpha
                est += own
            level += 1
        if est is None:
            est = draw()
        state.levels.append(level)
        state.rows.append(est)
        # a fresh array: the caller scales it in place, and `est` is kept as state
        return ops.copy(est) if removed is None else ops.subtract(est, removed, out=removed)

    def check(self, state: KernelState, step: int, dim: int) -> None:
        expected = [h for h in range(step.bit_length() - 1, -1, -1) if step >> h & 1]
        if state.levels != expected or len(state.rows) != len(expected):
            raise ValueError("tree noise state does not match its step")


class BLTKernel(StreamKernel):
    """``C·e = ξ`` for a BLT encoder as a recursion in ``buffers·d`` floats::

        e = ξ − Σ_i ω_i·r_i,    r_i ← θ_i·r_i + e
    """

    kind = "blt"
    mutates_buffer = True

    def __init__(self, theta: np.ndarray, omega: np.ndarray) -> None:
        self.theta = np.asarray(theta, dtype=np.float64)
        self.omega = np.asarray(omega, dtype=np.float64)

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> KernelState:
        state = KernelState()
        state.buf = ops.zeros(len(rows) if rows else self.theta.size, dim)
        for i, r in enumerate(rows):
            state.buf[i] = r
        state.count = state.buf.shape[0]
        state.consts = {"theta": ops.const(self.theta[:, None]), "omega": ops.const(self.omega)}
        return state

    def next(self, state: KernelState, step: int, draw: Draw, ops: ArrayOps) -> Array:
        r = state.buf
        e = draw()
        theta, omega = state.consts["theta"], state.consts["omega"]
        dim = r.shape[1]
        chunk = ops.chunk or dim
        # in cache-sized column chunks, so the k×d buffers cross memory once per step
        for lo in range(0, dim, chunk):
            sl = slice(lo, lo + chunk)
            part = r[:, sl]
            ops.sub_matvec(e[sl], omega, part)
            ops.decay_add(part, theta, e[sl])
        return e

    def saved_rows(self, state: KernelState) -> list[Array]:
        return [state.buf[i] for i in range(state.count)]

    def check(self, state: KernelState, step: int, dim: int) -> None:
        if tuple(state.buf.shape) != (self.theta.size, dim):
            raise ValueError("BLT noise state does not have one buffer per BLT buffer")
        finite = state.buf.isfinite().all() if hasattr(state.buf, "isfinite") else (
            np.all(np.isfinite(state.buf)))
        if not bool(finite):
            raise ValueError("BLT noise state holds non-finite values")
