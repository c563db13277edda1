"""The spends the memory store and the degraded resilient store decide single use by."""

from __future__ import annotations

from ivr.state.spent_tokens import SWEEP_AT, SpentTokens


def test_a_spend_holds_until_its_deadline_and_not_after() -> None:
    spends = SpentTokens()
    assert not spends.spent("tok", now=0.0)
    spends.spend("tok", until=10.0, now=0.0)
    assert spends.spent("tok", now=9.99)
    assert not spends.spent("tok", now=10.0)
    assert not spends.spent("other", now=1.0)


def test_past_the_sweep_size_expired_spends_go_and_live_ones_stay() -> None:
    spends = SpentTokens()
    for i in range(SWEEP_AT - 1):
        spends.spend(f"old-{i}", until=5.0, now=0.0)
    spends.spend("live", until=100.0, now=0.0)
    assert len(spends) == SWEEP_AT
    spends.spend("new", until=200.0, now=50.0)  # the old ones expired at 5
    assert len(spends) == 2
    assert spends.spent("live", now=50.0) and spends.spent("new", now=50.0)
    assert not spends.spent("old-0", now=50.0)
