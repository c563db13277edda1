"""Sub-flows: a `subflow` node runs another flow file until its `return` node, then continues."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ivr.flows.engine import call_env, new_state, step
from ivr.flows.events import (
    CallerPressed,
    CallerSilent,
    CallStarted,
    FlowState,
    Hangup,
    Listen,
    Resumed,
    Say,
)
from ivr.flows.loader import load_flow
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.registry import FlowRegistry
from ivr.flowtools.graph import to_dot, to_mermaid

ROOT = Path(__file__).resolve().parent.parent

PARENT = """\
name: parent
numbers: ["+15550001"]
start: hello
variables:
  secret: parent-only
  target: x
nodes:
  hello:
    kind: say
    text: Hello {{ caller }}.
    next: verify
  verify:
    kind: subflow
    flow: child
    pass: {wanted: "{{ target }}-1", fixed: 7}
    return: {got: answer, echo: wanted}
    next: done
  done:
    kind: hangup
    say: You said {{ got }} for {{ echo }}.
"""

CHILD = """\
name: child
start: ask
variables:
  wanted: ""
  fixed: 0
  region: {env: CHILD_REGION, default: eu}
nodes:
  ask:
    kind: ask
    prompt: Code for {{ wanted }} {{ fixed }} {{ caller }} in {{ region }}?
    store: answer
    next: back
    fallback: back
  back:
    kind: return
