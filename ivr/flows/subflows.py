"""Sub-flows across files: check the references between flows and attach what each includes.

A ``subflow`` node names another flow, so whether it is right depends on the flows loaded
together (a directory); these checks run after each file passed on its own. ``resolve`` attaches
to every flow the flows it includes (directly or not) as loaded together, and makes its
``version`` cover theirs: a call pinned to a version also pins its sub-flows, and a reload of a
sub-flow's file is a new version of every flow that includes it.

Everything here works on flows already loaded; ``ivr.flows.loader`` reads a directory's files.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable, Mapping

from ivr.flows.model import INPUT_KINDS, Flow, Node
from ivr.flows.nodes import ReturnNode, SubflowNode
from ivr.flows.problems import Problem
from ivr.flows.validate import input_free_cycles, known_variables


def resolve(flows: Mapping[str, Flow]) -> tuple[dict[str, Flow], list[Problem]]:
    """Every flow with its sub-flows attached; a flow with an error, or including one, is left
    out. Returns the flows and every problem (warnings too)."""
    problems = check_set(flows)
    bad_files = {p.file for p in problems if p.severity == "error"}
    bad = {name for name, flow in flows.items() if flow.source in bad_files}
    out: dict[str, Flow] = {}
    for name, flow in flows.items():
        closure = included(flows, name)
        broken = sorted(closure & bad)
        if name in bad:
            continue
        if broken:
            msg = f"flow '{name}' includes sub-flow(s) with errors: {', '.join(broken)}"
            problems.append(_problem(flow, "nodes", msg))
            continue
        out[name] = attach(flow, {n: flows[n] for n in closure})
    return out, problems


def attach(flow: Flow, subflows: Mapping[str, Flow]) -> Flow:
    """``flow`` running ``subflows``; its version is its file's digest plus theirs."""
    version = flow.file_version or flow.version
    if subflows:
        digest = hashlib.sha256(version.encode())
        for name in sorted(subflows):
            sub = subflows[name]
            digest.update(f"|{name}={sub.file_version or sub.version}".encode())
        version = digest.hexdigest()[:12]
    return flow.model_copy(update={"subflows": dict(subflows), "version": version})


def included(flows: Mapping[str, Flow], name: str) -> set[str]:
    """Names of the known flows ``name`` includes, directly or through other sub-flows."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        flow = flows.get(todo.pop())
        for node in flow.subflow_nodes().values() if flow else ():
            if node.flow not in seen and node.flow in flows:
                seen.add(node.flow)
                todo.append(node.flow)
    seen.discard(name)
    return seen


# ---------------------------------------------------------------- checks


def check_set(flows: Mapping[str, Flow]) -> list[Problem]:
    """Problems of sub-flow references among ``flows`` (flow name -> flow)."""
    problems: list[Problem] = []
    used = {node.flow for f in flows.values() for node in f.subflow_nodes().values()}
    for name, flow in flows.items():
        for node_name, node in flow.subflow_nodes().items():
            problems += _check_reference(flows, flow, node_name, node)
        if name not in used:
            problems += _unused_returns(flow)
    if not any(p.severity == "error" for p in problems):
        problems += _check_loops(flows)
    return problems


def _check_reference(
    flows: Mapping[str, Flow], flow: Flow, name: str, node: SubflowNode
) -> list[Problem]:
    at = f"nodes.{name}"
    target = flows.get(node.flow)
    if target is None:
        close = difflib.get_close_matches(node.flow, sorted(flows), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        msg = (
            f"unknown sub-flow '{node.flow}' in node '{name}'; {hint}"
            f"flows: {', '.join(sorted(flows))}"
        )
        return [_problem(flow, f"{at}.flow", msg)]
    loop = _path(flows, node.flow, flow.name)
    if loop is not None:
        chain = " -> ".join([flow.name, *loop])
        msg = (
            f"sub-flow loop {chain} in node '{name}': a flow cannot include itself, "
            "directly or through other sub-flows"
        )
        return [_problem(flow, f"{at}.flow", msg)]
    problems = []
    for var in node.pass_:
        if var not in target.variables:
            declared = ", ".join(sorted(target.variables)) or "none"
            msg = (
                f"sub-flow '{target.name}' has no variable '{var}' to pass to (node '{name}'); "
                f"declare it under its 'variables:' (declared: {declared})"
            )
            problems.append(_problem(flow, f"{at}.pass.{var}", msg))
    known = known_variables(target)
    for var, child in node.return_.items():
        if child.split(".")[0] not in known:
            close = difflib.get_close_matches(child.split(".")[0], sorted(known), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            msg = (
                f"sub-flow '{target.name}' has no variable '{child}' to return into '{var}' "
                f"(node '{name}'); {hint}known: {', '.join(sorted(known))}"
            )
            problems.append(_problem(flow, f"{at}.return.{var}", msg))
    if not any(isinstance(n, ReturnNode) for n in target.nodes.values()):
        msg = (
            f"sub-flow '{target.name}' has no return node: the call always ends inside it, "
            f"so 'next' of node '{name}' is never used"
        )
        problems.append(_problem(flow, f"{at}.flow", msg, warn=True))
    return problems


def _path(flows: Mapping[str, Flow], start: str, goal: str) -> list[str] | None:
    """Flow names from ``start`` to ``goal`` following sub-flow nodes, or None."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        name = todo.pop(0)
        if name == goal:
            return paths[name]
        flow = flows.get(name)
        for node in flow.subflow_nodes().values() if flow else ():
            if node.flow not in paths:
                paths[node.flow] = [*paths[name], node.flow]
                todo.append(node.flow)
    return None


def _unused_returns(flow: Flow) -> list[Problem]:
    return [
        _problem(
            flow,
            f"nodes.{name}",
            f"return node '{name}' in flow '{flow.name}', which no flow uses as a sub-flow: "
            "a call that starts in this flow hangs up there",
            warn=True,
        )
        for name, node in flow.nodes.items()
        if isinstance(node, ReturnNode)
    ]


def _check_loops(flows: Mapping[str, Flow]) -> list[Problem]:
    """Loops through subflow nodes whose sub-flow can return without waiting for the caller."""
    quick: dict[str, bool] = {}

    def returns_at_once(name: str) -> bool:
        if name not in quick:
            quick[name] = _returns_without_input(flows[name], waits)
        return quick[name]

    def waits(node: Node) -> bool:
        if isinstance(node, SubflowNode):
            return node.flow not in flows or not returns_at_once(node.flow)
        return node.kind in INPUT_KINDS

    problems = []
    for flow in flows.values():
        if not flow.subflow_nodes():
            continue
        for cycle in input_free_cycles(flow, waits):
            node = next((n for n in cycle if isinstance(flow.nodes[n], SubflowNode)), cycle[0])
            msg = (
                f"loop without any input step through {', '.join(cycle)}: sub-flow "
                f"'{getattr(flow.nodes[node], 'flow', '?')}' can return without waiting for the "
                "caller, so the call would spin forever"
            )
            problems.append(_problem(flow, f"nodes.{node}", msg))
    return problems


def _returns_without_input(flow: Flow, waits: Callable[[Node], bool]) -> bool:
    seen = {flow.start}
    todo = [flow.start]
    while todo:
        node = flow.nodes.get(todo.pop())
        if node is None or waits(node):
            continue
        if isinstance(node, ReturnNode):
            return True
        for _, target, _ in node.targets():
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return False


def _problem(flow: Flow, where: str, message: str, *, warn: bool = False) -> Problem:
    line, column = flow.ref_positions.get(where, (1, 1))
    return Problem(flow.source, line, column, message, "warning" if warn else "error")
