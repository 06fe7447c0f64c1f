"""A bounded LRU of KV caches keyed by token prefix.

An agent's state grows by appending turns. Keeping the KV cache of recent prefixes
lets a gate at turn ``k`` run the model only on the tokens added since turn ``k - 1``.
An entry serves any sequence it shares a beginning with, cut to what they share: two
policies' views of one call, which differ only after the conversation, read it once.
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

    def longest_shared(self, tokens: tuple[int, ...]) -> tuple[int, tuple[int, ...], Any]:
        """The entry sharing the longest beginning with ``tokens``: ``(shared length, its key, its kv)``,
        or ``(0, (), None)``. The kv holds the whole key: cut a copy to the shared length before use."""
        best, best_key = 0, ()
        for key in self._entries:
            shared = _shared_length(key, tokens)
            if shared > best or (shared == best > 0 and len(key) < len(best_key)):  # the shortest: least to cut
                best, best_key = shared, key
        if not best:
            return 0, (), None
        self._entries.move_to_end(best_key)
        return best, best_key, self._entries[best_key]

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


def _shared_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
