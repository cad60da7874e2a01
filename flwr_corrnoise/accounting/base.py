"""What every accountant shares: the error types, input checks and the interface.

The split follows ``dp_accounting``: a mechanism *describes* what it releases as an event
(:mod:`.events`: sensitivities and noise, never data), and an :class:`Accountant` turns that
description into ``(ε, δ)``. Unlike ``dp_accounting``'s accountants, ours are stateless —
``epsilon(event, δ)`` rather than ``compose(event)`` then ``get_epsilon(δ)`` — because every
caller here asks about one whole release (a learner's stream so far, a node's ``T`` steps)
that it can describe at once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

__all__ = [
    "Accountant",
    "PrivacyBudgetError",
    "Release",
    "UnsupportedEventError",
    "check_budget",
    "check_positive",
]


class PrivacyBudgetError(ValueError):
    """An impossible or malformed privacy budget / calibration input."""


class UnsupportedEventError(ValueError):
    """An accountant was asked about a release it cannot account (e.g. a Gaussian release
    to a pure-ε accountant): refusing is the only safe answer."""


def check_budget(epsilon: float, delta: float) -> tuple[float, float]:
    """Validate ``ε > 0`` finite and ``δ ∈ (0, 1)``; return them as floats."""
    try:
        eps, dlt = float(epsilon), float(delta)
    except (TypeError, ValueError) as err:
        raise PrivacyBudgetError(f"ε and δ must be numbers, got {epsilon!r}, {delta!r}") from err
    if not math.isfinite(eps) or eps <= 0:
        raise PrivacyBudgetError(f"ε must be a finite number > 0, got {epsilon!r}")
    if not math.isfinite(dlt) or not 0 < dlt < 1:
        raise PrivacyBudgetError(f"δ must lie strictly between 0 and 1, got {delta!r}")
    return eps, dlt


def check_positive(name: str, value: float) -> float:
    """``value`` as a float, refused unless finite and ``> 0`` (the message names it)."""
    try:
        x = float(value)
    except (TypeError, ValueError) as err:
        raise PrivacyBudgetError(f"{name} must be a number, got {value!r}") from err
    if not math.isfinite(x) or x <= 0:
        raise PrivacyBudgetError(f"{name} must be a finite number > 0, got {value!r}")
    return x


class Release:
    """Base of every release description (an event, :mod:`.events`): what a mechanism
    releases, as sensitivities and noise — never data."""


class Accountant(ABC):
    """Turns a release description into its privacy guarantee.

    ``name`` is the label that every result computed by this accountant carries (the
    ``method`` of a :class:`~flwr_corrnoise.privacy.Calibration`).
    """

    name: str = ""

    @abstractmethod
    def supports(self, event: Release) -> bool:
        """Whether this accountant can account ``event`` (else its methods raise
        :class:`UnsupportedEventError`)."""

    @abstractmethod
    def epsilon(self, event: Release, delta: float) -> float:
        """The smallest ε this accountant proves for ``event`` at ``δ``."""

    @abstractmethod
    def delta(self, event: Release, epsilon: float) -> float:
        """The δ this accountant proves for ``event`` at ``ε``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
