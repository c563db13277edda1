"""The gateway's long-lived parts, built once per process and shared by every call.

``build_gateway`` wires everything from the settings (store, providers, flows, the per-call
``CallServices``); nothing is filled in later. ``Gateway.start()`` only starts what was built:
the store, the offline LLM server when no provider is configured, engine warm-up, static
prompt synthesis and the flows watcher; ``aclose()`` undoes all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import uuid
from collections.abc import Callable

import httpx
import structlog

from ivr.admission import Admission, DrainResult, drain
from ivr.audio.endpointer import EndpointConfig, Endpointer
from ivr.audio.gated_vad import GatedSileroVad, shared_pool
from ivr.audio.vad import VoiceActivityDetector, WebRtcVad
from ivr.call.live import LiveCalls
from ivr.call.prompts import PromptCache
from ivr.call.services import CallServices
from ivr.call.turn_end import EndOfTurnDetector
from ivr.config import Settings
from ivr.control.after_stream import StreamOutcome
from ivr.control.connect import StreamConnector
from ivr.control.sweeper import CallSweeper, Windows
from ivr.control.tokens import StreamTokens
from ivr.control.warm import WarmTransfers
from ivr.control.webhook_auth import StreamAuth
from ivr.conversation import FlowConversation
from ivr.engines.smart_turn import SmartTurnModel
from ivr.flows.registry import FlowRegistry
from ivr.llm.base import LanguageModel
from ivr.llm.build import configured_llm
from ivr.obs import metrics
from ivr.obs.loop_lag import LoopLagMonitor
from ivr.providers.openai_http import preconnect_idle
from ivr.recording import recordings_from_settings
from ivr.state.base import CallStore
from ivr.state.memory import MemoryCallStore
from ivr.state.outcomes import Outcome
from ivr.state.redis_store import RedisCallStore
from ivr.state.resilient import ResilientCallStore
from ivr.stt.base import SpeechToText
from ivr.stt.build import build_stts
from ivr.telephony.rest import TwilioRest, rest_from_settings
from ivr.telephony.twilio import SignatureChecker
from ivr.tts.base import TextToSpeech
from ivr.tts.build import build_tts

log = structlog.get_logger("ivr.gateway")

FLOW_HTTP_TIMEOUT = 10.0
"""Seconds for a flow's http node or tool call (each node may set less)."""


