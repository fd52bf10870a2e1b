"""Least recently used, bounded by bytes, with a time to live (pure: the caller passes the time)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(slots=True)
class _Slot(Generic[V]):
    value: V
    size: int
    expires: float


class ByteLRU(Generic[V]):
    """Values with a size each; the least recently used go first when over ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._slots: OrderedDict[str, _Slot[V]] = OrderedDict()
        #: Told each key that goes (evicted, expired, or too large to hold anew), so
        #: what refers to it can go too (the semantic index's question); not told of
        #: a value replaced by another under the same key.
        self.evicted: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def get(self, key: str, now: float) -> V | None:
        """The value, if held and not expired (it becomes the most recently used)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if now >= slot.expires:
            self._drop(key)
            return None
        self._slots.move_to_end(key)
        return slot.value

    def put(self, key: str, value: V, size: int, expires: float) -> bool:
        """Hold ``value`` until ``expires``; False (nothing held) if it alone is over the bound."""
        if key in self._slots:
            self._drop(key, told=False)
        if size > self.max_bytes:
            if self.evicted is not None:
                self.evicted(key)
            return False
        self._slots[key] = _Slot(value, size, expires)
        self.bytes += size
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._slots))
            self._drop(oldest)
        return True

    def _drop(self, key: str, *, told: bool = True) -> None:
        slot = self._slots.pop(key)
        self.bytes -= slot.size
        if told and self.evicted is not None:
            self.evicted(key)
