"""Expected answers end the turn, through the real audio path (issue 22, item 3).

The simulated Twilio caller reads an account number to an LLM agent over a real WebSocket, with
a 700 ms pause in the middle; the gateway runs speculative turns as in production (its words
judged at each pause). The STT stand-in transcribes what the caller has said so far: the
stretches of speech in the upload, mapped to the words of each, so the pause in the middle
is transcribed as half the number and the end as all of it. The test asserts the decision at
each pause (``turn.judged``: the verdict and the endpoint silence it chose) and that the
agent got the whole number in one turn, never on wall-clock timing.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gateway_support import AUTH_TOKEN, PUBLIC_URL, GatewayFactory
from structlog.testing import capture_logs

from ivr.audio.wav import wav_to_pcm16
from ivr.sim.caller import place_call
from ivr.sim.script import script_from_data
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer

pytestmark = pytest.mark.slow

FLOWS = Path(__file__).resolve().parent.parent / "flows"
ACCOUNTS = "+15550100777"
FLOW = """\
name: accounts
numbers: ["+15550100777"]
start: talk
nodes:
  talk:
    kind: agent
    system: You find the caller's account.
    greeting: GREETING
    on_no_input: hangup
    tools:
      - name: find_account
        description: Find the caller's account by its number.
        parameters:
          type: object
          properties:
            account_number: {type: string, pattern: "^\\\\d{8}$"}
          required: [account_number]
"""
GAP_S = 0.4
"""Quiet this long between two stretches of speech in an upload: the caller paused there."""


class SaidSoFar:
    """STT stand-in: the words of as many of ``parts`` as the upload holds stretches of
    speech (quiet under ``GAP_S`` inside a part is a gap between its words)."""

    def __init__(self, parts: list[str]) -> None:
        self.parts = parts
        self.answers: list[str] = []

    def __call__(self, wav: bytes, form: object = None) -> str:
        audio = wav_to_pcm16(wav)
        x = np.frombuffer(audio.pcm16, dtype="<i2").astype(np.float64)
        frame = audio.sample_rate // 50
        n = x.size // frame
        rms = np.sqrt((x[: n * frame].reshape(n, frame) ** 2).mean(axis=1))
        loud = np.nonzero(rms > 300)[0]
        stretches = 1 + int(np.sum(np.diff(loud) * 0.02 >= GAP_S)) if loud.size else 0
        text = " ".join(self.parts[:stretches])
        self.answers.append(text)
        return text


def flows_with(tmp_path: Path, greeting: str) -> Path:
    target = tmp_path / "flows"
    shutil.copytree(FLOWS, target, ignore=shutil.ignore_patterns("tests"))
    (target / "accounts.yaml").write_text(FLOW.replace("GREETING", greeting), encoding="utf-8")
    return target


def judged(logs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["text"], e["silence_ms"]) for e in logs if e["event"] == "turn.judged"]


async def read_number(
    gateway_factory: GatewayFactory,
    fake: FakeOpenAIServer,
    tmp_path: Path,
    greeting: str,
    said: list[tuple[str, str]],
    pause_s: float = 0.7,
) -> tuple[list[tuple[str, int]], list[str], SaidSoFar]:
    """Call the agent and say the two ``said`` parts (speech, its transcript) with a pause
    between them: (the decision at each pause, the caller turns the model last got, the STT)."""
    stt = SaidSoFar([text for _, text in said])
    fake.transcribe = stt
    fake.chat = lambda request: ChatScript(text="Thank you, one moment.")
    steps: list[Any] = [
        {"say": said[0][0]},
        {"silence": pause_s},
        {"say": said[1][0], "wait": False},
    ]
    flows = flows_with(tmp_path, greeting)
    with capture_logs() as logs:
        async with gateway_factory(flows_dir=str(flows), speculate_after_ms=100) as server:
            report = await place_call(
                server.base_url,
                script=script_from_data({"steps": steps, "max_wait": 10}),
                auth_token=AUTH_TOKEN,
                public_base_url=PUBLIC_URL,
                to=ACCOUNTS,
            )
    assert not report.errors and not report.violations, report.format_transcript()
    # What the model was asked with (the stored record masks the digits).
    chats = [r.json for r in fake.requests_for("chat") if r.json is not None]
    users = [m["content"] for m in chats[-1]["messages"] if m["role"] == "user"]
    return judged(logs), users, stt


async def test_a_declared_account_number_read_in_two_groups_is_not_cut_and_ends_at_once(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    decisions, users, stt = await read_number(
        gateway_factory,
        fake_openai,
        tmp_path,
        "What is your account number?",
        [("My account number is four five six seven.", "my account number is 4567"),
         ("Eight nine zero one.", "8901")],
    )  # fmt: skip
    # The agent asked for find_account's account_number (^\d{8}$): four digits at the pause
    # wait the longest pause (digits), all eight end the turn at the normal endpoint.
    assert decisions[0] == ("incomplete", 2500), decisions
    assert decisions[-1] == ("complete", 300), decisions
    assert users == ["my account number is 4567 8901"], (users, stt.answers)


async def test_a_number_nobody_declared_waits_700_ms_after_its_digits_not_1500(
    gateway_factory: GatewayFactory, fake_openai: FakeOpenAIServer, tmp_path: Path
) -> None:
    # Issue 22's harness: "My account number is ... [700 ms] ... four five six seven" to an
    # agent whose question names no argument. The open clause at the pause waits the longest
    # pause (1500 ms: not cut); the number at the end, of unknown length, 700 ms.
    decisions, users, stt = await read_number(
        gateway_factory,
        fake_openai,
        tmp_path,
        "How can I help you today?",
        [("My account number is", "my account number is"),
         ("Four five six seven.", "4567")],
    )  # fmt: skip
    assert decisions[0] == ("incomplete", 1500), decisions
    assert decisions[-1] == ("number", 700), decisions
    assert users == ["my account number is 4567"], (users, stt.answers)
