"""The pure engine: events in, actions out, state that survives a JSON round trip."""

from __future__ import annotations

import gc
from typing import get_args

import pytest

from ivr.flows.engine import STEPS, FlowRuntimeError, copy_state, new_state, step
from ivr.flows.events import (
    AgentTurn,
    CallerHungUp,
    CallerPressed,
    CallerSaid,
    CallerSilent,
    CallStarted,
    ClassifyIntent,
    FlowAction,
    FlowEvent,
    FlowState,
    Hangup,
    HistoryItem,
    HttpRequest,
    HttpResult,
    IntentClassified,
    Listen,
    LlmReplied,
    Resumed,
    Say,
    Transfer,
)
from ivr.flows.loader import load_flow_text
from ivr.flows.matching import holds, spoken_digits, spoken_key
from ivr.flows.model import Flow, Node
from ivr.flows.spec import Condition
from ivr.flows.template import references, render
from ivr.flows.validate import RULES

FLOW = load_flow_text(
    """
name: bank
start: hello
resume_prompt: Sorry, we were cut off.
variables:
  api: {env: BANK_API, default: "http://bank"}
  tier: basic
intents:
  balance: {examples: [balance, how much]}
nodes:
  hello:
    kind: say
    text: Welcome to the bank.
    next: menu
  menu:
    kind: ask
    prompt: Press 1 or say balance. Press 2 for an agent.
    routes:
      - {intent: balance, key: "1", next: account}
      - {key: "2", next: agent}
    classify: true
    max_retries: 1
    fallback: agent
  account:
    kind: ask
    prompt: Your account number?
    digits: {num_digits: 4}
    pattern: "[0-9]{4}"
    store: account
    next: lookup
  lookup:
    kind: http
    request:
      url: "{{ api }}/accounts/{{ account }}"
      map: {balance: data.balance}
    next: route
    on_error: agent
  route:
    kind: branch
    cases:
      - {when: {var: balance, lt: 0}, next: overdrawn}
      - when: [{var: tier, equals: gold}, {var: balance, ge: 1000}]
        next: vip
    default: tell
  tell:
    kind: hangup
    say: Your balance is {{ balance }}.
  overdrawn:
    kind: set
    values: {flag: overdrawn}
    next: agent
  vip:
    kind: hangup
    say: Gold customer, {{ balance }}.
  agent:
    kind: transfer
    say: Connecting you.
    number: "+15550001111"
""",
    "bank.yaml",
)


def run(flow: Flow, state: FlowState, event: FlowEvent) -> tuple[FlowState, list[FlowAction]]:
    """Step, and check that the new state survives the JSON round trip the session does."""
    new, actions = step(flow, state, event)
    assert FlowState.model_validate_json(new.model_dump_json()) == new
    return new, actions


def says(actions: list[FlowAction]) -> list[str]:
    return [a.text for a in actions if isinstance(a, Say)]


def start(**call_vars: object) -> FlowState:
    state, _ = run(FLOW, new_state(FLOW, call_vars, env={}), CallStarted())
    return state


def test_call_start_says_the_welcome_then_asks_and_listens() -> None:
    state, actions = run(FLOW, new_state(FLOW, env={}), CallStarted())
    assert says(actions) == [
        "Welcome to the bank.",
        "Press 1 or say balance. Press 2 for an agent.",
    ]
    assert isinstance(actions[-1], Listen) and actions[-1].spec.dtmf
    assert (state.node, state.waiting) == ("menu", "input")


def test_step_does_not_modify_the_state_it_was_given() -> None:
    state = start()
    before = state.model_dump()
    step(FLOW, state, CallerPressed("1"))
    assert state.model_dump() == before


