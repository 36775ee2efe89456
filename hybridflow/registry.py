"""Name -> function (or class) registries: estimators, losses, scorers, tools and tool-call parsers are
registered by the name a config gives them, and a name never registered fails loudly with the known ones."""

from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Iterable, Iterator, List, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """Raised on lookup of a name that was never registered.

    Subclasses both ``KeyError`` (it is a failed mapping lookup) and
    ``ValueError`` (it is usually a bad config value) so callers can catch
    whichever reads more naturally.
    """

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class Registry:
    """A named mapping from strings to callables.

    Args:
        kind: human-readable description used in error messages,
            e.g. ``"advantage estimator"``.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: Dict[str, Callable] = {}
        self._needs: Dict[str, FrozenSet[str]] = {}

    def register(self, name: str, *aliases: str, needs: Iterable[str] = ()) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and any ``aliases``. ``needs``: what the function
        takes that the run must produce for it (e.g. an estimator's ``values``: a critic), read by the run
        plan (hybridflow/plan/needs.py) instead of name checks elsewhere."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                self.add(key, fn)
                self._needs[key] = frozenset(needs)
            return fn

        return decorator

    def needs(self, name: str) -> FrozenSet[str]:
        """What ``name`` declared it needs when it registered (unknown names: ``UnknownNameError``)."""
        self.get(name)
        return self._needs.get(name, frozenset())

    def add(self, name: str, fn: Callable) -> None:
        """Register ``fn`` under ``name``; re-registering a name is an error
        because silently replacing an estimator would change training."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty str, got {name!r}")
        if name in self._entries and self._entries[name] is not fn:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = fn

    def get(self, name: str) -> Callable:
        """Return the callable registered as ``name``.

        Raises:
            UnknownNameError: if ``name`` is not registered; the message lists
                every known name.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def names(self) -> List[str]:
        """Sorted registered names (aliases included)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
