"""Streaming kernels: each mechanism's noise recurrence, once, for any array library.

A noise stream hands out the increments ``e = C⁻¹ξ`` one step at a time. What differs
between mechanisms is only the recurrence that turns the next standard-normal rows into
``e[k]`` and the little state it keeps; where the normals come from (the keyed Philox of
:mod:`~flwr_corrnoise.noise_keys`, a ChaCha20 keystream) and what array type holds the state do not
change the math. So, as in jax_privacy's ``StreamingMatrix(init, next)``, every
:class:`~flwr_corrnoise.mechanisms.base.Factorization` supplies a :class:`StreamKernel`:

* ``init(ops, dim, levels, rows)`` → the kernel's own state (fresh, or rebuilt from the
  serialized ``levels``/``rows`` that ``save`` wrote);
* ``next(state, step, draw, ops)`` → the unit-std increment ``e[step]`` as a fresh array,
  the state advanced in place (in place because at ``d`` ≈ 10⁶ a copy per step is the cost);
* ``save``, ``checkpoint``/``rollback``, ``check``, ``state_floats``: what the state is
  to a stream — what to serialize, how to undo a failed round, how to reject a tampered
  state, what it costs. A stream never reads the state's fields, so each kernel keeps the
  state its recurrence needs (:class:`HistoryState` here; the tree's, BLT's and
  independent noise's live with their mechanisms in ``tree.py``, ``blt.py``,
  ``independent.py``).

``ops`` (:class:`ArrayOps`) is the array namespace: allocation, constants, copies. The
kernels use only Python operators (``+=``, ``*=``, ``@``, slicing) beyond it, which NumPy
arrays and torch tensors share, so the NumPy stream (:class:`flwr_corrnoise.streams.
NoiseStream`) and the device-resident torch stream (:mod:`flwr_corrnoise.torch.streams`)
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


#: what a kernel serializes: ``(levels, rows)``, the ``levels`` and ``rows`` entries of
#: :meth:`flwr_corrnoise.streams.NoiseStream.state_dict` (integers and ``d``-vectors)
Saved = tuple[list[int], list[Array]]


class StreamKernel(ABC):
    """One mechanism's streaming recurrence for ``e = C⁻¹ξ`` and the state it keeps.

    The state is the kernel's own object: :class:`~flwr_corrnoise.streams.NoiseStream`
    holds it and passes it back, and learns everything else through the methods below.
    """

    #: the stream kind recorded in states and shown in docs
    kind: str = ""

    @abstractmethod
    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> Any:
        """The state at step 0 (``levels`` and ``rows`` empty) or rebuilt from what
        :meth:`save` wrote."""

    @abstractmethod
    def next(self, state: Any, step: int, draw: Draw, ops: ArrayOps) -> Array:
        """``e[step]`` at unit std, a fresh array the caller may modify; advances ``state``."""

    @abstractmethod
    def save(self, state: Any) -> Saved:
        """``(levels, rows)``: whatever :meth:`init` needs to rebuild the state."""

    @abstractmethod
    def checkpoint(self, state: Any, ops: ArrayOps) -> object:
        """A token :meth:`rollback` restores the state from (a round that fails half-way
        releases nothing, so its steps are undone). Cheap: copy only what ``next``
        modifies in place."""

    @abstractmethod
    def rollback(self, state: Any, token: object) -> None:
        """Put ``state`` back where it was when ``token`` was taken."""

    @abstractmethod
    def check(self, state: Any, step: int, dim: int) -> None:
        """Reject (``ValueError``) a restored state that does not match its step."""

    @abstractmethod
    def state_floats(self, state: Any) -> int:
        """Rows of ``d`` floats the state holds (its memory, in units of ``d``)."""

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
            self.next(state, step, lambda: np.zeros(1), NUMPY_OPS)
            peak = max(peak, self.state_floats(state))
        return peak


@dataclass
class HistoryState:
    """Every ``ξ`` row drawn so far: ``buf[:count]`` (``buf`` grows by doubling); ``consts``:
    the noising coefficients already in the stream's namespace (derived, never saved)."""

    buf: Array
    count: int
    consts: dict[str, Array] = field(default_factory=dict)


class HistoryKernel(StreamKernel):
    """``e[k] = Σ_{j≤k} M[k, j]·ξ_j`` for a dense lower-triangular noising matrix ``M``:
    every past row is kept (``k·d`` floats).

    The shared base of the dense mechanisms (``toeplitz``, ``optimized``) and the default
    kernel of any square factorization. Give either ``toeplitz_g`` (``M`` Toeplitz with
    first column ``g``: row ``k`` is then the contiguous slice ``g(k), …, g(0)`` of one
    reversed array, no ``N×N`` matrix) or ``matrix`` (a function returning the dense
    ``M``, called once per stream)."""

    def __init__(self, kind: str, horizon: int, toeplitz_g: np.ndarray | None = None,
                 matrix: Callable[[], np.ndarray] | None = None) -> None:
        if (toeplitz_g is None) == (matrix is None):
            raise ValueError("give either the Toeplitz coefficients or the matrix")
        self.kind = kind
        self.horizon = horizon
        self._g_reversed = (None if toeplitz_g is None
                            else np.ascontiguousarray(np.asarray(toeplitz_g)[::-1]))
        self._matrix = matrix

    def init(self, ops: ArrayOps, dim: int, levels: list[int], rows: list[Array]) -> HistoryState:
        state = HistoryState(buf=ops.zeros(len(rows), dim), count=len(rows))
        for i, r in enumerate(rows):
            state.buf[i] = r
        if self._g_reversed is not None:
            state.consts["g_reversed"] = ops.const(self._g_reversed)
        else:
            state.consts["matrix"] = ops.const(self._matrix())  # type: ignore[misc]
        return state

    def next(self, state: HistoryState, step: int, draw: Draw, ops: ArrayOps) -> Array:
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

    def save(self, state: HistoryState) -> Saved:
        return [], [state.buf[i] for i in range(state.count)]

    def checkpoint(self, state: HistoryState, ops: ArrayOps) -> object:
        # rows below ``count`` are never rewritten: the count alone undoes the steps
        return state.count

    def rollback(self, state: HistoryState, token: object) -> None:
        state.count = int(token)  # type: ignore[call-overload]

    def check(self, state: HistoryState, step: int, dim: int) -> None:
        if state.count != step:
            raise ValueError("noise state history does not match its step")

    def state_floats(self, state: HistoryState) -> int:
        return state.count

    def peak_rows(self, horizon: int) -> int:
        return horizon