def new_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Gateway:
    """One process's parts: ``services`` for the streams, ``flows`` for the webhooks."""

    def __init__(
        self,
        settings: Settings,
        services: CallServices,
        flows: FlowConversation,
        llm: LanguageModel,
        *,
        flow_http: httpx.AsyncClient,
        admission: Admission,
        prewarm_prompts: bool = True,
    ) -> None:
        self.settings = settings
        self.services = services
        self.flows = flows
        self.llm = llm
        self.admission = admission
        self._flow_http = flow_http
        self._prewarm_prompts = prewarm_prompts
        self.sweeper = CallSweeper(
            services.store, Windows(settings.stream_token_ttl_s, settings.resume_window_s)
        )
        self._watcher: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self.services.instance_id

    @property
    def store(self) -> CallStore:
        return self.services.store

    @property
    def stt(self) -> SpeechToText:
        return self.services.stt

    @property
    def tts(self) -> TextToSpeech:
        return self.services.tts

    async def start(self) -> None:
        _warn_about_auth(self.services.auth)
        self._start_metrics_at_zero()
        metrics.watch_store(self.store)
        metrics.CAPACITY_CALLS.set(self.admission.max_calls)
        metrics.READY.set_function(lambda: float(self.admission.ready))
        self._lag_task = asyncio.create_task(self.admission.lag.run(), name="loop-lag")
        self._lag_task.add_done_callback(_report_watcher_failure)
        await self.store.start()
        await self.llm.start()
        await self.stt.warm()
        await self.tts.warm()
        texts = self.flows.static_prompts() if self._prewarm_prompts else []
        added = await self.services.prompts.warm(self.tts, texts)
        self._watcher = asyncio.create_task(self.flows.watch(), name="flows-watcher")
        self._watcher.add_done_callback(_report_watcher_failure)
        self._sweep_task = asyncio.create_task(self.sweeper.run(), name="call-sweeper")
        self._sweep_task.add_done_callback(_report_watcher_failure)
        if self.services.recordings is not None:
            self.services.recordings.start()
        if self.services.turn_model is not None:
            await self.services.turn_model.start()  # a model that cannot load: words only
        self.admission.lag.restart()  # what startup took is not load
        log.info(
            "gateway.started",
            instance=self.instance_id,
            stt=self.stt.name,
            tts=self.tts.name,
            llm=self.llm.name,
            llm_model=self.llm.model,
            prompts_cached=added,
        )

    def _start_metrics_at_zero(self) -> None:
        providers = {
            "stt": _provider_names(self.stt),
            "llm": _provider_names(self.llm),
            "tts": _provider_names(self.tts),
        }
        metrics.start_at_zero(
            providers, [o.value for o in Outcome], [r.value for r in StreamOutcome]
        )

    async def drain(self) -> DrainResult:
        """Stop taking calls and let the live ones end or move (``IVR_DRAIN_SECONDS`` at most)."""
        return await drain(self.services, seconds=self.settings.drain_seconds)

    async def aclose(self) -> None:
        for task in (self._watcher, self._lag_task, self._sweep_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._watcher = self._lag_task = self._sweep_task = None
        if self.services.turn_model is not None:
            await self.services.turn_model.aclose()
        if self.services.recordings is not None:  # before the store: saves note their location
            await self.services.recordings.aclose()
        if self.services.warm is not None:  # stop its watchdogs before the REST client closes
            await self.services.warm.aclose()
        rest = self.services.rest
        closers = [self.llm.aclose, self.stt.aclose, self.tts.aclose, self.store.aclose]
        closers += [self._flow_http.aclose] + ([rest.aclose] if rest is not None else [])
        for close in closers:
            with contextlib.suppress(Exception):  # close everything even if one part fails
                await close()


def build_gateway(
    settings: Settings,
    *,
    stt: SpeechToText | None = None,
    tts: TextToSpeech | None = None,
    llm: LanguageModel | None = None,
    prewarm_prompts: bool = True,
) -> Gateway:
    """Wire one gateway from ``settings``; the given providers replace the configured ones.

    Loads the flows now: a broken flow raises ``FlowLoadError`` listing every problem.
    """
    if not settings.instance_id:
        settings = settings.model_copy(update={"instance_id": new_instance_id()})
    store = build_store(settings, settings.instance_id)
    stt, streaming_stt = (stt, None) if stt is not None else build_stts(settings)
    tts = tts or build_tts(settings)
    llm = llm or configured_llm(settings)
    prompts = PromptCache()
    flow_http = httpx.AsyncClient(timeout=FLOW_HTTP_TIMEOUT)
    flows = _flow_conversation(settings, store, llm, tts, flow_http, prompts)
    tokens = _stream_tokens(settings)
    live = LiveCalls()
    rest = rest_from_settings(settings)
    connector = StreamConnector(tokens, store, settings.public_url, settings.public_ws_base)
    services = CallServices(
        instance_id=settings.instance_id,
        store=store,
        stt=stt,
        tts=tts,
        llm_name=llm.name,
        prompts=prompts,
        conversation=flows,
        new_endpointer=endpointer_factory(settings),
        playout_lead=settings.playout_lead_ms / 1000,
        playout_refill=settings.playout_refill_ms / 1000,
        heard_within=settings.heard_within,
        auth=_stream_auth(settings),
        tokens=tokens,
        connector=connector,
        live=live,
        rest=rest,
        warm=_warm_transfers(settings, store, rest, connector, llm),
        recordings=recordings_from_settings(settings, store),
        turn_model=_turn_model(settings),
        streaming_stt=streaming_stt,
        preconnect=_preconnect(settings),
    )
    return Gateway(
        settings,
        services,
        flows,
        llm,
        flow_http=flow_http,
        admission=build_admission(settings, live, store),
        prewarm_prompts=prewarm_prompts,
    )


def _flow_conversation(
    settings: Settings,
    store: CallStore,
    llm: LanguageModel,
    tts: TextToSpeech,
    http: httpx.AsyncClient,
    prompts: PromptCache,
) -> FlowConversation:
    """The flows loaded from ``settings.flows_dir``, run as the calls' conversation."""
    registry = FlowRegistry(settings.flows_dir)
    registry.load()
    return FlowConversation(
        registry,
        store=store,
        llm=llm,
        http=http,
        prompts=prompts,
        tts=tts,
        sources_ttl=float(settings.call_ttl_seconds),
        resume_prompt=settings.resume_prompt,
    )


def _stream_tokens(settings: Settings) -> StreamTokens:
    """Signs the media-stream URLs; the Twilio auth token serves when no own secret is set."""
    return StreamTokens.from_secret(
        settings.stream_token_secret or settings.twilio_auth_token,
        ttl=settings.stream_token_ttl_s,
    )


def _preconnect(settings: Settings) -> Callable[[], None] | None:
    """Warm the HTTP providers' connections as a caller begins to speak (``CallServices``)."""
    idle_s = settings.preconnect_idle_ms / 1000
    if idle_s <= 0:
        return None
    return functools.partial(preconnect_idle, idle_s)


def _turn_model(settings: Settings) -> EndOfTurnDetector | None:
    """The audio end-of-turn model; it only acts at pauses, so only with speculative turns."""
    if settings.turn_model == "off" or settings.speculate_after_ms <= 0:
        return None
    return EndOfTurnDetector(SmartTurnModel())


def _warm_transfers(
    settings: Settings,
    store: CallStore,
    rest: TwilioRest | None,
    connector: StreamConnector,
    llm: LanguageModel,
) -> WarmTransfers | None:
    """Warm transfers need the REST API (a conference, an agent leg); without it a flow's
    warm transfer is made cold (logged on each call)."""
    if rest is None:
        return None
    return WarmTransfers(
        store=store, rest=rest, connector=connector, llm=llm, public_url=settings.public_url
    )


def build_admission(settings: Settings, live: LiveCalls, store: CallStore) -> Admission:
    return Admission(
        live=live,
        lag=LoopLagMonitor(settings.max_loop_lag_ms / 1000),
        store=store,
        max_calls=settings.max_calls,
        max_backlog=settings.max_inbound_backlog_ms / 1000,
        overflow=settings.overflow,
        overflow_number=settings.overflow_number,
    )


def build_store(settings: Settings, instance_id: str) -> CallStore:
    """Redis when a URL is set (wrapped so calls survive a Redis outage), else in-memory."""
    if not settings.redis_url:
        return MemoryCallStore(ended_ttl=settings.call_ttl_seconds)
    redis = RedisCallStore(
        settings.redis_url, prefix=settings.redis_prefix, ended_ttl=settings.call_ttl_seconds
    )
    budget = settings.redis_budget_ms / 1000
    return ResilientCallStore(redis, instance_id=instance_id, budget=budget)


def endpointer_factory(settings: Settings) -> Callable[[], Endpointer]:
    """A fresh endpointer per call, with the VAD and silence settings of this gateway."""
    pause_ms = settings.speculate_after_ms
    config = EndpointConfig(
        silence_ms=settings.endpoint_silence_ms,
        min_speech_ms=settings.min_speech_ms,
        # Speculation only pays when it starts before the turn ends.
        pause_ms=pause_ms if 0 < pause_ms < settings.endpoint_silence_ms else 0,
    )

    # Created now, so its models load in the background before the first call needs one.
    pool = shared_pool(settings.silero_threshold) if settings.vad == "silero" else None

    def new_vad() -> VoiceActivityDetector:
        if pool is not None:
            return GatedSileroVad(pool)
        return WebRtcVad(settings.vad_mode)

    return lambda: Endpointer(new_vad(), config)


def _stream_auth(settings: Settings) -> StreamAuth:
    signatures = (
        SignatureChecker(settings.twilio_auth_token, settings.public_url, settings.public_ws_base)
        if settings.twilio_auth_token
        else None
    )
    return StreamAuth(signatures, allow_unsigned=settings.allow_unsigned)


def _warn_about_auth(auth: StreamAuth) -> None:
    if auth.signatures is not None:
        return
    if auth.allow_unsigned:
        log.warning(
            "security.unsigned_requests_allowed",
            detail="TWILIO_AUTH_TOKEN is not set and IVR_ALLOW_UNSIGNED=true: anyone who "
            "can reach this server can place calls. Development only.",
        )
    else:
        log.error(
            "security.calls_refused",
            detail="TWILIO_AUTH_TOKEN is not set: every webhook and stream is refused "
            "(403). Set it, or IVR_ALLOW_UNSIGNED=true for local development.",
        )


def _provider_names(provider: object) -> list[str]:
    """The names a provider's failures are counted under: each of a resilient wrapper's
    providers (the fallbacks too), else its own."""
    inner = getattr(provider, "providers", None)
    return [str(p.name) for p in inner] if inner else [str(getattr(provider, "name", "?"))]


def _report_watcher_failure(task: asyncio.Task[None]) -> None:
    """The flows watcher must never die silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway.background_failed", task=task.get_name(), exc_info=task.exception())
