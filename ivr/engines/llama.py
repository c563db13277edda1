"""Chat generation with a GGUF model on llama.cpp's C API (via llama-cpp-py-sync).

We call the public llama.h functions directly instead of the package's high-level
`Llama` class because that class tokenizes chat prompts without parsing special
tokens (so `<|im_start|>` reaches the model as plain text) and always allocates an
embeddings buffer. The chat template comes from the GGUF file itself.

The context keeps the KV cache of the last request: a new prompt that starts with the same
tokens (the system prompt and knowledge of an agent, the conversation so far) only evaluates
what is new. On a CPU that is most of the time to first token.
"""

from __future__ import annotations

import codecs
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ivr.engines import glibc_compat

INSTALL_HINT = "pip install 'llama-cpp-py-sync==0.11739'"
_GGML_LOG_WARN = 3
_PIECE_BYTES = 256


class EngineError(RuntimeError):
    """The local model could not be loaded or could not run a request."""


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    grammar: str | None = None
    """GBNF grammar constraining the reply (e.g. from a JSON schema)."""


@dataclass(slots=True)
class GenerationStats:
    """Filled in by `stream_chat` as it runs (mutable on purpose: it is an out-parameter)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV cache was kept from the previous request (not evaluated again)."""
    completion_tokens: int = 0
    finish_reason: str = "stop"


def _bindings() -> tuple[Any, Any]:
    """Return (ffi, lib), loading a glibc-compatible copy of the library if needed."""
    try:
        from llama_cpp_py_sync import _cffi_bindings as bindings
    except ImportError as exc:
        raise EngineError(f"llama-cpp-py-sync is not installed; run: {INSTALL_HINT}") from exc
    if bindings._lib is None and glibc_compat.needs_patch():
        source = Path(bindings.__file__).parent
        cache = (
            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ivr" / "llama-libs"
        )
        folder = glibc_compat.compat_library_dir(source, cache)
        bindings._lib = bindings.ffi.dlopen(str(folder / "libllama.so"))
    return bindings.get_ffi(), bindings.get_lib()  # type: ignore[no-untyped-call]