"""


def write(folder: Path, **files: str) -> Path:
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text)
    return folder


def said(actions: list[object]) -> str:
    return " | ".join(a.text for a in actions if isinstance(a, Say))


def start(flow: Flow, env: dict[str, str] | None = None) -> tuple[FlowState, list[object]]:
    state = new_state(flow, {"caller": "+1555", "called": "+1666"}, env=env or {})
    new, actions = step(flow, state, CallStarted())
    return new, list(actions)


def errors(exc: pytest.ExceptionInfo[FlowLoadError]) -> list[Problem]:
    return [p for p in exc.value.problems if p.severity == "error"]


# ---------------------------------------------------------------- engine


def test_the_engine_steps_into_a_sub_flow_with_passed_variables_and_back_with_returned_ones(
    tmp_path: Path,
) -> None:
    flow = load_flow(write(tmp_path, parent=PARENT, child=CHILD) / "parent.yaml")
    assert set(flow.subflows) == {"child"}
    state, actions = start(flow)
    # Inside the child: its own variables, the passed ones, the call's built-ins, not the parent's.
    assert (state.flow, state.node, state.waiting) == ("child", "ask", "input")
    assert said(actions) == "Hello +1555. | Code for x-1 7 +1555 in eu?"
    assert isinstance(actions[-1], Listen)
    assert [(f.flow, f.node) for f in state.stack] == [("parent", "verify")]
    assert "secret" not in state.vars and state.vars["fixed"] == 7
    state, actions = step(flow, state, CallerPressed("42"))
    assert state.stack == [] and state.flow == "parent" and state.version == flow.version
    assert state.vars["got"] == "42" and state.vars["echo"] == "x-1"
    assert state.vars["secret"] == "parent-only" and "answer" not in state.vars
    assert said(actions) == "You said 42 for x-1." and isinstance(actions[-1], Hangup)
    assert (state.outcome, state.node) == ("hangup", "done")


def test_a_call_resumed_from_json_inside_the_sub_flow_returns_to_its_parent(
    tmp_path: Path,
) -> None:
    flow = load_flow(write(tmp_path, parent=PARENT, child=CHILD) / "parent.yaml")
    state, _ = start(flow, env={"CHILD_REGION": "us"})
    saved = state.model_dump_json()  # what the session puts in Redis
    # Another instance: the same pinned version, loaded from its own files, with no environment.
    again = load_flow(tmp_path / "parent.yaml")
    assert again is not flow and again.version == flow.version
    assert "CHILD_REGION" not in saved  # environment values are never persisted
    resumed = FlowState.model_validate_json(saved)
    # What FlowRunner.run does on a resume: read the environment again.
    resumed = resumed.model_copy(update={"env": call_env(again, {"CHILD_REGION": "us"})})
    state, actions = step(again, resumed, Resumed())
    assert (state.flow, state.node, state.waiting) == ("child", "ask", "input")
    assert "in us?" in said(actions)
    state, actions = step(again, state, CallerSilent())
    state, actions = step(again, state, CallerSilent())
    state, actions = step(again, state, CallerSilent())  # retries used up: fallback -> return
    assert state.stack == [] and state.flow == "parent" and state.outcome == "hangup"
    assert said(actions).endswith("You said  for x-1.")


def test_a_call_resumed_on_a_version_without_its_place_starts_over_sensibly(
    tmp_path: Path,
) -> None:
    flow = load_flow(write(tmp_path, parent=PARENT, child=CHILD) / "parent.yaml")
    state, _ = start(flow)
    saved = state.model_dump_json()
    # The child's waiting node is gone: the child starts over, the parent still waits for it.
    write(
        tmp_path,
        child=CHILD.replace("ask:", "ask_again:").replace("start: ask", "start: ask_again"),
    )
    changed = load_flow(tmp_path / "parent.yaml")
    state, actions = step(changed, FlowState.model_validate_json(saved), Resumed())
    assert (state.flow, state.node, len(state.stack)) == ("child", "ask_again", 1)
    # The parent's subflow node is gone: the call's flow starts over with its own variables.
    write(tmp_path, parent=PARENT.replace("verify", "identify"))
    changed = load_flow(tmp_path / "parent.yaml")
    state, actions = step(changed, FlowState.model_validate_json(saved), Resumed())
    assert [f.node for f in state.stack] == ["identify"] and state.stack[0].vars["secret"]
    assert said(actions).startswith("Hello +1555.")


def test_a_return_node_reached_by_a_call_that_started_in_that_flow_hangs_up(
    tmp_path: Path,
) -> None:
    child = load_flow(write(tmp_path, child=CHILD) / "child.yaml")
    state, _ = start(child)
    state, actions = step(child, state, CallerPressed("1"))
    assert state.outcome == "hangup" and isinstance(actions[-1], Hangup)


# ---------------------------------------------------------------- validation


def test_an_unknown_sub_flow_is_reported_at_its_name_with_a_suggestion(tmp_path: Path) -> None:
    write(tmp_path, parent=PARENT.replace("flow: child", "flow: chlid"), child=CHILD)
    with pytest.raises(FlowLoadError) as exc:
        load_flow(tmp_path / "parent.yaml")
    [problem] = errors(exc)
    assert (problem.file, problem.line, problem.column) == (str(tmp_path / "parent.yaml"), 14, 11)
    assert "unknown sub-flow 'chlid' in node 'verify'; did you mean 'child'?" in problem.message


def test_a_flow_that_includes_itself_through_another_is_refused(tmp_path: Path) -> None:
    loop = CHILD.replace("next: back", "next: again") + (
        "  again:\n    kind: subflow\n    flow: parent\n    next: back\n"
    )
    write(tmp_path, parent=PARENT, child=loop)
    with pytest.raises(FlowLoadError) as exc:
        load_flow(tmp_path / "parent.yaml")
    found = {
        (Path(p.file).name, p.line, p.column, p.message.split(" in node")[0]) for p in errors(exc)
    }
    assert ("parent.yaml", 14, 11, "sub-flow loop parent -> child -> parent") in found
    assert ("child.yaml", 18, 11, "sub-flow loop child -> parent -> child") in found


def test_pass_and_return_must_name_variables_of_the_sub_flow(tmp_path: Path) -> None:
    bad = PARENT.replace("fixed: 7", "fixd: 7").replace("echo: wanted", "echo: wantd")
    write(tmp_path, parent=bad, child=CHILD)
    with pytest.raises(FlowLoadError) as exc:
        load_flow(tmp_path / "parent.yaml")
    by_line = {(p.line, p.column): p.message for p in errors(exc)}
    assert "no variable 'fixd' to pass to" in by_line[(15, 38)]
    assert "no variable 'wantd' to return into 'echo'" in by_line[(16, 27)]
    assert "did you mean 'wanted'?" in by_line[(16, 27)]


def test_a_template_in_pass_is_checked_against_the_calling_flow(tmp_path: Path) -> None:
    write(tmp_path, parent=PARENT.replace("{{ target }}-1", "{{ nope }}"), child=CHILD)
    with pytest.raises(FlowLoadError) as exc:
        load_flow(tmp_path / "parent.yaml")
    [problem] = errors(exc)
    assert problem.line == 15 and problem.message.startswith("unknown variable 'nope'")


def test_a_loop_through_a_sub_flow_that_returns_without_waiting_is_refused(
    tmp_path: Path,
) -> None:
    quick = "name: child\nstart: back\nnodes:\n  back:\n    kind: return\n"
    looping = (
        "name: parent\nstart: verify\nnodes:\n  verify:\n    kind: subflow\n    flow: child\n"
        "    next: verify\n"
    )
    write(tmp_path, parent=looping, child=quick)
    with pytest.raises(FlowLoadError) as exc:
        load_flow(tmp_path / "parent.yaml")
    [problem] = errors(exc)
    assert problem.line == 4 and "loop without any input step through verify" in problem.message
    # The same loop around a sub-flow that waits for the caller is fine.
    write(tmp_path, child=CHILD)
    assert load_flow(tmp_path / "parent.yaml").subflows["child"].name == "child"


def test_validate_reports_sub_flow_problems_and_warns_about_unused_return_nodes(
    tmp_path: Path,
) -> None:
    write(tmp_path, parent=PARENT.replace("flow: child", "flow: chlid"), child=CHILD)
    result = subprocess.run(
        [sys.executable, "-m", "ivr.flowtools.cli", "validate", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert f"{tmp_path / 'parent.yaml'}:14:11: error: unknown sub-flow 'chlid'" in result.stdout
    # child is now nobody's sub-flow: its return node would hang up.
    assert f"{tmp_path / 'child.yaml'}:14:3: warning: return node 'back'" in result.stdout


# ---------------------------------------------------------------- versions and hot reload


def test_a_reload_of_the_sub_flow_file_does_not_change_a_call_already_pinned(
    tmp_path: Path,
) -> None:
    write(tmp_path, parent=PARENT, child=CHILD)
    registry = FlowRegistry(tmp_path)
    registry.load()
    pinned = registry.pin("+15550001").flow
    state, actions = start(pinned)
    assert "Code for" in said(actions)
    (tmp_path / "child.yaml").write_text(CHILD.replace("Code for", "Number for"))
    assert registry.reload() == []
    fresh = registry.pin("+15550001").flow
    # Only the sub-flow's file changed, yet the calling flow is a new version: it runs new text.
    assert fresh.file_version == pinned.file_version and fresh.version != pinned.version
    assert "Number for" in said(start(fresh)[1])
    # The call in progress (and one resumed from its saved state) keeps the old sub-flow.
    saved = FlowState.model_validate_json(state.model_dump_json())
    assert "Code for" in said(step(pinned, saved, Resumed())[1])
    # A broken sub-flow edit is refused and the calling flow keeps its last good version.
    (tmp_path / "child.yaml").write_text(CHILD.replace("next: back", "next: nowhere"))
    problems = registry.reload()
    assert problems and all(p.file.endswith("child.yaml") for p in problems)
    assert registry.pin("+15550001").flow.version == fresh.version


def test_a_flow_whose_sub_flow_is_missing_is_refused_by_the_registry(tmp_path: Path) -> None:
    write(tmp_path, parent=PARENT)
    registry = FlowRegistry(tmp_path)
    problems = registry.load(strict=False)
    assert [(p.line, p.column) for p in problems] == [(14, 11)]
    with pytest.raises(LookupError):
        registry.flow_for_number("+15550001")


# ---------------------------------------------------------------- tools


def test_the_graph_shows_the_sub_flow_a_node_runs() -> None:
    flow = load_flow(ROOT / "flows" / "payments.yaml")
    assert '[["verify<br/><i>subflow: verify_caller</i>"]]' in to_mermaid(flow)
    assert '"verify" [shape=box, peripheries=2, label="verify\\n(subflow: verify_caller)"]' in (
        to_dot(flow)
    )


def test_conversation_tests_run_through_the_sub_flow_and_report_its_nodes(
    tmp_path: Path,
) -> None:
    for name in ("payments", "verify_caller"):
        shutil.copy(ROOT / "flows" / f"{name}.yaml", tmp_path)
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "flows" / "tests" / "payments_test.yaml", tmp_path / "tests")
    wrong = (
        "flow: payments\ntests:\n  - name: wrong\n    steps:\n"
        "      - {node: verify_caller.check, vars: {verified: true}}\n"
    )
    (tmp_path / "tests" / "wrong_test.yaml").write_text(wrong)
    result = subprocess.run(
        [sys.executable, "-m", "ivr.flowtools.cli", "test", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = result.stdout
    assert "5 passed, 1 failed" in out, out
    assert "PASS" in out and "payments_test.yaml :: verified in the sub-flow" in out
    assert "expected node 'verify_caller.check', at 'verify_caller.ask_account'" in out
    assert "expected variable verified = True, got False" in out
