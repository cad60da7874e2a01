"""Per-learner noise streams: one correlated-noise increment per local step.

A learner's released prefix sums are ``A·G + V·B·ξ``; what it adds at step ``k`` is the
*increment* ``e[k] = V·(b_k − b_{k−1})·ξ`` (Zhang, Zhu, Fay & Johansson, "Locally Differentially
Private Online Federated Learning With Correlated Noise", Algorithm 1 lines 9–10), with ``ξ`` a
``W×d`` matrix of i.i.d. standard normals and ``V`` the calibrated noise std.

``ξ`` is drawn row by row from the AES-128-CTR kernel (:mod:`~flwr_corrnoise.cipher_noise`)
keyed by 128 bits (OS entropy for a deployed learner, a hash of every bit of the seed in a
reproducible simulation; a standard cipher: its outputs do not reveal the key), in the order
the mechanism needs the rows; the ``w``-th draw is the kernel's row ``w``, a pure function
of the key and ``w`` (so a mechanism may regenerate a row by its index; a test checks the
rows against the kernel's). A small row is computed with the next ones in one kernel call and
handed out from a per-generator cache (≤ 32768 floats; the same rows, each once; not part of
the state, dropped whenever the position moves otherwise: a seek, a fork's copy, a restore —
:meth:`~flwr_corrnoise.cipher_noise.CipherGaussian.next_row`'s ``ahead``).
The vanilla tree draws only the rows that some prefix sum uses
(:meth:`~flwr_corrnoise.mechanisms.tree.BinaryTree.drawn_nodes`): one per step. The
stream's whole state is that generator's state (key, the next row's index), the step
index, and what the mechanism must remember of past rows (streams written before noise-state
format 3 keep the keyed Philox4x64-10 they began with, :mod:`~flwr_corrnoise.noise_keys`,
and continue bit for bit):

============== ======================================== =================================
kind           state besides the generator (floats)     why
============== ======================================== =================================
independent    0                                        ``e[k] = ξ_k``
tree           ≤ (⌊log₂N⌋ + 1)·d                         the dyadic cover's node estimates
toeplitz       k·d (grows to N·d)                       ``e[k] = Σ_j g(k−j)·ξ_j``: ``C⁻¹``
                                                        is dense, every past row is needed
dense          k·d (grows to N·d)                       ``C⁻¹`` of the optimized
                                                        factorization is dense
blt            buffers·d (constant; 4·d by default)     ``e = ξ − Σ ω_i r_i``,
                                                        ``r_i ← θ_i r_i + e``
regenerated    0 (a generator position: 12 words)       ``e[k] = Σ_{i<w} m(i)·ξ_{k−i}``; the
                                                        older rows are drawn again
                                                        (:class:`RowCursor`)
============== ======================================== =================================

The recurrences live with the mechanisms, not here: every factorization supplies a
:class:`~flwr_corrnoise.mechanisms.streaming.StreamKernel` (``init``/``next`` over an array
namespace) and owns what it remembers (which ``levels``/``rows`` to save, how to undo a
failed round, when a restored state is inconsistent); :class:`NoiseStream` only owns the
generator, the step, the scaling by ``V`` and the state format. The device-resident torch stream
(:class:`flwr_corrnoise.torch.TorchNoiseStream`) runs the same kernels on tensors.

**Stream groups** (:class:`~flwr_corrnoise.stream_group.StreamGroup`): ``L`` streams of
one mechanism at the same step advanced as one recurrence, for the in-process engine's
lockstep learners only; a single learner steps its own stream.

The state serializes to a small byte string (:mod:`~flwr_corrnoise.arraypack`, no
pickle) for Flower's ``context.state`` or a file, and a stream restored from it continues
bit for bit.

**Dtype.** A stream runs in float64, or in float32 for a float32 model (``dtype=`` in
:meth:`NoiseStream.create`; the torch stream runs in its tensors' dtype): buffers, draws
(the kernel's float32 rows, from the same key), recurrence and release, with
half the state and half its memory traffic. Its increments are the factorization's to
float32 precision (≤ 1e-5 of the std over long horizons; ``tests/noise/test_float32_stream.py``),
its scale is the float32 number nearest the calibrated std from above, and the release
is formed in float32. The state records the dtype and is restored in it, never
converted.
Asking for step ``N`` raises :class:`HorizonExhaustedError`: reusing noise would leak data.

**Secure streams** (``create(..., secure=True)``; a learner's opt-in, node config
``secure-noise``): ``ξ`` comes from a ChaCha20 keystream keyed by OS entropy instead (the
state is the key and a block counter, seven words), the increments are rounded to a
power-of-two grid, and :meth:`NoiseStream.add_next` forms the release ``trunc_g(value) + e``
exactly — see :mod:`~flwr_corrnoise.secure_noise` for the threats and the cost.
"""

