"""``ivr flows validate | test | schema | graph``.

The main CLI wires these in with ``add_commands(subparsers)``; ``python -m ivr.flowtools.cli ...``
runs them on their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from ivr.flows.loader import ROUTES_FILE, check_flow_text, load_flow, sibling_flows
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.registry import FlowRegistry
from ivr.flows.subflows import check_set
from ivr.flowtools.audio_test import run_audio_test_file
from ivr.flowtools.graph import to_dot, to_mermaid
from ivr.flowtools.testing import CaseResult, find_test_files, run_test_file

DEFAULT_DIR = "flows"


def add_commands(subparsers: Any) -> None:
    """Add ``flows`` with its subcommands to an argparse ``add_subparsers()`` object."""
    flows = subparsers.add_parser("flows", help="validate, test and inspect call flows")
    sub = flows.add_subparsers(dest="flows_command", required=True)

    p = sub.add_parser("validate", help="check flow files; exit 1 on errors")
    p.add_argument("paths", nargs="*", default=[DEFAULT_DIR], help="files or directories")
    p.add_argument("--json", action="store_true", help="print problems as JSON")
    p.add_argument("--strict", action="store_true", help="warnings count as errors")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("test", help="run YAML conversation tests in text mode")
    p.add_argument("paths", nargs="*", default=[DEFAULT_DIR], help="test files or directories")
    p.add_argument("-v", "--verbose", action="store_true", help="print every transcript")
    p.add_argument(
        "--audio",
        action="store_true",
        help="run each case as a call through the gateway's audio path (simulated Twilio caller)",
    )
    p.set_defaults(func=cmd_test)

    p = sub.add_parser("schema", help="print the JSON Schema of a flow file")
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("graph", help="draw a flow (Mermaid or Graphviz dot)")
    p.add_argument("flow", help="flow file, or flow name in --dir")
    p.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    p.add_argument("--dir", default=DEFAULT_DIR)
    p.set_defaults(func=cmd_graph)


def flow_files(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out += sorted(p for p in path.glob("*.y*ml") if p.name != ROUTES_FILE)
        else:
            out.append(path)
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    problems: list[Problem] = []
    files = flow_files(args.paths)
    valid: dict[Path, dict[str, Flow]] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(Problem(str(path), 1, 1, f"cannot read the file: {exc}"))
            continue
        flow, found = check_flow_text(text, str(path), base_dir=path.parent)
        problems += found
        if flow is not None:
            valid.setdefault(path.parent, {}).setdefault(flow.name, flow)
    for directory, flows in valid.items():
        problems += _subflow_problems(directory, flows)
    for raw in args.paths:
        if Path(raw).is_dir() and (Path(raw) / ROUTES_FILE).exists():
            registry = FlowRegistry(raw)
            problems += [p for p in registry.reload() if p.file.endswith(ROUTES_FILE)]
    elapsed = time.perf_counter() - started
    errors = [p for p in problems if p.severity == "error" or args.strict]
    if args.json:
        print(json.dumps({"files": len(files), "seconds": round(elapsed, 4),
                          "problems": [p.as_dict() for p in problems]}, indent=2))  # fmt: skip
    else:
        for problem in problems:
            print(problem)
        verdict = f"{len(errors)} error(s)" if errors else "ok"
        print(f"{len(files)} flow file(s) checked in {elapsed * 1000:.1f} ms: {verdict}")
    return 1 if errors else 0


def _subflow_problems(directory: Path, flows: dict[str, Flow]) -> list[Problem]:
    """Sub-flow references of the checked files, against the other flows of their directory."""
    siblings, _ = sibling_flows(directory)
    checked = {flow.source for flow in flows.values()}
    return [p for p in check_set({**siblings, **flows}) if p.file in checked]


def cmd_test(args: argparse.Namespace) -> int:
    run_file = run_audio_test_file if getattr(args, "audio", False) else run_test_file

    async def run_all() -> list[CaseResult]:
        results = []
        for path in find_test_files([Path(p) for p in args.paths]):
            results += await run_file(path)
        return results

    started = time.perf_counter()
    results = asyncio.run(run_all())
    failed = 0
    for result in results:
        print(f"{'PASS' if result.passed else 'FAIL'}  {result.file} :: {result.name}")
        for failure in result.failures:
            print(f"      {failure}")
        if result.failures or args.verbose:
            for who, text in result.transcript:
                print(f"        {who:>6}: {text}")
        failed += not result.passed
    print(
        f"{len(results) - failed} passed, {failed} failed in {time.perf_counter() - started:.2f} s"
    )
    return 1 if failed or not results else 0


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(Flow.model_json_schema(by_alias=True), indent=2))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    path = Path(args.flow)
    if not path.exists():
        path = Path(args.dir) / f"{args.flow}.yaml"
    try:
        flow = load_flow(path)
    except FlowLoadError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    print(to_mermaid(flow) if args.format == "mermaid" else to_dot(flow), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # The commands print their own findings; library logs below ERROR would only repeat them.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    parser = argparse.ArgumentParser(prog="ivr")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main(["flows", *sys.argv[1:]] if sys.argv[1:2] != ["flows"] else sys.argv[1:]))
