"""YAML conversation tests for flows (``ivr flows test``): offline, text mode, a few ms each.

    flow: support                 # flow name (looked up next to / above this file) or a path
    variables: {agent_number: "+15550100999"}
    backend:                      # optional real local HTTP server; its URL goes into a variable
      variable: backend_url
      routes:
        "GET /accounts/12345/balance": {json: {balance: 42.5}}
        "GET /accounts/00000/balance": {status: 404, json: {error: unknown}}
    tests:
      - name: balance by keypad
        steps:
          - {node: main_menu, bot_says: "press 1"}      # after the call starts
          - {press: "1", node: ask_account}
          - {say: "one two three four five", bot_says: "42.50", vars: {account: "12345"}}
          - {press: "2", ended: hangup}

A step gives at most one caller input (``say``, ``press``, ``silent: true``, ``hangup: true``;
``barge_in_after_words: N`` cuts the bot's next prompt), the LLM's answers to the calls that
input causes (``llm: [{text: ...}, {tool_calls: [{name, arguments}]}, {json: {...}}]`` or
``intent: NAME`` for the classifier), then what must hold when the bot waits again:
``node`` (or ``flow.node`` inside a sub-flow), ``bot_says`` (case-insensitive substrings of
what the bot said since the input), ``bot_not_says``, ``vars`` (subset), ``ended``
(hangup | transfer | caller_hangup), ``transfer_to``. The LLM is a real local
OpenAI-compatible server the test scripts.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ivr.callio.io import ListenSpec
from ivr.flows.events import FlowState
from ivr.flows.loader import load_flow
from ivr.flows.model import Flow
from ivr.flows.problems import FlowLoadError, SourceMap
from ivr.flows.runner import FlowRunner
from ivr.flows.yamlsource import parse_yaml, pydantic_problems
from ivr.flowtools.textio import CallerTurn, TextCallIO
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ToolCallScript(_Spec):
    name: str
    arguments: Any = Field(default_factory=dict, description="Object, or raw JSON text.")


class LlmReply(_Spec):
    text: str = ""
    tool_calls: list[ToolCallScript] = Field(default_factory=list)
    json_: dict[str, Any] | None = Field(default=None, alias="json")
    error: int | None = Field(default=None, description="Answer with this HTTP status instead.")


class Step(_Spec):
    say: str | None = None
    press: str | None = None
    silent: bool = False
    hangup: bool = False
    barge_in_after_words: int | None = None
    llm: list[LlmReply] = Field(default_factory=list)
    intent: str | None = None
    node: str | None = None
    bot_says: str | list[str] = Field(default_factory=list)
    bot_not_says: str | list[str] = Field(default_factory=list)
    vars: dict[str, Any] = Field(default_factory=dict)
    ended: str | None = None
    transfer_to: str | None = None

    def turn(self) -> CallerTurn | None:
        if self.say is not None:
            return CallerTurn("say", self.say, self.barge_in_after_words)
        if self.press is not None:
            return CallerTurn("press", self.press, self.barge_in_after_words)
        if self.silent:
            return CallerTurn("silent")
        return CallerTurn("hangup") if self.hangup else None


class Case(_Spec):
    name: str
    variables: dict[str, Any] = Field(default_factory=dict)
    steps: list[Step] = Field(min_length=1)


class BackendRoute(_Spec):
    status: int = 200
    json_: Any = Field(default=None, alias="json")


class Backend(_Spec):
    variable: str
    routes: dict[str, BackendRoute] = Field(default_factory=dict)


class TestFile(_Spec):
    flow: str
    variables: dict[str, Any] = Field(default_factory=dict)
    backend: Backend | None = None
    tests: list[Case] = Field(min_length=1)


@dataclass(slots=True)
class CaseResult:
    file: str
    name: str
    failures: list[str] = field(default_factory=list)
    transcript: list[tuple[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------- local servers


class LocalJsonServer:
    """A real HTTP server answering the routes a test file declares (404 otherwise)."""

    def __init__(self, routes: dict[str, BackendRoute]) -> None:
        table = routes

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                route = table.get(f"{self.command} {self.path}")
                status, body = (
                    (route.status, route.json_) if route else (404, {"error": "no route"})
                )
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LocalJsonServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class ScriptedLlm:
    """Feeds the fake OpenAI server the replies a test scripted, in order."""

    def __init__(self) -> None:
        self.queue: collections.deque[LlmReply] = collections.deque()
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def load(self, steps: list[Step]) -> None:
        """Start a case: forget the last one, queue the replies its steps script."""
        self.queue.clear()
        self.problems.clear()
        for s in steps:
            self.queue.extend(s.llm)
            if s.intent is not None:
                self.queue.append(LlmReply.model_validate({"json": {"intent": s.intent}}))

    def leftovers(self) -> list[str]:
        """What went wrong with the script in the case that ran."""
        unused = [f"{len(self.queue)} scripted LLM replies were never used"] if self.queue else []
        return [*self.problems, *unused]

    def __call__(self, request: dict[str, Any]) -> ChatScript:
        with self.lock:
            reply = self.queue.popleft() if self.queue else None
            if reply is None:
                self.problems.append(
                    "the LLM was called but no reply is scripted (add llm: or intent:)"
                )
                return ChatScript(status=500)
        if reply.error is not None:
            return ChatScript(status=reply.error)
        calls = [
            ScriptToolCall(
                c.name, c.arguments if isinstance(c.arguments, str) else json.dumps(c.arguments)
            )
            for c in reply.tool_calls
        ]
        text = json.dumps(reply.json_) if reply.json_ is not None else reply.text
        return ChatScript(text=text, tool_calls=calls)


# ---------------------------------------------------------------- running


def load_test_file(path: Path) -> tuple[TestFile, SourceMap]:
    data, smap = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    try:
        return TestFile.model_validate(data), smap
    except ValidationError as exc:
        raise FlowLoadError(pydantic_problems(exc, data, smap)) from None


def resolve_flow(test_path: Path, ref: str) -> Path:
    if ref.endswith((".yaml", ".yml")):
        return (test_path.parent / ref).resolve()
    for folder in (test_path.parent, test_path.parent.parent):
        candidate = folder / f"{ref}.yaml"
        if candidate.exists():
            return candidate
    return test_path.parent.parent / f"{ref}.yaml"


def needs_llm(flow: Flow) -> bool:
    return any(n.uses_llm() for f in (flow, *flow.subflows.values()) for n in f.nodes.values())


async def run_test_file(path: Path) -> list[CaseResult]:
    """Run every case of one test file; a broken file or flow is one failed result."""
    try:
        spec, smap = load_test_file(path)
        flow = load_flow(resolve_flow(path, spec.flow))
    except FlowLoadError as exc:
        return [CaseResult(str(path), "(load)", [str(p) for p in exc.problems])]
    except OSError as exc:
        return [CaseResult(str(path), "(load)", [f"cannot read: {exc}"])]
    async with _Servers(spec, flow) as servers, httpx.AsyncClient() as http:
        results = []
        for index, case in enumerate(spec.tests):
            result = CaseResult(str(path), case.name)
            await _run_case(flow, spec, case, index, smap, servers, http, result)
            results.append(result)
        return results


class _Servers:
    def __init__(self, spec: TestFile, flow: Flow) -> None:
        self.spec, self.flow = spec, flow
        self.backend: LocalJsonServer | None = None
        self.llm_server: FakeOpenAIServer | None = None
        self.llm: OpenAICompatLlm | None = None
        self.script = ScriptedLlm()

    async def __aenter__(self) -> _Servers:
        if self.spec.backend is not None:
            self.backend = LocalJsonServer(self.spec.backend.routes).__enter__()
        if needs_llm(self.flow):
            self.llm_server = FakeOpenAIServer()
            self.llm_server.chat = self.script
            await self.llm_server.__aenter__()
            self.llm = OpenAICompatLlm(
                base_url=self.llm_server.base_url,
                api_key="test",
                model="flow-test",
                max_tokens=None,
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.llm is not None:
            await self.llm.aclose()
        if self.llm_server is not None:
            await self.llm_server.__aexit__(*exc)
        if self.backend is not None:
            await asyncio.to_thread(self.backend.__exit__)


@dataclass(slots=True)
class _Checkpoint:
    state: FlowState | None
    bot: list[str]


async def _run_case(
    flow: Flow,
    spec: TestFile,
    case: Case,
    index: int,
    smap: SourceMap,
    servers: _Servers,
    http: httpx.AsyncClient,
    result: CaseResult,
) -> None:
    steps = list(case.steps)
    shifted = steps[0].turn() is not None
    if shifted:
        steps.insert(0, Step())  # nothing to check right after the call starts
    servers.script.load(steps)
    io = TextCallIO.scripted(t for s in steps[1:] if (t := s.turn()) is not None)
    checkpoints: list[_Checkpoint] = []
    last: list[FlowState | None] = [None]
    mark = [0]

    def on_listen(_: ListenSpec) -> None:
        bot = [text for who, text in io.transcript[mark[0] :] if who == "bot"]
        checkpoints.append(_Checkpoint(last[0], bot))
        mark[0] = len(io.transcript)

    async def on_step(state: FlowState) -> None:
        last[0] = state

    io.on_listen = on_listen
    variables = {**spec.variables, **case.variables}
    if servers.backend is not None and spec.backend is not None:
        variables.setdefault(spec.backend.variable, servers.backend.url)
    call_vars = {
        "caller": "+15550000000",
        "called": "+15550000001",
        "call_sid": "CA-test",
        **variables,
    }
    runner = FlowRunner(flow, io, servers.llm, http, on_step, call_vars=call_vars, env={})
    try:
        final: FlowState | None = await asyncio.wait_for(runner.run(), timeout=30)
    except Exception as exc:  # a test reports the failure, whatever it is
        result.failures.append(f"the flow crashed: {type(exc).__name__}: {exc}")
        final = last[0]
    checkpoints.append(_Checkpoint(final, [t for w, t in io.transcript[mark[0] :] if w == "bot"]))
    result.transcript = list(io.transcript)
    _compare(steps, checkpoints, io, smap, (index, shifted), result)
    result.failures += servers.script.leftovers()


def _compare(
    steps: list[Step],
    checkpoints: list[_Checkpoint],
    io: TextCallIO,
    smap: SourceMap,
    where: tuple[int, bool],
    result: CaseResult,
) -> None:
    index, shifted = where
    for i, step in enumerate(steps):
        step_index = i - 1 if shifted else i
        line, col = smap.locate(("tests", index, "steps", max(step_index, 0)))
        at = f"{result.file}:{line}:{col}"
        if i >= len(checkpoints):
            result.failures.append(f"{at}: the call ended before this step")
            return
        for problem in _check_step(step, checkpoints[i], io, i == len(checkpoints) - 1):
            result.failures.append(f"{at}: {problem}")


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def _check_step(step: Step, cp: _Checkpoint, io: TextCallIO, final: bool) -> list[str]:
    problems = []
    said = " ".join(cp.bot)
    state = cp.state
    if step.node is not None and (state is None or step.node not in _places(state)):
        problems.append(f"expected node '{step.node}', at '{_place(state)}'")
    for text in _as_list(step.bot_says):
        if text.lower() not in said.lower():
            problems.append(f"expected the bot to say {text!r}; it said {said!r}")
    for text in _as_list(step.bot_not_says):
        if text.lower() in said.lower():
            problems.append(f"the bot said {text!r}: {said!r}")
    for name, want in step.vars.items():
        got = state.vars.get(name) if state else None
        if got != want and str(got) != str(want):
            problems.append(f"expected variable {name} = {want!r}, got {got!r}")
    if step.ended is not None:
        outcome = state.outcome if state and final else None
        if outcome != step.ended:
            problems.append(
                f"expected the call to end with {step.ended}, got {outcome or 'no end'}"
            )
    if step.transfer_to is not None and io.transferred_to != step.transfer_to:
        problems.append(f"expected a transfer to {step.transfer_to}, got {io.transferred_to}")
    return problems


def _places(state: FlowState) -> tuple[str, str]:
    """A node may be named alone or as ``flow.node`` (inside a sub-flow)."""
    return state.node, f"{state.flow}.{state.node}"


def _place(state: FlowState | None) -> str:
    if state is None:
        return "?"
    return f"{state.flow}.{state.node}" if state.stack else state.node


def find_test_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            folder = path / "tests" if (path / "tests").is_dir() else path
            files += sorted(folder.glob("*.yaml"))
        else:
            files.append(path)
    return files
