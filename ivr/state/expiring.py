"""A map whose entries each hold until a deadline: what the in-process stores keep that Redis
would keep with a PX (spent stream tokens, flow versions).

Single use of a stream token is decided by the shared store (Redis: a SET NX); the memory
store, and the resilient store while Redis is unreachable, decide it in one of these instead.
"""

from __future__ import annotations

from typing import Final, Generic, TypeVar

SWEEP_AT: Final = 1024
"""Past this many entries, a put sweeps out the expired ones (entries outlive their deadlines
otherwise: a process up for weeks would keep every token it ever admitted)."""

V = TypeVar("V")


class ExpiringMap(Generic[V]):
    """Keys -> a value and the monotonic time it may be forgotten."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[str, tuple[V, float]] = {}

    def get(self, key: str, now: float) -> V | None:
        """``key``'s value while it holds at ``now`` (monotonic), else None."""
        entry = self._entries.get(key)
        return entry[0] if entry is not None and entry[1] > now else None

    def holds(self, key: str, now: float) -> bool:
        """Whether ``key`` is in and still holds at ``now``."""
        entry = self._entries.get(key)
        return entry is not None and entry[1] > now

    def put(self, key: str, value: V, until: float, now: float) -> None:
        """Keep ``value`` for ``key`` until ``until`` (monotonic, as ``now``)."""
        if len(self._entries) >= SWEEP_AT:
            self._entries = {k: e for k, e in self._entries.items() if e[1] > now}
        self._entries[key] = (value, until)

    def __len__(self) -> int:
        return len(self._entries)