from __future__ import annotations

import copy
import functools
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import arraypack
from .cipher_noise import STATE_TAG as CIPHER_TAG
from .cipher_noise import CipherGaussian
from .mechanisms import Factorization, build_factorization, check_mechanism
from .mechanisms.base import check_horizon
from .mechanisms.registry import factorization_by_digest
from .mechanisms.streaming import NUMPY_OPS, NUMPY_OPS32, ArrayOps, NumpyOps, numpy_ops
from .noise_keys import (
    KEY_BITS,
    PHILOX_TAG,
    pack_generator,
    unpack_generator,
)
from .secure_noise import STATE_TAG as SECURE_TAG
from .secure_noise import ChaCha20Gaussian, add_on_grid, granularity, round_to_grid

#: the noise-state format written: 4 since the AES-128-CTR generator's transform 2 (its
#: 5-word state, tagged ``cipher_noise.STATE_TAG``; format 3, transform 1, is refused by the
#: generator with a clear error: its rows cannot be regenerated); format 2 (keyed Philox,
#: tagged ``PHILOX_TAG``) is still read and continued, format 1 (PCG64) read and re-keyed
STATE_FORMAT = 4
_READ_FORMATS = (1, 2, 3, 4)

#: a stream's generator: the AES-128-CTR kernel (written since format 3), a keyed Philox
#: (streams of format 2, continued as they began), or ChaCha20 (secure streams)
Rng = CipherGaussian | np.random.Generator | ChaCha20Gaussian


class HorizonExhaustedError(RuntimeError):
    """The stream has handed out all ``N`` increments its privacy calibration covers."""


Shapes = tuple[tuple[int, ...], ...]


def normalize_shapes(dim_or_shapes: int | Sequence[Sequence[int]] | Sequence[int]) -> Shapes:
    """Accept a dimension ``d`` or a list of array shapes; return a tuple of shapes.

    Why both: a NumPy logistic model is one vector, a neural network a list of tensors; the
    stream draws one flat vector and the caller splits it.
    """
    if isinstance(dim_or_shapes, int | np.integer) and not isinstance(dim_or_shapes, bool):
        shapes: Shapes = ((int(dim_or_shapes),),)
    else:
        shapes = tuple(tuple(int(s) for s in np.atleast_1d(shape)) for shape in dim_or_shapes)
    if not shapes or any(s < 0 for shape in shapes for s in shape):
        raise ValueError(f"invalid model dimension / shapes: {dim_or_shapes!r}")
    if sum(math.prod(shape) for shape in shapes) < 1:
        raise ValueError("the model must have at least one parameter")
    return shapes


def split_flat(flat: np.ndarray, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """A flat vector cut into arrays of ``shapes`` (views where the array type can; NumPy
    arrays and torch tensors alike)."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset : offset + size].reshape(tuple(shape)))
        offset += size
    return out


#: generators a backend registers (:func:`register_generator`: the torch device's), by the
#: first word of their packed state: how to unpack one
_BACKEND_RNGS: dict[int, Callable[[np.ndarray], Any]] = {}


def register_generator(tag: int, unpack: Callable[[np.ndarray], Any],
                       key_slots: Sequence[int]) -> None:
    """Let streams hold a backend's generator (:mod:`flwr_corrnoise.torch` registers its
    device ChaCha20 one): packed words whose first is ``tag`` unpack with ``unpack``, and
    ``key_slots`` are the words a :class:`RowCursor` position leaves out. The generator
    packs itself (``pack()``) and reads and sets its ``state``; one whose ``position`` is
    its row counter says so with a true class attribute ``rows_by_counter``."""
    _BACKEND_RNGS[int(tag)] = unpack
    _KEY_SLOTS[int(tag)] = list(key_slots)


def pack_rng(gen: Rng) -> np.ndarray:
    """A stream generator's state as uint64 words (the ``rng`` entry of a stream's state):
    AES-128-CTR, the keyed Philox of format 2, ChaCha20, or a registered backend's."""
    if isinstance(gen, np.random.Generator):  # Philox: tag, counter, key, buffer (noise_keys)
        return pack_generator(gen)
    return gen.pack()  # AES: tag, key, row, sequential; secure: tag, 256-bit key, block


