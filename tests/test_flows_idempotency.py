"""Issue 8: a resumed call never repeats a side effect. A request that is not idempotent (the
payment POST of flows/payments.yaml, an agent tool's POST) carries an Idempotency-Key; the call
state keeps it in flight, then its answer, so a resume re-sends with the same key or reads the
kept answer. The backend is a real local HTTP server that deduplicates by key, as Stripe does."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_procs import AUTH_TOKEN, PUBLIC_URL, cluster, fast_speak
from redis_server import LOCAL_REDIS_URL

from ivr.flows.events import FlowState, HttpResult
from ivr.flows.loader import load_flow, load_flow_text
from ivr.flows.model import Flow
from ivr.flows.privacy import stored_state
from ivr.flows.problems import FlowLoadError
from ivr.flows.runner import FlowRunner
from ivr.flows.template import lookup
from ivr.flows.waits import kept_answer
from ivr.flowtools.textio import CallerTurn, TextCallIO, hangs_up, pressed, said
from ivr.llm.openai_compat import OpenAICompatLlm
from ivr.sim.caller import place_call
from ivr.sim.script import script_from_data
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, ScriptToolCall

REPO = Path(__file__).resolve().parent.parent
CALL_SID = "CA0123456789abcdef0123456789abcdef"
RESUME_PROMPT = "Sorry, we were cut off."
PAID = "Thank you, Ada. Your confirmation number is P1. Goodbye."


# -- the backend: a real HTTP server that pays once per idempotency key ---------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    method: str
    path: str
    key: str | None
    body: Any


@dataclass
class Backend:
    """Accounts to read (GET) and effects to cause (POST). A POST pays: it answers a new
    confirmation, or, under a key it has seen, the first answer again without paying. With
    ``stall`` the first POST is processed, then answered only once ``release`` is set: the
    gateway is gone by then, as when an instance dies while the backend works."""

    reads: dict[str, Any] = field(default_factory=dict)
    stall: bool = False
    header: str = "Idempotency-Key"
    requests: list[Seen] = field(default_factory=list)
    effects: list[Seen] = field(default_factory=list)
    answers: dict[str, bytes] = field(default_factory=dict)
    received: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, method: str, path: str, key: str | None, body: Any) -> tuple[int, bytes]:
        with self.lock:
            self.requests.append(Seen(method, path, key, body))
            if method == "GET":
                found = self.reads.get(path)
                return (200, json.dumps(found).encode()) if found else (404, b"{}")
            if key is not None and key in self.answers:
                return 200, self.answers[key]
            self.effects.append(Seen(method, path, key, body))
            data = json.dumps({"confirmation": f"P{len(self.effects)}"}).encode()
            if key is not None:
                self.answers[key] = data
            stall = self.stall and len(self.effects) == 1
        if stall:
            self.received.set()
            self.release.wait(10)
        return 200, data

    def posts(self) -> list[Seen]:
        return [r for r in self.requests if r.method != "GET"]


@dataclass
class Served:
    backend: Backend
    url: str


@pytest.fixture
def serve() -> Iterator[Callable[[Backend], Served]]:
    servers: list[tuple[ThreadingHTTPServer, threading.Thread, Backend]] = []

    def start(backend: Backend) -> Served:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(backend))
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        servers.append((server, thread, backend))
        return Served(backend, f"http://127.0.0.1:{server.server_address[1]}")

    yield start
    for server, thread, backend in servers:
        backend.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def _handler(backend: Backend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(size)) if size else None
            key = self.headers.get(backend.header)
            status, data = backend.answer(self.command, self.path, key, body)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the gateway left while the backend worked

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def bank() -> Backend:
    return Backend(
        reads={"/accounts/12345": {"name": "Ada"}, "/accounts/12345/balance": {"balance": 42.5}}
    )


# -- the call store: flow state saved at every step, as the call record keeps it ----------------


class InstanceDied(Exception):
    """Raised from inside a call to stop it dead, as a SIGKILL would."""


@dataclass
class SavedStates:
    """What ``FlowConversation`` saves in the call record at every step: the state with the
    caller's data masked, as JSON. With ``dies_at`` the instance dies at the first step it
    matches, before that step is saved or spoken."""

    flow: Flow
    dies_at: Callable[[FlowState], bool] | None = None
    saved: list[str] = field(default_factory=list)

    async def __call__(self, state: FlowState) -> None:
        if self.dies_at is not None and self.dies_at(state):
            raise InstanceDied
        self.saved.append(json.dumps(stored_state(self.flow, state).model_dump(mode="json")))

    def last(self) -> FlowState:
        """The state a new stream loads from the call record."""
        return FlowState.model_validate(json.loads(self.saved[-1]))


def after_the_answer(backend: Backend) -> Callable[[FlowState], bool]:
    """The first step that no longer waits for the request, once the backend has answered."""
    return lambda state: bool(backend.effects) and state.waiting not in ("http", "tool_http")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture(scope="module")
def payments() -> Flow:
    """The shipped flow (with its sub-flow verify_caller)."""
    return load_flow(REPO / "flows" / "payments.yaml")


def runner(
    flow: Flow, io: TextCallIO, http: httpx.AsyncClient, store: SavedStates, url: str,
    llm: OpenAICompatLlm | None = None,
) -> FlowRunner:  # fmt: skip
    env = {"SUPPORT_BACKEND_URL": url, "SUPPORT_AGENT_NUMBER": "+15550100999"}
    return FlowRunner(
        flow, io, llm, http, store, call_vars={"call_sid": CALL_SID, "api": url}, env=env,
        resume_prompt=RESUME_PROMPT,
    )  # fmt: skip


async def pay_until_cancelled(
    flow: Flow, http: httpx.AsyncClient, store: SavedStates, served: Served,
    turns: list[CallerTurn], llm: OpenAICompatLlm | None = None,
) -> None:  # fmt: skip
    """Run the call until the backend holds the payment, then cancel the runner mid-request."""
    io = TextCallIO.scripted(turns)
    task = asyncio.create_task(runner(flow, io, http, store, served.url, llm).run())
    assert await asyncio.to_thread(served.backend.received.wait, 5), "no payment was sent"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    served.backend.release.set()


# -- http nodes (flows/payments.yaml) ------------------------------------------------------------


async def test_a_call_resumed_after_the_payment_was_answered_does_not_pay_again(
    payments: Flow, http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    served = serve(bank())
    store = SavedStates(payments, dies_at=after_the_answer(served.backend))
    first = TextCallIO.scripted([pressed("12345"), pressed("1")])
    with pytest.raises(InstanceDied):
        await runner(payments, first, http, store, served.url).run()
    assert "confirmation" not in " ".join(first.bot_lines)  # died before saying it
    again = TextCallIO.scripted([])
    final = await runner(payments, again, http, SavedStates(payments), served.url).run(store.last())
    assert len(served.backend.effects) == 1, "paid twice"
    assert len(served.backend.posts()) == 1, "the kept answer is read, not asked for again"
    assert again.bot_lines == [RESUME_PROMPT, PAID]
    assert final.outcome == "hangup" and final.vars["confirmation"] == "P1"
    kept = store.last().request  # what the call record held: the answer, not yet read
    assert kept is not None and kept.answer is not None and kept.answer.status == 200


async def test_a_payment_in_flight_when_the_call_dropped_is_resent_with_the_same_key(
    payments: Flow, http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    backend = bank()
    backend.stall = True
    served = serve(backend)
    store = SavedStates(payments)
    await pay_until_cancelled(payments, http, store, served, [pressed("12345"), pressed("1")])
    in_flight = store.last()
    again = TextCallIO.scripted([])
    await runner(payments, again, http, SavedStates(payments), served.url).run(in_flight)
    posts = backend.posts()
    assert len(backend.effects) == 1, "paid twice"
    assert len(posts) == 2 and len({p.key for p in posts}) == 1, posts
    assert posts[0].key == f"{CALL_SID}:payments:pay:1"
    assert posts[1].path == posts[0].path == "/accounts/12345/payments"
    assert posts[1].body == posts[0].body == {"amount": 42.5}
    assert again.bot_lines == [RESUME_PROMPT, PAID]
    # What the call record held: the request in flight, with its key.
    assert in_flight.request is not None and in_flight.request.answer is None
    assert in_flight.request.key == posts[0].key and in_flight.waiting == "http"


async def test_reads_carry_no_key_and_each_payment_gets_its_own(
    http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    served = serve(bank())
    io = TextCallIO.scripted([pressed("1"), pressed("1"), pressed("2")])
    store = SavedStates(LOOP)
    final = await runner(LOOP, io, http, store, served.url).run()
    assert [r.key for r in served.backend.requests if r.method == "GET"] == [None]
    assert [p.key for p in served.backend.posts()] == [
        f"{CALL_SID}:loop:pay:1",
        f"{CALL_SID}:loop:pay:2",
    ]  # a second payment the caller asked for is a new request, not a resend
    assert final.request is None and final.http_seq == 2
    assert io.bot_lines[-1] == "Paid P2. Goodbye."


LOOP = load_flow_text(
    """
