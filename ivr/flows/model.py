"""The call-flow file format: what operators write in ``flows/*.yaml``, as pydantic models.

A flow is a graph of named nodes. Each node has a ``kind``; edges are node names in fields such
as ``next``, ``fallback``, ``on_error`` and per-option ``next``. Text fields are templates
(see ``ivr.flows.template``). ``Flow.model_json_schema()`` is what ``ivr flows schema`` prints.

References (targets, intents, variables, knowledge files) are checked by ``ivr.flows.validate``,
not here: pydantic only checks the shape, so every error can name its file, line and column.

The nodes are in ``ivr.flows.nodes``, the pieces flows and nodes share in ``ivr.flows.spec``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from ivr.callio.interruption_policy import InterruptionPolicy
from ivr.flows.nodes import (
    AgentNode,
    AskNode,
    BranchNode,
    GotoNode,
    HangupNode,
    HttpNode,
    MenuNode,
    ReturnNode,
    SayNode,
    SetNode,
    SubflowNode,
    TransferNode,
)
from ivr.flows.spec import (
    Defaults,
    EnvVar,
    Intent,
    Interruptions,
    NodeName,
    RecordingSpec,
    Spec,
    VarName,
)

Node = Annotated[
    SayNode
    | AskNode
    | MenuNode
    | AgentNode
    | BranchNode
    | SetNode
    | HttpNode
    | TransferNode
    | HangupNode
    | GotoNode
    | SubflowNode
    | ReturnNode,
    Field(discriminator="kind"),
]

INPUT_KINDS = frozenset({"ask", "menu", "agent"})
TERMINAL_KINDS = frozenset({"transfer", "hangup"})


class Flow(Spec):
    """One call flow file."""

    name: VarName
    description: str = ""
    numbers: list[str] = Field(default_factory=list, description="Called numbers it answers.")
    start: str
    variables: dict[VarName, Annotated[EnvVar | Any, Field(union_mode="left_to_right")]] = Field(
        default_factory=dict,
        description="Call variables and their start values; {env: NAME, default: x} reads the "
        "environment when the call starts.",
    )
    variables_in_clear: list[VarName] = Field(
        default_factory=list,
        description="Variables the call record keeps unmasked (the caller's answers and phone "
        "or card numbers are masked there otherwise), e.g. an account number a later http node "
        "needs after the call resumes on another instance.",
    )
    intents: dict[VarName, Intent] = Field(default_factory=dict)
    defaults: Defaults = Field(default_factory=Defaults)
    resume_prompt: str | None = Field(
        default=None, description="Said first when a call resumes on another instance."
    )
    recording: RecordingSpec = Field(default_factory=RecordingSpec)
    nodes: dict[NodeName, Node] = Field(min_length=1)

    # Filled by the loader, not written by operators.
    source: SkipJsonSchema[str] = Field(default="", exclude=True)
    version: SkipJsonSchema[str] = Field(default="", exclude=True)
    """This file's digest, combined with the file digests of every sub-flow it includes."""
    file_version: SkipJsonSchema[str] = Field(default="", exclude=True)
    """This file's digest alone."""
    subflows: SkipJsonSchema[dict[str, Flow]] = Field(default_factory=dict, exclude=True)
    """Every flow it includes, directly or not, by name: the versions a pinned call runs."""
    ref_positions: SkipJsonSchema[dict[str, tuple[int, int]]] = Field(
        default_factory=dict, exclude=True
    )
    """(line, column) of sub-flow references ("nodes.N.flow", "nodes.N.pass.K", ...)."""

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def subflow_nodes(self) -> dict[str, SubflowNode]:
        return {n: node for n, node in self.nodes.items() if isinstance(node, SubflowNode)}

    def flow_named(self, name: str) -> Flow | None:
        """This flow or one it includes."""
        return self if name == self.name else self.subflows.get(name)

    def interruptions(self, node_name: str) -> InterruptionPolicy:
        """What interrupts the prompts of ``node_name``: its own block, else the defaults'."""
        node = self.nodes.get(node_name)
        own = getattr(node, "interruptions", None)
        return (own if isinstance(own, Interruptions) else self.defaults.interruptions).policy()