class LlamaEngine:
    """One loaded model and context; one generation at a time (guarded by a lock)."""

    def __init__(self, model_path: Path, *, n_ctx: int = 2048, n_threads: int = 2) -> None:
        if not model_path.is_file():
            raise EngineError(f"model file not found: {model_path}")
        self._ffi, self._lib = _bindings()
        self._lock = threading.Lock()
        self._log_cb = self._ffi.callback("ggml_log_callback", _forward_warnings)
        self._lib.llama_log_set(self._log_cb, self._ffi.NULL)
        self._lib.llama_backend_init()
        self._model = self._load_model(model_path)
        self._ctx = self._new_context(n_ctx, n_threads)
        self._vocab = self._lib.llama_model_get_vocab(self._model)
        self._n_ctx = n_ctx
        self._n_batch = min(n_ctx, 512)
        self._memory = self._lib.llama_get_memory(self._ctx)
        self._evaluated: list[int] = []
        """The tokens whose KV cache sequence 0 holds, in order."""
        self._template = self._lib.llama_model_chat_template(self._model, self._ffi.NULL)
        if self._template == self._ffi.NULL:
            self.close()
            raise EngineError(f"{model_path} has no chat template (tokenizer.chat_template)")

    def _load_model(self, path: Path) -> Any:
        params = self._lib.llama_model_default_params()
        params.n_gpu_layers = 0
        model = self._lib.llama_model_load_from_file(str(path).encode(), params)
        if model == self._ffi.NULL:
            raise EngineError(f"llama.cpp could not load {path} (not a supported GGUF model?)")
        return model

    def _new_context(self, n_ctx: int, n_threads: int) -> Any:
        params = self._lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = min(n_ctx, 512)
        params.n_ubatch = min(n_ctx, 512)
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.embeddings = False
        params.no_perf = True
        ctx = self._lib.llama_init_from_model(self._model, params)
        if ctx == self._ffi.NULL:
            self._lib.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        return ctx

    def close(self) -> None:
        with self._lock:
            if getattr(self, "_ctx", None) not in (None, self._ffi.NULL):
                self._lib.llama_free(self._ctx)
            self._ctx = None
            if getattr(self, "_model", None) not in (None, self._ffi.NULL):
                self._lib.llama_model_free(self._model)
            self._model = None

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (e.g. ``general.name``, ``general.license``)."""
        buf = self._ffi.new("char[]", 512)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, 512)
        return None if n < 0 else str(self._ffi.string(buf).decode("utf-8", "replace"))

    def render(self, turns: Sequence[ChatTurn]) -> str:
        """Apply the GGUF's chat template and add the assistant prefix."""
        keep = [
            (self._ffi.new("char[]", t.role.encode()), self._ffi.new("char[]", t.content.encode()))
            for t in turns
        ]
        messages = self._ffi.new("llama_chat_message[]", len(keep))
        for i, (role, content) in enumerate(keep):
            messages[i].role, messages[i].content = role, content
        size = 1024 + 2 * sum(len(t.content.encode()) for t in turns)
        for _ in range(2):
            buf = self._ffi.new("char[]", size)
            n = self._lib.llama_chat_apply_template(
                self._template, messages, len(keep), True, buf, size
            )
            if n < 0:
                raise EngineError("llama.cpp does not support this GGUF's chat template")
            if n <= size:
                return str(self._ffi.string(buf, n).decode("utf-8", "replace"))
            size = n + 1
        raise EngineError("chat template output kept growing")

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 16
        tokens = self._ffi.new("llama_token[]", cap)
        n = self._lib.llama_tokenize(self._vocab, data, len(data), tokens, cap, True, True)
        if n < 0:
            raise EngineError(f"prompt could not be tokenized ({n})")
        return [int(tokens[i]) for i in range(n)]

    def stream_chat(
        self,
        turns: Sequence[ChatTurn],
        params: SamplingParams,
        cancel: threading.Event,
        stats: GenerationStats | None = None,
    ) -> Iterator[str]:
        """Yield text pieces; stops at end-of-turn, max_tokens or when cancel is set.

        Blocking and CPU-bound: run it in a worker thread.
        """
        with self._lock:
            if self._ctx is None:
                raise EngineError("engine is closed")
            prompt = self.tokenize(self.render(turns))
            if len(prompt) + params.max_tokens > self._n_ctx:
                raise EngineError(
                    f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                    f"exceeds the context window ({self._n_ctx})"
                )
            stats = stats if stats is not None else GenerationStats()
            stats.prompt_tokens = len(prompt)
            yield from self._generate(prompt, params, cancel, stats)

    def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        cancel: threading.Event,
        stats: GenerationStats,
    ) -> Iterator[str]:
        stats.cached_tokens = self._reuse_prefix(prompt)
        sampler = self._sampler(params)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stats.finish_reason = "length"
        try:
            self._decode(prompt[stats.cached_tokens :])
            for _ in range(params.max_tokens):
                if cancel.is_set():
                    stats.finish_reason = "cancelled"
                    return
                token = self._lib.llama_sampler_sample(sampler, self._ctx, -1)
                if self._lib.llama_vocab_is_eog(self._vocab, token):
                    stats.finish_reason = "stop"
                    break
                stats.completion_tokens += 1
                text = decoder.decode(self._piece(token))
                if text:
                    yield text
                self._decode([token])
            tail = decoder.decode(b"", final=True)
            if tail:
                yield tail
        finally:
            self._lib.llama_sampler_free(sampler)

    def _reuse_prefix(self, prompt: list[int]) -> int:
        """Drop the cache after the longest prefix ``prompt`` shares with it; return its length.

        At least the last prompt token is evaluated again: its logits pick the first reply token.
        """
        keep = 0
        limit = min(len(prompt) - 1, len(self._evaluated))
        while keep < limit and prompt[keep] == self._evaluated[keep]:
            keep += 1
        if keep == 0 or not self._lib.llama_memory_seq_rm(self._memory, 0, keep, -1):
            keep = 0  # some memory kinds cannot drop a tail: start from an empty cache
            self._lib.llama_memory_clear(self._memory, True)
        del self._evaluated[keep:]
        return keep

    def _decode(self, tokens: list[int]) -> None:
        for start in range(0, len(tokens), self._n_batch):
            part = tokens[start : start + self._n_batch]
            chunk = self._ffi.new("llama_token[]", part)
            batch = self._lib.llama_batch_get_one(chunk, len(part))
            rc = self._lib.llama_decode(self._ctx, batch)
            if rc != 0:
                # What a failed batch left in the cache is unknown: forget all of it.
                self._lib.llama_memory_clear(self._memory, True)
                self._evaluated.clear()
                raise EngineError(f"llama_decode failed with code {rc}")
            self._evaluated.extend(part)

    def _piece(self, token: int) -> bytes:
        buf = self._ffi.new("char[]", _PIECE_BYTES)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, _PIECE_BYTES, 0, False)
        return bytes(self._ffi.buffer(buf, max(n, 0)))

    def _sampler(self, params: SamplingParams) -> Any:
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if params.grammar is not None:
            grammar = lib.llama_sampler_init_grammar(self._vocab, params.grammar.encode(), b"root")
            if grammar == self._ffi.NULL:
                lib.llama_sampler_free(chain)
                raise EngineError("invalid GBNF grammar for the response format")
            lib.llama_sampler_chain_add(chain, grammar)
        if params.temperature <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain


def _forward_warnings(level: int, text: Any, _user: Any) -> None:
    # llama.cpp logs every tensor at INFO; keep only warnings and errors.
    if level in (_GGML_LOG_WARN, _GGML_LOG_WARN + 1) and text:
        from llama_cpp_py_sync._cffi_bindings import ffi

        sys.stderr.write(ffi.string(text).decode("utf-8", "replace"))
