"""Checks beyond shape: every reference resolves and the graph can always make progress.

* targets (``next``, ``fallback``, ``on_error``, route/option/case/tool ``next``) name real nodes
* intents used by routes are declared; template variables are ones the flow can set
* knowledge files exist; menu keys are unique; tool argument schemas are objects
* a request that is not idempotent does not set its idempotency header itself
* graph: no unreachable node, no dead end, no cycle that never waits for the caller
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from ivr.flows import template
from ivr.flows.model import INPUT_KINDS, Flow, Node
from ivr.flows.nodes import (
    AgentNode,
    AskNode,
    BranchNode,
    GotoNode,
    HttpNode,
    MenuNode,
    SayNode,
    SetNode,
    SubflowNode,
)
from ivr.flows.problems import Path_, Problem, SourceMap
from ivr.flows.spec import BUILTIN_TARGETS, HttpCall

BUILTIN_VARIABLES = (
    "caller",
    "called",
    "call_sid",
    "last_input",
    "last_intent",
    "http_status",
    "http_error",
    "direction",
    "answered_by",
    "transfer_status",
)
# Keys whose string values are names, phrases or schemas, never templates.
_NOT_TEMPLATES = frozenset(
    {
        "kind", "next", "fallback", "on_error", "on_max_turns", "on_no_input", "default",
        "description", "name", "key", "intent", "pattern", "var", "parameters", "schema",
        "knowledge", "knowledge_text", "store", "matches", "method", "history", "map",
        "examples", "equals", "not_equals", "in", "contains", "when", "options", "routes",
        "exit_when", "cases", "tools", "result", "idempotency_header", "hold_music",
    }
)  # fmt: skip


def read_knowledge(
    flow: Flow, smap: SourceMap, base_dir: Path
) -> tuple[Flow, list[Problem], list[bytes]]:
    """Put each agent's knowledge files into ``knowledge_text`` (read once, at load)."""
    problems: list[Problem] = []
    contents: list[bytes] = []
    nodes = dict(flow.nodes)
    for name, node in flow.nodes.items():
        if not isinstance(node, AgentNode) or not node.knowledge:
            continue
        texts = [node.knowledge_text] if node.knowledge_text else []
        for i, rel in enumerate(node.knowledge):
            path = base_dir / rel
            try:
                raw = path.read_bytes()
                texts.append(raw.decode("utf-8"))
                contents.append(raw)
            except (OSError, UnicodeDecodeError) as exc:
                msg = (
                    f"cannot read knowledge file '{rel}' of node '{name}' ({exc}); "
                    "paths are relative to the flow file"
                )
                problems.append(smap.problem(("nodes", name, "knowledge", i), msg))
        nodes[name] = node.model_copy(update={"knowledge_text": "\n\n".join(texts)})
    return flow.model_copy(update={"nodes": nodes}), problems, contents


def check_flow(flow: Flow, data: dict[str, Any], smap: SourceMap) -> list[Problem]:
    problems = _check_targets(flow, smap)
    problems += _check_nodes(flow, smap)
    problems += _check_variables(flow, data, smap)
    problems += _check_in_clear(flow, smap)
    problems += _check_graph(flow, smap)
    return problems


