"""A tiny name -> function registry, so variants are chosen by name rather than flag branches."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to implementations; an unknown name raises listing the valid ones."""

    def __init__(self, kind: str) -> None:
        """Create an empty registry; `kind` names it in error messages."""
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding an implementation under `name`."""

        def deco(obj: T) -> T:
            """Store `obj` under the name (a name may be registered once)."""
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The implementation registered under `name`."""
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self._items))}") from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        """Whether `name` is registered."""
        return name in self._items
