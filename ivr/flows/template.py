"""Prompt templates: ``{{ name }}`` or ``{{ name.field }}`` replaced by a call variable.

That is the whole language: no filters, no expressions, no code, so an operator's file can never
run anything. A missing variable renders as "" (the validator makes sure every name used is one
the flow can set). ``{{`` that does not open a valid reference is a load error.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote

_REF = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*\}\}")
_OPEN = re.compile(r"\{\{")


class TemplateSyntaxError(ValueError):
    def __init__(self, text: str, offset: int) -> None:
        snippet = text[offset : offset + 30]
        super().__init__(
            f"bad template reference {snippet!r}: write {{{{ name }}}} or {{{{ name.field }}}}"
        )
        self.offset = offset


def references(text: str) -> list[str]:
    """Variable paths used in ``text``; raises ``TemplateSyntaxError`` on a malformed ``{{``."""
    refs: list[str] = []
    pos = 0
    for opening in _OPEN.finditer(text):
        if opening.start() < pos:
            continue
        match = _REF.match(text, opening.start())
        if match is None:
            raise TemplateSyntaxError(text, opening.start())
        refs.append(match.group(1))
        pos = match.end()
    return refs


def has_references(text: str) -> bool:
    return _OPEN.search(text) is not None


def lookup(variables: Any, path: str) -> Any:
    """Follow a dotted path through dicts and lists; None when any step is missing."""
    value: Any = variables
    for part in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def render(text: str, variables: Mapping[str, Any]) -> str:
    def one(match: re.Match[str]) -> str:
        value = lookup(variables, match.group(1))
        return "" if value is None else _as_text(value)

    return _REF.sub(one, text)


def render_url(text: str, variables: Mapping[str, Any]) -> str:
    """Render a URL: every value is percent-encoded (a caller's or model's words cannot add path
    segments or query fields), except a reference that starts the URL, which is its base."""

    def one(match: re.Match[str]) -> str:
        value = lookup(variables, match.group(1))
        text = "" if value is None else _as_text(value)
        return text if match.start() == 0 else quote(text, safe="")

    return _REF.sub(one, text.strip())


def render_value(value: Any, variables: Mapping[str, Any]) -> Any:
    """Render every string inside a JSON-like value; a string that is exactly one reference keeps
    the variable's type (so ``amount: "{{ args.amount }}"`` stays a number)."""
    if isinstance(value, str):
        whole = _REF.fullmatch(value.strip())
        if whole is not None:
            return lookup(variables, whole.group(1))
        return render(value, variables)
    if isinstance(value, list):
        return [render_value(item, variables) for item in value]
    if isinstance(value, dict):
        return {key: render_value(item, variables) for key, item in value.items()}
    return value


def strings_in(value: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Every string inside a JSON-like value, with its path (for validation)."""
    if isinstance(value, str):
        yield (), value
    elif isinstance(value, list):
        for index, item in enumerate(value):
            for path, text in strings_in(item):
                yield (index, *path), text
    elif isinstance(value, dict):
        for key, item in value.items():
            for path, text in strings_in(item):
                yield (str(key), *path), text


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