def _unknown_target(flow: Flow, target: str, where: str) -> str:
    known = sorted(flow.nodes)
    close = difflib.get_close_matches(target, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown target '{target}' {where}; {hint}known nodes: {', '.join(known)} (or hangup)"


def _check_targets(flow: Flow, smap: SourceMap) -> list[Problem]:
    problems = []
    if flow.start not in flow.nodes:
        msg = _unknown_target(flow, flow.start, "in 'start'")
        problems.append(smap.problem(("start",), msg))
    for name, node in flow.nodes.items():
        for path, target, _ in node.targets():
            if target not in flow.nodes and target not in BUILTIN_TARGETS:
                msg = _unknown_target(flow, target, f"in node '{name}'")
                problems.append(smap.problem(("nodes", name, *path), msg))
    return problems


def _check_nodes(flow: Flow, smap: SourceMap) -> list[Problem]:
    problems: list[Problem] = []
    for name, node in flow.nodes.items():
        problems += RULES[node.kind].check(flow, name, node, smap)
    return problems


def _check_input(flow: Flow, name: str, node: AskNode | MenuNode, smap: SourceMap) -> list[Problem]:
    if node.speech or node.dtmf:
        return []
    return [smap.problem(("nodes", name), f"node '{name}' accepts neither speech nor dtmf")]


def _check_menu(flow: Flow, name: str, node: MenuNode, smap: SourceMap) -> list[Problem]:
    problems = _check_input(flow, name, node, smap)
    keys = [o.key for o in node.options]
    for i, option in enumerate(node.options):
        if keys.index(option.key) != i:
            msg = f"key '{option.key}' is used twice in menu '{name}'"
            problems.append(smap.problem(("nodes", name, "options", i, "key"), msg))
    return problems


def _check_http(call: HttpCall, at: Path_, smap: SourceMap) -> list[Problem]:
    """The gateway sets the idempotency header of a keyed request; a second one, from the file,
    would leave the backend unable to tell a resend from a new request."""
    if not call.keyed:
        return []
    for header in call.headers:
        if header.lower() == call.idempotency_header.lower():
            msg = (
                f"header '{header}' is set by the gateway on a {call.method} request (a key "
                "that stays the same when a resumed call sends it again); remove it, or mark "
                "the request 'idempotent: true' to send your own"
            )
            return [smap.problem((*at, "headers", header), msg)]
    return []


def _check_ask(flow: Flow, name: str, node: AskNode, smap: SourceMap) -> list[Problem]:
    problems = _check_input(flow, name, node, smap)
    for i, route in enumerate(node.routes):
        if route.intent is not None and route.intent not in flow.intents:
            known = ", ".join(sorted(flow.intents)) or "none declared"
            msg = (
                f"unknown intent '{route.intent}' in node '{name}'; "
                f"add it under 'intents:' (known: {known})"
            )
            problems.append(smap.problem(("nodes", name, "routes", i, "intent"), msg))
    if node.classify and not any(r.intent for r in node.routes):
        msg = f"node '{name}' has classify: true but no route with an intent to classify into"
        problems.append(smap.problem(("nodes", name, "classify"), msg))
    return problems


def _check_agent(name: str, node: AgentNode, smap: SourceMap) -> list[Problem]:
    problems = []
    seen: set[str] = set()
    for i, tool in enumerate(node.tools):
        at = ("nodes", name, "tools", i)
        if tool.name in seen:
            problems.append(smap.problem((*at, "name"), f"tool '{tool.name}' is declared twice"))
        seen.add(tool.name)
        params = tool.parameters
        if params.get("type") != "object" or not isinstance(params.get("properties", {}), dict):
            msg = (
                f"parameters of tool '{tool.name}' must be a JSON Schema "
                "{type: object, properties: ...}"
            )
            problems.append(smap.problem((*at, "parameters"), msg))
        if tool.http is not None:
            problems += _check_http(tool.http, (*at, "http"), smap)
    return problems


# ---------------------------------------------------------------- variables


def known_variables(flow: Flow) -> set[str]:
    names = set(BUILTIN_VARIABLES) | set(flow.variables)
    for node in flow.nodes.values():
        names.update(node.variables_set())
    return names


def _check_variables(flow: Flow, data: dict[str, Any], smap: SourceMap) -> list[Problem]:
    known = known_variables(flow)
    problems = []
    for path, text, args in _template_strings(flow, data):
        try:
            refs = template.references(text)
        except template.TemplateSyntaxError as exc:
            problems.append(smap.problem(path, str(exc)))
            continue
        for ref in refs:
            root, _, rest = ref.partition(".")
            if root == "args" and args is not None:
                if rest.split(".")[0] not in args:
                    names = ", ".join(sorted(args)) or "none"
                    msg = f"unknown tool argument '{ref}'; the tool's parameters are: {names}"
                    problems.append(smap.problem(path, msg))
            elif root not in known:
                problems.append(smap.problem(path, _unknown_var(ref, known)))
    for path, var in _condition_vars(flow):
        if var.split(".")[0] not in known:
            problems.append(smap.problem(path, _unknown_var(var, known)))
    return problems


def _check_in_clear(flow: Flow, smap: SourceMap) -> list[Problem]:
    """``variables_in_clear`` names variables the flow has: a typo would leave one masked."""
    known = known_variables(flow)
    return [
        smap.problem(("variables_in_clear", i), _unknown_var(name, known))
        for i, name in enumerate(flow.variables_in_clear)
        if name not in known
    ]


def _unknown_var(ref: str, known: set[str]) -> str:
    close = difflib.get_close_matches(ref.split(".")[0], sorted(known), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (
        f"unknown variable '{ref}'; {hint}declare it under 'variables:' or set it in a node "
        f"(store/set/map/extract); known: {', '.join(sorted(known))}"
    )


def _template_strings(
    flow: Flow, data: dict[str, Any]
) -> Iterator[tuple[Path_, str, set[str] | None]]:
    """(path, text, tool-argument names or None) for every template string in the flow."""
    for key in ("resume_prompt",):
        if isinstance(data.get(key), str):
            yield (key,), data[key], None
    for path, text in template.strings_in(data.get("defaults", {})):
        yield ("defaults", *path), text, None
    nodes = data.get("nodes", {})
    for name, raw in nodes.items():
        node = flow.nodes[name]
        yield from RULES[node.kind].templates(node, raw, ("nodes", name))


Templates = Iterator[tuple[Path_, str, set[str] | None]]


def _all_templates(node: Any, raw: dict[str, Any], at: Path_) -> Templates:
    """Every string of the node is a template (names, phrases and schemas aside)."""
    return _walk_templates(raw, at, None)


def _subflow_templates(node: SubflowNode, raw: dict[str, Any], at: Path_) -> Templates:
    """Only the values given to the sub-flow are templates."""
    for key, value in raw.get("pass", {}).items():
        yield from _walk_templates(value, (*at, "pass", str(key)), None)


def _agent_templates(node: AgentNode, raw: dict[str, Any], at: Path_) -> Templates:
    """A tool's ``set`` and ``http`` may also read the tool's arguments (``args.NAME``)."""
    yield from _walk_templates(raw, at, None)
    for i, tool in enumerate(node.tools):
        args = set(tool.parameters.get("properties", {}))
        raw_tool = raw["tools"][i]
        for part in ("set", "http"):
            if part in raw_tool:
                yield from _walk_templates(raw_tool[part], (*at, "tools", i, part), args)


def _walk_templates(
    value: Any, path: Path_, args: set[str] | None
) -> Iterator[tuple[Path_, str, set[str] | None]]:
    if isinstance(value, str):
        yield path, value, args
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk_templates(item, (*path, i), args)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _NOT_TEMPLATES:
                yield from _walk_templates(item, (*path, str(key)), args)


def _condition_vars(flow: Flow) -> Iterator[tuple[Path_, str]]:
    for name, node in flow.nodes.items():
        for field, cases in node.condition_lists():
            for i, case in enumerate(cases):
                listed = isinstance(case.when, list)
                for j, cond in enumerate(case.conditions):
                    at: Path_ = ("when", j, "var") if listed else ("when", "var")
                    yield ("nodes", name, field, i, *at), cond.var


# ---------------------------------------------------------------- graph


def _check_graph(flow: Flow, smap: SourceMap) -> list[Problem]:
    if flow.start not in flow.nodes:
        return []
    problems = []
    reachable = reachable_nodes(flow)
    for name in flow.nodes:
        if name not in reachable:
            msg = f"node '{name}' is unreachable from start '{flow.start}'; link to it or delete it"
            problems.append(smap.problem(("nodes", name), msg, key=True))
    for name, node in flow.nodes.items():
        reason = RULES[node.kind].dead_end(node)
        if reason:
            problems.append(
                smap.problem(("nodes", name), f"node '{name}' is a dead end: {reason}", key=True)
            )
    for cycle in input_free_cycles(flow):
        msg = (
            f"loop without any input step through {', '.join(cycle)}: the call would spin "
            "forever without the caller; put an ask, menu or agent node in the loop"
        )
        problems.append(smap.problem(("nodes", cycle[0]), msg, key=True))
    return problems


def reachable_nodes(flow: Flow) -> set[str]:
    seen = {flow.start}
    todo = [flow.start]
    while todo:
        node = flow.nodes.get(todo.pop())
        if node is None:
            continue
        for _, target, _ in node.targets():
            if target in flow.nodes and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _needs_next(node: SayNode | SetNode | GotoNode) -> str:
    return "" if node.next is not None else "add 'next:' (or end the call with a hangup node)"


def _subflow_dead_end(node: SubflowNode) -> str:
    if node.next is not None:
        return ""
    return "add 'next:' (where to continue when the sub-flow returns)"


def _http_dead_end(node: HttpNode) -> str:
    if node.next is None or node.on_error is None:
        return "an http node needs both 'next:' and 'on_error:'"
    return ""


def _branch_dead_end(node: BranchNode) -> str:
    return "add 'default:' for when no case matches" if node.default is None else ""


def _ask_dead_end(node: AskNode) -> str:
    return "add 'routes:' or 'next:'" if node.next is None and not node.routes else ""


def waits_for_caller(node: Node) -> bool:
    """Per file: a subflow node counts as waiting; ``ivr.flows.subflows`` checks it across files."""
    return node.kind in INPUT_KINDS or node.kind == "subflow"


def input_free_cycles(
    flow: Flow, waits: Callable[[Node], bool] = waits_for_caller
) -> list[list[str]]:
    """Strongly connected groups of nodes that never wait for the caller (Tarjan)."""
    graph = {
        name: [t for _, t, _ in node.targets() if t in flow.nodes and not waits(flow.nodes[t])]
        for name, node in flow.nodes.items()
        if not waits(node)
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                cycles.append(sorted(group))

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


# ---------------------------------------------------------------- per kind

N = TypeVar("N")


def _no_problems(flow: Flow, name: str, node: Any, smap: SourceMap) -> list[Problem]:
    return []


def _never_stuck(node: Any) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class Rules(Generic[N]):
    """What is checked of a node of one kind, beyond the shape pydantic checks."""

    check: Callable[[Flow, str, N, SourceMap], list[Problem]] = _no_problems
    """Its own problems (unknown intents, duplicate keys, ...)."""
    dead_end: Callable[[N], str] = _never_stuck
    """Why the call would get stuck at it ("" when it cannot)."""
    templates: Callable[[N, dict[str, Any], Path_], Templates] = _all_templates
    """Its template strings as written: (path, text, tool-argument names or None)."""


RULES: dict[str, Rules[Any]] = {
    "say": Rules(dead_end=_needs_next),
    "ask": Rules(_check_ask, _ask_dead_end),
    "menu": Rules(_check_menu),
    "agent": Rules(
        lambda flow, name, node, smap: _check_agent(name, node, smap),
        templates=_agent_templates,
    ),
    "branch": Rules(dead_end=_branch_dead_end),
    "set": Rules(dead_end=_needs_next),
    "http": Rules(
        lambda flow, name, node, smap: _check_http(node.request, ("nodes", name, "request"), smap),
        _http_dead_end,
    ),
    "transfer": Rules(),
    "hangup": Rules(),
    "goto": Rules(dead_end=_needs_next),
    "subflow": Rules(dead_end=_subflow_dead_end, templates=_subflow_templates),
    "return": Rules(),
}
"""The checks of each node kind, by ``kind``."""
