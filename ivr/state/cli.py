"""`ivr calls list [--ended]` / `ivr calls show SID`: look at call state from a shell; an ended
call shows how it ended in the console's words (``outcome``).

Numbers, and phone- or card-like text anywhere in a record, are masked unless ``--pii``: whoever
runs this reads Redis directly, but screens and terminal logs are shared.

Usage from the main CLI: ``add_commands(subparsers)`` then ``sys.exit(args.func(args))``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import datetime
from typing import Any

from ivr.state.base import StoreError
from ivr.state.redis_store import RedisCallStore

_COLUMNS = ("call_sid", "status", "flow_name", "node", "from_number", "instance_id", "updated_at")
_ENDED_COLUMNS = (
    "call_sid",
    "outcome",
    "twilio_status",
    "billed_seconds",
    "flow_name",
    "node",
    "from_number",
    "instance_id",
    "ended_at",
)


def add_commands(subparsers: Any) -> None:
    calls = subparsers.add_parser("calls", help="inspect call state in Redis")
    sub = calls.add_subparsers(dest="calls_command", required=True)
    listing = sub.add_parser(
        "list", help="active calls, most recently updated first (--ended: ended calls)"
    )
    listing.add_argument("--limit", type=int, default=100)
    listing.add_argument(
        "--ended", action="store_true", help="ended calls, newest first, with their outcome"
    )
    listing.set_defaults(func=_run_list)
    show = sub.add_parser("show", help="one call's full record")
    show.add_argument("sid")
    show.set_defaults(func=_run_show)
    for parser in (listing, show):
        parser.add_argument("--redis-url", default=os.environ.get("IVR_REDIS_URL"))
        parser.add_argument("--redis-prefix", default=os.environ.get("IVR_REDIS_PREFIX", "ivr:"))
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.add_argument(
            "--pii", action="store_true", help="show phone and card numbers unmasked"
        )


def _store(args: argparse.Namespace) -> RedisCallStore | None:
    if not args.redis_url:
        print("error: no Redis URL: pass --redis-url or set IVR_REDIS_URL", file=sys.stderr)
        return None
    return RedisCallStore(args.redis_url, prefix=args.redis_prefix, max_connections=2)


def _run_list(args: argparse.Namespace) -> int:
    store = _store(args)
    if store is None:
        return 2
    listed = store.list_ended(args.limit) if args.ended else store.list_active(args.limit)
    calls = _run(store, listed)
    if calls is None:
        return 1
    rows = [c.view(pii=args.pii) for c in calls]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.ended:
        print(_table(rows, _ENDED_COLUMNS, "ended"))
    else:
        print(_table(rows, _COLUMNS, "active"))
    return 0


def _run_show(args: argparse.Namespace) -> int:
    store = _store(args)
    if store is None:
        return 2
    record = _run(store, store.get(args.sid))
    if record is None:
        print(f"error: call {args.sid!r} not found", file=sys.stderr)
        return 1
    shown = record.view(pii=args.pii)
    if args.json:
        print(json.dumps(shown, indent=2))
    else:
        for key, value in shown.items():
            text = value if isinstance(value, str) else json.dumps(value)
            print(f"{key:>14}  {text}")
    return 0


def _run(store: RedisCallStore, op: Any) -> Any:
    async def go() -> Any:
        try:
            return await op
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return None
        finally:
            await store.aclose()

    return asyncio.run(go())


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...], what: str) -> str:
    cells = [[_cell(r.get(c), c) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.append(f"({len(rows)} {what})")
    return "\n".join(lines)


def _cell(value: object, column: str) -> str:
    if value is None:
        return "-"
    if column.endswith("_at") and isinstance(value, str):
        return datetime.fromisoformat(value).isoformat(timespec="seconds")
    return str(value)
