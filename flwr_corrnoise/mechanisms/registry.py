"""The mechanism registry: every factorization a user can name, by name.

A mechanism is one module that ends with :func:`register`: its name, a one-line
description, its parameters (:class:`Param`), a builder ``build(n, **params)`` and, for the
solved kinds whose result can change between solves, ``restore(n, digest)`` from the
write-once cache. Its :class:`~.base.Factorization` supplies its own streaming kernel
(:meth:`~.base.Factorization.stream_kernel`). Everything that lists, builds or restores
mechanisms asks this registry — :func:`build_factorization`, :data:`MECHANISMS`, the
streams, the calibration, the CLI, the benchmarks — so adding one is one file (and its
test: ``docs/architecture.md`` walks through one), and there is no ``if name == …`` chain
whose forgotten branch could build another mechanism than the one named.

Built-in mechanisms register when :mod:`flwr_corrnoise.mechanisms` is imported; one
outside the package registers when its module is imported (before a stream of it is
restored in a new process).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from . import cache
from .base import Factorization, check_horizon

#: a name no mechanism may take: the learner's noiseless baseline (``PrivacySettings``)
RESERVED = frozenset({"none"})


@dataclass(frozen=True)
class Param:
    """One parameter a mechanism's builder takes (e.g. BLT's ``buffers``).

    ``kind`` is ``int``, ``float``, ``bool`` or ``str``; ``valid`` (if given) accepts a
    value of that type, and ``constraint`` says in words what it accepts (for errors and
    ``--help``). Values are checked here, before the builder runs, because a bad one
    would otherwise surface as a minutes-long solve or an empty matrix.
    """

    name: str
    kind: type
    default: Any
    doc: str
    valid: Callable[[Any], bool] | None = None
    constraint: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"parameter name {self.name!r} is not an identifier")
        if self.kind not in (int, float, bool, str):
            raise ValueError(f"parameter {self.name}: kind must be int, float, bool or str")
        object.__setattr__(self, "default", self.coerce(self.default))

    def coerce(self, value: Any) -> Any:
        """``value`` as this parameter's type, or ``ValueError`` saying what it accepts."""
        ok = {
            bool: isinstance(value, bool),
            int: isinstance(value, numbers.Integral) and not isinstance(value, bool),
            float: isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(float(value)),
            str: isinstance(value, str),
        }[self.kind]
        if ok:
            value = self.kind(value)
            ok = self.valid is None or bool(self.valid(value))
        if not ok:
            what = f"a{'n' if self.kind is int else ''} {self.kind.__name__}"
            raise ValueError(f"parameter {self.name} must be {what}"
                             f"{' ' + self.constraint if self.constraint else ''}, "
                             f"got {value!r}")
        return value


@dataclass(frozen=True)
class Mechanism:
    """A registered mechanism: what :func:`register` records (see the module docstring)."""

    name: str
    description: str
    build: Callable[..., Factorization]
    params: tuple[Param, ...] = ()
    restore: Callable[[int, str], Factorization | None] | None = None
    #: modules the builder imports when it runs (kept out of module import: SciPy's
    #: optimizers and signal tools cost ≈ 0.4–0.9 s each to import, paid by every learner
    #: process otherwise); a timed build imports them first (``cli._build``)
    build_imports: tuple[str, ...] = ()

    def resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter's value: ``given`` checked, defaults for the rest."""
        known = {p.name: p for p in self.params}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"mechanism {self.name!r} takes no parameter {unknown[0]!r}; "
                             f"its parameters are {sorted(known) or 'none'}")
        try:
            return {name: p.coerce(given[name]) if name in given else p.default
                    for name, p in known.items()}
        except ValueError as err:
            raise ValueError(f"mechanism {self.name!r}: {err}") from None

    def create(self, n: int, **params: Any) -> Factorization:
        """A new factorization for horizon ``n`` (``params`` checked, the rest at their
        defaults), not memoized: what :func:`build_factorization` memoizes, and what a
        benchmark timing a build from scratch calls."""
        n = check_horizon(n)
        fact = self.build(n, **self.resolve(params))
        if (fact.name, fact.n) != (self.name, n):
            # a stream records the factorization's own name: a builder that returned
            # another mechanism would make its noise (and its accounting) another's
            raise TypeError(f"the builder of {self.name!r} (N = {n}) returned "
                            f"{fact.name!r} (N = {fact.n})")
        return fact


