"""The console's search of ended calls: pages of the store's ended index (every instance's
ended calls, newest first), filtered as the operator asked, until a page of matches is full.

A search reads at most ``MAX_SCANNED`` records per request and answers with a cursor (``next``:
the end time of the last record it read) to go on from, so a search that matches little never
reads the whole index in one request. A day (``date``) starts the read at the end of that day
and stops at its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from ivr.console import views
from ivr.state.base import CallStore
from ivr.state.outcomes import UnknownOutcome, parse_outcome

PAGE = 100
"""Records read from the store at a time."""
MAX_SCANNED = 2000
"""Records one search request reads at most before it answers with a cursor."""


class BadSearch(ValueError):
    """A search field that cannot be read; the message names it and what was given."""


@dataclass(frozen=True, slots=True)
class Search:
    query: str = ""
    flow: str = ""
    outcome: str = ""
    day: date | None = None
    before: datetime | None = None

    @classmethod
    def parse(cls, query: str, flow: str, outcome: str, day: str, before: str) -> Search:
        try:
            on = date.fromisoformat(day) if day else None
        except ValueError:
            raise BadSearch(f"date={day!r}: expected a day as YYYY-MM-DD") from None
        try:
            after = datetime.fromisoformat(before) if before else None
        except ValueError:
            raise BadSearch(f"before={before!r}: expected an ISO 8601 time") from None
        if after is not None and after.tzinfo is None:
            raise BadSearch(f"before={before!r}: the time needs its UTC offset")
        try:  # the previous version's names ("hangup", "transfer") still find their calls
            ended = parse_outcome(outcome).value if outcome.strip() else ""
        except UnknownOutcome as exc:
            raise BadSearch(str(exc)) from None
        return cls(query.strip(), flow.strip(), ended, on, after)


async def search_ended(
    store: CallStore, search: Search, *, limit: int, pii: bool, max_scanned: int = MAX_SCANNED
) -> dict[str, Any]:
    """Up to ``limit`` rows of ended calls matching ``search``, newest first, and the cursor
    to the next ones (None when the index holds no more)."""
    cursor = search.before
    start: datetime | None = None
    if search.day is not None:
        start = datetime.combine(search.day, time.min, UTC)
        end_of_day = start + timedelta(days=1)
        cursor = end_of_day if cursor is None else min(cursor, end_of_day)
    day = search.day.isoformat() if search.day else ""
    rows: list[dict[str, Any]] = []
    scanned = 0
    while len(rows) < limit and scanned < max_scanned:
        page = await store.list_ended(min(PAGE, max_scanned - scanned), cursor)
        if not page:
            return {"calls": rows, "next": None, "scanned": scanned}
        for record in page:
            if start is not None and record.ended_at is not None and record.ended_at < start:
                return {"calls": rows, "next": None, "scanned": scanned}
            scanned += 1
            cursor = record.ended_at
            row = views.summary(record, pii=pii)
            if views.matches(row, search.query, search.flow, search.outcome, day):
                rows.append(row)
                if len(rows) >= limit:
                    break
    return {"calls": rows, "next": cursor.isoformat() if cursor else None, "scanned": scanned}
