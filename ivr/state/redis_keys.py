"""Where a call's data lives in Redis, and for how long: the key schema of
``ivr.state.redis_store`` (its docstring draws the layout)."""

from __future__ import annotations

import time
from datetime import datetime

from ivr.state.base import CallRecord


class RedisKeys:
    """The keys under ``prefix``; in a cluster a call's sid is a hash tag, so every key a call
    may ever have lands in its slot."""

    def __init__(self, prefix: str, *, cluster: bool, active_ttl: float, ended_ttl: float) -> None:
        self.prefix = prefix
        self.cluster = cluster
        self.active_ttl = active_ttl
        self.ended_ttl = ended_ttl
        self.active = f"{prefix}active"
        self.ended = f"{prefix}ended"

    def call_key(self, call_sid: str) -> str:
        if self.cluster:
            return f"{self.prefix}call:{{{call_sid}}}"
        return f"{self.prefix}call:{call_sid}"

    def token_key(self, token: str) -> str:
        """A minted token, as earlier releases register and spend it (GETDEL)."""
        return f"{self.prefix}token:{token}"

    def spent_key(self, token: str) -> str:
        """A spent token: single use is this key's SET NX."""
        return f"{self.prefix}spent:{token}"

    def flow_key(self, version: str) -> str:
        return f"{self.prefix}flow:{version}"

    def ttl_ms(self, record: CallRecord) -> int:
        if record.ended_at is None:
            return max(1, int(self.active_ttl * 1000))
        # Measured from ended_at, so re-writing an ended call does not extend its life.
        spent = (record.updated_at - record.ended_at).total_seconds()
        return max(1, int((self.ended_ttl - spent) * 1000))

    def index_score(self, record: CallRecord) -> float:
        """Where the record sits in its index: the active set by updated_at, the ended one by
        ended_at (constant: re-writing an ended call does not move it)."""
        return score(record.ended_at or record.updated_at)

    def ended_cutoff(self) -> float:
        """Ended calls older than this have expired: the ended index drops them."""
        return time.time() - self.ended_ttl


def score(when: datetime) -> float:
    """A time as an index score (epoch seconds)."""
    return when.timestamp()