name: loop
start: look
variables: {api: "http://127.0.0.1:1"}
nodes:
  look:
    kind: http
    request: {url: "{{ api }}/accounts/12345/balance", map: {balance: balance}}
    next: offer
    on_error: offer
  offer:
    kind: menu
    prompt: Press 1 to pay {{ balance }}, 2 to stop.
    options: [{key: "1", next: pay}, {key: "2", next: bye}]
  pay:
    kind: http
    request:
      method: POST
      url: "{{ api }}/payments"
      json: {amount: "{{ balance }}"}
      map: {confirmation: confirmation}
    next: offer
    on_error: offer
  bye:
    kind: hangup
    say: Paid {{ confirmation }}. Goodbye.
""",
    "loop.yaml",
)


def post_flow(*request_lines: str, name: str = "post") -> Flow:
    """A flow that makes one POST, with these extra lines in its request."""
    lines = "".join(f"\n      {line}" for line in request_lines)
    text = f"""
name: {name}
start: pay
variables: {{api: "http://127.0.0.1:1"}}
nodes:
  pay:
    kind: http
    request:
      method: POST
      url: "{{{{ api }}}}/payments"{lines}
      map: {{confirmation: confirmation}}
    next: bye
    on_error: bye
  bye:
    kind: hangup
    say: Paid {{{{ confirmation }}}}.
