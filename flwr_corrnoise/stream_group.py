"""Stream groups: ``L`` noise streams of one mechanism at the same step as one recurrence.

Why a module of its own: only the in-process engine (:func:`flwr_corrnoise.engine.
run_vectorized`) steps many learners in lockstep; a Flower learner, the torch optimizer
and every other front end step one stream (:meth:`~flwr_corrnoise.streams.NoiseStream.
add_next`) and never come here. The engine hands :func:`grouped_noise` to
:func:`~flwr_corrnoise.learner.local_rounds` as its ``noise``.

Every kernel (:mod:`~flwr_corrnoise.mechanisms.streaming`) is linear column by column with
coefficients that depend on the step only, so ``L`` streams' states side by side
(:meth:`~flwr_corrnoise.mechanisms.streaming.StreamKernel.stack`) step as one state of
dimension ``L·d``; each stream's rows still come from its own keyed generator, in its own
order. The increments and states are those of the ``L`` separate streams, to the rounding
of a wider product (``tests/noise/test_stream_group.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .cipher_noise import CipherGaussian, next_rows_of
from .streams import NoiseStream


class StreamGroup:
    """``L`` noise streams of one mechanism at the same step, advanced together: one
    kernel state of dimension ``L·d`` (the streams' states side by side,
    :meth:`~flwr_corrnoise.mechanisms.streaming.StreamKernel.stack`), one recurrence for
    all, and each stream's rows still drawn from its own keyed generator, in its own order.

    Why: the vectorized in-process engine (:func:`flwr_corrnoise.engine.run_vectorized`,
    through :func:`flwr_corrnoise.learner.local_rounds`'s ``noise``) steps ``L`` learners
    in lockstep, and ``L`` calls of :meth:`NoiseStream.next` per step
    cost ``L`` trips through the kernel (for the dense kinds ``L`` products, each reading
    one learner's history). Every kernel is linear column by column with coefficients that
    depend on the step only, so the stacked step is each stream's step: the increments and
    the states after :meth:`close` are those of ``L`` separate streams, up to the rounding
    of a product over more columns (a test compares every mechanism). One stream is the
    ``L = 1`` group: its own :meth:`NoiseStream.next`, the same kernel step.

    While the group is open it holds its members' kernel states (not their generators,
    steps or keys): a member's own call that needs its state (``next``, ``checkpoint``,
    ``rollback``, ``state_dict``, …) closes the group first, so no member ever steps or
    saves a stale state. Use it as a context manager, or call :meth:`close`.

    ``ahead``: how many steps the caller means to take before closing (the vectorized
    engine's ``τ``). The group's first draw then takes that many rows from each member's
    generator in one call (:class:`GroupCursor`): the same numbers in the same order as
    one call per row, since a generator fills an array row after row; a group closed
    before it used them puts every generator back where the rows it used leave it.
    """

    def __init__(self, streams: Sequence[NoiseStream], *, ahead: int = 1,
                 _keyed: bool = False) -> None:
        members = list(streams)
        if not members:
            raise ValueError("a stream group needs at least one stream")
        if len({id(s) for s in members}) != len(members):
            raise ValueError("a stream appears twice in the group")
        self.streams = members
        self.dim: int = getattr(members[0], "dim", 0)
        self._state: Any = None
        self._cursor: GroupCursor | None = None
        self._open = True
        if len(members) == 1:  # the stream itself (any object with a stream's next/add_next)
            return
        key = group_key(members[0])
        if not _keyed and any(group_key(s) != key for s in members[1:]):
            raise ValueError("a stream group's streams must share the kernel, dimension, "
                             "step, std and generator kind (use StreamGroup.partition)")
        for s in members:
            s._release()
        first = members[0]
        self._kernel, self._ops = first._kernel, first._ops
        self._state = self._kernel.stack(self._ops, [s._state for s in members], self.dim)
        self._cursor = GroupCursor(members, self._ops, ahead)
        for s in members:
            s._group, s._state = self, None

    @classmethod
    def partition(cls, streams: Sequence[NoiseStream],
                  ahead: int = 1) -> list[tuple[list[int], StreamGroup]]:
        """The streams as groups of equal :func:`group_key`, in order of first
        appearance: ``(indices into streams, group)`` pairs, every stream in exactly one
        group. Why: learners of one settings may still be at different steps (a sampled
        federation), and only streams at the same step can share a recurrence."""
        by_key: dict[tuple, list[int]] = {}
        for i, s in enumerate(streams):
            by_key.setdefault(group_key(s), []).append(i)
        return [(idx, cls([streams[i] for i in idx], ahead=ahead, _keyed=True))
                for idx in by_key.values()]

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def step(self) -> int:
        """The members' common step."""
        return self.streams[0].step

    def next(self) -> np.ndarray:
        """The ``L×d`` increments ``e[step]`` (row ``i``: stream ``i``'s); every member's
        step moves on. Past the horizon it refuses before anything is drawn."""
        if not self._open:
            raise RuntimeError("this stream group is closed")
        first = self.streams[0]
        if self._state is None:  # L = 1: the stream's own step
            return first.next()[None, :]
        first._check_step()
        unit, self._state = self._kernel.next(self._state, first.step, self._cursor,
                                              self._ops)
        for s in self.streams:
            s.step += 1
        return first._scaled(unit).reshape(len(self.streams), self.dim)

    def add_next(self, values: np.ndarray) -> np.ndarray:
        """``values + e[step]`` row by row (``values``: ``L×d``): the members' releases,
        each as :meth:`NoiseStream.add_next` forms it (exact on a secure grid)."""
        if self._state is None and self._open:  # L = 1: the stream's own release
            return self.streams[0].add_next(values[0])[None, :]
        return self.streams[0]._add(values, self.next())

    def close(self) -> None:
        """Give every member its own kernel state back, and its generator where the rows
        it used leave it (idempotent)."""
        if not self._open:
            return
        self._open = False
        if self._state is None:
            return
        self._cursor.settle()  # type: ignore[union-attr]
        states = self._kernel.unstack(self._ops, self._state, len(self.streams), self.dim)
        for s, state in zip(self.streams, states, strict=True):
            s._state, s._group = state, None
        self._state = None

    def __enter__(self) -> StreamGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def group_key(stream: NoiseStream) -> tuple:
    """What streams must share to run one recurrence: the kernel object (one
    factorization), the array namespace, the dimension, the step, the std and the
    generator kind (secure streams share a grid only at one std). An object that only
    behaves like a stream (``next``, ``add_next``) is a group of its own."""
    if not isinstance(stream, NoiseStream):
        return ("alone", id(stream))
    return (type(stream), id(stream._kernel), id(stream._ops), stream.dim, stream.step,
            stream.std, stream.secure)


class GroupCursor:
    """A :class:`StreamGroup`'s ``draw``: one row from every member's own generator, side
    by side (member ``i``'s in columns ``i·d … (i+1)·d − 1``); :meth:`tell` and
    :meth:`seek` read and move every member's position (:class:`RowCursor`), side by side.

    With ``ahead > 1`` (and every member drawing into rows: an AES stream of either dtype,
    or a float64 Philox one) the first call draws ``ahead`` rows from each generator at
    once (:meth:`NoiseStream._draw_rows`: the kernel's rows at the position, several short
    rows per transform; Philox's ``standard_normal(out=ahead×d)``): the rows ``ahead``
    single draws give, in that order (``tests/noise/test_stream_group.py`` checks it bit for
    bit), for a quarter of the calls at τ = 4 — per learner and step a call cost about as
    much as its 100 normals. The calls after it hand out those rows, then draw one row at
    a time again. :meth:`settle` (from :meth:`StreamGroup.close`, :meth:`tell`,
    :meth:`seek`) puts every generator where the rows handed out leave it: each one's
    state before the draw, then moved past the used rows."""

    __slots__ = ("_ahead", "_cipher", "_dim", "_ops", "_rows", "_saved", "_streams", "_used")

    def __init__(self, streams: list[NoiseStream], ops: Any, ahead: int = 1) -> None:
        self._streams, self._ops, self._dim = streams, ops, streams[0].dim
        #: every member an AES stream: their short rows share one transform a draw
        #: (:func:`~flwr_corrnoise.cipher_noise.next_rows_of`)
        self._cipher = all(s._draws_into and isinstance(s._rng, CipherGaussian)
                           for s in streams)
        prefetch = ahead > 1 and all(s._draws_into for s in streams)
        self._ahead = int(ahead) if prefetch else 1
        self._rows: np.ndarray | None = None  # (members, rows, d): drawn, not all used
        self._saved: list[Any] = []  # the generators' states before those rows
        self._used = 0

    def __call__(self) -> Any:
        if self._rows is not None and self._used < self._rows.shape[1]:
            self._used += 1
            return self._rows[:, self._used - 1].copy().reshape(-1)
        if self._ahead > 1 and self._rows is None:
            first = self._streams[0]
            count = min(self._ahead, first.horizon - first.step)
            if count > 1:
                return self._draw_ahead(count)
        d = self._dim
        out = self._ops.zeros(1, d * len(self._streams))[0]
        if self._cipher:
            next_rows_of([s._rng for s in self._streams], out.reshape(len(self._streams), 1, d))
            return out
        for i, s in enumerate(self._streams):
            if s._draws_into:  # the generator straight into the row (the same draw)
                s._draw_rows(out[i * d:(i + 1) * d][None])
            else:
                out[i * d:(i + 1) * d] = s._draw()
        return out

    def _draw_ahead(self, count: int) -> np.ndarray:
        """``count`` rows of every member at once; the first of them handed out."""
        rows = np.empty((len(self._streams), count, self._dim),
                        dtype=self._streams[0].noise_dtype)
        self._saved = [s._rng_state() for s in self._streams]
        if self._cipher:
            next_rows_of([s._rng for s in self._streams], rows)
        else:
            for s, block in zip(self._streams, rows, strict=True):
                s._draw_rows(block)
        self._rows, self._used = rows, 1
        return rows[:, 0].copy().reshape(-1)

    def settle(self) -> None:
        """Forget the rows drawn ahead; if some were not handed out, put each generator
        back to its state before them and draw the used ones again (the same numbers),
        so that it stands where one call per row would have left it."""
        rows, used = self._rows, self._used
        self._rows, self._used = None, 0
        if rows is None or used == rows.shape[1]:
            self._saved = []
            return
        for s, state in zip(self._streams, self._saved, strict=True):
            s._set_rng_state(state)
            s._skip_rows(used)
        self._saved = []

    def tell(self) -> np.ndarray:
        self.settle()
        self._ahead = 1  # a kernel that reads positions draws one row at a time
        return np.concatenate([s._cursor.tell() for s in self._streams])

    def seek(self, position: np.ndarray) -> None:
        self.settle()
        self._ahead = 1
        parts = np.split(np.asarray(position, dtype=np.uint64).reshape(-1), len(self._streams))
        for s, part in zip(self._streams, parts, strict=True):
            s._cursor.seek(part)

    def rows_back(self, count: int) -> bool:
        """Every member's :meth:`~flwr_corrnoise.streams.RowCursor.rows_back`, side by
        side: all or none (a group shares one generator kind)."""
        self.settle()
        self._ahead = 1
        cursors = [s._cursor for s in self._streams]
        if not all(c.rows_back(0) for c in cursors):
            return False
        for c in cursors:
            c.rows_back(count)
        return True


class GroupedNoise:
    """A round's noise for :func:`~flwr_corrnoise.learner.local_rounds`: the learners'
    streams partitioned into open :class:`StreamGroup` s (one per step, settings and
    generator kind) for the whole round, ``ahead`` steps drawn at once."""

    def __init__(self, streams: Sequence[NoiseStream], ahead: int = 1) -> None:
        self.groups = StreamGroup.partition(streams, ahead=ahead)

    def add(self, g: np.ndarray) -> np.ndarray:
        """Each group's releases ``g[rows] + e`` (exact on a secure stream's grid)."""
        if len(self.groups) == 1 and len(self.groups[0][0]) == g.shape[0]:
            return self.groups[0][1].add_next(g)
        out = np.empty_like(g)
        for idx, group in self.groups:
            out[idx] = group.add_next(g[idx])
        return out

    def close(self) -> None:
        """Give every stream its own state back (idempotent)."""
        for _, group in self.groups:
            group.close()


def grouped_noise(streams: Sequence[NoiseStream], ahead: int) -> GroupedNoise:
    """The in-process engine's ``noise`` for :func:`~flwr_corrnoise.learner.local_rounds`."""
    return GroupedNoise(streams, ahead)
