"""The map the memory store and the degraded resilient store keep spends and flows in."""

from __future__ import annotations

from ivr.state.expiring import SWEEP_AT, ExpiringMap


def test_an_entry_holds_until_its_deadline_and_not_after() -> None:
    spends: ExpiringMap[str] = ExpiringMap()
    assert not spends.holds("tok", now=0.0)
    spends.put("tok", "CA1", until=10.0, now=0.0)
    assert spends.holds("tok", now=9.99) and spends.get("tok", now=9.99) == "CA1"
    assert not spends.holds("tok", now=10.0) and spends.get("tok", now=10.0) is None
    assert not spends.holds("other", now=1.0) and spends.get("other", now=1.0) is None


def test_past_the_sweep_size_expired_entries_go_and_live_ones_stay() -> None:
    spends: ExpiringMap[str] = ExpiringMap()
    for i in range(SWEEP_AT - 1):
        spends.put(f"old-{i}", "CA-old", until=5.0, now=0.0)
    spends.put("live", "CA-live", until=100.0, now=0.0)
    assert len(spends) == SWEEP_AT
    spends.put("new", "CA-new", until=200.0, now=50.0)  # the old ones expired at 5
    assert len(spends) == 2
    assert spends.get("live", now=50.0) == "CA-live" and spends.holds("new", now=50.0)
    assert not spends.holds("old-0", now=50.0)
