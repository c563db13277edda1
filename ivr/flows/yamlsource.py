"""YAML read with the line and column of every key and value, and pydantic errors placed there.

Used for every YAML file the flow tools read (flows, ``routes.yaml``, conversation tests), so
each problem names the file, line and column it comes from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import ValidationError

from ivr.flows.problems import FlowLoadError, Path_, Problem, SourceMap

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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
    """``exc`` as problems at the places in the YAML document they are about."""
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