def test_a_steps_copy_of_the_state_shares_nothing_a_step_could_change() -> None:
    state = start()
    state.vars["order"] = {"items": [{"sku": "A1", "sizes": (1, 2)}]}
    state.env["API_KEY"] = "secret"
    state.history.append(HistoryItem(role="user", content="hello"))
    copy = copy_state(state)
    assert copy == state and copy.env == {**state.env}
    copy.vars["order"]["items"][0]["sku"] = "B2"
    copy.env["API_KEY"] = "other"
    copy.history[-1].content = "changed"
    assert state.vars["order"] == {"items": [{"sku": "A1", "sizes": (1, 2)}]}
    assert state.env["API_KEY"] == "secret" and state.history[-1].content == "hello"


def test_variables_come_from_defaults_env_and_call_variables_in_that_order() -> None:
    state = new_state(FLOW, {"tier": "gold"}, env={"BANK_API": "http://10.0.0.1"})
    # {env: ...} values stay out of vars (persisted); the engine reads them from state.env.
    assert state.vars == {"tier": "gold"} and state.env == {"BANK_API": "http://10.0.0.1"}
    assert "10.0.0.1" not in state.model_dump_json()


def test_a_key_a_spoken_key_and_an_example_phrase_all_pick_the_route() -> None:
    for event in (CallerPressed("1"), CallerSaid("one"), CallerSaid("What's my balance?")):
        state, actions = run(FLOW, start(), event)
        assert state.node == "account", event
        assert says(actions) == ["Your account number?"]


def test_dtmf_settings_reach_the_listen_spec() -> None:
    _, actions = run(FLOW, start(), CallerPressed("1"))
    listen = actions[-1]
    assert isinstance(listen, Listen) and listen.spec.num_digits == 4


def test_a_menu_of_single_keys_answers_on_the_first_key() -> None:
    # Without this the caller waits out the inter-digit timeout (3 s) after pressing "1".
    _, actions = run(FLOW, new_state(FLOW, env={}), CallStarted())
    listen = actions[-1]
    assert isinstance(listen, Listen) and listen.spec.num_digits == 1


def test_an_unmatched_answer_goes_to_the_classifier_and_its_intent_routes() -> None:
    state, actions = run(FLOW, start(), CallerSaid("uh, money stuff"))
    assert state.waiting == "classify"
    ask = actions[-1]
    assert isinstance(ask, ClassifyIntent) and [i.name for i in ask.intents] == ["balance"]
    state, actions = run(FLOW, state, IntentClassified("balance"))
    assert state.node == "account" and state.vars["last_intent"] == "balance"


def test_no_match_then_no_input_reprompt_and_then_the_fallback_is_taken() -> None:
    state, actions = run(FLOW, start(), CallerSaid("pizza"))
    state, actions = run(FLOW, state, IntentClassified(None))
    assert says(actions) == [
        "Sorry, I didn't get that.",
        "Press 1 or say balance. Press 2 for an agent.",
    ]
    state, actions = run(FLOW, state, CallerSilent())
    assert says(actions) == ["Connecting you."]
    assert actions[-1] == Transfer("+15550001111")
    assert state.outcome == "transfer" and state.done


def test_a_spoken_account_number_is_stored_as_digits_and_fills_the_url() -> None:
    state, _ = run(FLOW, start(), CallerPressed("1"))
    state, actions = run(FLOW, state, CallerSaid("one two three four"))
    assert state.vars["account"] == "1234"
    assert actions == [HttpRequest("GET", "http://bank/accounts/1234", {}, None, 5.0)]


def test_an_answer_that_fails_the_pattern_is_a_no_match() -> None:
    state, _ = run(FLOW, start(), CallerPressed("1"))
    state, actions = run(FLOW, state, CallerPressed("12"))
    assert state.node == "account" and state.attempts == 1
    assert "Sorry, I didn't get that." in says(actions)


def at_lookup(**call_vars: object) -> FlowState:
    state, _ = run(FLOW, start(**call_vars), CallerPressed("1"))
    state, _ = run(FLOW, state, CallerPressed("1234"))
    return state


