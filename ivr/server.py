"""Assemble and run a gateway process: settings -> store -> gateway -> flows -> app -> uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
import uvicorn
from fastapi import FastAPI

from ivr.app import create_app
from ivr.config import Settings
from ivr.conversation import attach_flows
from ivr.gateway import Gateway, new_instance_id
from ivr.llm.base import LanguageModel
from ivr.obs.logging import configure_logging
from ivr.state.base import CallStore
from ivr.state.memory import MemoryCallStore
from ivr.state.resilient import ResilientCallStore
from ivr.stt.base import SpeechToText
from ivr.tts.base import TextToSpeech

log = structlog.get_logger("ivr.server")


def build_store(settings: Settings, instance_id: str) -> CallStore:
    """Redis when a URL is set (wrapped so calls survive a Redis outage), else in-memory."""
    if not settings.redis_url:
        return MemoryCallStore(ended_ttl=settings.call_ttl_seconds)
    from ivr.state.redis_store import RedisCallStore

    redis = RedisCallStore(
        settings.redis_url, prefix=settings.redis_prefix, ended_ttl=settings.call_ttl_seconds
    )
    return ResilientCallStore(redis, instance_id=instance_id)


def build_gateway(
    settings: Settings,
    *,
    stt: SpeechToText | None = None,
    tts: TextToSpeech | None = None,
    llm: LanguageModel | None = None,
) -> Gateway:
    if not settings.instance_id:
        settings = settings.model_copy(update={"instance_id": new_instance_id()})
    store = build_store(settings, settings.instance_id)
    gateway = Gateway(settings, store=store, stt=stt, tts=tts, llm=llm)
    attach_flows(gateway)
    return gateway


@dataclass(slots=True)
class RunningServer:
    app: FastAPI
    gateway: Gateway
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def running_server(
    gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[RunningServer]:
    """Run the gateway under uvicorn in this event loop until the block exits."""
    port = port or free_port(host)
    app = create_app(gateway)
    server = uvicorn.Server(uvicorn_config(app, host, port))
    task = asyncio.create_task(server.serve(), name="uvicorn")
    try:
        while not server.started:
            if task.done():
                task.result()  # re-raise the startup failure
                raise RuntimeError("uvicorn exited during startup")
            await asyncio.sleep(0.02)
        yield RunningServer(app=app, gateway=gateway, host=host, port=port)
    finally:
        server.should_exit = True
        await asyncio.gather(task, return_exceptions=True)


async def serve(host: str | None = None, port: int | None = None) -> int:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    gateway = build_gateway(settings)
    app = create_app(gateway)
    await uvicorn.Server(uvicorn_config(app, host or settings.host, port or settings.port)).serve()
    return 0


def uvicorn_config(app: FastAPI, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # structlog owns logging
        access_log=False,
        lifespan="on",
        ws="websockets-sansio",
        ws_per_message_deflate=False,  # mu-law barely compresses; deflate would only cost CPU
    )
