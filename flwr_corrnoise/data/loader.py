"""Minibatches over a fixed local dataset whose participation the library knows.

A Flower app trains epochs over a fixed partition, so each datum enters the noise stream
many times; the ε printed must account for it (:mod:`flwr_corrnoise.mechanisms.participation`).
The library cannot see which data a user's loop touches, so instead of a promise it offers
the loop itself: :class:`CyclicLoader` fixes every example's slot once (one shuffled order,
the same in every epoch and every round), so example ``i`` is used exactly at the steps
``s_i, s_i + b, s_i + 2b, …`` with ``b`` the steps per epoch — a *fixed-epoch*
participation of ``rounds × local_epochs`` epochs. The loader derives the horizon
(``rounds × local_epochs × b``), the local steps per round and that participation, and the
per-step front ends (:class:`~flwr_corrnoise.flower.PrivateSteps`,
:func:`~flwr_corrnoise.flower.private_optimizer`) calibrate to them and refuse a step for
which no batch was drawn from it.

The order is a deterministic function of ``order_seed`` (default 0), not a secret: the
fixed-epoch accounting holds for *any* order fixed before training, and a Flower
``ClientApp`` is rebuilt every round, so the order must come out the same each time.

Pure NumPy; :mod:`flwr_corrnoise.torch.loader` turns it into a torch ``batch_sampler``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..mechanisms.participation import Participation


class EpochLoop:
    """What every loop over a fixed local dataset shares, whatever picks its batches
    (:class:`CyclicLoader`'s fixed order, :class:`~flwr_corrnoise.data.sampling.
    CyclicPoissonLoader`'s sampling): the sizes' checks, the order drawn once from
    ``order_seed``, and the counts the accounting reads (steps per epoch, local steps,
    epochs, horizon). The subclasses are frozen dataclasses with ``num_examples``,
    ``batch_size``, ``rounds``, ``local_epochs`` and ``order_seed``."""

    num_examples: int
    batch_size: int
    rounds: int
    local_epochs: int
    order_seed: int

    def _check_sizes(self, names: tuple[str, ...]) -> None:
        """Every size in ``names`` a positive integer, a batch no larger than the data,
        and the order fixed (a function of ``order_seed`` and the sizes only)."""
        kind = type(self).__name__
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{kind}: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.batch_size > self.num_examples:
            raise ValueError(f"{kind}: batch_size {self.batch_size} exceeds the "
                             f"{self.num_examples} examples")
        rng = np.random.default_rng(int(self.order_seed))
        object.__setattr__(self, "order", rng.permutation(self.num_examples))

    @property
    def steps_per_epoch(self) -> int:
        """``⌈num_examples / batch_size⌉``: steps per (expected) pass over the data."""
        return -(-self.num_examples // self.batch_size)

    @property
    def local_steps(self) -> int:
        """τ: steps per round (``local_epochs × steps_per_epoch``)."""
        return self.local_epochs * self.steps_per_epoch

    @property
    def epochs(self) -> int:
        """(Expected) passes over the data in the whole run."""
        return self.rounds * self.local_epochs

    @property
    def horizon(self) -> int:
        return self.rounds * self.local_steps

    def indices(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def round_indices(self, first_step: int) -> Iterator[np.ndarray]:
        """The batches of the round that starts at global step ``first_step``."""
        if int(first_step) % self.local_steps:
            raise ValueError(f"a round starts at a multiple of {self.local_steps} steps, "
                             f"not at step {first_step}")
        for step in range(int(first_step), int(first_step) + self.local_steps):
            yield self.indices(step)


@dataclass(frozen=True)
class CyclicLoader(EpochLoop):
    """Batches of example indices in one order fixed once, ``local_epochs`` passes per
    round, ``rounds`` rounds (the run's ``num-server-rounds``).

    ``batch_size`` examples per step; the last batch of an epoch holds the remainder, so
    every example is in exactly one batch per epoch and ``steps_per_epoch =
    ⌈num_examples / batch_size⌉``.
    """

    num_examples: int
    batch_size: int
    rounds: int
    local_epochs: int = 1
    order_seed: int = 0
    order: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_sizes(("num_examples", "batch_size", "rounds", "local_epochs"))

    # -- what the accounting needs --------------------------------------------------------
    @property
    def participation(self) -> Participation:
        return Participation.epochs(self.epochs, self.steps_per_epoch)

    def config(self) -> dict[str, Any]:
        """The learner's config keys this loop implies (``horizon``, ``local-steps``,
        ``epochs``, ``num-server-rounds``)."""
        return {"horizon": self.horizon, "local-steps": self.local_steps,
                "epochs": self.epochs, "num-server-rounds": self.rounds}

    @property
    def order_digest(self) -> str:
        """A digest of the order (SHA-256 of the index permutation and the batch size):
        the learner's state records it on the first round and refuses a loader whose order
        differs — an order reshuffled every round is not the fixed order the fixed-epoch
        ε assumes (printed 2.00, true 2.2–2.5). A function of ``order_seed`` and the sizes,
        not of the data."""
        h = hashlib.sha256(np.asarray(self.order, dtype="<i8").tobytes())
        h.update(f"/{self.batch_size}/{self.local_epochs}".encode())
        return h.hexdigest()

    # -- the batches ----------------------------------------------------------------------
    def indices(self, step: int) -> np.ndarray:
        """The example indices of global step ``step`` (``0 ≤ step < horizon``)."""
        if not 0 <= int(step) < self.horizon:
            raise IndexError(f"step {step} is outside the loader's horizon {self.horizon}")
        slot = int(step) % self.steps_per_epoch
        return self.order[slot * self.batch_size:(slot + 1) * self.batch_size]

    def uses(self, example: int) -> np.ndarray:
        """The global steps at which ``example`` is used (for checks and audits)."""
        slot = int(np.flatnonzero(self.order == int(example))[0]) // self.batch_size
        return np.arange(slot, self.horizon, self.steps_per_epoch)
