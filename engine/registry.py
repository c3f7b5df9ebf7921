"""A name registry for swappable parts (weight loaders, linear methods, attention backends):
implementations register under a name, callers build one by name."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")
FactoryT = TypeVar("FactoryT", bound=Callable)


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # what the names name, for messages: "weight loader", ...
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[FactoryT], FactoryT]:
        """Class (or factory) decorator: make it buildable as `name`."""

        def decorate(factory: FactoryT) -> FactoryT:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._factories[name] = factory
            return factory

        return decorate

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories

    def create(self, name: str, *args, **kwargs) -> T:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._factories[name](*args, **kwargs)
