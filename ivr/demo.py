"""``ivr demo``: the newcomer's first call, fully offline.

Starts a real gateway on a free local port (offline STT, TTS and LLM unless providers are
configured), signs requests with a throwaway auth token exactly as Twilio would, places one
simulated call that speaks a few lines, and prints the transcript with per-turn latency.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Sequence

from ivr.audio.resample import resample
from ivr.config import Settings
from ivr.gateway import build_gateway
from ivr.obs.logging import configure_logging
from ivr.server import free_port, running_server
from ivr.sim.caller import CallReport, place_call
from ivr.sim.script import script_from_strings

DEFAULT_LINES = (
    "Hi, what are your opening hours?",
    "Thanks, that is all. Goodbye.",
)


async def run_demo(
    lines: Sequence[str] | None = None,
    record: str | None = "demo-call.wav",
    tts: str | None = None,
) -> int:
    port = free_port()
    token = secrets.token_hex(16)
    overrides: dict[str, object] = {
        # Twilio only dials wss:// URLs; the simulated caller maps this public name to the
        # local port, and every signature is computed over it, exactly as in production.
        "public_url": "https://ivr-demo.example",
        "port": port,
        "twilio_auth_token": token,
    }
    if tts:
        overrides["tts_provider"] = tts
    if not os.environ.get("IVR_LLM_MAX_TOKENS"):
        overrides["llm_max_tokens"] = 48  # the 135M offline model rambles; keep turns short
    settings = Settings(**overrides)  # type: ignore[arg-type]
    configure_logging("console", "warning" if settings.log_level == "info" else settings.log_level)
    print("ivr demo: starting the gateway (loading offline engines can take ~20 s)...", flush=True)
    started = time.monotonic()
    gateway = build_gateway(settings)
    async with running_server(gateway, port=port) as server:
        print(
            f"ivr demo: gateway up in {time.monotonic() - started:.1f} s at {server.base_url} "
            f"(stt={gateway.stt.name}, tts={gateway.tts.name}, llm={gateway.llm.model})",
            flush=True,
        )

        async def transcribe(pcm16_16k: bytes) -> str:
            audio = resample(pcm16_16k, 16000, gateway.stt.sample_rate)
            return (await gateway.stt.transcribe(audio)).text.strip()

        # A slow offline LLM may pause between sentences: wait longer before talking.
        script = script_from_strings(list(lines or DEFAULT_LINES), turn_gap=1.5, max_wait=30)
        report = await place_call(
            server.base_url,
            script=script,
            auth_token=token,
            public_base_url=settings.public_url,
            record_path=record,
            transcriber=transcribe,
        )
        stored = await gateway.store.get(report.call_sid)
    _print_report(report, record)
    if stored is not None and stored.turns:
        _print_breakdown(stored.turns)
    return 1 if report.errors or report.violations else 0


def _print_report(report: CallReport, record: str | None) -> None:
    print()
    print(report.format_transcript())
    latencies = [t.latency_s for t in report.turns if t.latency_s is not None and t.caller_text]
    if latencies:
        print(
            "\nturn latency (end of caller speech -> first bot audio heard): "
            + ", ".join(f"{x:.2f} s" for x in latencies)
        )
    if record:
        print(f"bot audio saved to {record}")
    if report.errors:
        print("errors: " + "; ".join(report.errors), file=sys.stderr)


STAGES = ("endpoint_silence", "stt", "llm_ttft", "llm_first_clause", "tts_ttfb", "gateway", "total")


def _print_breakdown(turns: Sequence[dict[str, float]]) -> None:
    """The gateway's own view of each turn: where the time went, in milliseconds."""
    print("\nper-turn breakdown at the gateway (ms; total = end of speech -> first audio sent):")
    print("  turn  " + "  ".join(f"{stage:>16}" for stage in STAGES))
    for number, turn in enumerate(turns, 1):
        cells = [
            f"{turn[stage] * 1000:16.0f}" if stage in turn else f"{'-':>16}" for stage in STAGES
        ]
        print(f"  {number:>4}  " + "  ".join(cells))
