"""The STT the settings ask for (``IVR_STT_PROVIDER``): one builder per provider name.

A cloud provider is wrapped with retries and an optional fallback endpoint
(``ivr.stt.resilient``); the offline engine answers when no provider is configured, so a fresh
machine answers calls with no account and no key. A new provider: its module in this room, its
builder in ``BUILDERS``, its name in ``Settings.stt_provider``.
"""

from __future__ import annotations

from collections.abc import Callable

from ivr.config import Settings, SttProviderName
from ivr.providers.resilience import RetryPolicy, refuse_fallback
from ivr.stt.base import SpeechToText
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
    # hides (bench/whisper_beam.py).
    return LocalWhisperStt(
        timeout_s=settings.stt_answer_timeout, beam_size=5, prompt=settings.stt_prompt or None
    )


BUILDERS: dict[SttProviderName, Callable[[Settings], SpeechToText]] = {
    "local": _whisper,
    "openai": _openai,
}
