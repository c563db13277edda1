"""``ivr dial``: place one outbound call, or a campaign from a CSV, through a running gateway.

    ivr dial +15550100998 --flow reminder --var name=Sam
    ivr dial --csv numbers.csv --rate 1/s --flow reminder [--concurrency 4]

The gateway does the dialling (``POST /calls`` with ``IVR_ADMIN_TOKEN``), so a call is placed
the same way from a shell, a script or another service. Exit status: 0 every call placed, 1 a
call (or a row) refused, 2 bad arguments, an unreadable file or no gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from ivr.outbound.campaign import (
    Campaign,
    CampaignError,
    GatewayClient,
    RowResult,
    parse_rate,
    read_rows,
)
from ivr.outbound.dialer import parse_vars

REQUEST_TIMEOUT = 30.0


def add_commands(subparsers: Any) -> None:
    dial = subparsers.add_parser(
        "dial", help="place an outbound call (or a CSV campaign) through a running gateway"
    )
    dial.add_argument("number", nargs="?", help="the number to call, E.164 (+15550100998)")
    dial.add_argument("--flow", required=True, help="the flow the call runs")
    dial.add_argument("--var", action="append", default=[], help="NAME=VALUE (repeatable)")
    dial.add_argument("--csv", type=Path, help="a campaign: one row per number, columns = vars")
    dial.add_argument("--rate", default="1/s", help="campaign calls per time: 1/s, 30/min")
    dial.add_argument("--concurrency", type=int, default=4, help="campaign requests in flight")
    dial.add_argument("--gateway", default=_default_gateway(), help="the gateway's base URL")
    dial.add_argument(
        "--token", default=os.environ.get("IVR_ADMIN_TOKEN", ""), help="IVR_ADMIN_TOKEN"
    )
    dial.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.number is None) == (args.csv is None):
        return _usage("give either a NUMBER or --csv FILE")
    if not args.token:
        return _usage("no admin token: set IVR_ADMIN_TOKEN or pass --token")
    if args.concurrency < 1:
        return _usage("--concurrency must be at least 1")
    try:
        common = parse_vars(args.var)
        if args.csv is not None:
            return asyncio.run(_campaign(args, common))
    except (ValueError, CampaignError) as exc:
        return _usage(str(exc))
    return asyncio.run(_one(args, common))


async def _one(args: argparse.Namespace, variables: dict[str, Any]) -> int:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        client = GatewayClient(http, args.gateway, args.token)
        placed, message = await client.dial(
            {"to": args.number, "flow": args.flow, "vars": variables}
        )
    if placed:
        print(f"placed {message} (flow {args.flow})")
        return 0
    print(f"ivr dial: not placed: {message}", file=sys.stderr)
    return 2 if message.startswith("gateway unreachable") else 1


async def _campaign(args: argparse.Namespace, common: dict[str, Any]) -> int:
    rows, bad = read_rows(args.csv)
    for result in bad:
        print(result.describe(), file=sys.stderr)
    rate = parse_rate(args.rate)

    def report(result: RowResult) -> None:
        print(result.describe(), file=sys.stdout if result.placed else sys.stderr, flush=True)

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as http:
        campaign = Campaign(
            GatewayClient(http, args.gateway, args.token),
            args.flow,
            rate,
            args.concurrency,
            common,
            on_result=report,
        )
        results = await campaign.run(rows)
    placed = sum(r.placed for r in results)
    refused = len(results) - placed + len(bad)
    print(f"{placed} placed, {refused} not placed ({len(bad)} bad rows)")
    return 0 if refused == 0 else 1


def _default_gateway() -> str:
    url = os.environ.get("IVR_GATEWAY_URL")
    if url:
        return url
    host = os.environ.get("IVR_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{os.environ.get('IVR_PORT', '8080')}"


def _usage(message: str) -> int:
    print(f"ivr dial: {message}", file=sys.stderr)
    return 2