def unpack_rng(words: np.ndarray, secure: bool = False) -> Rng:
    """The generator :func:`pack_rng` packed (``secure``: a ChaCha20 one)."""
    if secure:
        return ChaCha20Gaussian.unpack(words)
    w = np.asarray(words).reshape(-1)
    if w.size == 7:  # e.g. a secure state whose "secure" flag was dropped
        raise ValueError("this is a secure (ChaCha20) generator state, not a Philox one")
    if w.size == 5 and int(w[0]) == CIPHER_TAG:
        return CipherGaussian.unpack(w)
    if w.size and int(w[0]) in _BACKEND_RNGS:
        return _BACKEND_RNGS[int(w[0])](w)
    return unpack_generator(w)


def new_seed() -> int:
    """128 bits of OS entropy: the seed for a deployed learner (never sent anywhere)."""
    return secrets.randbits(KEY_BITS)


#: how to restore a stream of another array backend: ``restore(state, device)``, registered
#: by the backend's own module on import (:mod:`~flwr_corrnoise.torch.streams` registers
#: ``"torch"``). Why a table and not an import: the core must not import torch, and the
#: torch stream builds on this module, so the dependency runs one way only.
_BACKENDS: dict[str, Callable[[dict[str, np.ndarray], Any], NoiseStream]] = {}


def register_stream_backend(
    name: str, restore: Callable[[dict[str, np.ndarray], Any], NoiseStream]
) -> None:
    """Make :func:`restore_stream` hand states whose ``backend`` is ``name`` to ``restore``."""
    if name == "numpy":
        raise ValueError("'numpy' is the built-in backend")
    _BACKENDS[name] = restore


def restore_stream(state: dict[str, np.ndarray], device: Any = None, *,
                   adopt: bool = False) -> NoiseStream:
    """A stream of any registered backend from its :meth:`NoiseStream.state_dict`
    (``device``: where a device backend puts it; ``None``: the type it was saved on;
    ``adopt``: a NumPy stream may keep ``state``'s rows array as its own buffers,
    :meth:`NoiseStream.from_state_dict`)."""
    backend = str(state.get("backend", "numpy"))
    if backend == "numpy":
        return NoiseStream.from_state_dict(state, adopt=adopt)
    restore = _BACKENDS.get(backend)
    if restore is None:
        hint = (" (import flwr_corrnoise.torch, which needs the 'torch' extra)"
                if backend == "torch" else "")
        raise ValueError(f"this state holds a {backend} noise stream and no {backend} "
                         f"backend is loaded{hint}")
    return restore(state, device)


class RowCursor:
    """The ``draw`` a stream hands its kernel: a call draws the next row of ``ξ``;
    :meth:`tell` and :meth:`seek` read and move the stream's generator position.

    Why a position: a kernel may *regenerate* rows it used before instead of storing them
    (``banded-inverse``, :mod:`~flwr_corrnoise.mechanisms.banded`: its state is the
    generator's position at its oldest live row, not ``bands·d`` floats). A position holds
    no key words (:data:`_KEY_SLOTS`): :meth:`seek` moves within this stream's own
    keystream only, so a saved position can never make a stream draw under another key.
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: NoiseStream) -> None:
        self._stream = stream

    def __call__(self) -> Any:
        return self._stream._draw()

    def _words(self) -> tuple[np.ndarray, np.ndarray]:
        words = self._stream._pack_rng()
        free = np.ones(words.size, dtype=bool)
        free[_KEY_SLOTS[int(words[0])]] = False
        return words, free

    def tell(self) -> np.ndarray:
        """The generator's position before the next row (uint64 words, no key)."""
        words, free = self._words()
        return words[free]

    def seek(self, position: np.ndarray) -> None:
        """Move the generator to ``position`` (a :meth:`tell`) under its own key."""
        words, free = self._words()
        position = np.asarray(position, dtype=np.uint64).reshape(-1)
        if position.size != int(free.sum()):
            raise ValueError("a saved generator position of another generator type")
        words[free] = position
        gen = unpack_rng(words, secure=self._stream.secure)
        self._stream._set_rng_state(gen.bit_generator.state
                                    if isinstance(gen, np.random.Generator) else gen.state)

    def rows_back(self, count: int) -> bool:
        """Move the generator back ``count`` rows, where its position *is* a row counter
        (the AES kernel: row ``t`` is a pure function of the key and ``t``, and the stream
        draws one row a call), and say so; ``False``, moving nothing, for a generator whose
        rows are not addressable (Philox's ziggurat, ChaCha20's stream), whose positions a
        kernel must :meth:`tell` and keep. Why: a regenerating kernel
        (:mod:`~flwr_corrnoise.mechanisms.banded`) then keeps no generator position at all
        — it goes back by the number of rows it needs again. ``rows_back(0)`` asks."""
        rng = self._stream._rng
        if not getattr(type(rng), "rows_by_counter", False):  # AES; the torch device's
            return False
        if count:
            if not 0 <= count <= rng.position:
                raise ValueError(f"cannot go back {count} rows from row {rng.position}")
            rng.position = rng.position - count  # the setter drops rows computed ahead
        return True