"""
    return load_flow_text(text, f"{name}.yaml")


@pytest.mark.parametrize(("own_header", "keys", "effects"), [
    ("", [None, None], 2),
    ("Idempotency-Key", ["mine", "mine"], 1),
])  # fmt: skip
async def test_idempotent_true_opts_out_no_key_nothing_kept_and_a_resume_sends_again(
    own_header: str, keys: list[str | None], effects: int,
    http: httpx.AsyncClient, serve: Callable[[Backend], Served],
) -> None:  # fmt: skip
    backend = bank()
    backend.stall = True
    served = serve(backend)
    header = [f"headers: {{{own_header}: mine}}"] if own_header else []
    flow = post_flow("idempotent: true", *header)
    store = SavedStates(flow)
    await pay_until_cancelled(flow, http, store, served, [])
    in_flight = store.last()
    assert in_flight.waiting == "http" and in_flight.request is None and in_flight.http_seq == 0
    await runner(flow, TextCallIO.scripted([]), http, SavedStates(flow), served.url).run(in_flight)
    # The gateway adds no key and keeps nothing: the resume sends the request again, with the
    # author's own header if the flow sets one (this backend deduplicates on it).
    assert [p.key for p in backend.posts()] == keys
    assert len(backend.effects) == effects


def test_a_keyed_request_may_not_set_its_key_header_itself() -> None:
    with pytest.raises(FlowLoadError) as caught:
        post_flow('headers: {idempotency-key: "x"}', name="bad")
    [problem] = caught.value.problems
    assert str(problem).startswith("bad.yaml:11:")
    assert "header 'idempotency-key' is set by the gateway on a POST request" in str(problem)
    assert "idempotent: true" in str(problem)
    assert post_flow('headers: {X-Request-Id: "x"}').nodes["pay"]
    assert post_flow("idempotent: true", 'headers: {Idempotency-Key: "x"}').nodes["pay"]


def test_a_bad_idempotency_header_name_is_a_load_error() -> None:
    with pytest.raises(FlowLoadError, match="'Bad Header' is not an HTTP header name"):
        post_flow("idempotency_header: 'Bad Header'")


async def test_the_key_goes_in_the_header_the_flow_names(
    http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    backend = bank()
    backend.header = "X-Request-Id"
    served = serve(backend)
    flow = post_flow("idempotency_header: X-Request-Id", name="named")
    await runner(flow, TextCallIO.scripted([]), http, SavedStates(flow), served.url).run()
    assert [p.key for p in backend.posts()] == [f"{CALL_SID}:named:pay:1"]


async def test_a_large_answer_is_kept_as_only_the_mapped_fields(
    payments: Flow, http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    class Bulky(Backend):
        def answer(self, method: str, path: str, key: str | None, body: Any) -> tuple[int, bytes]:
            status, data = super().answer(method, path, key, body)
            if method == "POST":
                big = {**json.loads(data), "receipt": {"lines": ["x" * 100] * 400}}
                return status, json.dumps(big).encode()
            return status, data

    backend = Bulky(reads=bank().reads)
    served = serve(backend)
    store = SavedStates(payments, dies_at=after_the_answer(backend))
    with pytest.raises(InstanceDied):
        await runner(payments, TextCallIO.scripted([pressed("12345"), pressed("1")]), http,
                     store, served.url).run()  # fmt: skip
    kept = store.last().request
    assert kept is not None and kept.answer is not None
    assert kept.answer.body == {"confirmation": "P1"} and len(store.saved[-1]) < 4000


def test_a_large_answer_keeps_each_mapped_path_as_lookup_finds_it() -> None:
    items = [{"name": "a", "x": "y" * 9000}, {"name": "b", "n": [1, 2]}]
    body = {"data": {"items": items}, "total": 2, "pad": "z" * 9000}
    paths = ("data.items.1.name", "data.items.1.n", "data.items", "total", "missing.path")
    small = HttpResult(True, 200, {"total": 2})
    assert kept_answer(small, paths) is small
    kept = kept_answer(HttpResult(True, 200, body), ("data.items.1.name", "total", "nope"))
    assert kept.json == {"data": {"items": [None, {"name": "b"}]}, "total": 2}
    assert all(lookup(kept.json, p) == lookup(body, p) for p in ("data.items.1.name", "total"))
    whole = kept_answer(HttpResult(True, 200, body), paths)  # a path holding its deeper ones
    assert whole.json == {"data": {"items": items}, "total": 2}
    assert kept_answer(HttpResult(True, 200, ["x" * 20_000]), ()).json == []


async def test_a_state_saved_before_keys_existed_still_loads_and_resumes(
    payments: Flow, http: httpx.AsyncClient, serve: Callable[[Backend], Served]
) -> None:
    served = serve(bank())
    old = {
        "flow": "payments", "version": payments.version, "node": "pay", "waiting": "http",
        "vars": {"backend_url": served.url, "account": "12345", "customer": "Ada",
                 "verified": True, "balance": 42.5},
        "stack": [], "attempts": 0, "agent_turns": 0, "tool_rounds": 0, "tool_errors": 0,
        "pending_tools": [], "pending_answer": None, "history": [], "outcome": None,
        "transfer_to": None, "steps": 9,
    }  # fmt: skip
    state = FlowState.model_validate(old)
    assert state.request is None and state.http_seq == 0 and state.call_id == ""
    io = TextCallIO.scripted([])
    await runner(payments, io, http, SavedStates(payments), served.url).run(state)
    # Nothing recorded whether it was sent: it is sent again, from now on with a key.
    assert [p.key for p in served.backend.posts()] == [f"{CALL_SID}:payments:pay:1"]
    assert io.bot_lines == [RESUME_PROMPT, PAID]


# -- agent tools -----------------------------------------------------------------------------------

AGENT = load_flow_text(
    """
