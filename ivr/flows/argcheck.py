"""Check tool-call arguments against the JSON Schema declared in the flow.

A subset of JSON Schema that tool parameters use in practice: type, enum, required, properties,
additionalProperties (false), items, minimum/maximum, minLength/maxLength, pattern. Unknown
keywords are ignored (the model still sees them).
"""

from __future__ import annotations

import json
import re
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def parse_arguments(raw: str, schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Parse the model's raw argument text; returns (arguments, problems)."""
    try:
        value = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        return {}, [f"arguments are not valid JSON ({exc.msg} at char {exc.pos})"]
    except RecursionError:
        return {}, ["arguments are nested too deeply"]
    if not isinstance(value, dict):
        return {}, ["arguments must be a JSON object"]
    return value, check(value, schema)


def check(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    problems = _check_type(value, schema, where)
    if problems:
        return problems
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {schema['enum']}, not {value!r}")
    if isinstance(value, dict):
        problems += _check_object(value, schema, where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += check(item, schema["items"], f"{where}[{i}]")
    elif isinstance(value, str):
        problems += _check_string(value, schema, where)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where} must be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where} must be <= {schema['maximum']}")
    return problems


def _check_type(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    wanted = schema.get("type")
    if wanted is None:
        return []
    names = wanted if isinstance(wanted, list) else [wanted]
    for name in names:
        types = _TYPES.get(name, ())
        is_bool = isinstance(value, bool)
        if isinstance(value, types) and (name == "boolean" or not is_bool):
            return []
    return [f"{where} must be of type {' or '.join(names)}, not {type(value).__name__}"]


def _check_object(value: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    problems = []
    props: dict[str, Any] = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in value:
            problems.append(f"{where} is missing required field '{name}'")
    for name, item in value.items():
        if name in props:
            problems += check(item, props[name], f"{where}.{name}")
        elif schema.get("additionalProperties") is False:
            problems.append(f"{where} has unknown field '{name}'")
    return problems


def _check_string(value: str, schema: dict[str, Any], where: str) -> list[str]:
    problems = []
    if "minLength" in schema and len(value) < schema["minLength"]:
        problems.append(f"{where} must have at least {schema['minLength']} characters")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        problems.append(f"{where} must have at most {schema['maxLength']} characters")
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        problems.append(f"{where} must match {schema['pattern']!r}")
    return problems