#: packed-generator words a :class:`RowCursor` position leaves out, by the packed tag:
#: the tag and the key (AES: words 1–2, the position is the next row and the sequential
#: position; Philox: words 5–6; ChaCha20: words 1–4)
_KEY_SLOTS = {int(CIPHER_TAG): [0, 1, 2], int(PHILOX_TAG): [0, 5, 6],
              int(SECURE_TAG): [0, 1, 2, 3, 4]}


@functools.lru_cache(maxsize=16)
def _noise_dtype(ops_dtype: Any) -> np.dtype:
    """A namespace's dtype (NumPy's, or torch's ``torch.float32``) as a NumPy dtype. Cached:
    parsing the name on every call was ≈ 1 % of a learner message (called per step)."""
    return np.dtype(str(ops_dtype).removeprefix("torch."))


def float32_at_least(value: float) -> float:
    """The float32 number nearest ``value`` from above (as a Python float, which a float32
    multiply in NumPy or torch then uses exactly). Why: a float32 stream scales its unit
    noise by its std, and rounding the std to the nearest float32 could make the noise up
    to 2⁻²⁴ of it smaller than the calibration — an ε that does not hold, however
    slightly. Until 2026-11-29 only the NumPy stream rounded up; the torch stream and the
    torch optimizer's adaptive clip (noise × ``C_t``) rounded to nearest."""
    factor = np.float32(value)
    if float(factor) < value:
        factor = np.nextafter(factor, np.float32(np.inf))
    return float(factor)


