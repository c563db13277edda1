"""The console after a burst of calls, in Chromium: a screenshot and what the store holds.

    PYTHONPATH=tests .venv/bin/python tests/console_screens.py --out after.png
    PYTHONPATH=tests .venv/bin/python tests/console_screens.py --code /tmp/old --out before.png

Starts a private Redis, the fake providers and one real ``ivr serve`` (running the code under
``--code``: another checkout, for a before/after comparison; default this one), places a burst
(tests/call_bursts.py: callers who hang up, flows that hang up, forged handshakes, streams killed
mid-call), waits ``--wait`` seconds (past the token and resume windows, 3 s and 8 s here), opens
one call and keeps it in progress, then signs in to the console and saves a full-page
screenshot. Prints the store's active list and each ended call's outcome as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
from call_bursts import burst, call_in_progress
from gateway_procs import (
    API_KEY,
    AUTH_TOKEN,
    PUBLIC_URL,
    GatewayProcesses,
    agent_replies,
    fast_speak,
    gateway_env,
)
from ops_checks import REPO
from ops_stack import fake_transcribe
from redis_server import RedisServer

from ivr.testing.openai_server import FakeOpenAIServer

ADMIN = "console-admin-token"
CHROMIUM = "/usr/bin/chromium"
WINDOWS = {"IVR_STREAM_TOKEN_TTL_S": "3", "IVR_RESUME_WINDOW_S": "8"}


async def screenshot(base_url: str, out: Path) -> None:
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        page = await browser.new_page(viewport={"width": 1400, "height": 1000})
        await page.goto(f"{base_url}/console")
        await page.fill("#token", ADMIN)
        await page.click("#login-form button")
        await expect(page.locator("#link-state")).to_have_text("live", timeout=10_000)
        await expect(page.locator("#ended-table tbody tr[data-sid]").first).to_be_visible()
        await asyncio.sleep(2.5)  # a feed read or two after sign-in: the lists are current
        # Open a call that never connected: ended (after) or still "ringing" (before).
        never = page.locator("#ended-table tbody tr", has_text="never_connected")
        ringing = page.locator("#active-table tbody tr", has_text="ringing")
        target = never if await never.count() else ringing
        if await target.count():
            await target.first.click()
            await expect(page.locator("#call-facts dd").first).to_be_visible()
            await asyncio.sleep(0.5)
        out.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(out), full_page=True)
        await browser.close()


async def store_view(base_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        active = (await http.get("/admin/calls", headers=headers)).json()["calls"]
        ended = (await http.get("/console/api/ended?limit=100", headers=headers)).json()
    return {
        "active": [{"call_sid": c["call_sid"], "status": c["status"]} for c in active],
        "ended": {c["call_sid"]: c["outcome"] for c in ended["calls"]},
    }


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", type=Path, help="the checkout whose gateway runs")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--wait", type=float, default=14.0, help="seconds after the burst")
    args = parser.parse_args(argv)
    code = (args.code or REPO).resolve()
    redis = RedisServer()
    with (
        tempfile.TemporaryDirectory(prefix="ivr-screens-") as tmp,
        FakeOpenAIServer(api_key=API_KEY) as fake,
        GatewayProcesses(Path(tmp)) as group,
    ):
        fake.speak, fake.chat, fake.transcribe = fast_speak, agent_replies, fake_transcribe
        await asyncio.to_thread(redis.start)
        try:
            env = gateway_env(
                providers_url=fake.base_url,
                api_key=API_KEY,
                public_url=PUBLIC_URL,
                auth_token=AUTH_TOKEN,
                redis_url=redis.url,
                redis_prefix=f"screens:{uuid.uuid4().hex[:8]}:",
                IVR_ADMIN_TOKEN=ADMIN,
                IVR_FLOWS_DIR=str(code / "flows"),
                PYTHONPATH=str(code),
                **WINDOWS,
            )
            gateway = group.start("gw", env)
            await group.wait_healthy()
            sent = await burst(gateway.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL)
            await asyncio.sleep(args.wait)
            async with httpx.AsyncClient(timeout=10) as http:
                live = await call_in_progress(
                    http, gateway.base_url, auth_token=AUTH_TOKEN, public_url=PUBLIC_URL
                )
                await screenshot(gateway.base_url, args.out)
                seen = await store_view(gateway.base_url)
                await live.hang_up()
        finally:
            redis.close()
    seen["expected"] = sent.expected() | {live.call_sid: "in progress"}
    print(json.dumps(seen, indent=1))
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(asyncio.run(main()))
