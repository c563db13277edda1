"""Every CallStore behaves the same: run against MemoryCallStore and RedisCallStore (real Redis)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from redis_server import LOCAL_REDIS_URL, delete_prefix, unique_prefix

from ivr.state.base import (
    CallExists,
    CallNotFound,
    CallRecord,
    CallStatus,
    CallStore,
    CorruptRecord,
    mask,
)
from ivr.state.memory import MemoryCallStore
from ivr.state.outcomes import Outcome, UnknownOutcome, outcome_of, parse_outcome
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore

StoreFactory = Callable[..., CallStore]


@pytest.fixture(params=["memory", "redis", "resilient-redis"])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    prefix = unique_prefix()
    made: list[CallStore] = []

    def make(**kwargs: Any) -> CallStore:
        store: CallStore
        if request.param == "memory":
            store = MemoryCallStore(**kwargs)
        elif request.param == "redis":
            store = RedisCallStore(LOCAL_REDIS_URL, prefix=prefix, **kwargs)
        else:  # the gateway's store while Redis is healthy must keep the same contract
            store = ResilientCallStore(RedisCallStore(LOCAL_REDIS_URL, prefix=prefix, **kwargs))
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()
    await delete_prefix(LOCAL_REDIS_URL, prefix)


@pytest.fixture
def store(make_store: StoreFactory) -> CallStore:
    return make_store()


def a_call(sid: str = "CA0001", **fields: Any) -> CallRecord:
    base: dict[str, Any] = {
        "call_sid": sid,
        "account_sid": "AC1",
        "from_number": "+14155550123",
        "to_number": "+14155550999",
        "flow_name": "support",
        "flow_version": "abc123",
        "status": CallStatus.ACTIVE,
    }
    return CallRecord(**(base | fields))


def incr(name: str) -> Callable[[CallRecord], None]:
    def mutate(record: CallRecord) -> None:
        record.variables[name] = record.variables.get(name, 0) + 1

    return mutate


async def test_a_created_call_reads_back_equal_at_version_1(store: CallStore) -> None:
    created = await store.create(a_call(node="greet", variables={"lang": "en"}))
    got = await store.get("CA0001")
    assert created.version == 1
    assert got == created
    assert got is not None and got.variables == {"lang": "en"} and got.node == "greet"


async def test_a_missing_call_reads_as_none(store: CallStore) -> None:
    assert await store.get("CA-nope") is None


async def test_creating_an_existing_call_fails_and_keeps_the_first(store: CallStore) -> None:
    await store.create(a_call(node="first"))
    with pytest.raises(CallExists, match="CA0001"):
        await store.create(a_call(node="second"))
    got = await store.get("CA0001")
    assert got is not None and got.node == "first"


async def test_update_applies_the_mutation_and_bumps_version(store: CallStore) -> None:
    created = await store.create(a_call())

    def move(r: CallRecord) -> None:
        r.node = "menu"
        r.flow_state["visits"] = [1, 2]

    updated = await store.update("CA0001", move)
    got = await store.get("CA0001")
    assert updated.version == 2 and updated.updated_at >= created.updated_at
    assert got == updated and got.node == "menu" and got.flow_state == {"visits": [1, 2]}


async def test_an_update_that_raises_writes_nothing(store: CallStore) -> None:
    await store.create(a_call())

    def broken(r: CallRecord) -> None:
        r.node = "half-done"
        raise RuntimeError("flow bug")

    with pytest.raises(RuntimeError, match="flow bug"):
        await store.update("CA0001", broken)
    got = await store.get("CA0001")
    assert got is not None and got.node is None and got.version == 1


async def test_updating_a_missing_call_raises_call_not_found(store: CallStore) -> None:
    with pytest.raises(CallNotFound, match="CA-gone"):
        await store.update("CA-gone", incr("n"))


async def test_an_update_may_not_change_the_call_sid(store: CallStore) -> None:
    await store.create(a_call())

    def hijack(r: CallRecord) -> None:
        r.call_sid = "CA-other"

    with pytest.raises(ValueError, match="call_sid"):
        await store.update("CA0001", hijack)
    assert await store.get("CA-other") is None


async def test_a_value_that_is_not_json_is_rejected_before_writing(store: CallStore) -> None:
    await store.create(a_call())

    def bad(r: CallRecord) -> None:
        r.variables["socket"] = object()

    with pytest.raises(ValueError):
        await store.update("CA0001", bad)
    got = await store.get("CA0001")
    assert got is not None and got.variables == {} and got.version == 1


async def test_history_and_turns_keep_only_the_newest_entries(store: CallStore) -> None:
    await store.create(a_call(history_limit=3, turns_limit=2))
    for i in range(5):

        def turn(r: CallRecord, i: int = i) -> None:
            r.history.append({"role": "user", "content": f"u{i}"})  # type: ignore[arg-type]
            r.add_message("assistant", f"a{i}")
            r.add_turn({"turn": i, "e2e_ms": 500 + i})

        await store.update("CA0001", turn)
    got = await store.get("CA0001")
    assert got is not None
    assert [m.content for m in got.history] == ["a3", "u4", "a4"]
    assert [t["turn"] for t in got.turns] == [3, 4]


async def test_end_stamps_the_call_and_removes_it_from_the_active_list(
    store: CallStore,
) -> None:
    await store.create(a_call("CA-a"))
    await store.create(a_call("CA-b"))
    await store.end("CA-a")
    ended = await store.get("CA-a")
    active = await store.list_active(10)
    assert ended is not None and ended.status is CallStatus.ENDED and ended.ended_at is not None
    assert [r.call_sid for r in active] == ["CA-b"]


async def test_an_ended_call_expires_after_the_ended_ttl(make_store: StoreFactory) -> None:
    store = make_store(ended_ttl=0.3)
    await store.create(a_call())
    await store.end("CA0001", CallStatus.TRANSFERRING)
    got = await store.get("CA0001")
    assert got is not None and got.status is CallStatus.TRANSFERRING
    await asyncio.sleep(0.45)
    assert await store.get("CA0001") is None


async def test_a_live_call_does_not_expire_on_the_ended_ttl(make_store: StoreFactory) -> None:
    store = make_store(ended_ttl=0.1)
    await store.create(a_call())
    await asyncio.sleep(0.25)
    assert await store.get("CA0001") is not None


async def test_a_live_call_nobody_writes_any_more_expires_after_the_active_ttl(
    make_store: StoreFactory,
) -> None:
    """A call whose end was never recorded (its instance died, Twilio never came back) must
    not be kept for ever; every write renews it."""
    store = make_store(active_ttl=0.4)
    if isinstance(store, ResilientCallStore):
        pytest.skip("by design it serves its own copy (bounded LRU) of a call Redis has lost")
    await store.create(a_call())
    await asyncio.sleep(0.25)
    await store.update("CA0001", incr("n"))  # renews
    await asyncio.sleep(0.25)
    assert await store.get("CA0001") is not None
    await asyncio.sleep(0.3)
    assert await store.get("CA0001") is None
    assert [r.call_sid for r in await store.list_active()] == []


async def test_list_active_is_most_recent_first_and_honours_limit(store: CallStore) -> None:
    for sid in ("CA-1", "CA-2", "CA-3"):
        await store.create(a_call(sid))
        await asyncio.sleep(0.002)
    await store.update("CA-1", incr("n"))
    assert [r.call_sid for r in await store.list_active(10)] == ["CA-1", "CA-3", "CA-2"]
    assert [r.call_sid for r in await store.list_active(2)] == ["CA-1", "CA-3"]


async def test_a_stream_token_admits_one_stream(store: CallStore) -> None:
    await store.put_stream_token("CA0001", "tok-abc", ttl=30)
    assert await store.claim_stream_token("tok-abc", "CA0001", ttl=30)
    assert not await store.claim_stream_token("tok-abc", "CA0001", ttl=30), "one stream a token"
    assert await store.claim_stream_token("tok-other", "CA0001", ttl=30)


async def test_a_token_the_store_never_registered_still_admits_one_stream(
    store: CallStore,
) -> None:
    # Its signature proves it genuine; the webhook's instance may have failed to register it.
    assert await store.claim_stream_token("tok-unregistered", "CA0001", ttl=30)
    assert not await store.claim_stream_token("tok-unregistered", "CA0001", ttl=30)


async def test_a_spent_token_is_forgotten_once_it_has_expired(store: CallStore) -> None:
    assert await store.claim_stream_token("tok-abc", "CA0001", ttl=0.3)
    assert not await store.claim_stream_token("tok-abc", "CA0001", ttl=0.3)
    await asyncio.sleep(0.45)  # the token itself is refused by now: the store keeps nothing
    assert await store.claim_stream_token("tok-abc", "CA0001", ttl=0.3)


async def test_concurrent_updates_in_one_process_are_all_kept(store: CallStore) -> None:
    await store.create(a_call())
    await asyncio.gather(*(store.update("CA0001", incr("n")) for _ in range(40)))
    got = await store.get("CA0001")
    assert got is not None and got.variables["n"] == 40 and got.version == 41


async def test_a_returned_record_is_a_copy_not_the_stored_state(store: CallStore) -> None:
    created = await store.create(a_call())
    created.variables["leak"] = True
    got = await store.get("CA0001")
    assert got is not None and "leak" not in got.variables


async def test_ping_answers_true_when_the_store_is_up(store: CallStore) -> None:
    assert await store.ping() is True


def test_redacted_masks_phone_numbers_but_the_last_two_digits() -> None:
    shown = a_call().redacted()
    assert shown.from_number == "+*********23"
    assert shown.to_number == "+*********99"
    assert a_call().from_number == "+14155550123"  # the original is untouched
    assert mask("client:alice") == "******:***ce"


def test_a_record_loaded_from_json_keeps_its_bounds_and_rejects_unknown_fields() -> None:
    raw = a_call(history_limit=2).model_dump(mode="json")
    raw["history"] = [{"role": "user", "content": str(i)} for i in range(4)]
    assert [m.content for m in CallRecord.model_validate(raw).history] == ["2", "3"]
    with pytest.raises(ValueError, match="colour"):
        CallRecord.model_validate(raw | {"colour": "red"})


def test_redaction_masks_the_numbers_in_flow_variables_too() -> None:
    record = CallRecord(
        call_sid="CA1",
        from_number="+14155550123",
        to_number="+15550100001",
        variables={"caller": "+14155550123", "account": "12345"},
        flow_state={"vars": {"called": "+15550100001"}},
    )
    shown = record.redacted().model_dump_json()
    assert "+14155550123" not in shown and "+15550100001" not in shown
    assert '"account":"12345"' in shown.replace(" ", "")


# -- flow sources: the files a pinned flow version was loaded from ------------------------------

SOURCES = {
    "support.yaml": "name: support\nstart: hi\n",
    "knowledge/faq.md": "Opening hours: 9\u201317 h\r\nno trailing newline",
}


async def test_saved_flow_sources_read_back_exactly(store: CallStore) -> None:
    await store.save_flow_sources("v1abc", SOURCES, ttl=30)
    assert await store.load_flow_sources("v1abc") == SOURCES
    assert await store.load_flow_sources("v2def") is None


async def test_flow_sources_of_a_version_are_kept_from_the_first_save(store: CallStore) -> None:
    await store.save_flow_sources("v1abc", SOURCES, ttl=30)
    await store.save_flow_sources("v1abc", {"other.yaml": "name: other\n"}, ttl=30)
    assert await store.load_flow_sources("v1abc") == SOURCES


async def test_flow_sources_expire_after_their_ttl(store: CallStore) -> None:
    await store.save_flow_sources("v1abc", SOURCES, ttl=0.3)
    await asyncio.sleep(0.45)
    assert await store.load_flow_sources("v1abc") is None


async def test_saving_flow_sources_again_renews_their_ttl(store: CallStore) -> None:
    await store.save_flow_sources("v1abc", SOURCES, ttl=0.4)
    await asyncio.sleep(0.25)
    await store.save_flow_sources("v1abc", SOURCES, ttl=0.4)
    await asyncio.sleep(0.25)  # 0.5 s after the first save, 0.25 s after the second
    assert await store.load_flow_sources("v1abc") == SOURCES


async def test_returned_flow_sources_are_a_copy(store: CallStore) -> None:
    await store.save_flow_sources("v1abc", SOURCES, ttl=30)
    got = await store.load_flow_sources("v1abc")
    assert got is not None
    got["support.yaml"] = "changed"
    assert await store.load_flow_sources("v1abc") == SOURCES


# -- the ended index: calls that ended on any instance, newest first ----------------------------


async def end_in_order(store: CallStore, *sids: str) -> list[CallRecord]:
    """Create and end each call in turn; their records as stored (ended_at set)."""
    ended = []
    for sid in sids:
        await store.create(a_call(sid))
        await asyncio.sleep(0.002)  # distinct end times
        await store.end(sid)
        got = await store.get(sid)
        assert got is not None and got.ended_at is not None
        ended.append(got)
    return ended


async def test_ended_calls_are_listed_newest_first_and_paged_by_end_time(
    store: CallStore,
) -> None:
    await store.create(a_call("CA-live"))
    first, second, third = await end_in_order(store, "CA-e1", "CA-e2", "CA-e3")
    page = await store.list_ended(2)
    assert [r.call_sid for r in page] == ["CA-e3", "CA-e2"]
    assert page[0] == third and page[1].ended_at == second.ended_at
    rest = await store.list_ended(2, before=page[-1].ended_at)
    assert [r.call_sid for r in rest] == ["CA-e1"]
    assert await store.list_ended(2, before=first.ended_at) == []
    assert await store.list_ended(0) == []
    assert [r.call_sid for r in await store.list_active(10)] == ["CA-live"]


async def test_an_ended_call_is_listed_once_at_its_end_time_however_often_it_is_written(
    store: CallStore,
) -> None:
    [ended] = await end_in_order(store, "CA-once")
    await store.end("CA-once")  # ending again keeps the first end time

    def attach(r: CallRecord) -> None:
        r.recordings.append("local:CA-once.ogg")

    await store.update("CA-once", attach)  # a recording saved after the end
    [listed] = await store.list_ended(10)
    assert listed.call_sid == "CA-once" and listed.ended_at == ended.ended_at
    assert listed.recordings == ["local:CA-once.ogg"]


async def test_a_call_stored_already_ended_is_listed(store: CallStore) -> None:
    """A write-back of a call that ended while the store was away creates it ended."""
    ended = a_call("CA-late", status=CallStatus.ENDED, ended_at=a_call().created_at)
    await store.create(ended)
    assert [r.call_sid for r in await store.list_ended(10)] == ["CA-late"]


async def test_an_ended_call_leaves_the_ended_list_when_it_expires(
    make_store: StoreFactory,
) -> None:
    store = make_store(ended_ttl=0.3)
    await end_in_order(store, "CA-gone")
    assert [r.call_sid for r in await store.list_ended(10)] == ["CA-gone"]
    await asyncio.sleep(0.45)
    assert await store.list_ended(10) == []


async def test_the_timeline_keeps_only_the_newest_events(store: CallStore) -> None:
    await store.create(a_call(timeline_limit=3))
    for i in range(5):

        def press(r: CallRecord, i: int = i) -> None:
            r.add_events([{"at": f"t{i}", "kind": "dtmf", "digits": str(i)}])

        await store.update("CA0001", press)
    got = await store.get("CA0001")
    assert got is not None and [e["digits"] for e in got.timeline] == ["2", "3", "4"]


async def test_list_stale_gives_the_live_calls_unwritten_since_oldest_first(
    store: CallStore,
) -> None:
    for sid in ("CA-old", "CA-older-ended", "CA-mid"):
        await store.create(a_call(sid))
        await asyncio.sleep(0.02)
    await store.end("CA-older-ended")
    await asyncio.sleep(0.02)
    cutoff = datetime.now(UTC)
    await asyncio.sleep(0.02)
    await store.update("CA-mid", incr("n"))  # written after the cutoff: not stale
    await store.create(a_call("CA-new"))
    stale = await store.list_stale(cutoff)
    assert [r.call_sid for r in stale] == ["CA-old"]
    assert await store.list_stale(datetime.now(UTC), limit=1) == [await store.get("CA-old")]
    assert await store.list_stale(datetime.now(UTC), limit=0) == []


# -- records across versions ---------------------------------------------------------------------

PREVIOUS_FIELDS = {
    "call_sid", "stream_sid", "account_sid", "from_number", "to_number", "flow_name",
    "flow_version", "node", "variables", "flow_state", "history", "turns", "status",
    "created_at", "updated_at", "ended_at", "version", "instance_id", "stream_count",
    "record_call", "recordings", "end_action", "transfer_to", "warm_transfer", "direction",
    "answered_by", "twilio_answered_by", "history_limit", "turns_limit", "timeline",
    "timeline_limit",
}  # fmt: skip
"""CallRecord's fields in the version before outcomes (extra="forbid" there)."""


