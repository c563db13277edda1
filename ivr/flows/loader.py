"""Read flow files: YAML -> plain data with a line/column for every key and value -> ``Flow``.

Every problem found (YAML syntax, shape, references, graph) is reported with the file, line and
column it comes from, all at once, as a ``FlowLoadError``. A flow directory holds one flow per
``*.yaml`` file plus an optional ``routes.yaml``; ``load_flow`` attaches the sub-flows a flow
includes from the other flow files of its directory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from ivr.flows.model import Flow
from ivr.flows.nodes import ReturnNode
from ivr.flows.problems import FlowLoadError, Path_, Problem, SourceMap
from ivr.flows.subflows import included, resolve
from ivr.flows.validate import check_flow, read_knowledge
from ivr.flows.yamlsource import parse_yaml, pydantic_problems

ROUTES_FILE = "routes.yaml"
"""The one YAML file of a flow directory that is not a flow: called number -> flow name."""


def flow_files(directory: Path) -> list[Path]:
    """The flow files of ``directory``, sorted (every ``*.yaml``/``*.yml`` but the routes)."""
    return sorted(p for p in directory.glob("*.y*ml") if p.name != ROUTES_FILE and p.is_file())


def load_flow(
    path: str | Path, *, display_name: str | None = None, with_subflows: bool = True
) -> Flow:
    """Load and fully validate one flow file; raises ``FlowLoadError`` with every problem.

    With ``with_subflows`` the flows it includes are loaded from the same directory and
    attached (``Flow.subflows``), so the result is ready to run.
    """
    file = Path(path)
    shown = display_name or str(path)
    text = read_flow_text(file, shown)
    flow = load_flow_text(text, shown, base_dir=file.parent)
    if with_subflows and flow.subflow_nodes():
        flow = attach_from_directory(flow, file.parent, exclude=file)
    return flow


def read_flow_text(path: Path, shown: str | None = None) -> str:
    """A flow file's text as the loader hashes it; ``FlowLoadError`` if it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        where = shown or str(path)
        raise FlowLoadError([Problem(where, 1, 1, f"cannot read the file: {exc}")]) from None


def file_digest(text: str, knowledge: Iterable[bytes]) -> str:
    """A flow file's version: its text plus the knowledge files it embeds, in node order."""
    digest = hashlib.sha256(text.encode())
    for part in knowledge:
        digest.update(part)
    return digest.hexdigest()[:12]


def load_flow_text(text: str, file: str, *, base_dir: Path | None = None) -> Flow:
    flow, problems = check_flow_text(text, file, base_dir=base_dir)
    if flow is None:
        raise FlowLoadError(problems)
    return flow


def check_flow_text(
    text: str, file: str, *, base_dir: Path | None = None
) -> tuple[Flow | None, list[Problem]]:
    """Validate a flow; returns the flow (None if any error) and all problems, warnings included."""
    try:
        data, smap = parse_yaml(text, file)
    except FlowLoadError as exc:
        return None, exc.problems
    if not isinstance(data, dict):
        return None, [smap.problem((), "a flow file must be a mapping (name:, start:, nodes:)")]
    try:
        flow = Flow.model_validate(data)
    except ValidationError as exc:
        return None, pydantic_problems(exc, data, smap)
    flow, problems, digest_parts = read_knowledge(flow, smap, base_dir or Path("."))
    problems = sorted(problems + check_flow(flow, data, smap), key=lambda p: (p.line, p.column))
    if any(p.severity == "error" for p in problems):
        return None, problems
    version = file_digest(text, digest_parts)
    update = {"source": file, "version": version, "file_version": version,
              "ref_positions": _ref_positions(flow, smap)}  # fmt: skip
    return flow.model_copy(update=update), problems


def _ref_positions(flow: Flow, smap: SourceMap) -> dict[str, tuple[int, int]]:
    """Positions of sub-flow references, for problems found later against other files."""
    out: dict[str, tuple[int, int]] = {}
    for name, any_node in flow.nodes.items():
        if isinstance(any_node, ReturnNode):
            out[f"nodes.{name}"] = smap.locate(("nodes", name), key=True)
    for name, node in flow.subflow_nodes().items():
        at: Path_ = ("nodes", name)
        out[f"nodes.{name}"] = smap.locate(at, key=True)
        out[f"nodes.{name}.flow"] = smap.locate((*at, "flow"))
        for part, keys in (("pass", node.pass_), ("return", node.return_)):
            for key in keys:
                out[f"nodes.{name}.{part}.{key}"] = smap.locate((*at, part, key), key=True)
    return out


# ---------------------------------------------------------------- a flow's directory


def sibling_flows(
    directory: Path, exclude: Path | None = None
) -> tuple[dict[str, Flow], dict[str, list[Problem]]]:
    """Valid flows of a directory (not resolved) by name, and the refused files' problems by
    file stem."""
    flows: dict[str, Flow] = {}
    refused: dict[str, list[Problem]] = {}
    for path in flow_files(directory):
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        flow, problems = check_flow_text(text, str(path), base_dir=directory)
        if flow is None:
            refused[path.stem] = [p for p in problems if p.severity == "error"]
        else:
            flows.setdefault(flow.name, flow)
    return flows, refused


def attach_from_directory(flow: Flow, directory: Path, *, exclude: Path | None = None) -> Flow:
    """``flow`` with the flows it includes, found among the flow files of ``directory``."""
    siblings, refused = sibling_flows(directory, exclude)
    flows = {**siblings, flow.name: flow}
    resolved, problems = resolve(flows)
    if flow.name in resolved:
        return resolved[flow.name]
    names = included(flows, flow.name) | {flow.name}
    files = {flows[n].source for n in names}
    errors = [p for p in problems if p.severity == "error" and p.file in files]
    for name in names:
        for node in flows[name].subflow_nodes().values():
            errors += refused.get(node.flow, [])
    raise FlowLoadError(errors)
