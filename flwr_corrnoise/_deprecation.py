"""Old spellings of renamed API, kept for one release (listed in ``docs/changes.md``).

Why one helper: every renamed keyword, dataclass field and class must keep working for a
release *and* say so the same way — a :class:`DeprecationWarning` naming the new spelling,
raised at the caller's line — so that a user's code keeps running while the warning tells
them what to change, and the library itself can be checked to use no old name
(``tests/test_renames.py`` runs it with every such warning recorded).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

#: when the old spellings go away
REMOVED_IN = "the next release"

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``. The default ``stacklevel``
    points at the caller of the function that calls this one (the user's line)."""
    warnings.warn(f"{old} is deprecated: use {new} (it will be removed in {REMOVED_IN})",
                  DeprecationWarning, stacklevel=stacklevel)


def _rename(what: str, renames: dict[str, str], kwargs: dict[str, Any]) -> None:
    """Move each deprecated keyword of ``kwargs`` to its new name, warning once each; both
    spellings at once is ambiguous and refused rather than one silently winning."""
    for old, new in renames.items():
        if old in kwargs:
            if new in kwargs:
                raise TypeError(f"{what}() got both {new!r} and its deprecated spelling {old!r}")
            warn_renamed(f"{what}({old}=...)", f"{new}=...", stacklevel=4)
            kwargs[new] = kwargs.pop(old)


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorate a function whose keyword ``old`` is now ``new`` (``old="new"``): calls
    with ``old=`` still work and warn. Positions are unchanged, so positional calls are
    unaffected (and pay only one ``if``)."""

    def decorate(func: F) -> F:
        what = func.__qualname__

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kwargs:
                _rename(what, renames, kwargs)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def renamed_fields(**renames: str) -> Callable[[C], C]:
    """Decorate a (frozen) dataclass whose field ``old`` is now ``new``: the constructor
    still takes ``old=`` and a read-only ``old`` property still reads ``new``, both with a
    warning. The field itself, its position, equality, hashing and ``asdict`` are the new
    field's only."""

    def decorate(cls: C) -> C:
        init = cls.__init__  # type: ignore[misc]
        name = cls.__name__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            if kwargs:
                _rename(name, renames, kwargs)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        for old, new in renames.items():

            def read(self: Any, _old: str = old, _new: str = new) -> Any:
                warn_renamed(f"{name}.{_old}", f"{name}.{_new}")
                return getattr(self, _new)

            setattr(cls, old, property(read, doc=f"Deprecated spelling of :attr:`{new}`."))
        return cls

    return decorate


def deprecated_names(module: str, renames: dict[str, tuple[str, Callable[[], Any]]]
                     ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for renamed module-level names: ``renames`` maps an old
    name to its new name and a loader of the object; the old name returns the *same*
    object (so ``isinstance`` and identity hold) with a warning. Other names raise the
    usual :class:`AttributeError`."""

    def __getattr__(attr: str) -> Any:  # noqa: N807
        if attr in renames:
            new, load = renames[attr]
            warn_renamed(f"{module}.{attr}", f"{module}.{new}")
            return load()
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")

    return __getattr__