name: billing
start: chat
variables: {api: "http://127.0.0.1:1"}
nodes:
  chat:
    kind: agent
    system: You take bill payments.
    tools:
      - name: pay_bill
        description: Pay the caller's bill.
        parameters:
          type: object
          properties: {amount: {type: number}}
          required: [amount]
        http:
          method: POST
          url: "{{ api }}/payments"
          json: {amount: "{{ args.amount }}"}
          map: {confirmation: confirmation}
""",
    "billing.yaml",
)


def a_model() -> Callable[[dict[str, Any]], ChatScript]:
    """Pays when the caller has just spoken (each time with a new call id, as models do);
    reads the tool's answer back otherwise."""
    ids = itertools.count(1)

    def reply(request: dict[str, Any]) -> ChatScript:
        last = request["messages"][-1]
        if last["role"] == "tool":
            return ChatScript(text=f"Done: {last['content']}")
        return ChatScript(tool_calls=[ScriptToolCall("pay_bill", '{"amount": 42}',
                                                     id=f"call_{next(ids)}")])  # fmt: skip

    return reply


@pytest.fixture
async def llm() -> AsyncIterator[tuple[FakeOpenAIServer, OpenAICompatLlm]]:
    async with FakeOpenAIServer(api_key="sk-test") as server:
        server.chat = a_model()
        model = OpenAICompatLlm(base_url=server.base_url, api_key="sk-test", model="m",
                                max_tokens=None)  # fmt: skip
        yield server, model
        await model.aclose()


