"""What a call does once its stream is up: the YAML flow it was pinned to at webhook time.

``FlowConversation`` binds the flow runtime (``ivr.flows``) to live calls (``ivr.call``).

Flow state is persisted to the call store after every step, before the step's prompt is
spoken, so an instance that dies loses at most the turn in progress; the stream that resumes
the call (on any instance) picks the saved state up and the runner re-enters the node.

The flow version is shared the same way: pinning a call saves the files its version was loaded
from in the store (once per version and process, renewed before it expires), and an instance
that has not loaded that version (other files on its disk, or started after an edit) loads it
from there. Only when those are gone too does the call go on with the current version (logged).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import structlog

from ivr import phrases
from ivr.call.prompts import PromptCache
from ivr.callio.io import CallIO
from ivr.control.answer import ANSWER_TIMEOUT, BEEP_TIMEOUT, AnswerBoard, watching_answer
from ivr.flows.events import FlowState
from ivr.flows.model import Flow
from ivr.flows.privacy import stored_state
from ivr.flows.problems import FlowLoadError, Problem
from ivr.flows.registry import FlowRegistry
from ivr.flows.runner import FlowRunner, OnStep
from ivr.flows.sources import load_flow_from_sources
from ivr.llm.base import LanguageModel
from ivr.state.base import CallRecord, CallStore, StoreError, StreamSuperseded, fenced
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.conversation")

MAX_REMEMBERED_VERSIONS = 64
MIN_SOURCES_TTL = 6 * 3600.0
"""Shared flow sources outlive any call pinned to them (Twilio caps a call at 4 h)."""


class FlowVersions:
    """Every flow version this process has loaded, so a call finishes on the version it began
    with even after a hot reload replaced it (bounded: oldest versions are forgotten)."""

    def __init__(self) -> None:
        self._flows: OrderedDict[str, Flow] = OrderedDict()

    def remember(self, flows: dict[str, Flow]) -> None:
        for flow in flows.values():
            self._flows[flow.version] = flow
            self._flows.move_to_end(flow.version)
        while len(self._flows) > MAX_REMEMBERED_VERSIONS:
            self._flows.popitem(last=False)

    def get(self, version: str) -> Flow | None:
        return self._flows.get(version)


class SharedVersions:
    """Flow versions through the call store, for calls that move between instances."""

    def __init__(self, store: CallStore, registry: FlowRegistry, ttl: float) -> None:
        self.store, self.registry, self.ttl = store, registry, ttl
        self._saved: dict[str, float] = {}  # version -> monotonic time of its last save

    async def share(self, flow: Flow) -> None:
        """Save ``flow``'s sources unless this process did so within half their TTL."""
        now = time.monotonic()
        last = self._saved.get(flow.version)
        if last is not None and now - last < self.ttl / 2:
            return
        sources = self.registry.sources(flow)
        if sources is None:  # why was logged at load; do not retry on every call
            self._saved[flow.version] = now
            return
        try:
            await self.store.save_flow_sources(flow.version, sources, self.ttl)
        except StoreError as exc:  # the call goes on; a resume elsewhere may fall back
            log.error("flows.sources_save_failed", version=flow.version, error=str(exc))
            return
        if len(self._saved) >= 1024:
            self._saved = {v: t for v, t in self._saved.items() if now - t < self.ttl / 2}
        self._saved[flow.version] = now

    async def fetch(self, name: str, version: str) -> Flow | None:
        """Flow ``name`` at ``version`` loaded from the sources in the store; None (logged) if
        they are missing, unloadable or not that version."""
        try:
            sources = await self.store.load_flow_sources(version)
        except StoreError as exc:
            log.error("flows.sources_load_failed", flow=name, version=version, error=str(exc))
            return None
        if sources is None:
            return None
        try:
            flow = await asyncio.to_thread(load_flow_from_sources, sources, name)
        except FlowLoadError as exc:
            problems = [str(p) for p in exc.problems]
            log.error("flows.sources_invalid", flow=name, version=version, problems=problems)
            return None
        if flow.version != version:
            log.error("flows.sources_mismatch", flow=name, version=version, got=flow.version)
            return None
        log.info("flows.version_from_store", flow=name, version=version)
        return flow


