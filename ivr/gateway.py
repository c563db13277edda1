"""The gateway's long-lived parts, built once per process and shared by every call.

``Gateway.start()`` loads engines, starts the offline LLM server if no provider is configured,
connects the call store and pre-synthesises static prompts; ``aclose()`` undoes all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import structlog

from ivr.call.io import CallIO
from ivr.call.prompts import PromptCache
from ivr.config import Settings
from ivr.llm.base import LanguageModel
from ivr.obs import metrics
from ivr.providers import build_llm, build_stt, build_tts
from ivr.state.base import CallRecord, CallStore
from ivr.stt.base import SpeechToText
from ivr.telephony.rest import TwilioRest, rest_from_settings
from ivr.telephony.twilio import SignatureChecker
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.gateway")


class Conversation(Protocol):
    """What runs a call once its stream is up (the flow runner)."""

    def __call__(self, io: CallIO, record: CallRecord) -> Coroutine[Any, Any, None]: ...


def new_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        store: CallStore,
        stt: SpeechToText | None = None,
        tts: TextToSpeech | None = None,
        llm: LanguageModel | None = None,
    ) -> None:
        self.settings = settings
        self.instance_id = settings.instance_id or new_instance_id()
        self.store = store
        self.stt = stt or build_stt(settings)
        self.tts = tts or build_tts(settings)
        self._llm = llm
        self.prompts = PromptCache()
        self.signatures: SignatureChecker | None = (
            SignatureChecker(
                settings.twilio_auth_token, settings.public_url, settings.public_ws_base
            )
            if settings.twilio_auth_token
            else None
        )
        self.rest: TwilioRest | None = None
        """Twilio's REST API (transfers), when an account SID and token are configured."""
        self.conversation: Conversation | None = None
        self.pin_flow: Callable[[CallRecord], Awaitable[None]] | None = None
        """Sets flow_name/flow_version on a new call's record and shares that flow version
        through the store (raises LookupError: no flow)."""
        self.static_prompts: Callable[[], set[str]] = set
        self._exit = contextlib.AsyncExitStack()
        self._background_factories: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._background: list[asyncio.Task[None]] = []

    def add_background(self, factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A long-running job started with the gateway and cancelled when it closes."""
        self._background_factories.append(factory)

    def on_close(self, closer: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._exit.push_async_callback(closer)

    @property
    def llm(self) -> LanguageModel:
        if self._llm is None:
            raise RuntimeError("Gateway.start() has not run: no LLM yet")
        return self._llm

    @property
    def accepts_unsigned(self) -> bool:
        return self.signatures is None and self.settings.allow_unsigned

    async def start(self) -> None:
        settings = self.settings
        if self.signatures is None:
            if settings.allow_unsigned:
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
        self.rest = rest_from_settings(settings)
        if self.rest is not None:
            self.on_close(self.rest.aclose)
        metrics.watch_store(self.store)
        start_store = getattr(self.store, "start", None)
        if start_store is not None:
            await start_store()
        if self._llm is None:
            self._llm = await self._start_llm()
        for engine in (self.stt, self.tts):
            warm = getattr(engine, "warm", None)
            if warm is not None:
                await warm()
        added = await self.prompts.warm(self.tts, sorted(self.static_prompts()))
        for factory in self._background_factories:
            task = asyncio.create_task(factory())
            task.add_done_callback(_report_background_failure)
            self._background.append(task)
        log.info(
            "gateway.started",
            instance=self.instance_id,
            stt=self.stt.name,
            tts=self.tts.name,
            llm=self.llm.name,
            llm_model=self.llm.model,
            prompts_cached=added,
        )

    async def _start_llm(self) -> LanguageModel:
        settings = self.settings
        if not settings.use_local_llm:
            return build_llm(
                settings,
                base_url=settings.llm_base_url,
                api_key=settings.llm_api_key,
                model=settings.llm_model,
            )
        from ivr.llm.local_server import LocalLlmServer

        log.info("llm.offline", detail="no LLM API key set: starting the offline model server")
        server: Any = await self._exit.enter_async_context(LocalLlmServer())
        return build_llm(
            settings, base_url=server.base_url, api_key=server.api_key, model=server.model
        )

    async def aclose(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._background.clear()
        for closeable in (self._llm, self.stt, self.tts, self.store):
            if closeable is not None:
                with contextlib.suppress(Exception):
                    await closeable.aclose()
        await self._exit.aclose()


def _report_background_failure(task: asyncio.Task[None]) -> None:
    """A background job (the flows watcher) must never die silently."""
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway.background_failed", task=task.get_name(), exc_info=task.exception())
