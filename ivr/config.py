"""All settings, from environment variables (and an optional ``.env`` file).

Every setting is documented in the README's configuration table; keep the two in step.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CEREBRAS_BASE_URL = "https://api.cerebras.ai/v1"
CEREBRAS_GEMMA_MODEL = "gemma-4-31b"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="IVR_", env_file=".env", extra="ignore", populate_by_name=True
    )

    # Where Twilio reaches us. Signatures are checked against this URL, never against the
    # Host header, because proxies and tunnels rewrite scheme and host.
    public_url: str = "http://127.0.0.1:8080"
    host: str = "127.0.0.1"
    port: int = 8080

    twilio_account_sid: str = Field(
        "", validation_alias=AliasChoices("TWILIO_ACCOUNT_SID", "IVR_TWILIO_ACCOUNT_SID")
    )
    twilio_auth_token: str = Field(
        "", validation_alias=AliasChoices("TWILIO_AUTH_TOKEN", "IVR_TWILIO_AUTH_TOKEN")
    )
    # REST API base (calls are redirected/ended through it); override only to test locally.
    twilio_api_base_url: str = ""
    # Development only: accept unsigned webhooks and streams when no auth token is set.
    allow_unsigned: bool = False

    llm_provider: Literal["auto", "openai", "local"] = "auto"
    llm_base_url: str = CEREBRAS_BASE_URL
    llm_api_key: str = Field(
        "", validation_alias=AliasChoices("IVR_LLM_API_KEY", "CEREBRAS_API_KEY")
    )
    llm_model: str = CEREBRAS_GEMMA_MODEL
    llm_temperature: float = 0.3
    llm_max_tokens: int = 200
    llm_first_token_timeout: float = 5.0
    llm_timeout: float = 20.0

    stt_provider: Literal["local", "openai"] = "local"
    stt_base_url: str = "https://api.openai.com/v1"
    stt_api_key: str = ""
    stt_model: str = "whisper-1"
    stt_language: str = "en"
    stt_timeout: float = 10.0

    tts_provider: Literal["piper", "espeak", "openai"] = "piper"
    tts_base_url: str = "https://api.openai.com/v1"
    tts_api_key: str = ""
    tts_model: str = "tts-1"
    tts_voice: str = "alloy"
    tts_sample_rate: int = 24000
    tts_timeout: float = 10.0

    # Silero (neural) ignores hiss and comfort noise that WebRTC's GMM hears as speech for
    # seconds after a turn. "silero" runs it only when a permissive WebRTC gate hears something
    # (ivr/audio/gated_vad.py), so listening to silence costs about what WebRTC alone costs.
    vad: Literal["silero", "webrtc"] = "silero"
    vad_mode: int = Field(2, ge=0, le=3)
    silero_threshold: float = Field(0.5, gt=0.0, lt=1.0)
    endpoint_silence_ms: int = Field(300, ge=60, le=5000)
    min_speech_ms: int = Field(100, ge=20, le=5000)
    # How far ahead of Twilio's playout clock we may queue audio; bounds the cost of `clear`.
    playout_lead_ms: int = Field(600, ge=100, le=2000)

    redis_url: str = ""
    redis_prefix: str = "ivr:"
    call_ttl_seconds: int = 86400
    resume_prompt: str = "Sorry, we had a brief technical problem. Let's continue."

    flows_dir: str = "flows"
    admin_token: str = ""
    instance_id: str = ""

    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"

    @field_validator("public_url")
    @classmethod
    def _public_url_is_absolute(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(
                f"IVR_PUBLIC_URL must be an absolute http(s) URL such as https://gw.example.com, "
                f"got {value!r}"
            )
        return value.rstrip("/")

    @property
    def public_ws_base(self) -> str:
        """The wss:// (or ws:// for plain http) base that Twilio connects the stream to."""
        parts = urlsplit(self.public_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}{parts.path}"

    @property
    def use_local_llm(self) -> bool:
        if self.llm_provider != "auto":
            return self.llm_provider == "local"
        return not self.llm_api_key
