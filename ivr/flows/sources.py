"""The exact files a flow version was loaded from, so any instance can load that version again.

A call is pinned to a flow version at webhook time; the instance that later carries (or resumes)
its stream may have loaded other files since, or never seen that version. ``capture`` records,
when a file is loaded, its text and the knowledge files it embeds as {relative path: text};
``load_flow_from_sources`` writes such a set into a private temporary directory and loads it
with the normal loader, so the sources are checked and versioned exactly as on disk.

Paths are relative to the flow directory (flow files by name, knowledge files as the flow
names them); absolute knowledge paths cannot be carried and make a flow's sources unavailable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

import structlog

from ivr.flows.loader import file_digest, sibling_flows
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.subflows import resolve

log = structlog.get_logger("ivr.flows")

Sources = dict[str, str]
"""relative path -> text (knowledge files: exactly their bytes, decoded as UTF-8)"""


def knowledge_paths(flow: Flow) -> list[str]:
    """The knowledge files ``flow`` embeds, in the order the loader reads (and hashes) them."""
    return [rel for node in flow.nodes.values() for rel in node.knowledge_files()]


def capture(flow: Flow, text: str, path: Path) -> Sources | None:
    """The sources of ``flow``, just loaded from ``text`` (the file at ``path``): the text plus
    its knowledge files read again; None (logged) if they changed since the load or cannot be
    carried, since they would not reproduce ``flow.file_version``."""
    sources: Sources = {path.name: text}
    parts: list[bytes] = []
    for rel in knowledge_paths(flow):
        key = _key(rel)
        if key is None:
            log.warning("flows.sources_not_portable", file=str(path), knowledge=rel)
            return None
        try:
            raw = (path.parent / rel).read_bytes()
            sources.setdefault(key, raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("flows.sources_unreadable", file=str(path), knowledge=rel, error=str(exc))
            return None
        parts.append(raw)
    if file_digest(text, parts) != flow.file_version:
        log.warning("flows.sources_changed", file=str(path), version=flow.file_version)
        return None
    return sources


def combine(parts: Iterable[Mapping[str, str]]) -> Sources | None:
    """One set of sources from several files'; None if two disagree about one path."""
    out: Sources = {}
    for part in parts:
        for key, text in part.items():
            if out.setdefault(key, text) != text:
                log.warning("flows.sources_conflict", path=key)
                return None
    return out


def load_flow_from_sources(sources: Mapping[str, str], name: str) -> Flow:
    """Flow ``name`` (with its sub-flows) loaded from ``sources`` written to a private
    temporary directory; ``FlowLoadError`` lists every problem (bad paths included)."""
    with tempfile.TemporaryDirectory(prefix="ivr-flow-") as tmp:
        base = _materialise(sources, Path(tmp))
        flows, refused = sibling_flows(base)
        resolved, problems = resolve(flows)
    if name in resolved:
        return resolved[name]
    errors = [p for p in problems if p.severity == "error"]
    errors += [p for items in refused.values() for p in items]
    if not errors:
        errors = [Problem("<sources>", 1, 1, f"no flow named '{name}' in the sources")]
    raise FlowLoadError(errors)


def _key(rel: str) -> str | None:
    """``rel`` normalised (``a/./b`` -> ``a/b``), or None if it cannot be carried (absolute)."""
    if not rel or PurePosixPath(rel).is_absolute() or Path(rel).is_absolute():
        return None
    key = os.path.normpath(rel).replace(os.sep, "/")
    return None if key in (".", "..") or key.endswith("/..") else key


def _materialise(sources: Mapping[str, str], root: Path) -> Path:
    """Write ``sources`` under ``root``; returns the flow directory. Knowledge paths that climb
    out of it (``../shared/x.md``) land in directories made for them, never outside ``root``."""
    keys = {}
    for rel in sources:
        key = _key(rel)
        if key is None:
            raise FlowLoadError([Problem("<sources>", 1, 1, f"absolute path in sources: {rel}")])
        keys[rel] = key
    depth = max((_climbs(k) for k in keys.values()), default=0)
    base = root.joinpath(*(["up"] * depth), "flows")
    for rel, key in keys.items():
        target = Path(os.path.normpath(base / key))
        if target == root or root not in target.parents:
            raise FlowLoadError([Problem("<sources>", 1, 1, f"path leaves the flow tree: {rel}")])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(sources[rel].encode("utf-8"))  # bytes: no newline translation
    base.mkdir(parents=True, exist_ok=True)
    return base


def _climbs(key: str) -> int:
    parts = PurePosixPath(key).parts
    return next((i for i, part in enumerate(parts) if part != ".."), len(parts))