@pytest.mark.parametrize(
    ("tier", "balance", "expected"),
    [
        ("basic", 50, "Your balance is 50."),
        ("gold", 5000, "Gold customer, 5000."),
        ("gold", 10, "Your balance is 10."),
    ],
)
def test_the_http_answer_is_mapped_and_branches_on_it(
    tier: str, balance: int, expected: str
) -> None:
    state, actions = run(
        FLOW, at_lookup(tier=tier), HttpResult(True, 200, {"data": {"balance": balance}})
    )
    assert says(actions) == [expected]
    assert isinstance(actions[-1], Hangup) and state.outcome == "hangup"


def test_a_negative_balance_sets_a_flag_and_goes_to_an_agent() -> None:
    state, _ = run(FLOW, at_lookup(), HttpResult(True, 200, {"data": {"balance": -3}}))
    assert state.vars["flag"] == "overdrawn" and state.outcome == "transfer"


@pytest.mark.parametrize(
    "result",
    [
        HttpResult(False, 503, None, "HTTP 503"),
        HttpResult(False, 0, None, "ConnectError"),
        HttpResult(True, 200, {"x": 1}),
    ],
)
def test_http_failures_and_missing_fields_take_the_error_edge(result: HttpResult) -> None:
    state, _ = run(FLOW, at_lookup(), result)
    assert state.node == "agent" and state.vars["http_error"]


def test_a_resumed_call_apologises_and_asks_the_current_question_again() -> None:
    state, _ = run(FLOW, start(), CallerPressed("1"))
    saved = FlowState.model_validate_json(state.model_dump_json())
    state, actions = run(FLOW, saved, Resumed())
    assert says(actions) == ["Sorry, we were cut off.", "Your account number?"]
    assert isinstance(actions[-1], Listen) and state.node == "account"


def test_a_resumed_call_apologises_with_the_gateway_prompt_when_the_flow_sets_none() -> None:
    quiet = FLOW.model_copy(update={"resume_prompt": None})
    state, _ = run(quiet, start(), CallerPressed("1"))
    _, actions = run(quiet, state, Resumed("One moment, we are back."))
    assert says(actions) == ["One moment, we are back.", "Your account number?"]
    # The flow's own apology wins over the gateway's.
    _, actions = run(FLOW, state, Resumed("One moment, we are back."))
    assert says(actions)[0] == "Sorry, we were cut off."


def test_the_caller_hanging_up_ends_the_flow_and_later_events_are_ignored() -> None:
    state, actions = run(FLOW, start(), CallerHungUp())
    assert actions == [] and state.outcome == "caller_hangup"
    assert run(FLOW, state, CallerPressed("1")) == (
        state.model_copy(update={"steps": state.steps + 1}),
        [],
    )


def test_an_event_the_node_is_not_waiting_for_is_a_runtime_error() -> None:
    with pytest.raises(FlowRuntimeError, match="while waiting for input"):
        step(FLOW, start(), HttpResult(True, 200, {}))


@pytest.mark.parametrize(
    ("cond", "value", "expected"),
    [
        ({"var": "v", "equals": 1}, "1", True),
        ({"var": "v", "equals": "Gold"}, "gold", True),
        ({"var": "v", "not_equals": "a"}, "a", False),
        ({"var": "v", "in": ["a", "b"]}, "b", True),
        ({"var": "v", "exists": True}, "", False),
        ({"var": "v", "exists": False}, None, True),
        ({"var": "v", "gt": 10}, "10.5", True),
        ({"var": "v", "le": 10}, "ten", False),
        ({"var": "v", "contains": "LATE"}, "payment late", True),
        ({"var": "v", "matches": "[0-9]{3}"}, "123", True),
        ({"var": "v.x", "equals": 2}, {"x": 2}, True),
    ],
)
def test_conditions_compare_plain_values(
    cond: dict[str, object], value: object, expected: bool
) -> None:
    assert holds(Condition.model_validate(cond), {"v": value}) is expected


def test_a_condition_needs_exactly_one_operator() -> None:
    with pytest.raises(ValueError, match="exactly one operator"):
        Condition.model_validate({"var": "v", "gt": 1, "lt": 3})


