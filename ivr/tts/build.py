"""The TTS the settings ask for (``IVR_TTS_PROVIDER``): one builder per provider name.

A cloud provider is wrapped with retries and an optional fallback endpoint
(``ivr.tts.resilient``); the offline engines answer when no provider is configured. A new
provider: its module in this room, its builder in ``BUILDERS``, its name in
``Settings.tts_provider``.
"""

from __future__ import annotations

from collections.abc import Callable

from ivr.config import Settings, TtsProviderName
from ivr.providers.resilience import RetryPolicy, refuse_fallback
from ivr.tts.base import TextToSpeech
from ivr.tts.resilient import ResilientTts

TTS_MIN_ATTEMPT = 0.4
"""The least time worth giving one attempt: about a typical first-byte time (see STT's)."""


def build_tts(settings: Settings) -> TextToSpeech:
    return BUILDERS[settings.tts_provider](settings)


def _openai(settings: Settings) -> TextToSpeech:
    from ivr.tts.openai_http import OpenAIHttpTts

    def client(base_url: str, api_key: str, model: str, voice: str, name: str) -> OpenAIHttpTts:
        return OpenAIHttpTts(
            base_url=base_url,
            api_key=api_key or "none",  # self-hosted servers need no key
            model=model,
            voice=voice,
            sample_rate=settings.tts_sample_rate,
            first_byte_timeout=settings.tts_first_byte_timeout,
            stall_timeout=settings.tts_stall_timeout,
            total_timeout=settings.tts_timeout,
            name=name,
        )

    s = settings
    ttss = [client(s.tts_base_url, s.tts_api_key, s.tts_model, s.tts_voice, "openai_tts")]
    if s.tts_fallback_base_url:
        model, voice = s.tts_fallback_model or s.tts_model, s.tts_fallback_voice or s.tts_voice
        key = s.tts_fallback_api_key
        ttss.append(client(s.tts_fallback_base_url, key, model, voice, "openai_tts_fallback"))
    return ResilientTts(ttss, RetryPolicy(s.tts_first_byte_timeout, TTS_MIN_ATTEMPT))


def _piper(settings: Settings) -> TextToSpeech:
    refuse_fallback("TTS", settings.tts_fallback_base_url)
    from ivr.tts.piper_local import LocalPiperTts

    return LocalPiperTts()


def _espeak(settings: Settings) -> TextToSpeech:
    refuse_fallback("TTS", settings.tts_fallback_base_url)
    from ivr.tts.espeak_local import LocalEspeakTts

    return LocalEspeakTts()


BUILDERS: dict[TtsProviderName, Callable[[Settings], TextToSpeech]] = {
    "piper": _piper,
    "espeak": _espeak,
    "openai": _openai,
}
