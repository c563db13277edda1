"""``ivr call``: place one simulated Twilio call at a gateway from the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ivr.sim.caller import Transcriber, place_call
from ivr.sim.script import Script, load_script, script_from_data


class _StepAction(argparse.Action):
    """Keeps --say/--wav/--press/--silence in the order given on the command line."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        steps = list(getattr(namespace, "steps", None) or [])
        value = float(values) if self.dest == "silence" else values
        steps.append({self.dest: value})
        namespace.steps = steps


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ivr call", description="Call the gateway like Twilio does.")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="real address of the gateway")
    p.add_argument("--ws-url", help="real WebSocket base (default: from --url)")
    p.add_argument("--public-url", help="public base URL the gateway signs with (default: --url)")
    p.add_argument("--auth-token", default=os.environ.get("TWILIO_AUTH_TOKEN"))
    p.add_argument("--say", "-s", dest="say", action=_StepAction, metavar="TEXT")
    p.add_argument("--wav", dest="wav", action=_StepAction, metavar="PATH")
    p.add_argument("--press", dest="press", action=_StepAction, metavar="DIGITS")
    p.add_argument("--silence", dest="silence", action=_StepAction, metavar="SECONDS")
    p.add_argument("--script", type=Path, help="YAML call script (steps from flags are appended)")
    p.add_argument("--from", dest="from_", default="+15550001111")
    p.add_argument("--to", default="+15550002222")
    p.add_argument("--record", type=Path, help="write the call as stereo WAV (caller L, bot R)")
    p.add_argument("--comfort-noise", action="store_true")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def build_script(ns: argparse.Namespace) -> Script:
    base = load_script(ns.script) if ns.script else None
    flags = list(getattr(ns, "steps", None) or [])
    if base is None:
        return script_from_data(flags, source="command line")
    data = base.model_dump(exclude_none=True)
    data["steps"] = [{k: v for k, v in s.items() if k != "kind"} for s in data["steps"]] + flags
    return script_from_data(data, source=str(ns.script))


def run_cli(args: Sequence[str] | None = None, *, transcriber: Transcriber | None = None) -> int:
    """``ivr call``: 0 when the call ran without errors or protocol violations."""
    ns = _parser().parse_args(args)
    if not ns.auth_token:
        print("ivr call: --auth-token or TWILIO_AUTH_TOKEN is required", file=sys.stderr)
        return 2
    if not (ns.script or getattr(ns, "steps", None)):
        print("ivr call: give --script or at least one --say/--wav/--press", file=sys.stderr)
        return 2
    report = asyncio.run(
        place_call(
            ns.url,
            script=build_script(ns),
            auth_token=ns.auth_token,
            public_base_url=ns.public_url,
            ws_base=ns.ws_url,
            from_=ns.from_,
            to=ns.to,
            record_path=ns.record,
            transcriber=transcriber,
            comfort_noise=ns.comfort_noise,
        )
    )
    print(json.dumps(report.to_dict(), indent=2) if ns.json else report.format_transcript())
    return 1 if report.errors or report.violations else 0
