"""The STT the settings ask for (``IVR_STT_PROVIDER``): one builder per provider name.

A cloud provider is wrapped with retries and an optional fallback endpoint
(``ivr.stt.resilient``); the offline engine answers when no provider is configured, so a fresh
machine answers calls with no account and no key. A new provider: its module in this room, its
builder in ``BUILDERS``, its name in ``Settings.stt_provider``.
"""

from __future__ import annotations

from collections.abc import Callable

from ivr.config import STREAMING_STT, Settings, SttProviderName
from ivr.errors import ConfigError
from ivr.providers.resilience import RetryPolicy, refuse_fallback
from ivr.stt.base import SpeechToText, StreamingSpeechToText
from ivr.stt.resilient import ResilientStt

STT_MIN_ATTEMPT = 0.5
"""The least time worth giving one attempt (a retry, or a fallback when the primary hangs):
about a typical good answer time. The primary leaves this much of the limit to each fallback."""


def build_stt(settings: Settings) -> SpeechToText:
    return BUILDERS[settings.stt_provider](settings)


def _openai(settings: Settings) -> SpeechToText:
    from ivr.stt.openai_http import OpenAIHttpStt

    limit = settings.stt_answer_timeout

    def client(base_url: str, api_key: str, model: str, name: str) -> OpenAIHttpStt:
        return OpenAIHttpStt(
            base_url=base_url,
            api_key=api_key or "none",  # self-hosted servers need no key
            model=model,
            language=settings.stt_language,
            sample_rate=settings.stt_sample_rate,
            timeout=limit,
            name=name,
        )

    stts = [client(settings.stt_base_url, settings.stt_api_key, settings.stt_model, "openai_stt")]
    if settings.stt_fallback_base_url:
        model = settings.stt_fallback_model or settings.stt_model
        key = settings.stt_fallback_api_key
        stts.append(client(settings.stt_fallback_base_url, key, model, "openai_stt_fallback"))
    return ResilientStt(stts, RetryPolicy(limit, STT_MIN_ATTEMPT))


def _whisper(settings: Settings) -> SpeechToText:
    refuse_fallback("STT", settings.stt_fallback_base_url)
    from ivr.stt.whisper_local import LocalWhisperStt

    # Beam 5: 4 points fewer word errors than greedy for ~50 ms a sentence, which speculation
    # hides. A short encoder window (the turn, at least 10 s) instead of whisper's 30 s: a
    # third of the decode time, on the critical path of every offline turn (issue 22, the
    # demo within 1.0 s), at about the same word error rate (bench/whisper_beam.py --window).
    return LocalWhisperStt(
        timeout_s=settings.stt_answer_timeout,
        beam_size=5,
        prompt=settings.stt_prompt or None,
        short_window=True,
    )


BUILDERS: dict[SttProviderName, Callable[[Settings], SpeechToText]] = {
    "local": _whisper,
    "openai": _openai,
}


def build_streaming_stt(settings: Settings) -> StreamingSpeechToText | None:
    """The streaming STT the settings ask for, with reconnection and failover (to the
    OpenAI-compatible batch STT when ``IVR_STT_FALLBACK_BASE_URL`` is set); None for a batch
    provider."""
    if settings.stt_provider not in STREAMING_STT:
        return None
    from ivr.stt.resilient_stream import BatchSttStream, ResilientStreamingStt

    limit = settings.stt_answer_timeout
    providers: list[StreamingSpeechToText] = [_streaming(settings, settings.stt_provider, limit)]
    if settings.stt_fallback_base_url:
        from ivr.stt.openai_http import OpenAIHttpStt

        fallback = OpenAIHttpStt(
            base_url=settings.stt_fallback_base_url,
            api_key=settings.stt_fallback_api_key or "none",
            model=settings.stt_fallback_model or settings.stt_model,
            language=settings.stt_language, sample_rate=settings.stt_sample_rate,
            timeout=limit, name="openai_stt_fallback",
        )  # fmt: skip
        providers.append(BatchSttStream(fallback))
    return ResilientStreamingStt(providers, RetryPolicy(limit, STT_MIN_ATTEMPT))


def _streaming(settings: Settings, name: str, limit: float) -> StreamingSpeechToText:
    if name == "openai-realtime":
        from ivr.stt.openai_realtime import OpenAIRealtimeStt

        _require(settings.stt_api_key, "IVR_STT_API_KEY", name)
        return OpenAIRealtimeStt(
            api_key=settings.stt_api_key, model=settings.stt_realtime_model,
            base_url=settings.stt_realtime_url, language=settings.stt_language,
            prompt=settings.stt_prompt, finalize_timeout=limit,
        )  # fmt: skip
    from ivr.stt.deepgram import DeepgramStt

    _require(settings.deepgram_api_key, "DEEPGRAM_API_KEY", name)
    flux = name == "deepgram-flux"
    terms = tuple(t.strip() for t in settings.deepgram_keyterms.split(",") if t.strip())
    return DeepgramStt(
        api_key=settings.deepgram_api_key, flux=flux, base_url=settings.deepgram_url,
        model=settings.deepgram_flux_model if flux else settings.deepgram_model,
        language=settings.stt_language, keyterms=terms,
        eot_threshold=settings.deepgram_eot_threshold if flux else None,
        eager_eot_threshold=settings.deepgram_eager_eot_threshold if flux else None,
        finalize_timeout=limit,
    )  # fmt: skip


def _require(value: str, variable: str, provider: str) -> None:
    if not value:
        raise ConfigError(f"IVR_STT_PROVIDER={provider} needs {variable}")


def _streamed_batch(settings: Settings) -> SpeechToText:
    """A streaming provider's session per utterance, for what is not a call (a call opens
    its own session: ``build_stts``)."""
    from ivr.stt.stream_batch import StreamedBatchStt

    stream = build_streaming_stt(settings)
    assert stream is not None
    return StreamedBatchStt(stream)


for _name in STREAMING_STT:
    BUILDERS[_name] = _streamed_batch  # type: ignore[index]


def build_stts(settings: Settings) -> tuple[SpeechToText, StreamingSpeechToText | None]:
    """The batch STT and, for a streaming provider, the streaming one each call opens a
    session on (the batch one is then the same provider, one session per utterance)."""
    stream = build_streaming_stt(settings)
    if stream is None:
        return build_stt(settings), None
    from ivr.stt.stream_batch import StreamedBatchStt

    return StreamedBatchStt(stream), stream
