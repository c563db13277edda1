"""What every flow check speaks: a ``Problem`` at a file, line and column, and where YAML was.

The loader, the checks, the registry and the tools all report in these terms, so they sit in a
module of their own that imports nothing of the flow package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ivr.errors import FlowError

Path_ = tuple[str | int, ...]
"""Keys and indexes from the document's root to a value: ("nodes", "menu", "options", 0)."""


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
