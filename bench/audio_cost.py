"""CPU cost of the inbound listening path per 20 ms Twilio frame.

Path: json.loads of a Twilio "media" message -> base64 decode -> mu-law to PCM16 -> VAD ->
endpointer. Audio is espeak-ng speech with line noise between utterances (about half speech).

    .venv/bin/python bench/audio_cost.py [--silero]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from audio_fixtures import noise_pcm16, speech_pcm16, trimmed

from ivr.audio.codec import pcm16_to_ulaw, ulaw_to_pcm16
from ivr.audio.endpointer import Endpointer, SpeechEnded
from ivr.audio.vad import SileroVad, VoiceActivityDetector, WebRtcVad

FRAMES_PER_MINUTE = 3000
SID = "MZ18ad3ab5a668481ce02b83e7395059f0"


def media_messages(ulaw: bytes) -> list[str]:
    msgs = []
    for i in range(len(ulaw) // 160):
        payload = base64.b64encode(ulaw[i * 160 : (i + 1) * 160]).decode()
        msgs.append(
            json.dumps(
                {
                    "event": "media",
                    "sequenceNumber": str(i + 3),
                    "media": {
                        "track": "inbound",
                        "chunk": str(i + 1),
                        "timestamp": str(i * 20),
                        "payload": payload,
                    },
                    "streamSid": SID,
                }
            )
        )
    return msgs


def one_minute_of_call() -> bytes:
    lines = ["I would like to check my account balance, please.", "Yes.", "Agent please."]
    parts = []
    while sum(map(len, parts)) < FRAMES_PER_MINUTE * 320:
        for i, text in enumerate(lines):
            parts += [noise_pcm16(1.5, seed=len(parts) + i), trimmed(speech_pcm16(text))]
    return pcm16_to_ulaw(b"".join(parts)[: FRAMES_PER_MINUTE * 320])


def run(msgs: list[str], vad: VoiceActivityDetector) -> tuple[float, int]:
    ep = Endpointer(vad)
    ends = 0
    start = time.process_time()
    for msg in msgs:
        m = json.loads(msg)
        if m["event"] == "media":
            pcm = ulaw_to_pcm16(base64.b64decode(m["media"]["payload"]))
            event = ep.push(pcm, int(m["media"]["timestamp"]) / 1000)
            ends += isinstance(event, SpeechEnded)
    return time.process_time() - start, ends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--silero", action="store_true", help="use SileroVad instead of WebRtcVad")
    ap.add_argument("--minutes", type=int, default=5, help="call-minutes to time (best run)")
    args = ap.parse_args()
    msgs = media_messages(one_minute_of_call())
    name = "SileroVad" if args.silero else "WebRtcVad(mode=2)"
    best, ends = float("inf"), 0
    for _ in range(args.minutes):
        vad: VoiceActivityDetector = SileroVad() if args.silero else WebRtcVad(2)
        cpu, ends = run(msgs, vad)
        best = min(best, cpu)
    per_frame_us = best / len(msgs) * 1e6
    print(f"VAD: {name}; {len(msgs)} frames per call-minute; {ends} utterances per minute")
    print(f"CPU per 20 ms frame (json + base64 + mu-law + VAD + endpointer): {per_frame_us:.1f} us")
    print(f"CPU per call-minute of listening: {best:.3f} CPU-s (budget for the gateway: 0.5)")


if __name__ == "__main__":
    main()
