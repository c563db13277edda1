"""How fast a reply starts, with and without speculative turns: one call, several turns.

    .venv/bin/python bench/turn_taking.py                  # off vs on, 3 calls x 6 turns each
    .venv/bin/python bench/turn_taking.py --calls 5 --json

A real ``ivr serve`` process (Silero gated by WebRTC, webhook path) answers a simulated Twilio
caller (``ivr.sim``: espeak speech in real time, playout and mark echoes like Twilio's). The
providers are ``FakeOpenAIServer`` in a process of their own with Cerebras-like delays (STT
150 ms, LLM first token 140 ms, TTS first byte 120 ms; ``--stt-ms`` etc.). The endpoint silence
is 300 ms. Printed per mode:

- ``heard p50/p95``: the caller's end of speech to the first reply audio played at the caller
  (the simulated caller's own clock): voice-to-voice.
- ``gateway p50``: what the gateway adds beyond the providers' remaining wait and the endpoint
  silence (its ``turn.latency`` log lines).
- ``speculation``: the gateway's ``ivr_speculations_total`` (used / wasted / failed per stage),
  and the extra provider requests per turn that wasted or failed speculation cost.

Lines with commas make the caller pause mid-sentence (wasted speculation is part of the cost).
The fake STT answers with a word per 0.3 s of audio, so the words at a pause the caller talks
on after differ from the whole turn's, as a real STT's would: a reply started on them is waste.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import AUTH_TOKEN, PUBLIC_URL, gateway, pct, providers_process
from prometheus_client.parser import text_string_to_metric_families

from ivr.sim.caller import place_call

LINES = [
    "What are your opening hours?",
    "Do you open on Saturdays, or only during the week?",
    "I would like to book a table for four people.",
    "My number is five five five, one two three four.",
    "Can I bring my dog?",
    "Thanks, that is all.",
]

STAGES = ("endpoint_silence", "stt", "llm_ttft", "llm_first_clause", "tts_ttfb", "total", "heard")
"""The gateway's own per-turn breakdown (``turn.latency``): with speculation the provider
stages count only what was left of them once the turn ended."""

MODES: dict[str, dict[str, str]] = {
    "off (today)": {"IVR_SPECULATE_AFTER_MS": "0", "IVR_TURN_MODEL": "off"},
    "speculative": {"IVR_SPECULATE_AFTER_MS": "60", "IVR_TURN_MODEL": "smart-turn"},
    "words-only": {"IVR_SPECULATE_AFTER_MS": "60", "IVR_TURN_MODEL": "off"},
    "spec-40ms": {"IVR_SPECULATE_AFTER_MS": "40", "IVR_TURN_MODEL": "smart-turn"},
}


@dataclass(slots=True)
class ModeResult:
    mode: str
    turns: int = 0
    heard: list[float] = field(default_factory=list)
    gateway: list[float] = field(default_factory=list)
    stages: dict[str, list[float]] = field(default_factory=dict)
    speculation: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        wasted = sum(v for k, v in self.speculation.items() if not k.endswith(".used"))
        return {
            "mode": self.mode,
            "turns": self.turns,
            "heard_p50_ms": round(pct(self.heard, 0.5) * 1000),
            "heard_p95_ms": round(pct(self.heard, 0.95) * 1000),
            "gateway_p50_ms": round(pct(self.gateway, 0.5) * 1000, 1),
            "extra_requests_per_turn": round(wasted / max(1, self.turns), 2),
            "speculation": self.speculation,
        }


def speculation_counts(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "ivr_speculations":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = f"{sample.labels['stage']}.{sample.labels['outcome']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def turn_lines(log_path: Path) -> list[dict[str, Any]]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"turn.latency"' not in line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


async def run_mode(
    mode: str, env: dict[str, str], provider_url: str, args: argparse.Namespace, workdir: Path
) -> ModeResult:
    result = ModeResult(mode)
    settings = {"IVR_ENDPOINT_SILENCE_MS": "300", **env}
    name = "gateway-" + mode.split()[0]
    with gateway(provider_url, args.vad, args.log_level, workdir, name=name, env=settings) as gw:
        await gw.wait_ready()
        for _ in range(args.calls):
            report = await place_call(
                gw.base_url,
                script=LINES[: args.turns],
                auth_token=AUTH_TOKEN,
                public_base_url=PUBLIC_URL,
            )
            for turn in report.turns:
                if turn.caller_text is not None and turn.latency_s is not None:
                    result.heard.append(turn.latency_s)
                    result.turns += 1
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{gw.base_url}/metrics")).text
        result.speculation = speculation_counts(text)
        for line in turn_lines(gw.log_path):
            if "gateway" in line:
                result.gateway.append(float(line["gateway"]))
            for stage in STAGES:
                if stage in line:
                    result.stages.setdefault(stage, []).append(float(line[stage]))
    return result


def print_table(results: list[ModeResult], args: argparse.Namespace) -> None:
    print(
        f"\nturn taking: {args.calls} calls x {args.turns} turns, VAD {args.vad}, endpoint 300 ms,"
        f" providers STT {args.stt_ms} / LLM {args.llm_ms} / TTS {args.tts_ms} ms"
    )
    head = f"{'mode':<14} {'turns':>5} {'heard p50':>10} {'heard p95':>10} {'gateway p50':>12}"
    print(head + "  extra req/turn  speculation used/wasted/failed")
    for r in results:
        row = r.row()
        spec = " ".join(
            f"{stage} {int(r.speculation.get(stage + '.used', 0))}/"
            f"{int(r.speculation.get(stage + '.wasted', 0))}/"
            f"{int(r.speculation.get(stage + '.failed', 0))}"
            for stage in ("stt", "llm", "tts")
        )
        print(
            f"{r.mode:<14} {r.turns:>5} {row['heard_p50_ms']:>8} ms {row['heard_p95_ms']:>7} ms"
            f" {row['gateway_p50_ms']:>9} ms  {row['extra_requests_per_turn']:>14}  {spec}"
        )
    print("gateway's breakdown, p50 ms (after the turn ended, for speculated stages):")
    for r in results:
        parts = "  ".join(
            f"{stage} {pct(r.stages[stage], 0.5) * 1000:.0f}"
            for stage in STAGES
            if stage in r.stages
        )
        print(f"  {r.mode:<14} {parts}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--turns", type=int, default=len(LINES), choices=range(1, len(LINES) + 1))
    parser.add_argument("--vad", default="silero", choices=["silero", "webrtc"])
    parser.add_argument("--stt-ms", type=int, default=150)
    parser.add_argument("--llm-ms", type=int, default=140)
    parser.add_argument("--tts-ms", type=int, default=120)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated mode names")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--log-dir", type=Path, help="keep the gateways' logs here")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


async def main_async(args: argparse.Namespace) -> list[ModeResult]:
    delays = (args.stt_ms / 1000, args.llm_ms / 1000, args.tts_ms / 1000)
    # The fake STT answers with words in proportion to the audio (see transcript_by_length).
    os.environ["IVR_BENCH_TRANSCRIPTS"] = "by-length"
    results = []
    with tempfile.TemporaryDirectory() as tmp, providers_process(*delays) as url:
        workdir = args.log_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for mode in args.modes.split(","):
            started = time.monotonic()
            results.append(await run_mode(mode, MODES[mode], url, args, workdir))
            print(f"  {mode}: {time.monotonic() - started:.0f} s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(main_async(args))
    print_table(results, args)
    if args.json:
        print(json.dumps([asdict(r) | r.row() for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
