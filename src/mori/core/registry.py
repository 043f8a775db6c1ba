"""A small generic name -> object registry.

One registry per kind of plug-in (hardware presets, policies, ...): registering a name
twice is an error, and looking up an unknown name lists the valid choices, so a CLI can
take its choices from ``names()`` and report a typo usefully.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised by ``Registry.get`` for a name that is not registered.

    It is both a ``KeyError`` (a failed lookup) and a ``ValueError`` (a bad argument,
    e.g. from the command line); its message lists the valid names, sorted.
    """

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = valid
        choices = ", ".join(valid) if valid else "(none registered)"
        self.message = f"unknown {kind} {name!r}; valid names: {choices}"
        super().__init__(self.message)

    def __reduce__(self) -> tuple[type[UnknownNameError], tuple[str, str, list[str]]]:
        # picklable, so an error raised in a worker process arrives intact
        return (type(self), (self.kind, self.name, self.valid))

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message and wrap it in quotes.
        return self.message


class DuplicateNameError(ValueError):
    """Raised by ``Registry.register`` when the name is already taken."""


class FrozenRegistryError(RuntimeError):
    """Raised by ``Registry.register`` after ``freeze()``."""


class Registry(Generic[T]):
    """Maps unique names to objects of one kind.

    ``kind`` is a human label used in error messages (``"hardware preset"``).
    After ``freeze()`` the registry is read-only, which is how module-level tables
    built once at import stay constant.
    """

    __slots__ = ("_frozen", "_items", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._frozen = False

    def register(self, name: str, obj: T) -> T:
        """Add ``obj`` under ``name`` and return it; duplicate names are an error."""
        if self._frozen:
            raise FrozenRegistryError(f"the {self.kind} registry is frozen; cannot add {name!r}")
        if not name:
            raise ValueError(f"{self.kind} name must be non-empty")
        if name in self._items:
            raise DuplicateNameError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def freeze(self) -> None:
        """Make the registry read-only from now on."""
        self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    def get(self, name: str) -> T:
        """The object registered as ``name``; ``UnknownNameError`` lists the valid names."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        """Iterates over the names, sorted."""
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()!r})"