def _previous(**fields: Any) -> str:
    """A record as the previous version wrote it."""
    base = {
        "call_sid": "CA-prev",
        "status": "ended",
        "created_at": "2026-11-01T10:00:00Z",
        "updated_at": "2026-11-01T10:01:00Z",
        "ended_at": "2026-11-01T10:01:00Z",
        "version": 7,
        "stream_count": 1,
    }
    return json.dumps(base | fields)


@pytest.mark.parametrize(
    ("fields", "outcome"),
    [
        ({"flow_state": {"outcome": "hangup"}, "end_action": "hangup"}, Outcome.FLOW_HUNG_UP),
        ({"flow_state": {"outcome": "caller_hangup"}}, Outcome.CALLER_HUNG_UP),
        ({"end_action": "transfer", "transfer_to": "+15550100"}, Outcome.TRANSFERRED_COLD),
        (
            {"end_action": "transfer", "warm_transfer": {"room": "r", "status": "connected"}},
            Outcome.TRANSFERRED_WARM,
        ),
        ({}, Outcome.CALLER_HUNG_UP),  # its "dropped": ended on `stop`, no decision
        ({"stream_count": 0, "direction": "outbound"}, Outcome.NEVER_CONNECTED),
        ({"status": "active", "ended_at": None}, None),
    ],
)
def test_a_record_the_previous_version_wrote_reads_with_the_new_outcome_names(
    fields: dict[str, Any], outcome: Outcome | None
) -> None:
    record = CallRecord.from_json(_previous(**fields), "redis:ivr:call:CA-prev")
    assert outcome_of(record) == outcome
    assert record.view()["outcome"] == (outcome.value if outcome else None)


def test_new_fields_stay_out_of_the_json_until_set_so_the_previous_version_reads_it() -> None:
    live = a_call("CA-live")
    assert set(json.loads(live.to_json())) <= PREVIOUS_FIELDS
    assert CallRecord.from_json(live.to_json(), "x") == live
    live.outcome, live.twilio_status, live.billed_seconds = Outcome.DROPPED, "completed", 12
    ended = CallRecord.from_json(live.to_json(), "x")
    assert (ended.outcome, ended.twilio_status, ended.billed_seconds) == (
        Outcome.DROPPED,
        "completed",
        12,
    )
    with pytest.raises(CorruptRecord, match="outcome"):
        CallRecord.from_json(_previous(outcome="vanished"), "x")


def test_outcome_names_of_the_previous_version_are_understood() -> None:
    assert parse_outcome("hangup") == Outcome.FLOW_HUNG_UP
    assert parse_outcome("Caller hung up") == Outcome.CALLER_HUNG_UP
    assert parse_outcome("never-connected") == Outcome.NEVER_CONNECTED
    assert parse_outcome("error") == Outcome.FAILED
    with pytest.raises(UnknownOutcome, match="one of caller_hung_up, flow_hung_up"):
        parse_outcome("exploded")
