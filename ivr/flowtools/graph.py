"""Draw a flow as a Mermaid flowchart or a Graphviz dot graph (``ivr flows graph``)."""

from __future__ import annotations

from ivr.flows.model import Flow
from ivr.flows.nodes import Edge, SubflowNode


def edge_label(edge: Edge) -> str:
    if edge.label is not None:  # the node names the choice (a route, a key, a tool)
        return edge.label
    field = edge.path[0]
    if field in ("cases", "exit_when"):
        return f"case {int(edge.path[1]) + 1}"
    return "" if field == "next" else str(field)


def _all_edges(flow: Flow) -> list[tuple[str, str, str]]:
    return [
        (name, edge.target, edge_label(edge))
        for name, node in flow.nodes.items()
        for edge in node.targets()
    ]


def _uses_hangup_target(flow: Flow) -> bool:
    return any(target == "hangup" for _, target, _ in _all_edges(flow))


def to_mermaid(flow: Flow) -> str:
    lines = ["flowchart TD", f"  start((start)) --> {_mid(flow.start)}"]
    for name, node in flow.nodes.items():
        if isinstance(node, SubflowNode):  # Mermaid's subroutine shape
            lines.append(f'  {_mid(name)}[["{name}<br/><i>subflow: {node.flow}</i>"]]')
        else:
            lines.append(f'  {_mid(name)}["{name}<br/><i>{node.kind}</i>"]')
    if _uses_hangup_target(flow):
        lines.append("  hangup((hang up))")
    for source, target, label in _all_edges(flow):
        arrow = f' -- "{label}" --> ' if label else " --> "
        lines.append(f"  {_mid(source)}{arrow}{_mid(target)}")
    return "\n".join(lines) + "\n"


def to_dot(flow: Flow) -> str:
    lines = [f'digraph "{flow.name}" {{', "  rankdir=TB;", '  start [shape=circle, label="start"];']
    for name, node in flow.nodes.items():
        shape = "diamond" if node.kind == "branch" else "box"
        kind = f"subflow: {node.flow}" if isinstance(node, SubflowNode) else node.kind
        extra = ", peripheries=2" if isinstance(node, SubflowNode) else ""
        lines.append(f'  "{name}" [shape={shape}{extra}, label="{name}\\n({kind})"];')
    if _uses_hangup_target(flow):
        lines.append('  "hangup" [shape=doublecircle, label="hang up"];')
    lines.append(f'  start -> "{flow.start}";')
    for source, target, label in _all_edges(flow):
        attr = f' [label="{label}"]' if label else ""
        lines.append(f'  "{source}" -> "{target}"{attr};')
    return "\n".join([*lines, "}"]) + "\n"


def _mid(name: str) -> str:
    """Mermaid ids cannot contain '-' in all renderers, and 'end' is reserved."""
    return "n_" + name.replace("-", "_")
