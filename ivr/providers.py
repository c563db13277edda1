"""Build the STT, TTS and LLM providers the settings ask for.

Cloud providers are plain OpenAI-compatible HTTP clients, each wrapped with retries and an
optional fallback endpoint (``ivr.providers_resilience``); offline engines are used when no
provider is configured, so a fresh machine answers calls with no account and no key.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ivr.config import Settings
from ivr.errors import ConfigError
from ivr.llm.base import LanguageModel
from ivr.llm.openai_compat import REASONING_OFF, OpenAICompatLlm
from ivr.providers_resilience import ResilientLlm, ResilientStt, ResilientTts, RetryPolicy
from ivr.stt.base import SpeechToText
from ivr.tts.base import TextToSpeech

# The least time worth giving one attempt (a retry, or a fallback when the primary hangs):
# about a typical good answer time of each stage. The primary leaves this much of the stage's
# first-output limit to each fallback.
STT_MIN_ATTEMPT, LLM_MIN_ATTEMPT, TTS_MIN_ATTEMPT = 0.5, 0.5, 0.4


def build_stt(settings: Settings) -> SpeechToText:
    limit = settings.stt_answer_timeout
    if settings.stt_provider == "openai":
        from ivr.stt.openai_http import OpenAIHttpStt

        def client(base_url: str, api_key: str, model: str, name: str) -> OpenAIHttpStt:
            return OpenAIHttpStt(
                base_url=base_url,
                api_key=api_key or "none",  # self-hosted servers need no key
                model=model,
                language=settings.stt_language,
                timeout=limit,
                name=name,
            )

        stts = [
            client(settings.stt_base_url, settings.stt_api_key, settings.stt_model, "openai_stt")
        ]
        if settings.stt_fallback_base_url:
            model = settings.stt_fallback_model or settings.stt_model
            key = settings.stt_fallback_api_key
            stts.append(client(settings.stt_fallback_base_url, key, model, "openai_stt_fallback"))
        return ResilientStt(stts, RetryPolicy(limit, STT_MIN_ATTEMPT))
    _no_fallback("STT", settings.stt_fallback_base_url)
    from ivr.stt.whisper_local import LocalWhisperStt

    # Beam 5: 4 points fewer word errors than greedy for ~50 ms a sentence, which speculation
    # hides (bench/whisper_beam.py).
    return LocalWhisperStt(timeout_s=limit, beam_size=5, prompt=settings.stt_prompt or None)


def build_tts(settings: Settings) -> TextToSpeech:
    if settings.tts_provider == "openai":
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
    _no_fallback("TTS", settings.tts_fallback_base_url)
    if settings.tts_provider == "espeak":
        from ivr.tts.espeak_local import LocalEspeakTts

        return LocalEspeakTts()
    from ivr.tts.piper_local import LocalPiperTts

    return LocalPiperTts()


def _no_fallback(stage: str, fallback_url: str) -> None:
    if fallback_url:
        raise ConfigError(
            f"IVR_{stage}_FALLBACK_BASE_URL is set but IVR_{stage}_PROVIDER is an offline engine: "
            f"a fallback backs up an OpenAI-compatible provider (IVR_{stage}_PROVIDER=openai)"
        )


# Hosts known to accept `reasoning_effort: none` (thinking off for voice). Others may reject an
# unknown field with 422, so they get a plain request (Gemma 4 does not think unless asked).
REASONING_OFF_HOSTS = ("api.cerebras.ai", "router.huggingface.co")


def build_llm(settings: Settings, *, base_url: str, api_key: str, model: str) -> LanguageModel:
    """The LLM at ``base_url``, then IVR_LLM_FALLBACK_BASE_URL if set, with retries."""
    llms = [_compat_llm(settings, base_url, api_key, model, "openai_compat")]
    if settings.llm_fallback_base_url:
        fallback_model = settings.llm_fallback_model or model
        llms.append(
            _compat_llm(
                settings,
                settings.llm_fallback_base_url,
                settings.llm_fallback_api_key,
                fallback_model,
                "openai_compat_fallback",
            )
        )
    return ResilientLlm(llms, RetryPolicy(settings.llm_first_token_limit, LLM_MIN_ATTEMPT))


def _compat_llm(
    settings: Settings, base_url: str, api_key: str, model: str, name: str
) -> OpenAICompatLlm:
    host = urlsplit(base_url).hostname or ""
    return OpenAICompatLlm(
        extra_body=REASONING_OFF if host in REASONING_OFF_HOSTS else None,
        base_url=base_url,
        api_key=api_key or "none",
        model=model,
        name=name,
        temperature=settings.llm_temperature,
        max_tokens=settings.llm_max_tokens,
        first_token_timeout=settings.llm_first_token_limit,
        stall_timeout=settings.llm_stall_limit,
        total_timeout=settings.llm_timeout,
    )
