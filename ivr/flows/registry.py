"""All flows of a directory, routed by called number, reloaded while calls keep running.

A call pins the flow version it starts with (``registry.pin(to_number)``); flows are immutable
values, so a reload swaps the registry's table but never changes a pinned flow. A flow carries
the sub-flows it includes as loaded with it (``Flow.subflows``), so they are pinned too. A
changed file that fails validation is refused: its problems are logged and the old version
keeps serving. ``sources(flow)`` gives the exact files a version was loaded from (captured at
load: a kept old version's files may already be changed on disk), for other instances.

    flows/support.yaml, flows/sales.yaml, ...   one flow per file (``numbers:`` optional)
    flows/routes.yaml                            optional: {default: NAME, routes: {NUMBER: NAME}}
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import watchfiles
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ivr.flows.loader import ROUTES_FILE, flow_files, load_flow_text, read_flow_text
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.sources import Sources, capture, combine
from ivr.flows.subflows import resolve
from ivr.flows.template import has_references
from ivr.flows.yamlsource import parse_yaml, pydantic_problems

log = structlog.get_logger("ivr.flows")

OnReload = Callable[[list[Problem]], Awaitable[None]]


class RoutesSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    default: str | None = None
    routes: dict[str, str] = Field(default_factory=dict, description="called number -> flow name")


@dataclass(frozen=True, slots=True)
class PinnedFlow:
    """The flow version a call runs from start to end, whatever reloads happen meanwhile."""

    flow: Flow

    @property
    def name(self) -> str:
        return self.flow.name

    @property
    def version(self) -> str:
        return self.flow.version


@dataclass(frozen=True, slots=True)
class _Table:
    flows: dict[str, Flow] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    """flow file path -> flow name"""
    routes: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    sources: dict[str, Sources] = field(default_factory=dict)
    """file version -> the files it was loaded from, for every file version in ``flows``"""


class FlowRegistry:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._table = _Table()
        self.refused: dict[str, list[Problem]] = {}
        """Files whose latest version was refused, with the reasons."""

    # ------------------------------------------------------------ loading

    def load(self, *, strict: bool = True) -> list[Problem]:
        """(Re)load every flow file; with ``strict`` any invalid file raises ``FlowLoadError``."""
        problems = self.reload()
        if strict and problems:
            raise FlowLoadError(problems)
        return problems

    def reload(self) -> list[Problem]:
        """Validate all files and swap in the valid ones at once; returns the refused problems."""
        old = self._table
        flows: dict[str, Flow] = {}
        files: dict[str, str] = {}
        problems: list[Problem] = []
        refused: dict[str, list[Problem]] = {}
        sources = dict(old.sources)
        for path in flow_files(self.directory):
            key = str(path)
            try:
                flow, captured = _load_file(path)  # sub-flows are attached below, across files
            except FlowLoadError as exc:
                refused[key] = exc.problems
                kept = old.files.get(key)
                if kept is not None and kept in old.flows:  # keep serving the old version
                    flows[kept], files[key] = old.flows[kept], kept
                continue
            if flow.name in flows:
                msg = (
                    f"flow name '{flow.name}' is already used by another file; names must be unique"
                )
                refused[key] = [Problem(key, 1, 1, msg)]
                continue
            flows[flow.name], files[key] = flow, flow.name
            if captured is not None:
                sources.setdefault(flow.file_version, captured)
        flows = self._attach_subflows(flows, files, old, refused)
        routes, default, route_problems = self._routes(flows, old)
        if route_problems:
            refused[str(self.directory / ROUTES_FILE)] = route_problems
        for key, items in refused.items():
            problems += items
            if self.refused.get(key) != items:
                log.error("flows.refused", file=key, problems=[str(p) for p in items])
        self._log_changes(old, flows)
        used = {f.file_version for flow in flows.values() for f in (flow, *flow.subflows.values())}
        sources = {v: sources[v] for v in used if v in sources}
        self._table = _Table(flows, files, routes, default, sources)  # one assignment: atomic swap
        self.refused = refused
        return problems

    @staticmethod
    def _attach_subflows(
        flows: dict[str, Flow], files: dict[str, str], old: _Table,
        refused: dict[str, list[Problem]],
    ) -> dict[str, Flow]:  # fmt: skip
        """Flows with their sub-flows; one whose references are wrong keeps its old version."""
        resolved, problems = resolve(flows)
        for key, name in list(files.items()):
            if name in resolved:
                continue
            errors = [p for p in problems if p.file == key and p.severity == "error"]
            refused[key] = refused.get(key, []) + errors
            if name in old.flows:
                resolved[name] = old.flows[name]
            else:
                del files[key]
        return resolved

    def _routes(
        self, flows: dict[str, Flow], old: _Table
    ) -> tuple[dict[str, str], str | None, list[Problem]]:
        routes: dict[str, str] = {}
        for flow in flows.values():
            for number in flow.numbers:
                routes[number] = flow.name
        default = "default" if "default" in flows else None
        path = self.directory / ROUTES_FILE
        if not path.exists():
            return routes, default, []
        try:
            data, smap = parse_yaml(read_flow_text(path), str(path))
            spec = RoutesSpec.model_validate(data)
        except FlowLoadError as exc:
            return old.routes, old.default, exc.problems
        except ValidationError as exc:
            return old.routes, old.default, pydantic_problems(exc, data, smap)
        problems = []
        for number, name in [("default", spec.default), *spec.routes.items()]:
            if name is not None and name not in flows:
                where = ("default",) if number == "default" else ("routes", number)
                msg = (
                    f"route {number} names unknown flow '{name}'; flows: {', '.join(sorted(flows))}"
                )
                problems.append(smap.problem(where, msg))
        if problems:
            return old.routes, old.default, problems
        return {**routes, **spec.routes}, spec.default or default, []

    @staticmethod
    def _log_changes(old: _Table, flows: dict[str, Flow]) -> None:
        for name, flow in flows.items():
            before = old.flows.get(name)
            if before is None or before.version != flow.version:
                log.info("flows.loaded", flow=name, version=flow.version,
                         previous=before.version if before else None)  # fmt: skip

    async def watch(
        self, stop: asyncio.Event | None = None, on_reload: OnReload | None = None
    ) -> None:
        """Reload on every change in the directory (flows, routes, knowledge files).

        ``on_reload(problems)`` is awaited after each reload (e.g. to synthesise new prompts).
        """
        async for _changes in watchfiles.awatch(self.directory, stop_event=stop, debounce=200):
            try:
                problems = await asyncio.to_thread(self.reload)
                if on_reload is not None:
                    await on_reload(problems)
            except Exception:  # a bad edit must not stop the watching for good
                log.exception("flows.reload_failed", directory=str(self.directory))

    # ------------------------------------------------------------ lookups

    def get(self, name: str) -> Flow:
        return self._table.flows[name]

    @property
    def flows(self) -> dict[str, Flow]:
        return dict(self._table.flows)

    def flow_for_number(self, to_number: str) -> Flow:
        table = self._table
        name = (
            table.routes.get(to_number) or table.routes.get(_normalize(to_number)) or table.default
        )
        if name is None or name not in table.flows:
            raise LookupError(f"no flow answers {to_number} and there is no default flow")
        return table.flows[name]

    def sources(self, flow: Flow) -> Sources | None:
        """The files ``flow`` (a version this registry serves) was loaded from, sub-flows and
        knowledge included; None if they could not be captured (logged at load)."""
        table = self._table
        parts = [table.sources.get(f.file_version) for f in (flow, *flow.subflows.values())]
        if any(p is None for p in parts):
            return None
        return combine(p for p in parts if p is not None)

    def pin(self, to_number: str) -> PinnedFlow:
        return PinnedFlow(self.flow_for_number(to_number))

    def static_prompt_texts(self) -> set[str]:
        """Prompts without variables, for pre-synthesis (they sound the same on every call)."""
        return {
            t
            for flow in self._table.flows.values()
            for t in _prompts(flow)
            if t and not has_references(t)
        }


def _load_file(path: Path) -> tuple[Flow, Sources | None]:
    text = read_flow_text(path)
    flow = load_flow_text(text, str(path), base_dir=path.parent)
    return flow, capture(flow, text, path)


def _normalize(number: str) -> str:
    digits = "".join(c for c in number if c.isdigit())
    return f"+{digits}" if digits else number


def _prompts(flow: Flow) -> Iterator[str]:
    d = flow.defaults
    yield from (d.no_input_prompt, d.no_match_prompt, d.error_prompt, flow.resume_prompt or "")
    if flow.recording.enabled != "never":
        yield flow.recording.consent_prompt or ""
    for node in flow.nodes.values():
        yield from node.spoken_texts()
