"""Flow sources in a ``ResilientCallStore``: the versions this instance saved are kept here
(newest ``MAX_LOCAL_FLOWS``), so its calls load them while the primary is away, and saved to
the primary when it is back."""

from __future__ import annotations

import time

from ivr.state.base import StoreUnavailable
from ivr.state.resilient_core import ResilientCore

MAX_LOCAL_FLOWS = 256  # flow versions whose sources are kept here (a few KB to MB each)


class FlowSources(ResilientCore):
    """Keeps, loads and (once the primary is back) saves the flow sources of this instance."""

    async def save_flow_sources(self, version: str, sources: dict[str, str], ttl: float) -> None:
        kept = self._flows.get(version)
        if kept is None or kept[1] <= time.monotonic():  # stored if absent, like the primary
            kept = (dict(sources), 0.0)
        self._flows[version] = (kept[0], time.monotonic() + ttl)
        self._flows.move_to_end(version)
        while len(self._flows) > MAX_LOCAL_FLOWS:
            old, _ = self._flows.popitem(last=False)
            self._pending_flows.discard(old)
        if not self.degraded:
            try:
                work = self.primary.save_flow_sources(version, sources, ttl)
                await self._within_budget("save_flow_sources", work)
                return
            except StoreUnavailable as exc:
                self._degrade("save_flow_sources", exc)
        self._pending_flows.add(version)
        self._wake.set()

    async def load_flow_sources(self, version: str) -> dict[str, str] | None:
        entry = self._flows.get(version)
        if entry is not None and entry[1] > time.monotonic():
            return dict(entry[0])
        if self.degraded:
            return None
        try:
            work = self.primary.load_flow_sources(version)
            return await self._within_budget("load_flow_sources", work)
        except StoreUnavailable as exc:
            self._degrade("load_flow_sources", exc)
            return None

    async def _flush_flows(self) -> None:
        for version in list(self._pending_flows):
            entry = self._flows.get(version)
            left = entry[1] - time.monotonic() if entry is not None else 0.0
            if entry is not None and left > 0:
                await self.primary.save_flow_sources(version, entry[0], left)
            self._pending_flows.discard(version)