def test_spoken_keys_and_digits_are_understood() -> None:
    assert spoken_key("press two") == "2"
    assert spoken_key("option 3") == "3"
    assert spoken_key("two please now") is None
    assert spoken_digits("one two three four five") == "12345"


def test_templates_replace_variables_and_nothing_else() -> None:
    assert references("Hi {{ name }}, {{a.b}}!") == ["name", "a.b"]
    assert (
        render("Hi {{ name }}, {{ a.b }}{{ missing }}!", {"name": "Ann", "a": {"b": 2.0}})
        == "Hi Ann, 2!"
    )
    assert render("{{ __class__ }}", {}) == ""


AGENT = load_flow_text(
    "name: a\nstart: chat\nnodes:\n  chat:\n    kind: agent\n    system: Help.\n"
    "    greeting: Hi.\n",
    "a.yaml",
)


def test_a_resumed_agent_call_answers_the_question_whose_reply_was_lost() -> None:
    state, _ = run(AGENT, new_state(AGENT, env={}), CallStarted())
    state, actions = run(AGENT, state, CallerSaid("What time is it?"))
    assert state.waiting == "agent"  # the instance dies while the model is answering
    state, actions = run(AGENT, state, Resumed())
    turn = actions[-1]
    assert isinstance(turn, AgentTurn)
    assert [m.content for m in turn.messages[1:]] == ["Hi.", "What time is it?"]


def test_a_step_leaves_no_garbage_for_the_cycle_collector() -> None:
    # Speculation steps the engine on every caller pause: a reference cycle per step would
    # pile copies of the state (history included) on the collector, whose full passes then
    # stall every call of the process.
    state = start()
    gc.collect()
    gc.disable()
    try:
        for event in (CallerSaid("What's my balance?"), CallerPressed("1"), CallerSaid("agent")):
            step(FLOW, state, event)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_words_after_a_reply_nobody_heard_join_the_sentence_it_answered() -> None:
    # The caller paused mid-sentence, the pause was taken for the end of the turn and the
    # reply was cut before a word of it was heard: the rest of the sentence is the same turn.
    state, _ = run(AGENT, new_state(AGENT, env={}), CallStarted())
    state, _ = run(AGENT, state, CallerSaid("Yes, that is"))
    state, actions = run(AGENT, state, LlmReplied("", interrupted=True))
    assert isinstance(actions[-1], Listen)
    state, actions = run(AGENT, state, CallerSaid("correct."))
    turn = actions[-1]
    assert isinstance(turn, AgentTurn)
    assert [m.content for m in turn.messages[1:]] == ["Hi.", "Yes, that is correct."]
    assert state.vars["last_input"] == "Yes, that is correct."


def test_words_after_a_reply_the_caller_heard_part_of_are_a_turn_of_their_own() -> None:
    state, _ = run(AGENT, new_state(AGENT, env={}), CallStarted())
    state, _ = run(AGENT, state, CallerSaid("What time is it?"))
    state, _ = run(AGENT, state, LlmReplied("It is", interrupted=True))
    state, actions = run(AGENT, state, CallerSaid("Sorry, in Paris."))
    turn = actions[-1]
    assert isinstance(turn, AgentTurn)
    contents = [m.content for m in turn.messages[1:]]
    assert contents == ["Hi.", "What time is it?", "It is", "Sorry, in Paris."]
    # A reply heard whole, then the caller: a turn of its own too.
    state, _ = run(AGENT, state, LlmReplied("Noon in Paris."))
    state, actions = run(AGENT, state, CallerSaid("Thanks."))
    turn = actions[-1]
    assert isinstance(turn, AgentTurn)
    assert [m.content for m in turn.messages[-2:]] == ["Noon in Paris.", "Thanks."]


def test_every_node_kind_has_its_steps_and_its_checks() -> None:
    models = get_args(get_args(Node)[0])
    kinds = {get_args(m.model_fields["kind"].annotation)[0] for m in models}
    assert len(kinds) == len(models) == 12
    assert set(STEPS) == kinds
    assert set(RULES) == kinds