class FlowConversation:
    """Runs each call on the YAML flow pinned to it at webhook time (a ``Conversation``)."""

    def __init__(
        self,
        registry: FlowRegistry,
        *,
        store: CallStore,
        llm: LanguageModel,
        http: httpx.AsyncClient,
        prompts: PromptCache,
        tts: TextToSpeech,
        sources_ttl: float,
        resume_prompt: str = "",
    ) -> None:
        self.registry = registry
        self._store = store
        self._llm = llm
        self._http = http
        self._prompts = prompts
        self._tts = tts
        self._resume_prompt = resume_prompt
        self._versions = FlowVersions()
        self._versions.remember(registry.flows)
        self._shared = SharedVersions(store, registry, max(sources_ttl, MIN_SOURCES_TTL))
        self.answers = AnswerBoard()
        """Outbound calls being classified here, for Twilio's AMD callback."""

    def static_prompts(self) -> list[str]:
        """Every prompt text known before a call starts, worth synthesising in advance."""
        texts = self.registry.static_prompt_texts() | set(phrases.CACHED_AT_START)
        if self._resume_prompt:
            texts.add(self._resume_prompt)
        return sorted(texts)

    async def watch(self) -> None:
        """Hot reload: run until cancelled, picking up every valid edit of the flows."""
        await self.registry.watch(on_reload=self._on_reload)

    async def _on_reload(self, problems: list[Problem]) -> None:
        self._versions.remember(self.registry.flows)  # the registry logs what it refused
        added = await self._prompts.warm(self._tts, self.static_prompts())
        log.info("flows.reloaded", refused=len(problems), prompts_synthesised=added)

    async def pin(self, record: CallRecord) -> None:
        """Set the flow that answers ``record.to_number`` (and its version) on a new call's
        record, and share that version through the store. Raises LookupError: no flow."""
        flow = self.registry.flow_for_number(record.to_number)
        record.flow_name, record.flow_version = flow.name, flow.version
        record.record_call = flow.recording.records(asked=record.record_call)
        await self._shared.share(flow)

    async def _pinned(self, record: CallRecord) -> Flow:
        """The call's flow version: loaded here, else from the store, else the current one."""
        flow = self._versions.get(record.flow_version)
        if flow is None and record.flow_version:
            flow = await self._shared.fetch(record.flow_name, record.flow_version)
            if flow is not None:
                self._versions.remember({flow.name: flow})
        return flow or _current(self.registry, record)

    async def run(self, io: CallIO, record: CallRecord) -> None:
        flow = await self._pinned(record)
        saved = FlowState.model_validate(record.flow_state) if record.flow_state else None
        leg = record.warm_transfer
        if saved is not None and saved.waiting == "transfer" and leg and leg.status == "failed":
            # Back from a warm transfer's hold: the flow goes on at the node's fallback.
            saved = saved.model_copy(update={"transfer_result": leg.result or "failed"})
        if saved is not None and saved.done:
            # Dropped while the goodbye or transfer prompt played: finish what was decided.
            await _leave(io, saved)
            return
        stream_sid = record.stream_sid or ""
        consent = flow.recording.consent_prompt
        if saved is None and record.record_call and consent:  # before anything else is said
            await io.say(consent, interruptible=False)

        async def persist(state: FlowState) -> None:
            await _persist(self._store, record.call_sid, stream_sid, flow, state, io)

        call_vars = {
            "caller": record.from_number,
            "called": record.to_number,
            "call_sid": record.call_sid,
            "direction": record.direction,
        }
        if record.direction == "outbound" and (saved is None or saved.waiting == "start"):
            await self._run_outbound(io, record, flow, persist, call_vars)
            return
        await self._runner(flow, io, persist, call_vars).run(saved)

    def _runner(
        self,
        flow: Flow,
        io: CallIO,
        persist: OnStep,
        call_vars: dict[str, Any],
        wait_for_beep: Callable[[], Awaitable[None]] | None = None,
    ) -> FlowRunner:
        return FlowRunner(
            flow,
            io,
            self._llm,
            self._http,
            persist,
            call_vars=call_vars,
            resume_prompt=self._resume_prompt,
            wait_for_beep=wait_for_beep,
        )

    async def _run_outbound(
        self,
        io: CallIO,
        record: CallRecord,
        flow: Flow,
        persist: OnStep,
        call_vars: dict[str, Any],
    ) -> None:
        """A call we placed: the flow starts once we know who answered (``answered_by``), with
        the dial's variables; a ``say`` with ``after_beep`` waits for the machine's beep."""
        async with watching_answer(
            io, record.call_sid, self.answers, record.twilio_answered_by
        ) as watch:
            answered_by = await watch.answered_by(ANSWER_TIMEOUT)
            audio = io.capabilities.caller_audio
            if audio is not None:  # a machine's greeting runs on: its say waits
                await audio.forget_caller_input(until_quiet=answered_by != "machine")
            await _save_answered_by(self._store, record, answered_by)

            async def wait_for_beep() -> None:
                if not await watch.greeting_ended(BEEP_TIMEOUT):
                    log.warning("amd.no_beep", waited_s=BEEP_TIMEOUT)

            variables = {**record.variables, **call_vars, "answered_by": answered_by}
            await self._runner(flow, io, persist, variables, wait_for_beep).run(None)


