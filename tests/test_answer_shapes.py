"""Expected answers end the turn (issue 22, item 3): the shape rules, the shapes a flow or an
agent's tool declares, and how long each verdict lets the caller pause."""

from __future__ import annotations

import textwrap

import pytest

from ivr.call.answer_shapes import date_verdict, digits_in, last_number, year_state
from ivr.call.turn_end import judge_words, silence_needed_ms, text_completeness
from ivr.callio.turn_policy import Expect, policy_for
from ivr.flows.loader import check_flow_text, load_flow_text
from ivr.flows.nodes import AgentNode
from ivr.flows.schema_shape import AnswerShape, pattern_digits, schema_shape
from ivr.flows.waits import listen_spec


def words(text: str) -> list[str]:
    import re

    return re.findall(r"[a-z0-9']+", text.lower())


# ---------------------------------------------------------------- counting digits


@pytest.mark.parametrize(
    ("said", "digits"),
    [
        ("four five six seven", 4),
        ("4567 8901", 8),
        ("4, 5, 6, 7", 4),
        ("forty five sixty seven", 4),
        ("double five oh one", 4),
        ("triple seven", 3),
        ("fifteen", 2),
    ],
)
def test_digits_are_counted_as_numerals_and_as_words(said: str, digits: int) -> None:
    assert digits_in(words(said)) == digits


def test_the_last_number_runs_over_fillers_and_skips_words_after_it() -> None:
    assert last_number(words("It's 4567, uh, 8901")) == (8, True)
    assert last_number(words("4567 8901 is my number")) == (8, False)
    assert last_number(words("I have 2 accounts, one is 4567")) == (4, True)
    assert last_number(words("I don't know it")) == (0, False)


# ---------------------------------------------------------------- verdicts by shape


@pytest.mark.parametrize(
    ("transcript", "expect", "digits", "max_digits", "verdict"),
    [
        ("My account number is 4567", "digits", 8, None, "incomplete"),
        ("My account number is 4567 8901.", "digits", 8, None, "complete"),
        ("four five six seven, eight nine zero one", "digits", 8, None, "complete"),
        ("It's 1234.", "digits", 4, None, "complete"),
        ("1234 5678", "digits", 8, 10, "number"),  # 8 of 8 to 10: may go on
        ("1234 5678 90", "digits", 8, 10, "complete"),
        ("1234", "digits", 8, 10, "incomplete"),
        ("4567", "digits", None, None, "number"),  # unknown length
        ("4567 and", "digits", None, None, "incomplete"),  # "and": more to come
        ("let me find it", "digits", 8, None, "unknown"),  # no digits yet: other rules
        ("9 4 1 0 5", "zip", None, None, "complete"),
        ("94105-12", "zip", None, None, "incomplete"),
        ("94105 1234", "zip", None, None, "complete"),
        ("941", "zip", None, None, "incomplete"),
        ("March 14th, 1985.", "date", None, None, "complete"),
        ("03/14/1985", "date", None, None, "complete"),
        ("the fourteenth of March nineteen eighty five", "date", None, None, "complete"),
        ("March fourteenth nineteen", "date", None, None, "incomplete"),  # the year begun
        ("March fourteenth nineteen eighty", "date", None, None, "number"),  # 1980, or 198x
        ("March fourteenth", "date", None, None, "number"),  # the year may follow
        ("It was in March", "date", None, None, "incomplete"),
        ("Tomorrow.", "date", None, None, "complete"),
        ("two thousand and three", "date", None, None, "number"),  # a year without a day
    ],
)
def test_an_expected_value_is_whole_part_or_maybe_whole(
    transcript: str, expect: Expect, digits: int | None, max_digits: int | None, verdict: str
) -> None:
    got = text_completeness(transcript, expect, digits, max_digits=max_digits)
    assert got == verdict


def test_spoken_years() -> None:
    assert year_state(words("nineteen eighty five")) == "complete"
    assert year_state(words("twenty twenty four")) == "complete"
    assert year_state(words("born in 1985")) == "complete"
    assert year_state(words("two thousand")) == "partial"
    assert year_state(words("march nineteen")) == "begun"
    assert year_state(words("march fourteenth")) is None
    assert date_verdict(words("I want a refund"), "I want a refund") is None


def test_a_number_of_unknown_length_waits_700_ms_not_the_longest_pause() -> None:
    anything = policy_for("any")  # a free answer, as at an agent with nothing declared
    verdict = judge_words(anything, "My account number is four five six seven.")
    assert verdict == "number"
    assert silence_needed_ms(anything, None, verdict) == 700 < anything.max_silence_ms
    assert judge_words(anything, "My account number is") == "incomplete"  # waits 1500
    # Never past the node's longest pause, never under its shortest.
    assert silence_needed_ms(policy_for("any", max_silence_ms=500), None, "number") == 500
    assert silence_needed_ms(policy_for("any", min_silence_ms=900), None, "number") == 900
    # A whole declared number ends at the normal endpoint, a part of one waits the longest.
    eight = policy_for("digits", digits=8)
    assert silence_needed_ms(eight, None, judge_words(eight, "45678901")) == 300
    assert silence_needed_ms(eight, None, judge_words(eight, "4567")) == 2500


