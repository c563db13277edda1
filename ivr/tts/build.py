"""The TTS the settings ask for (``IVR_TTS_PROVIDER``): one builder per provider name.

A cloud provider is wrapped with retries and an optional fallback endpoint
(``ivr.tts.resilient``); the offline engines answer when no provider is configured. A new
provider: its module in this room, its builder in ``BUILDERS``, its name in
``Settings.tts_provider``.
"""

from __future__ import annotations

from collections.abc import Callable

from ivr.config import STREAMING_TTS, Settings, TtsProviderName
from ivr.errors import ConfigError
from ivr.providers.resilience import RetryPolicy, refuse_fallback
from ivr.tts.base import StreamingTextToSpeech, TextToSpeech
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


def build_streaming_tts(settings: Settings) -> StreamingTextToSpeech | None:
    """The streaming TTS the settings ask for, with retries (and, when both are configured,
    the other streaming voice as the fallback); None for a batch provider."""
    if settings.tts_provider not in STREAMING_TTS:
        return None
    from ivr.tts.resilient_stream import ResilientStreamingTts

    names = [settings.tts_provider] + [
        n for n in sorted(STREAMING_TTS) if n != settings.tts_provider and _configured(settings, n)
    ]
    providers = [_streaming(settings, name) for name in names]
    return ResilientStreamingTts(
        providers, RetryPolicy(settings.tts_first_byte_timeout, TTS_MIN_ATTEMPT)
    )


def _configured(settings: Settings, name: str) -> bool:
    if name == "cartesia":
        return bool(settings.cartesia_api_key and settings.cartesia_voice)
    return bool(settings.elevenlabs_api_key and settings.elevenlabs_voice)


def _streaming(settings: Settings, name: str) -> StreamingTextToSpeech:
    s = settings
    first, stall = s.tts_first_byte_timeout, s.tts_stall_timeout
    if not _configured(settings, name):
        raise ConfigError(
            f"IVR_TTS_PROVIDER={name} needs IVR_{name.upper()}_API_KEY and IVR_{name.upper()}_VOICE"
        )
    if name == "cartesia":
        from ivr.tts.cartesia import CartesiaTts

        return CartesiaTts(
            api_key=s.cartesia_api_key, voice=s.cartesia_voice, model=s.cartesia_model,
            base_url=s.cartesia_url, first_audio_timeout=first, stall_timeout=stall,
        )  # fmt: skip
    from ivr.tts.elevenlabs import ElevenLabsTts

    return ElevenLabsTts(
        api_key=s.elevenlabs_api_key, voice=s.elevenlabs_voice, model=s.elevenlabs_model,
        base_url=s.elevenlabs_url, first_audio_timeout=first, stall_timeout=stall,
    )  # fmt: skip


def _streaming_voice(settings: Settings) -> TextToSpeech:
    """A streaming voice for the call: replies use its sessions, prompts its whole texts."""
    from ivr.tts.voice import StreamingVoice

    streaming = build_streaming_tts(settings)
    assert streaming is not None  # the name is one of STREAMING_TTS
    return StreamingVoice(streaming)


for _name in STREAMING_TTS:
    BUILDERS[_name] = _streaming_voice  # type: ignore[index]
