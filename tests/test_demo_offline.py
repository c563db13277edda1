"""`ivr demo` end to end with the real offline engines: whisper, espeak, SmolLM2 on llama.cpp.

One call to Harbor Bikes (flows/demo.yaml): a key press at the menu, a spoken answer to the
question step, a question the agent answers from flows/knowledge/harbor_bikes.md, a spoken
goodbye at the wrap-up menu.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import pytest_asyncio

from ivr.demo import DemoCall, place_demo_call, print_demo_call
from ivr.engines.llm_server import available

pytestmark = [
    pytest.mark.engines,
    pytest.mark.slow,
    pytest.mark.skipif(available() is not None, reason=f"offline LLM missing: {available()}"),
]

KNOWLEDGE = Path(__file__).parent.parent / "flows" / "knowledge" / "harbor_bikes.md"


def street_address() -> str:
    """The street of the shop, as the knowledge file gives it ("42 Harbor Street")."""
    found = re.search(r"^- Address: ([^,.]+)", KNOWLEDGE.read_text(), re.MULTILINE)
    assert found, f"{KNOWLEDGE} has no '- Address:' line"
    return found.group(1).strip()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo_call(tmp_path_factory: pytest.TempPathFactory) -> DemoCall:
    record = tmp_path_factory.mktemp("demo") / "demo.wav"
    return await place_demo_call(record=str(record), tts="espeak")


async def test_the_demo_call_takes_the_menu_the_question_and_the_goodbye_without_errors(
    demo_call: DemoCall, capsys: pytest.CaptureFixture[str]
) -> None:
    report, record = demo_call.report, demo_call.record
    print_demo_call(demo_call, None)
    out = capsys.readouterr().out
    assert not report.errors and not report.violations, out
    assert record is not None, out
    assert record.flow_name == "demo", out
    # The key press chose the booking, the spoken answer the bike, the spoken goodbye the end.
    assert record.variables.get("bike") == "mountain bike", record.variables
    assert (record.node, record.end_action) == ("goodbye", "hangup"), out
    assert "per-turn breakdown at the gateway" in out, out
    assert len(record.turns) >= 3, record.turns


async def test_the_agent_answers_where_the_shop_is_from_the_knowledge_file(
    demo_call: DemoCall,
) -> None:
    assert demo_call.record is not None
    history = demo_call.record.history
    # On failure: the whole history and what the caller heard, to tell a misheard question
    # from a model that answered a right one wrongly.
    call = "\n".join(f"{m.role}: {m.content!r}" for m in history)
    call += "\n" + demo_call.report.format_transcript()
    asked = [i for i, m in enumerate(history) if m.role == "user" and "shop" in m.content.lower()]
    assert asked, call
    answer = history[asked[0] + 1]
    assert answer.role == "assistant", call
    assert street_address().lower() in answer.content.lower(), call