def test_an_answer_the_node_lists_is_complete_even_when_the_stt_doubts_its_last_word() -> None:
    menu = policy_for("any", answers=("mountain", "road bike"))
    assert judge_words(menu, "A mountain bike.", last_word_probability=0.6) == "complete"
    assert judge_words(menu, "Road bike", last_word_probability=0.6) == "complete"
    # Not when the phrase is further back (what followed it may be a new clause), nor open.
    doubted = judge_words(menu, "Mountain, I'd like it for it.", last_word_probability=0.6)
    assert doubted == "unsure"
    assert judge_words(menu, "A mountain bike and", last_word_probability=0.99) == "incomplete"
    assert menu == policy_for("any")  # phrases are no part of the timing


# ---------------------------------------------------------------- shapes a schema declares


def test_a_json_schema_declares_digits_zip_date_or_nothing() -> None:
    assert pattern_digits(r"^\d{3}-?\d{3}-?\d{4}$") == (10, 10)
    assert pattern_digits(r"^[A-Z]{2}\d{4}$") is None
    assert schema_shape({"type": "string", "pattern": r"^\d{4}$"}) == AnswerShape("digits", 4)
    assert schema_shape({"type": "string", "pattern": r"^[0-9]{8,10}$"}) == AnswerShape(
        "digits", 8, 10
    )
    assert schema_shape({"type": "string", "pattern": r"^\d{5}(-\d{4})?$"}) == AnswerShape("zip")
    assert schema_shape({"type": "string", "format": "date"}) == AnswerShape("date")
    assert schema_shape({"type": "integer", "minimum": 1000, "maximum": 9999}) == AnswerShape(
        "digits", 4
    )
    assert schema_shape({"type": "string", "pattern": r"^\d+$"}) == AnswerShape("digits")
    assert schema_shape({"type": "string"}) is None


AGENT_FLOW = """\
name: t
start: talk
nodes:
  talk:
    kind: agent
    system: You help.
    greeting: Hello, what is your account number?
    on_no_input: hangup
    tools:
      - name: find_account
        description: Find the caller's account.
        parameters:
          type: object
          properties:
            account_number: {type: string, pattern: "^\\\\d{8}$"}
            zip: {type: string, pattern: "^\\\\d{5}(-\\\\d{4})?$"}
            born: {type: string, format: date}
            note: {type: string}
        expects:
          born: {asked_as: [date of birth, birthday]}
"""


@pytest.mark.parametrize(
    ("reply", "expect", "digits"),
    [
        ("Hello, what is your account number?", "digits", 8),
        ("Thanks. And your ZIP code, please.", "zip", None),
        ("Got it. What is your date of birth?", "date", None),
        ("Your account number is fine. How can I help?", "any", None),  # the last question
        ("What are your account number and ZIP?", "any", None),  # two shapes: neither
        (None, "any", None),
    ],
)
def test_the_agent_listens_for_the_argument_its_question_asks_for(
    reply: str | None, expect: str, digits: int | None
) -> None:
    flow = load_flow_text(AGENT_FLOW, "t.yaml")
    node = flow.nodes["talk"]
    assert isinstance(node, AgentNode)
    turn = listen_spec(flow, node, reply).turn
    assert (turn.expect, turn.digits) == (expect, digits)


@pytest.mark.parametrize(
    ("edit", "message", "line"),
    [
        ("born: {asked_as: [date of birth, birthday]}", None, None),
        ("nope: {expect: date}", "'nope' is not one of its parameters", 20),
        ("note: {asked_as: [note]}", "'note': its schema declares no shape", 20),
        ("born: {expect: date, digits: 4}", "digits: 4 only applies with 'expect: digits'", 20),
        ("born: {expect: birthday}", "'digits', 'yes_no', 'zip' or 'date'", 20),
    ],
)
def test_a_bad_expects_entry_is_an_error_at_its_line(
    edit: str, message: str | None, line: int | None
) -> None:
    text = AGENT_FLOW.replace("born: {asked_as: [date of birth, birthday]}", edit)
    flow, problems = check_flow_text(textwrap.dedent(text), "t.yaml")
    if message is None:
        assert flow is not None and not problems
        return
    assert flow is None
    hits = [p for p in problems if message in p.message]
    assert len(hits) == 1, problems
    assert (hits[0].file, hits[0].line) == ("t.yaml", line), hits
    assert "tools[0].expects" in str(hits[0]) or "tools.0.expects" in str(hits[0]), hits


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ("{expect: zip, digits: 5}", "digits: 5 only applies with 'expect: digits'"),
        ("{expect: digits, digits: 10, max_digits: 8}", "max_digits (8) is below digits (10)"),
        ("{number_silence_ms: 50}", "greater than or equal to 100"),
    ],
)
def test_a_bad_turn_shape_is_an_error_at_its_line(block: str, message: str) -> None:
    text = AGENT_FLOW.replace(
        "    on_no_input: hangup\n", f"    on_no_input: hangup\n    turn: {block}\n"
    )
    flow, problems = check_flow_text(text, "t.yaml")
    assert flow is None
    hits = [p for p in problems if message in p.message]
    assert len(hits) == 1, problems
    assert hits[0].line == 9 and "turn" in str(hits[0]), hits