@pytest.mark.parametrize("drop", ["in_flight", "answered"])
async def test_an_agent_tool_request_is_not_repeated_by_a_resume(
    drop: str, http: httpx.AsyncClient, serve: Callable[[Backend], Served],
    llm: tuple[FakeOpenAIServer, OpenAICompatLlm],
) -> None:  # fmt: skip
    server, model = llm
    backend = bank()
    backend.stall = drop == "in_flight"
    served = serve(backend)
    turns = [said("Pay my bill please")]
    if drop == "in_flight":
        store = SavedStates(AGENT)
        await pay_until_cancelled(AGENT, http, store, served, turns, model)
    else:
        store = SavedStates(AGENT, dies_at=after_the_answer(backend))
        with pytest.raises(InstanceDied):
            await runner(AGENT, TextCallIO.scripted(turns), http, store, served.url,
                         model).run()  # fmt: skip
    io = TextCallIO.scripted([hangs_up()])
    await runner(AGENT, io, http, SavedStates(AGENT), served.url, model).run(store.last())
    posts = backend.posts()
    assert len(backend.effects) == 1, "paid twice"
    assert {p.key for p in posts} == {f"{CALL_SID}:billing:chat:call_1:1"}
    assert len(posts) == (2 if drop == "in_flight" else 1)
    assert io.bot_lines == [RESUME_PROMPT, 'Done: {"confirmation": "P1"}']
    tool_turn = server.requests_for("chat")[-1].json
    assert tool_turn is not None and tool_turn["messages"][-1]["tool_call_id"] == "call_1"


# -- real processes: SIGKILL the instance carrying the call while the backend pays ---------------

PAYMENTS_NUMBER = "+15550100004"  # flows/payments.yaml


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key="sk-test") as server:
        server.speak = fast_speak  # before the gateways start: they pre-synthesise prompts
        yield server


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_sigkill_during_the_payment_leaves_exactly_one_payment(
    tmp_path: Path, fake: FakeOpenAIServer, serve: Callable[[Backend], Served]
) -> None:
    """Two ``ivr serve`` processes on one Redis behind a load balancer; the caller pays; the
    backend takes the payment and stalls its answer; the instance carrying the call is
    SIGKILLed. The call resumes on the other one, which sends the payment again with the same
    key: the backend answers the first payment, and the caller hears its confirmation."""
    backend = bank()
    backend.stall = True
    served = serve(backend)
    env = {"SUPPORT_BACKEND_URL": served.url}
    script = script_from_data([{"press": "12345"}, {"press": "1"}, {"silence": 15}], source="pay")
    async with cluster(tmp_path, fake, LOCAL_REDIS_URL, per_instance=[env, env]) as cl:
        call = asyncio.create_task(place_call(
            cl.lb.url, script=script, auth_token=AUTH_TOKEN, public_base_url=PUBLIC_URL,
            to=PAYMENTS_NUMBER,
        ))  # fmt: skip
        try:
            assert await asyncio.to_thread(backend.received.wait, 30), cl.tails()
            active = await cl.only_active_call()
            carrier = cl.proc_for(active.instance_id)
            carrier.kill()
            backend.release.set()
            report = await asyncio.wait_for(asyncio.shield(call), 40)
        finally:
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        record = await cl.store.get(report.call_sid)
    assert not report.errors and not report.violations, report.format_transcript()
    posts = backend.posts()
    assert len(backend.effects) == 1, f"paid {len(backend.effects)} times: {posts}"
    assert len(posts) == 2 and {p.key for p in posts} == {f"{report.call_sid}:payments:pay:1"}
    # The same request again, from the record the other instance saved (account kept in clear).
    assert posts[0].path == posts[1].path == "/accounts/12345/payments"
    assert posts[0].body == posts[1].body == {"amount": 42.5}
    assert record is not None and record.stream_count == 2
    assert record.end_action == "hangup" and record.variables["confirmation"] == "P1"
    spoken = [(r.json or {}).get("input") for r in fake.requests_for("speech")]  # by sentence
    assert spoken[-3:] == ["Thank you, Ada.", "Your confirmation number is P1.", "Goodbye."]
    assert report.closing_twiml is not None and "<Hangup" in report.closing_twiml
