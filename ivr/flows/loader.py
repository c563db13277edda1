"""Read a flow file: YAML -> plain data with a line/column for every key and value -> ``Flow``.

Every problem found (YAML syntax, shape, references, graph) is reported with the file, line and
column it comes from, all at once, as a ``FlowLoadError``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from ivr.errors import FlowError
from ivr.flows.model import Flow

Path_ = tuple[str | int, ...]
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    column: int
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.severity}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "severity": self.severity,
            "message": self.message,
        }


class FlowLoadError(FlowError):
    """A flow file is invalid; ``problems`` lists every reason with its position."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(slots=True)
class SourceMap:
    """Where each piece of the YAML document starts (1-based line and column)."""

    file: str
    values: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    keys: dict[Path_, tuple[int, int]] = field(default_factory=dict)

    def locate(self, path: Path_, *, key: bool = False) -> tuple[int, int]:
        """Position of ``path`` (its key if ``key``), else of its nearest existing parent."""
        if key and path in self.keys:
            return self.keys[path]
        for end in range(len(path), -1, -1):
            if path[:end] in self.values:
                return self.values[path[:end]]
        return (1, 1)

    def problem(
        self, path: Path_, message: str, *, key: bool = False, warn: bool = False
    ) -> Problem:
        line, column = self.locate(path, key=key)
        return Problem(self.file, line, column, message, "warning" if warn else "error")


def parse_yaml(text: str, file: str) -> tuple[Any, SourceMap]:
    """Parse one YAML document into plain data plus its ``SourceMap``."""
    smap = SourceMap(file)
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                raise FlowLoadError([Problem(file, 1, 1, "the file is empty")])
            data = _convert(root, (), smap, loader)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, column = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        reason = " ".join(s for s in (exc.context, exc.problem) if s)
        raise FlowLoadError([Problem(file, line, column, f"YAML syntax: {reason}")]) from None
    return data, smap


def _convert(node: yaml.Node, path: Path_, smap: SourceMap, loader: Any) -> Any:
    smap.values[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                key = str(key)
            if key in out:
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                msg = f"duplicate key {key!r}: the second one would silently win; remove one"
                raise FlowLoadError([Problem(smap.file, line, col, msg)])
            child = (*path, str(key))
            smap.keys[child] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            out[key] = _convert(value_node, child, smap, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), smap, loader) for i, item in enumerate(node.value)]
    return loader.construct_object(node, deep=True)


def pydantic_problems(exc: ValidationError, data: Any, smap: SourceMap) -> list[Problem]:
    problems: list[Problem] = []
    for err in exc.errors():
        path = _data_path(err["loc"], data)
        if any(
            p.message.endswith(_where(path)) and smap.locate(path) == (p.line, p.column)
            for p in problems
        ):
            continue  # one message per place: a union reports each alternative
        problems.append(
            smap.problem(path, _describe(err, path), key=err["type"] == "extra_forbidden")
        )
    return problems


def _data_path(loc: Iterable[str | int], data: Any) -> Path_:
    """Map a pydantic error location onto the YAML data, skipping union tags like 'menu'."""
    path: list[str | int] = []
    current = data
    for part in loc:
        if isinstance(current, dict) and part in current:
            current = current[part]
            path.append(str(part))
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            current = current[part]
            path.append(part)
        elif isinstance(current, dict) and not isinstance(part, int) and _is_field_name(part):
            path.append(part)  # a missing or extra field: point at its parent
            current = None
    return tuple(path)


def _is_field_name(part: str) -> bool:
    kinds = {"say", "ask", "menu", "agent", "branch", "set", "http", "transfer", "hangup", "goto",
             "subflow", "return"}  # fmt: skip
    return part not in kinds and not part.startswith("function-")


def _where(path: Path_) -> str:
    if len(path) >= 2 and path[0] == "nodes":
        rest = ".".join(str(p) for p in path[2:])
        return f" in node '{path[1]}'" + (f" (at {rest})" if rest else "")
    return f" at {'.'.join(str(p) for p in path)}" if path else ""


def _describe(err: Any, path: Path_) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    name = path[-1] if path else ""
    where = _where(path[:-1]) if kind in ("missing", "extra_forbidden") else _where(path)
    if kind == "missing":
        return f"missing field '{name}'{where}"
    if kind == "extra_forbidden":
        return f"unknown field '{name}'{where}; check the spelling (ivr flows schema lists fields)"
    if kind == "union_tag_invalid":
        tags = ctx.get("expected_tags", "")
        return f"unknown node kind {ctx.get('tag')!r}{where}; kinds are: {tags}"
    if kind == "union_tag_not_found":
        return f"missing 'kind'{where}; every node needs kind: say|ask|menu|agent|branch|..."
    msg = str(err["msg"]).removeprefix("Value error, ")
    if kind == "string_type" and isinstance(err.get("input"), bool | int | float):
        msg += f" (YAML read {err['input']!r}; put quotes around it)"
    return f"{msg}{where}"


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
        from ivr.flows.subflows import attach_from_directory

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
    from ivr.flows.validate import check_flow, read_knowledge

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
        if any_node.kind == "return":
            out[f"nodes.{name}"] = smap.locate(("nodes", name), key=True)
    for name, node in flow.subflow_nodes().items():
        at: Path_ = ("nodes", name)
        out[f"nodes.{name}"] = smap.locate(at, key=True)
        out[f"nodes.{name}.flow"] = smap.locate((*at, "flow"))
        for part, keys in (("pass", node.pass_), ("return", node.return_)):
            for key in keys:
                out[f"nodes.{name}.{part}.{key}"] = smap.locate((*at, part, key), key=True)
    return out
