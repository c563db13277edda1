"""Build the STT, TTS and LLM providers the settings ask for.

Cloud providers are plain OpenAI-compatible HTTP clients; offline engines are used when no
provider is configured, so a fresh machine answers calls with no account and no key.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ivr.config import Settings
from ivr.llm.base import LanguageModel
from ivr.llm.openai_compat import REASONING_OFF, OpenAICompatLlm
from ivr.stt.base import SpeechToText
from ivr.tts.base import TextToSpeech


def build_stt(settings: Settings) -> SpeechToText:
    if settings.stt_provider == "openai":
        from ivr.stt.openai_http import OpenAIHttpStt

        return OpenAIHttpStt(
            base_url=settings.stt_base_url,
            api_key=settings.stt_api_key,
            model=settings.stt_model,
            language=settings.stt_language,
            timeout=settings.stt_timeout,
        )
    from ivr.stt.whisper_local import LocalWhisperStt

    return LocalWhisperStt(timeout_s=settings.stt_timeout, beam_size=5)


def build_tts(settings: Settings) -> TextToSpeech:
    if settings.tts_provider == "openai":
        from ivr.tts.openai_http import OpenAIHttpTts

        return OpenAIHttpTts(
            base_url=settings.tts_base_url,
            api_key=settings.tts_api_key,
            model=settings.tts_model,
            voice=settings.tts_voice,
            sample_rate=settings.tts_sample_rate,
            first_byte_timeout=settings.tts_timeout,
        )
    if settings.tts_provider == "espeak":
        from ivr.tts.espeak_local import LocalEspeakTts

        return LocalEspeakTts()
    from ivr.tts.piper_local import LocalPiperTts

    return LocalPiperTts()


# Hosts known to accept `reasoning_effort: none` (thinking off for voice). Others may reject an
# unknown field with 422, so they get a plain request (Gemma 4 does not think unless asked).
REASONING_OFF_HOSTS = ("api.cerebras.ai", "router.huggingface.co")


def build_llm(settings: Settings, *, base_url: str, api_key: str, model: str) -> LanguageModel:
    host = urlsplit(base_url).hostname or ""
    return OpenAICompatLlm(
        extra_body=REASONING_OFF if host in REASONING_OFF_HOSTS else None,
        base_url=base_url,
        api_key=api_key or "none",
        model=model,
        temperature=settings.llm_temperature,
        max_tokens=settings.llm_max_tokens,
        first_token_timeout=settings.llm_first_token_timeout,
        total_timeout=settings.llm_timeout,
    )