class NoiseStream:
    """Hands out ``e[0], e[1], …, e[N−1]`` for one learner, one call at a time.

    >>> s = NoiseStream.create("tree", horizon=8, dim=3, std=1.0, seed=1)
    >>> e0 = s.next()
    >>> restored = NoiseStream.from_bytes(s.to_bytes())
    >>> bool(np.array_equal(s.next(), restored.next()))
    True
    """

    #: the array namespace the mechanism's kernel runs in (float64 NumPy on the host, or
    #: float32 for a float32 model: ``dtype=`` in :meth:`create`)
    _ops: ArrayOps = NUMPY_OPS

    def __init__(
        self,
        mechanism: str,
        horizon: int,
        shapes: Shapes,
        std: float,
        rng: Rng,
        step: int = 0,
        levels: list[int] | None = None,
        rows: np.ndarray | list[np.ndarray] | None = None,
        factorization: Factorization | None = None,
        *,
        dtype: Any = None,
        adopt_rows: bool = False,
    ) -> None:
        if dtype is not None:  # a NumPy stream of this float dtype (float64 by default)
            self._ops = numpy_ops(dtype)
            if isinstance(rng, ChaCha20Gaussian) and self._ops is not NUMPY_OPS:
                raise ValueError("a secure noise stream is float64 only (its grid is)")
        self.mechanism = check_mechanism(mechanism)
        self.horizon = check_horizon(horizon)
        self.shapes = shapes
        self.dim = sum(math.prod(s) for s in shapes)
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"noise std must be finite and >= 0, got {std!r}")
        self.std = float(std)
        self.step = int(step)
        self._rng = rng
        # the exact factorization (restored streams pass the one their digest names)
        self._factorization = factorization or build_factorization(self.mechanism, self.horizon)
        if (self._factorization.name, self._factorization.n) != (self.mechanism, self.horizon):
            raise ValueError("the factorization does not match the stream's mechanism and N")
        self.kind = self._factorization.stream_kind
        # the mechanism's own recurrence (mechanisms/streaming.py): no dispatch on names here
        self._kernel = self._factorization.stream_kernel()
        given: Any = [] if rows is None else (
            rows if adopt_rows and self._adoptable(rows) else [self._as_row(r) for r in rows])
        for r in given:
            if tuple(r.shape) != (self.dim,):
                raise ValueError("noise state buffers have the wrong dimension")
        levels = list(levels or [])
        self._state = self._kernel.init(self._ops, self.dim, levels, given)
        self._cursor = RowCursor(self)  # the kernel's draw (and generator position)
        #: the open :class:`StreamGroup` that holds this stream's kernel state, if any
        self._group: Any = None
        #: whether :meth:`_draw` is a row of the AES kernel (either dtype) or a float64
        #: ``standard_normal(d)`` of a Philox generator, which a group may ask to write into
        #: its row (:meth:`_draw_rows`) instead
        self._draws_into = (type(self)._draw is NoiseStream._draw
                            and (isinstance(rng, CipherGaussian)
                                 or (isinstance(rng, np.random.Generator)
                                     and self._ops is NUMPY_OPS)))

    def _release(self) -> None:
        """Take the kernel state back from an open group (closing it,
        :class:`~flwr_corrnoise.stream_group.StreamGroup`), so
        that nothing ever reads or steps a state the group has moved on."""
        if self._group is not None:
            self._group.close()

    def _as_row(self, row: np.ndarray) -> np.ndarray:
        """One serialized row as an array of this stream's namespace."""
        return np.asarray(row, dtype=self._ops.dtype)  # type: ignore[attr-defined]

    def _adoptable(self, rows: Any) -> bool:
        """Whether ``rows`` can be the kernel's state as it is: one aligned, writable,
        C-contiguous ``rows×d`` array of the stream's dtype, for a kernel that keeps its
        rows so (BLT). Why: an offloaded state is read into a fresh buffer the learner
        owns; copying its buffers once more cost as much as a step."""
        return (self._kernel.adopts_rows and isinstance(rows, np.ndarray) and rows.ndim == 2
                and rows.shape[1:] == (self.dim,) and rows.dtype == self.noise_dtype
                and rows.flags.c_contiguous and rows.flags.writeable and rows.flags.aligned)

    @property
    def noise_dtype(self) -> np.dtype:
        """The float dtype the stream's buffers, draws and increments are in."""
        return _noise_dtype(self._ops.dtype)  # type: ignore[attr-defined]

    # -- construction -----------------------------------------------------------------
    @classmethod
    def create(
        cls,
        mechanism: str,
        horizon: int,
        dim: int | Sequence[Sequence[int]],
        std: float,
        seed: int | None = None,
        secure: bool = False,
        factorization: Factorization | None = None,
        dtype: Any = None,
    ) -> NoiseStream:
        """A fresh stream at step 0. ``seed=None`` draws one from OS entropy.
        ``dtype``: float64 (default) or float32, for a float32 model (the buffers, the
        draws — NumPy's float32 normals from the same keyed generator, as the torch stream
        draws them — the recurrence and the release in float32; the std is the calibrated
        one, see :meth:`_scaled`).
        ``factorization``: the exact one to stream (a mechanism built with parameters,
        e.g. a BLT optimized for multiple participations); default: the mechanism's
        default for ``horizon``.

        ``secure=True``: ChaCha20 keyed from OS entropy and increments on a power-of-two
        grid (:mod:`~flwr_corrnoise.secure_noise`); it takes no seed, so no caller can
        choose (or replay) its noise.
        """
        if secure:
            if seed is not None:
                raise ValueError(
                    "a secure noise stream is keyed from OS entropy only; it takes no seed"
                )
            if dtype is not None and np.dtype(dtype) != np.float64:
                raise ValueError("a secure noise stream is float64 only (its grid is)")
            secure_rng = ChaCha20Gaussian.from_os_entropy()
            return cls(mechanism, horizon, normalize_shapes(dim), std, secure_rng,  # type: ignore[arg-type]
                       factorization=factorization)
        if seed is not None and int(seed) < 0:
            raise ValueError("the seed must be a non-negative integer")
        # AES-128-CTR keyed by OS entropy, or by a hash of every bit of the seed
        rng = CipherGaussian.from_seed(None if seed is None else int(seed))
        return cls(mechanism, horizon, normalize_shapes(dim), std, rng,
                   factorization=factorization, dtype=dtype)

    # -- the increments ---------------------------------------------------------------
    @property
    def remaining(self) -> int:
        """Increments left before the horizon."""
        return self.horizon - self.step

    def next(self) -> np.ndarray:
        """The flat increment ``e[step]`` (length ``d``, the stream's dtype); advances the
        step."""
        self._release()
        self._check_step()
        unit, self._state = self._kernel.next(self._state, self.step, self._cursor, self._ops)
        self.step += 1
        return self._scaled(unit)

    @property
    def draws_blocks(self) -> bool:
        """Whether :meth:`next_block` is this stream's fast path: a NumPy stream drawing
        from the kernel (not secure: its grid is per step), whose rows come as a block."""
        return (self._draws_into and self._kernel.has_steps
                and isinstance(self._rng, CipherGaussian) and isinstance(self._ops, NumpyOps))

    def next_block(self, count: int) -> np.ndarray:
        """The next ``count`` increments as one ``count × d`` array (row ``i`` is
        ``e[step + i]``, the stream's dtype); advances the step by ``count``. The same
        floats as ``count`` calls of :meth:`next`, drawn in one block and stepped by the
        kernel's :meth:`~flwr_corrnoise.mechanisms.streaming.StreamKernel.steps` — for BLT
        one pass over its buffers instead of one a step. Refused, before anything is
        drawn, if the block would pass the horizon. Only where :attr:`draws_blocks` (BLT,
        the default mechanism)."""
        self._release()
        count = int(count)
        self._check_step(count)
        if not self.draws_blocks:
            raise ValueError("next_block is for NumPy streams drawing from the kernel")
        rows = np.empty((count, self.dim), dtype=self.noise_dtype)
        self._draw_rows(rows)
        units, self._state = self._kernel.steps(self._state, self.step, rows, self._ops)
        self.step += count
        return self._scaled(units)

    def release(self, value: np.ndarray, increment: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
        """``value`` released with an increment this stream already handed out
        (:meth:`next_block`): what :meth:`add_next` forms with :meth:`next`'s. ``out``:
        where the release is written (and returned); the sum is then formed in place when
        ``value`` is ``out`` in the noise's dtype (an ordinary stream: the same one
        rounding as :meth:`_add`'s), which saves a new d-vector and its copy a step."""
        if out is None:
            return self._add(value, increment)
        if (value is out and not self.secure and out.dtype == increment.dtype
                and out.dtype == self.noise_dtype):
            return np.add(out, increment, out=out)
        out[...] = self._add(value, increment)
        return out

    def _check_step(self, count: int = 1) -> None:
        """Refuse a step (or ``count`` steps) past the horizon, before anything is drawn."""
        if count < 0 or self.step + count > self.horizon:
            raise HorizonExhaustedError(
                f"the {self.mechanism} noise stream is calibrated for {self.horizon} steps and "
                f"{self.step} of them have been used; adding {count} more noisy steps would "
                f"exceed the privacy budget (or reuse noise)"
            )

    def _scaled(self, unit: np.ndarray) -> np.ndarray:
        """A kernel's unit-std increment(s) as released noise: times ``V``, and on a secure
        stream's grid (in place: every kernel returns a fresh array).

        A float32 stream multiplies by the float32 number nearest ``V`` from above, never
        below: its noise is at least the calibrated std (float32 rounds ``V`` by ≤ 2⁻²⁴
        relative; a float64 stream multiplies by ``V`` itself)."""
        if self.std != 1.0:
            unit *= self._std_factor()
        if isinstance(self._rng, ChaCha20Gaussian):  # secure: the released increment on
            round_to_grid(unit, granularity(self.std), out=unit)  # a power-of-two grid
        return unit

    @property
    def secure(self) -> bool:
        """Whether this stream draws from ChaCha20 keyed by OS entropy, on a grid."""
        return isinstance(self._rng, ChaCha20Gaussian)

    def add_next(self, value: np.ndarray) -> np.ndarray:
        """``value + e[step]``: the release. Why a method: a secure stream's release must be
        ``trunc_g(value) + e`` on its power-of-two grid (exact float addition, nothing to
        read from rounding); an ordinary stream's is the plain sum."""
        return self._add(value, self.next())

    def _add(self, value: np.ndarray, noise: np.ndarray) -> np.ndarray:
        if self.secure:
            return add_on_grid(value, noise, granularity(self.std))
        if self._ops is NUMPY_OPS32:
            # the release in float32: the value rounded to float32, plus the noise. A
            # float64 sum would keep the value's low-order bits below the float32 noise's
            # coarser grid (2⁻²³·|e|): a release of data the noise does not cover
            return np.asarray(value, dtype=np.float32) + noise
        return value + noise

    def _std_factor(self) -> float:
        """``V`` as the stream multiplies by it: itself (float64), or the float32 number
        nearest it from above (a float32 stream's noise is never below the calibration)."""
        if self.noise_dtype != np.float32:  # any float32 stream, NumPy's or torch's
            return self.std
        return float32_at_least(self.std)

    def next_arrays(self) -> list[np.ndarray]:
        """The increment split into the stream's array shapes."""
        return self.split(self.next())

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Split a flat length-``d`` vector into the stream's shapes (views)."""
        return split_flat(flat, self.shapes)

    def _draw(self) -> np.ndarray:
        if isinstance(self._rng, CipherGaussian):  # the next row, in the stream's dtype;
            # small rows several per kernel call (the same rows: CipherGaussian.next_row)
            return self._rng.next_row(self.dim, self._ops.dtype,  # type: ignore[attr-defined]
                                      ahead=self.horizon - self.step)
        if self._ops is NUMPY_OPS32:  # Philox's float32 normals (as the torch stream's)
            return self._rng.standard_normal(self.dim, dtype=np.float32)  # type: ignore[call-arg]
        return self._rng.standard_normal(self.dim)

    def _draw_rows(self, out: np.ndarray) -> None:
        """The next ``len(out)`` rows into ``out`` (rows × d, the stream's dtype), as as
        many :meth:`_draw` calls give them (only where :attr:`_draws_into`)."""
        if isinstance(self._rng, CipherGaussian):
            self._rng.rows(self._rng.position, out.shape[0], self.dim, out.dtype, out=out)
            self._rng.position += out.shape[0]
        else:  # a Philox generator fills an array row after row
            self._rng.standard_normal(out=out)  # type: ignore[union-attr]

    def _skip_rows(self, count: int) -> None:
        """Move the generator past ``count`` rows (as :meth:`_draw_rows` would)."""
        if isinstance(self._rng, CipherGaussian):
            self._rng.position += count
        elif count:
            self._rng.standard_normal(out=np.empty((count, self.dim)))  # type: ignore[union-attr]

    @property
    def factorization(self) -> Factorization:
        """The exact factorization this stream's noise comes from."""
        return self._factorization

    # -- a round that fails half-way is not written --------------------------------
    def fork(self) -> NoiseStream:
        """A stream at this one's position that steps on its own: the same kernel state
        (the kernels are pure, :mod:`~flwr_corrnoise.mechanisms.streaming`: neither
        stream's steps change it) and a copy of the generator (its packed words).

        Why: a learner's round runs on a fork and the learner takes the fork only when
        the round succeeded (:meth:`~flwr_corrnoise.learner_state.LearnerState.fork`), so
        undoing a failed round is not writing it — no undo tokens, no copy of the history.
        The stream it was forked from continues exactly as if the fork never stepped."""
        self._release()
        twin = copy.copy(self)
        # the fork, which a round goes on with, takes the live generator (and the rows it
        # computed ahead, CipherGaussian.next_row); this stream a copy at its position
        self._rng = unpack_rng(pack_rng(twin._rng), secure=twin.secure)
        twin._cursor = RowCursor(twin)
        twin._group = None
        return twin

    def _rng_state(self) -> object:
        # AES: (key, row, sequential); secure (ChaCha20): (key, block); Philox: its dict
        if isinstance(self._rng, np.random.Generator):
            return self._rng.bit_generator.state
        return self._rng.state

    def _set_rng_state(self, state: object) -> None:
        if isinstance(self._rng, np.random.Generator):
            self._rng.bit_generator.state = state
        else:
            self._rng.state = state  # type: ignore[assignment]

    # -- state --------------------------------------------------------------------------
    @property
    def state_floats(self) -> int:
        """Floats held besides the generator: the stream's memory (history rows for the
        dense kinds, cover estimates for the tree, the buffers for BLT)."""
        self._release()
        return len(self._kernel.save(self._state)[1]) * self.dim

    def state_dict(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Everything needed to continue the stream, as plain arrays (no pickle).

        ``copy=False``: where the kernel keeps its rows as one array (BLT), ``rows`` *is*
        that array, not a copy — for a caller that writes the state out at once and keeps
        nothing (:mod:`~flwr_corrnoise.state_offload`). A float32
        stream records ``dtype``; a float64 state is written as before (no ``dtype`` key)."""
        shape_lens = np.array([len(s) for s in self.shapes], dtype=np.int64)
        shape_dims = np.array([d for s in self.shapes for d in s], dtype=np.int64)
        self._release()
        levels, saved = self._kernel.save(self._state)
        view = None if copy else self._rows_view(self._kernel.rows_view(self._state))
        rows = view if view is not None else self._rows_array(saved)
        out = {
            "format": np.array(STATE_FORMAT, dtype=np.int64),
            "mechanism": np.array(self.mechanism),
            "horizon": np.array(self.horizon, dtype=np.int64),
            "shape_lens": shape_lens,
            "shape_dims": shape_dims,
            "std": np.array(self.std, dtype=np.float64),
            "step": np.array(self.step, dtype=np.int64),
            "rng": self._pack_rng(),
            "secure": np.array(isinstance(self._rng, ChaCha20Gaussian)),
            "levels": np.array(levels, dtype=np.int64),
            "factorization": np.array(self._factorization.digest),
            "rows": rows,
        }
        if self._ops is NUMPY_OPS32:
            out["dtype"] = np.array("float32")
        return out

    def _rows_view(self, view: Any) -> np.ndarray | None:
        """The kernel's rows as one NumPy array without a copy (a kernel that keeps them
        so: BLT), or ``None``."""
        return view if isinstance(view, np.ndarray) else None

    def _rows_array(self, saved: list[np.ndarray]) -> np.ndarray:
        dtype = self._ops.dtype  # type: ignore[attr-defined]
        return np.array(saved, dtype=dtype) if saved else np.zeros((0, self.dim), dtype)

    def _pack_rng(self) -> np.ndarray:
        return pack_rng(self._rng)

    @classmethod
    def from_state_dict(cls, state: dict[str, np.ndarray], *,
                        adopt: bool = False) -> NoiseStream:
        """Rebuild a stream from :meth:`state_dict`; validates what it reads.

        The stream has the dtype the state records (float64 without a ``dtype`` key), and
        rows of another dtype are refused, never converted: a state is continued in the
        arithmetic it was made in. ``adopt=True``: the stream may keep ``state["rows"]``
        as its own buffers (no copy) — only for a state read into memory the caller hands
        over (a state file's fresh buffer); the caller must not use the array again."""
        backend = str(state.get("backend", "numpy"))
        if backend != "numpy" and cls is NoiseStream:
            # a learner state may hold a device stream: its backend module restores it
            return restore_stream(state)
        if backend != "numpy":
            raise ValueError(
                f"this is the state of a {state['backend']} noise stream; restore it with "
                f"flwr_corrnoise.streams.restore_stream"
            )
        try:
            kwargs = cls._parse_state(state)
            dtype = np.dtype(str(state["dtype"])) if "dtype" in state else np.dtype(np.float64)
            rows = np.asarray(state["rows"])
            if rows.size and rows.dtype != dtype:
                raise ValueError(f"the state records {dtype} buffers but holds {rows.dtype} "
                                 "rows; refusing to convert them")
            stream = cls(
                rng=unpack_rng(  # type: ignore[arg-type]
                    np.asarray(state["rng"]),
                    secure=bool(state["secure"]) if "secure" in state else False,
                ),
                rows=rows if rows.size else rows.astype(dtype),
                dtype=dtype, adopt_rows=adopt,
                **kwargs,
            )
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"malformed noise-stream state: {err!r}") from err
        stream._check_consistent()
        return stream

    @staticmethod
    def _parse_state(state: dict[str, np.ndarray]) -> dict:
        """The fields every backend's state shares (all but the generator and the rows)."""
        if int(state["format"]) not in _READ_FORMATS:
            raise ValueError(f"unsupported noise-state format {int(state['format'])}")
        lens = [int(x) for x in state["shape_lens"]]
        dims = [int(x) for x in state["shape_dims"]]
        shapes, offset = [], 0
        for n in lens:
            shapes.append(tuple(dims[offset : offset + n]))
            offset += n
        mechanism, horizon = str(state["mechanism"]), int(state["horizon"])
        # the exact factorization the stream was made with, never a newer cache entry
        factorization = (
            factorization_by_digest(mechanism, horizon, str(state["factorization"]))
            if "factorization" in state else None  # states written before digests
        )
        return {
            "mechanism": mechanism,
            "horizon": horizon,
            "shapes": normalize_shapes(shapes),
            "std": float(state["std"]),
            "step": int(state["step"]),
            "levels": [int(x) for x in state["levels"]],
            "factorization": factorization,
        }

    def _check_consistent(self) -> None:
        """Reject a state whose buffers do not match its step (corruption, tampering)."""
        if not 0 <= self.step <= self.horizon:
            raise ValueError(f"noise state step {self.step} outside [0, {self.horizon}]")
        self._release()
        self._kernel.check(self._state, self.step, self.dim)

    def to_bytes(self) -> bytes:
        """Serialize (for ``context.state`` or disk): :mod:`flwr_corrnoise.arraypack`.
        The rows are packed from the kernel's own buffers (``state_dict(copy=False)``):
        packing copies them once, into the bytes."""
        return arraypack.pack(self.state_dict(copy=False))

    @classmethod
    def from_bytes(cls, data: bytes) -> NoiseStream:
        """Inverse of :meth:`to_bytes` (also reads the ``.npz`` states of version 0.1)."""
        try:
            state = arraypack.unpack_any(data)  # also the earlier .npz format
        except (OSError, ValueError, EOFError) as err:
            raise ValueError(f"unreadable noise-stream state: {err}") from err
        return cls.from_state_dict(state, adopt=True)  # the unpacked arrays are fresh copies