def _current(registry: FlowRegistry, record: CallRecord) -> Flow:
    """The call's pinned version is gone (another instance loaded it, then a reload): run the
    current version of the same flow, or whatever now answers the number."""
    if record.flow_version:
        log.warning("flows.version_missing", flow=record.flow_name, version=record.flow_version)
    try:
        return registry.get(record.flow_name)
    except KeyError:
        return registry.flow_for_number(record.to_number)


async def _leave(io: CallIO, state: FlowState) -> None:
    if state.outcome == "transfer" and state.transfer_to:
        await io.transfer(state.transfer_to)
    else:
        await io.hangup()


async def _save_answered_by(store: CallStore, record: CallRecord, answered_by: str) -> None:
    def save(stored: CallRecord) -> None:
        stored.answered_by = answered_by

    try:
        await store.update(record.call_sid, fenced(record.stream_sid or "", save))
    except StreamSuperseded:
        raise
    except StoreError as exc:  # the call goes on; the record only misses the label
        log.error("amd.save_failed", error=str(exc))


async def _persist(
    store: CallStore, call_sid: str, stream_sid: str, flow: Flow, live: FlowState, io: CallIO
) -> None:
    # The record gets a masked copy (ivr.flows.privacy); the call goes on with the real values.
    state = stored_state(flow, live)
    data = state.model_dump(mode="json")
    turn_log, timeline = io.capabilities.turn_log, io.capabilities.timeline
    turns = turn_log.unsaved_turns() if turn_log is not None else []
    events = timeline.drain() if timeline is not None else []

    def save(record: CallRecord) -> None:
        if state.done:  # decided before the last prompt plays: a drop now must not resume it
            record.end_action = "transfer" if state.outcome == "transfer" else "hangup"
            record.transfer_to = state.transfer_to or ""
        leg = record.warm_transfer
        if leg is not None and leg.status == "failed" and state.waiting != "transfer":
            record.warm_transfer = None  # read by the fallback; a later transfer starts afresh
        record.flow_state = data
        record.node = state.node
        record.variables = dict(state.vars)
        record.history = []
        for item in state.history:
            if item.role in ("user", "assistant") and item.content:
                record.add_message(item.role, item.content)
        for turn in turns:
            record.add_turn(turn)
        record.add_events(events)

    try:
        await store.update(call_sid, fenced(stream_sid, save))
    except StreamSuperseded:
        raise  # a newer stream carries the call: this one must stop
    except StoreError as exc:  # the call goes on; the store logs and counts its own outage
        log.error("flow.persist_failed", error=str(exc))
