"""Campaigns: a CSV of numbers (with per-row variables) dialled through a gateway's
``POST /calls`` at a steady rate, with a bounded number of requests in flight.

Every row ends with one result: placed (its CallSid), refused by the gateway (its reason), or
bad in the file (which line, what is wrong). A bad row never stops the others.
"""

from __future__ import annotations

import asyncio
import csv
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ivr.errors import IvrError
from ivr.state.base import mask
from ivr.telephony.dialing import is_dialable

NUMBER_COLUMNS = ("number", "to", "phone")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|second|m|min|minute|h|hour))?\s*$")
_PER = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}
_PER |= {"h": 3600.0, "hour": 3600.0}


class CampaignError(IvrError):
    """The campaign cannot start (unreadable file, no number column, bad rate)."""


@dataclass(frozen=True, slots=True)
class Row:
    line: int
    """Line in the CSV file (the header is line 1)."""
    to: str
    vars: dict[str, str]


@dataclass(frozen=True, slots=True)
class RowResult:
    line: int
    to: str
    placed: bool
    message: str
    """The CallSid when placed, else what was wrong."""
    sent_at: float | None = None
    """``time.monotonic()`` when its request left (None: never sent)."""

    def describe(self) -> str:
        what = f"placed {self.message}" if self.placed else f"not placed: {self.message}"
        return f"row {self.line} {mask(self.to) if self.to else '-'}: {what}"


def parse_rate(text: str) -> float:
    """Calls per second from ``1/s``, ``30/min``, ``0.5`` (per second)."""
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise CampaignError(f"--rate {text!r}: expected N/s, N/min or N/hour with N > 0")
    return float(m.group(1)) / _PER[m.group(2) or "s"]


def read_rows(path: Path) -> tuple[list[Row], list[RowResult]]:
    """The rows to dial, and the bad ones (with their line and what is wrong)."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            column = next((c for c in NUMBER_COLUMNS if c in header), None)
            if column is None:
                raise CampaignError(
                    f"{path}: no number column (first line must name one of "
                    f"{', '.join(NUMBER_COLUMNS)}; got {', '.join(header) or 'nothing'})"
                )
            return _rows(reader, column)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CampaignError(f"{path}: cannot read the CSV: {exc}") from exc


def _rows(reader: csv.DictReader[str], column: str) -> tuple[list[Row], list[RowResult]]:
    rows: list[Row] = []
    bad: list[RowResult] = []
    seen: dict[str, int] = {}
    for record in reader:
        line = reader.line_num
        values = {(k or "").strip(): (v or "").strip() for k, v in record.items() if k}
        if None in record:  # more cells than the header names
            bad.append(RowResult(line, values.get(column, ""), False, "more cells than columns"))
            continue
        to = values.pop(column, "")
        if not to:
            bad.append(RowResult(line, "", False, f"empty '{column}'"))
        elif not is_dialable(to):
            bad.append(RowResult(line, to, False, f"'{to}' is not E.164 (e.g. +15550100998)"))
        elif to in seen:
            bad.append(RowResult(line, to, False, f"same number as row {seen[to]}"))
        else:
            seen[to] = line
            rows.append(Row(line, to, {k: v for k, v in values.items() if v}))
    return rows, bad


@dataclass(slots=True)
class GatewayClient:
    """``POST /calls`` on a gateway with the admin token."""

    http: httpx.AsyncClient
    base_url: str
    token: str

    async def dial(self, body: dict[str, Any]) -> tuple[bool, str]:
        """(placed, CallSid or the reason it was not)."""
        try:
            resp = await self.http.post(
                self.base_url.rstrip("/") + "/calls",
                json=body,
                headers={"Authorization": f"Bearer {self.token}"},
            )
        except httpx.HTTPError as exc:
            return False, f"gateway unreachable: {exc!r}"
        try:
            data = resp.json()
        except ValueError:
            data = {}
        if resp.status_code == 201 and isinstance(data, dict) and data.get("call_sid"):
            return True, str(data["call_sid"])
        reason = data.get("error") if isinstance(data, dict) else None
        return False, f"HTTP {resp.status_code}: {reason or resp.text[:200]}"


@dataclass(slots=True)
class Campaign:
    client: GatewayClient
    flow: str
    rate: float
    """Calls per second (request starts are spaced by 1/rate)."""
    concurrency: int = 4
    """Requests in flight at once, at most."""
    common_vars: dict[str, str] = field(default_factory=dict)
    on_result: Callable[[RowResult], None] | None = None

    async def run(self, rows: list[Row]) -> list[RowResult]:
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(self.concurrency)
        results: list[RowResult] = []
        next_start = loop.time()

        async def send(row: Row) -> None:
            try:
                body = {"to": row.to, "flow": self.flow, "vars": {**self.common_vars, **row.vars}}
                sent = loop.time()
                placed, message = await self.client.dial(body)
                self._done(results, RowResult(row.line, row.to, placed, message, sent))
            finally:
                slots.release()

        async with asyncio.TaskGroup() as group:
            for row in rows:
                await slots.acquire()
                await asyncio.sleep(max(0.0, next_start - loop.time()))
                next_start = max(next_start, loop.time()) + 1 / self.rate
                group.create_task(send(row))
        return sorted(results, key=lambda r: r.line)

    def _done(self, results: list[RowResult], result: RowResult) -> None:
        results.append(result)
        if self.on_result is not None:
            self.on_result(result)