_REGISTRY: dict[str, Mechanism] = {}


def register(
    name: str,
    description: str,
    build: Callable[..., Factorization],
    params: tuple[Param, ...] | list[Param] = (),
    restore: Callable[[int, str], Factorization | None] | None = None,
    build_imports: tuple[str, ...] | list[str] = (),
) -> Mechanism:
    """Make a mechanism nameable. ``build(n, **params)`` returns its factorization for
    horizon ``n``; ``restore(n, digest)`` (solved kinds) the exact one cached under
    ``digest`` when it was built, or ``None``; ``build_imports`` the modules ``build``
    imports inside its functions. A name can be registered once."""
    if not name or name != name.strip() or name in RESERVED:
        raise ValueError(f"{name!r} cannot name a mechanism")
    if name in _REGISTRY:
        raise ValueError(f"a mechanism named {name!r} is already registered")
    params = tuple(params)
    if len({p.name for p in params}) != len(params):
        raise ValueError(f"mechanism {name!r} declares a parameter twice")
    mechanism = Mechanism(name, description, build, params, restore, tuple(build_imports))
    _REGISTRY[name] = mechanism
    return mechanism


def unregister(name: str) -> None:
    """Remove a mechanism (a test's temporary one); forgets every built factorization."""
    get_mechanism(name)
    del _REGISTRY[name]
    _build.cache_clear()


def get_mechanism(name: str) -> Mechanism:
    """The registered mechanism ``name``; the error lists the valid ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown mechanism {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None


def check_mechanism(name: str) -> str:
    """Validate a mechanism name; the error lists the valid ones."""
    return get_mechanism(name).name


def mechanism_names(preferred: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every registered name: those in ``preferred`` first, in that order (each checked:
    a script's deliberate order or subset cannot name a mechanism that does not exist),
    then the others in registration order."""
    first = [check_mechanism(name) for name in preferred]
    return first + [name for name in _REGISTRY if name not in first]


class _Descriptions(Mapping[str, str]):
    """``name → one-line description``: a read-only, live view of the registry."""

    def __getitem__(self, name: str) -> str:
        try:
            return _REGISTRY[name].description
        except (KeyError, TypeError):
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr({name: m.description for name, m in _REGISTRY.items()})


#: every mechanism a user can name, with a one-line description (read-only)
MECHANISMS: Mapping[str, str] = _Descriptions()


def build_factorization(name: str, n: int, **params: Any) -> Factorization:
    """The factorization called ``name`` for horizon ``n`` with ``params`` (the others at
    their defaults), memoized per process on all three: every virtual learner of a
    simulation needs the same matrices."""
    mechanism = get_mechanism(name)
    resolved = mechanism.resolve(params)
    return _build(name, check_horizon(n), tuple(sorted(resolved.items())))


@lru_cache(maxsize=16)
def _build(name: str, n: int, params: tuple[tuple[str, Any], ...]) -> Factorization:
    return _REGISTRY[name].create(n, **dict(params))


build_factorization.cache_clear = _build.cache_clear  # type: ignore[attr-defined]


class FactorizationChangedError(ValueError):
    """A stream was made with a factorization that can no longer be rebuilt exactly."""


def factorization_by_digest(name: str, n: int, digest: str) -> Factorization:
    """The exact factorization ``(name, N)`` whose :attr:`~Factorization.digest` is
    ``digest``: the current one if it matches, else the write-once copy that was cached
    under that digest when it was built (solved kinds: the mechanism's ``restore``).
    Raises :class:`FactorizationChangedError`, naming old and new, if neither exists."""
    current = build_factorization(name, n)
    if current.digest == digest:
        return current
    restore = get_mechanism(name).restore
    found = restore(n, digest) if restore is not None else None
    if found is None or found.digest != digest:
        raise FactorizationChangedError(
            f"the noise stream was made with the {name} factorization for N = {n} with digest "
            f"{digest[:16]}…, but this process builds digest {current.digest[:16]}… and the "
            f"original is not in the cache ({cache.cache_dir()}); refusing to continue the "
            f"stream with other noise"
        )
    return found
