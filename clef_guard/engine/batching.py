"""Requests waiting for the backbone, and how they are packed into forward passes.

Requests from concurrent threads (``batch``, a server) queue as :class:`Job` objects;
whoever holds the backbone next answers every waiting one, packing them into passes of
at most ``max_tree_tokens`` tokens. A request's own error fails that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from clef_guard.engine.tree import Branch, OptionFeatures
from clef_guard.errors import EngineError, RequestError

_Item = TypeVar("_Item")


@dataclass(frozen=True)
class EncodedRequest:
    """Features of every question of one request, with token accounting."""

    features: list[OptionFeatures]
    input_tokens: int
    cached_tokens: int
    truncated_tokens: int


@dataclass
class Job:
    """One request waiting for (or done by) a forward pass."""

    state: Any
    branches: list[Branch]
    result: EncodedRequest | None = None
    error: BaseException | None = None
    done: bool = False

    def fail(self, exc: Exception) -> None:
        """Record why this job could not be answered: its own request error, or an engine failure."""
        if isinstance(exc, (RequestError, EngineError)):
            self.error = exc
        else:
            self.error = EngineError(f"the engine failed on this request: {exc}")
            self.error.__cause__ = exc
        self.done = True


@dataclass(frozen=True)
class Prepared:
    """A request with its prefix tokens, ready for a forward pass."""

    job: Job
    prefix: tuple[int, ...]
    truncated: int

    @property
    def length(self) -> int:
        """Prefix and tree tokens together."""
        return len(self.prefix) + sum(b.length for b in self.job.branches)


def packed(items: Sequence[_Item], size: Callable[[_Item], int], budget: int) -> list[list[_Item]]:
    """Consecutive groups of at most ``budget`` total size (an oversized item goes alone)."""
    groups: list[list[_Item]] = []
    total = 0
    for item in items:
        if not groups or total + size(item) > budget:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size(item)
    return groups
