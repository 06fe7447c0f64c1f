"""A bounded LRU of KV caches keyed by token prefix.

An agent's state grows by appending turns. Keeping the KV cache of recent prefixes
lets a gate at turn ``k`` run the model only on the tokens added since turn ``k - 1``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class PrefixCache:
    """Least-recently-used KV caches, looked up by the longest cached prefix of a sequence."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, tokens: tuple[int, ...]) -> tuple[int, Any]:
        """The longest cached prefix of ``tokens``: ``(length, kv)``, or ``(0, None)``."""
        best: tuple[int, ...] = ()
        for key in self._entries:
            if len(best) < len(key) <= len(tokens) and tokens[: len(key)] == key:
                best = key
        if not best:
            return 0, None
        self._entries.move_to_end(best)
        return len(best), self._entries[best]

    def put(self, tokens: tuple[int, ...], kv: Any) -> None:
        """Remember ``kv`` as the cache of exactly ``tokens``, evicting the oldest entries."""
        if self.max_entries <= 0:
            return
        self._entries[tokens] = kv
        self._entries.move_to_end(tokens)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def discard(self, tokens: tuple[int, ...]) -> None:
        """Forget the entry for ``tokens`` (after a failure may have left it half-written)."""
        self._entries.pop(tokens, None)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
