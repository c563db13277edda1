"""`ivr demo` end to end with the real offline engines: whisper, espeak, SmolLM2 on llama.cpp."""

from __future__ import annotations

from pathlib import Path

import pytest

from ivr.demo import run_demo
from ivr.engines.llm_server import available

pytestmark = [pytest.mark.engines, pytest.mark.slow]


@pytest.mark.skipif(available() is not None, reason=f"offline LLM missing: {available()}")
async def test_the_demo_completes_a_spoken_exchange_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "demo.wav"
    rc = await run_demo(
        lines=["Hello, what are your opening hours?"], record=str(record), tts="espeak"
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert record.stat().st_size > 16000  # seconds of 8 kHz audio, not an empty file
    assert "CALLER" in out and out.count("BOT") >= 2, out
    assert "per-turn breakdown at the gateway" in out, out
