"""Stream tokens spent in this process, each remembered until it would have expired anyway.

Single use of a stream token is decided by the shared store (Redis: a SET NX); the memory
store, and the resilient store while Redis is unreachable, decide it here instead.
"""

from __future__ import annotations

from typing import Final

SWEEP_AT: Final = 1024
"""Past this many entries, a spend sweeps out the expired ones (spends outlive their tokens
otherwise: a process up for weeks would keep every token it ever admitted)."""


class SpentTokens:
    """Tokens spent here -> the monotonic time their spend may be forgotten."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def spent(self, token: str, now: float) -> bool:
        """Whether ``token`` was spent here and that spend still holds at ``now``."""
        return self._until.get(token, 0.0) > now

    def spend(self, token: str, until: float, now: float) -> None:
        """Remember ``token`` as spent until ``until`` (monotonic, as ``now``)."""
        if len(self._until) >= SWEEP_AT:
            self._until = {t: d for t, d in self._until.items() if d > now}
        self._until[token] = until

    def __len__(self) -> int:
        return len(self._until)
