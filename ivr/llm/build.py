"""The LLM the settings ask for: an OpenAI-compatible endpoint (Cerebras by default) with an
optional fallback and retries (``ivr.llm.resilient``), or the offline model when no key is
set (``ivr.llm.llama_local``)."""

from __future__ import annotations

from urllib.parse import urlsplit

from ivr.config import Settings
from ivr.llm.base import LanguageModel
from ivr.llm.llama_local import OfflineLlm
from ivr.llm.openai_compat import REASONING_OFF, OpenAICompatLlm
from ivr.llm.resilient import ResilientLlm
from ivr.providers.resilience import RetryPolicy

LLM_MIN_ATTEMPT = 0.5
"""The least time worth giving one attempt: about a typical first-token time."""

# Hosts known to accept `reasoning_effort: none` (thinking off for voice). Others may reject an
# unknown field with 422, so they get a plain request (Gemma 4 does not think unless asked).
REASONING_OFF_HOSTS = ("api.cerebras.ai", "router.huggingface.co")


def configured_llm(settings: Settings) -> LanguageModel:
    """IVR_LLM_*'s endpoint, or the offline model (``IVR_LLM_PROVIDER``; no key: offline)."""
    if not settings.use_local_llm:
        return build_llm(
            settings,
            base_url=settings.llm_base_url,
            api_key=settings.llm_api_key,
            model=settings.llm_model,
        )
    return OfflineLlm(
        lambda base_url, api_key, model: build_llm(
            settings, base_url=base_url, api_key=api_key, model=model
        )
    )


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
