"""Flow files are checked at load: each problem names file, line and column and how to fix it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ivr.flows.loader import check_flow_text, load_flow, load_flow_text
from ivr.flows.problems import FlowLoadError, Problem

FLOWS = Path(__file__).resolve().parent.parent / "flows"


def problems_of(text: str, tmp_path: Path | None = None) -> list[Problem]:
    flow, problems = check_flow_text(textwrap.dedent(text), "t.yaml", base_dir=tmp_path)
    assert flow is None, "expected the flow to be refused"
    return problems


def only(problems: list[Problem], needle: str) -> Problem:
    hits = [p for p in problems if needle in p.message]
    assert len(hits) == 1, problems
    return hits[0]


GOOD = """\
name: t
start: hello
nodes:
  hello:
    kind: say
    text: Hi
    next: bye
  bye:
    kind: hangup
    say: Bye
"""


def test_a_good_flow_loads_with_a_content_version() -> None:
    flow = load_flow_text(GOOD, "t.yaml")
    assert flow.start == "hello"
    assert len(flow.version) == 12
    assert load_flow_text(GOOD.replace("Hi", "Hello"), "t.yaml").version != flow.version


def test_broken_yaml_is_reported_where_the_parser_stopped() -> None:
    text = "name: t\nstart: a\nnodes:\n  a: {kind: say, text: hi\n  b: 1\n"
    problems = problems_of(text)
    assert len(problems) == 1
    assert problems[0].message.startswith("YAML syntax")
    assert (problems[0].file, problems[0].line) == ("t.yaml", 5)


def test_an_unknown_node_kind_lists_the_known_kinds() -> None:
    problem = only(problems_of(GOOD.replace("kind: say", "kind: speak")), "unknown node kind")
    assert (problem.line, problem.column) == (5, 5)
    assert (
        "'speak'" in problem.message
        and "'menu'" in problem.message
        and "'hello'" in problem.message
    )


def test_a_dangling_target_names_the_node_and_suggests_the_close_one() -> None:
    problem = only(problems_of(GOOD.replace("next: bye", "next: by")), "unknown target")
    assert (problem.line, problem.column) == (7, 11)
    assert "'by'" in problem.message and "node 'hello'" in problem.message
    assert "did you mean 'bye'" in problem.message


def test_an_unknown_template_variable_points_at_the_text() -> None:
    problem = only(problems_of(GOOD.replace("text: Hi", "text: Hi {{ nmae }}")), "unknown variable")
    assert (problem.line, problem.column) == (6, 11)
    assert "'nmae'" in problem.message and "variables:" in problem.message


def test_a_malformed_template_reference_is_an_error() -> None:
    problem = only(problems_of(GOOD.replace("text: Hi", "text: 'Hi {{ 1 + 2 }}'")), "bad template")
    assert problem.line == 6


def test_an_unreachable_node_is_reported_at_its_name() -> None:
    text = GOOD + "  orphan:\n    kind: hangup\n"
    problem = only(problems_of(text), "unreachable")
    assert (problem.line, problem.column) == (11, 3)
    assert "'orphan'" in problem.message


def test_a_loop_without_any_input_step_is_refused() -> None:
    text = GOOD.replace("next: bye", "next: again") + (
        "  again:\n    kind: set\n    values: {x: 1}\n    next: hello\n"
    )
    problem = only(problems_of(text), "loop without any input")
    assert "again" in problem.message and "hello" in problem.message
    assert problem.column == 3


def test_a_loop_through_an_ask_node_is_fine() -> None:
    text = GOOD.replace("next: bye", "next: q") + (
        "  q:\n    kind: ask\n    prompt: Again?\n"
        '    routes: [{key: "1", next: hello}, {key: "2", next: bye}]\n'
    )
    assert load_flow_text(text, "t.yaml").nodes["q"].kind == "ask"


def test_a_dead_end_says_what_to_add() -> None:
    problem = only(problems_of(GOOD.replace("    next: bye\n", "")), "dead end")
    assert "next:" in problem.message


def test_a_duplicate_key_is_refused_instead_of_silently_overwritten() -> None:
    problem = only(
        problems_of(GOOD.replace("    text: Hi\n", "    text: Hi\n    text: Ho\n")), "duplicate key"
    )
    assert (problem.line, problem.column) == (7, 5)


def test_a_missing_field_and_an_unknown_field_are_named() -> None:
    problems = problems_of(GOOD.replace("    text: Hi\n", "    txt: Hi\n"))
    assert only(problems, "missing field 'text'").line == 5
    assert (
        only(problems, "unknown field 'txt'").line,
        only(problems, "unknown field 'txt'").column,
    ) == (6, 5)


def test_a_yaml_boolean_where_text_is_expected_says_to_quote_it() -> None:
    text = GOOD.replace("    text: Hi\n", "    text: no\n")
    assert "put quotes around it" in only(problems_of(text), "valid string").message


def test_an_unknown_intent_and_a_missing_knowledge_file_are_reported(tmp_path: Path) -> None:
    text = """\
    name: t
    start: q
    nodes:
      q:
        kind: ask
        prompt: What?
        routes: [{intent: billing, next: a}]
        next: a
      a:
        kind: agent
        system: Help.
        knowledge: [missing.md]
    """
    problems = problems_of(text, tmp_path)
    assert only(problems, "unknown intent 'billing'").line == 7
    assert only(problems, "missing.md").line == 12


def test_every_problem_is_reported_at_once_sorted_by_position() -> None:
    text = GOOD.replace("next: bye", "next: nowhere").replace("text: Hi", "text: '{{ who }}'")
    problems = problems_of(text)
    assert len(problems) >= 3  # dangling target, unknown variable, 'bye' now unreachable
    assert problems == sorted(problems, key=lambda p: (p.line, p.column))


def test_load_flow_raises_an_error_whose_text_lists_the_problems(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("next: bye", "next: nope"))
    with pytest.raises(FlowLoadError) as info:
        load_flow(path)
    assert f"{path}:7:11: error: unknown target 'nope'" in str(info.value)


@pytest.mark.parametrize("name", ["support", "sales", "default"])
def test_the_example_flows_load_without_problems(name: str) -> None:
    flow, problems = check_flow_text((FLOWS / f"{name}.yaml").read_text(), name, base_dir=FLOWS)
    assert problems == []
    assert flow is not None and flow.name == name
