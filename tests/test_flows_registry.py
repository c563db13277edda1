"""Hot reload: valid edits swap in at once, invalid ones are refused, calls keep their version."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.registry import FlowRegistry

FLOWS = Path(__file__).resolve().parent.parent / "flows"


def flow_text(name: str, greeting: str, numbers: str = "[]") -> str:
    return (
        f"name: {name}\nnumbers: {numbers}\nstart: hi\nnodes:\n"
        f"  hi:\n    kind: say\n    text: {greeting}\n    next: bye\n"
        "  bye:\n    kind: hangup\n    say: 'Bye {{ caller }}.'\n"
    )


@pytest.fixture
def flow_dir(tmp_path: Path) -> Path:
    (tmp_path / "main.yaml").write_text(flow_text("main", "Hello one.", '["+15550001"]'))
    (tmp_path / "default.yaml").write_text(flow_text("default", "Default here."))
    return tmp_path


def test_numbers_route_to_their_flow_and_others_to_the_default(flow_dir: Path) -> None:
    registry = FlowRegistry(flow_dir)
    registry.load()
    assert registry.flow_for_number("+15550001").name == "main"
    assert registry.flow_for_number("+1 555-0001").name == "main"
    assert registry.flow_for_number("+19999999").name == "default"


def test_a_routes_file_overrides_and_names_the_default(flow_dir: Path) -> None:
    (flow_dir / "routes.yaml").write_text('default: main\nroutes: {"+15550002": default}\n')
    registry = FlowRegistry(flow_dir)
    registry.load()
    assert registry.flow_for_number("+15550002").name == "default"
    assert registry.flow_for_number("+10000000").name == "main"


def test_a_route_to_an_unknown_flow_is_an_error_with_its_position(flow_dir: Path) -> None:
    (flow_dir / "routes.yaml").write_text('routes:\n  "+15550002": sales\n')
    with pytest.raises(
        FlowLoadError, match=r"routes.yaml:2:16: error: route \+15550002 names unknown flow 'sales'"
    ):
        FlowRegistry(flow_dir).load()


def test_an_edit_gives_new_calls_the_new_version_while_pinned_calls_keep_theirs(
    flow_dir: Path,
) -> None:
    registry = FlowRegistry(flow_dir)
    registry.load()
    old_call = registry.pin("+15550001")
    (flow_dir / "main.yaml").write_text(flow_text("main", "Hello two.", '["+15550001"]'))
    assert registry.reload() == []
    new_call = registry.pin("+15550001")
    assert new_call.version != old_call.version
    assert new_call.flow.nodes["hi"].text == "Hello two."  # type: ignore[union-attr]
    assert old_call.flow.nodes["hi"].text == "Hello one."  # type: ignore[union-attr]


def test_an_invalid_edit_is_refused_and_logged_and_the_old_version_keeps_serving(
    flow_dir: Path,
) -> None:
    registry = FlowRegistry(flow_dir)
    registry.load()
    before = registry.pin("+15550001").version
    (flow_dir / "main.yaml").write_text(
        flow_text("main", "Hello.", '["+15550001"]').replace("next: bye", "next: by")
    )
    with capture_logs() as logs:
        problems = registry.reload()
    assert any("unknown target 'by'" in p.message for p in problems)
    assert registry.pin("+15550001").version == before
    refused = [e for e in logs if e["event"] == "flows.refused"]
    assert (
        refused
        and refused[0]["log_level"] == "error"
        and "main.yaml:8:11" in refused[0]["problems"][0]
    )


async def test_the_watcher_reloads_a_changed_file_by_itself(flow_dir: Path) -> None:
    registry = FlowRegistry(flow_dir)
    registry.load()
    before = registry.pin("+15550001").version
    stop, reloaded = asyncio.Event(), asyncio.Event()
    seen: list[list[Problem]] = []

    async def on_reload(problems: list[Problem]) -> None:
        seen.append(problems)
        reloaded.set()

    watcher = asyncio.create_task(registry.watch(stop, on_reload))
    try:
        await asyncio.sleep(0.3)  # let the watcher start before the edit
        (flow_dir / "main.yaml").write_text(flow_text("main", "Hello three.", '["+15550001"]'))
        await asyncio.wait_for(reloaded.wait(), 10)
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(watcher, 5)
    assert seen[0] == [] and registry.pin("+15550001").version != before
    assert registry.pin("+15550001").flow.nodes["hi"].text == "Hello three."  # type: ignore[union-attr]


def test_static_prompts_are_those_without_variables() -> None:
    registry = FlowRegistry(FLOWS)
    registry.load()
    prompts = registry.static_prompt_texts()
    assert "Thank you for calling Acme." in prompts
    assert "Please hold while I connect you to an agent." in prompts
    assert not any("{{" in p for p in prompts)
    assert registry.flow_for_number("+15550100003").name == "sales"
    assert registry.flow_for_number("+15550100001").name == "support"
    assert registry.flow_for_number("+15559999999").name == "default"
