"""All settings, from environment variables (and an optional ``.env`` file).

Every setting is documented in the README's configuration table; keep the two in step.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CEREBRAS_BASE_URL = "https://api.cerebras.ai/v1"
CEREBRAS_GEMMA_MODEL = "gemma-4-31b"
_E164 = re.compile(r"\+[1-9]\d{6,14}")  # as ivr.telephony.dialing (a room above this one)

# Provider limits, seconds. A failing cloud provider must leave at most ~2 s of dead air after
# the caller stops: 0.3 s endpoint silence + the stages before it at their usual speed + the
# failing stage's limit, then a pre-synthesised apology (typical cloud latency in brackets):
#   STT answer      1.5  [Whisper on Groq/OpenAI 0.2-0.8 s]  0.3 + 1.5             = 1.8 s
#   LLM first token 1.2  [Cerebras 0.1-0.4, HF router 0.3-0.6] 0.3 + 0.4 + 1.2     = 1.9 s
#   TTS first byte  1.0  [OpenAI tts-1 0.2-0.5 s]            0.3 + 0.4 + 0.3 + 1.0 = 2.0 s
# Retries and fallbacks fit inside these same limits (ivr/providers/resilience.py). A stream
# quiet for STALL (1.0 s; token and audio gaps are normally tens of ms) is dead: the caller has
# heard what came before, and the apology follows within a second. Totals only stop runaways.
# The offline engines share two CPU cores with everything else, so they keep generous limits.
CLOUD_STT, LOCAL_STT = 1.5, 10.0
CLOUD_LLM_FIRST_TOKEN, LOCAL_LLM_FIRST_TOKEN = 1.2, 5.0
CLOUD_LLM_STALL, LOCAL_LLM_STALL = 1.0, 3.0
# On top of the stage limits, a turn deadline: with cloud providers a failing stage gives up in
# time for the cached apology to be heard within this of the end of the caller's speech (the
# sum of the limits above allows up to 2 s). Not with offline engines: their normal turn is
# slower than this.
CLOUD_HEARD_WITHIN = 1.5
# Stream tokens carry their expiry in wall-clock time, checked on whichever instance the stream
# reaches: a call ends for want of a stream only this long after the last token could connect.
CLOCK_SKEW_S = 5.0

# Provider names (IVR_STT_PROVIDER, IVR_TTS_PROVIDER), built by each kind's room (ivr/stt/build.py,
# ivr/tts/build.py). A name not listed offline is a cloud provider, with cloud limits.
SttProviderName = Literal["local", "openai", "deepgram", "deepgram-flux", "openai-realtime"]
TtsProviderName = Literal["piper", "espeak", "openai", "cartesia", "elevenlabs"]
STREAMING_STT: frozenset[str] = frozenset({"deepgram", "deepgram-flux", "openai-realtime"})
STREAMING_TTS: frozenset[str] = frozenset({"cartesia", "elevenlabs"})
OFFLINE_STT: frozenset[str] = frozenset({"local"})
OFFLINE_TTS: frozenset[str] = frozenset({"piper", "espeak"})


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
    # None: the cloud or offline default above.
    llm_first_token_timeout: float | None = Field(None, gt=0)
    llm_stall_timeout: float | None = Field(None, gt=0)
    llm_timeout: float = Field(20.0, gt=0)
    # A second OpenAI-compatible endpoint tried when the first fails before answering.
    llm_fallback_base_url: str = ""
    llm_fallback_api_key: str = ""
    llm_fallback_model: str = ""
    """Empty: the primary's model name."""

    stt_provider: SttProviderName = "local"
    stt_base_url: str = "https://api.openai.com/v1"
    stt_api_key: str = ""
    stt_model: str = "whisper-1"
    stt_language: str = "en"
    stt_sample_rate: int = Field(8000, ge=8000, le=48000)
    """Rate of the WAV uploaded to an OpenAI-compatible STT. The line's own 8 kHz by default:
    upsampling adds nothing the server's own resampler would not, and cost a soxr pass over
    every utterance twice a turn (the speculated and the final transcript: ~0.9 ms of CPU a
    turn alone, ``bench/turn_audio_cost.py``). 16000 for a server that takes only 16 kHz WAV
    (whisper.cpp's without ``--convert``): one given 8 kHz fails every transcript, its own
    error message in the gateway's log."""
    stt_timeout: float | None = Field(None, gt=0)
    stt_fallback_base_url: str = ""
    stt_fallback_api_key: str = ""
    stt_fallback_model: str = ""
    # Offline whisper only: words callers are likely to say (business and menu words), given
    # to the decoder as its initial prompt; it fixes many misheard short answers.
    stt_prompt: str = ""

    # Streaming STT (IVR_STT_PROVIDER=deepgram | deepgram-flux | openai-realtime): one socket per
    # call, the caller's mu-law as it arrives. openai-realtime uses IVR_STT_API_KEY.
    deepgram_api_key: str = Field(
        "", validation_alias=AliasChoices("IVR_DEEPGRAM_API_KEY", "DEEPGRAM_API_KEY")
    )
    deepgram_url: str = "wss://api.deepgram.com"
    deepgram_model: str = "nova-3"
    deepgram_flux_model: str = "flux-general-en"
    # Flux: EagerEndOfTurn at this end-of-turn confidence (empty: off), EndOfTurn at eot.
    deepgram_eager_eot_threshold: float | None = Field(None, ge=0.3, le=0.9)
    deepgram_eot_threshold: float = Field(0.7, ge=0.5, le=1.0)
    deepgram_keyterms: str = ""
    """Comma-separated words to boost (Nova-3 and Flux keyterm prompting)."""
    stt_realtime_url: str = "wss://api.openai.com/v1/realtime"
    stt_realtime_model: str = "gpt-4o-transcribe"

    tts_provider: TtsProviderName = "piper"
    # Streaming TTS (IVR_TTS_PROVIDER=cartesia | elevenlabs): 8 kHz mu-law, no resampling.
    cartesia_api_key: str = Field(
        "", validation_alias=AliasChoices("IVR_CARTESIA_API_KEY", "CARTESIA_API_KEY")
    )
    cartesia_url: str = "wss://api.cartesia.ai/tts/websocket"
    cartesia_model: str = "sonic-2"
    cartesia_voice: str = ""
    elevenlabs_api_key: str = Field(
        "", validation_alias=AliasChoices("IVR_ELEVENLABS_API_KEY", "ELEVENLABS_API_KEY")
    )
    elevenlabs_url: str = "wss://api.elevenlabs.io"
    elevenlabs_model: str = "eleven_flash_v2_5"
    elevenlabs_voice: str = ""
    tts_base_url: str = "https://api.openai.com/v1"
    tts_api_key: str = ""
    tts_model: str = "tts-1"
    tts_voice: str = "alloy"
    tts_sample_rate: int = 24000
    tts_first_byte_timeout: float = Field(1.0, gt=0)
    tts_stall_timeout: float = Field(1.0, gt=0)
    tts_timeout: float = Field(10.0, gt=0)
    tts_fallback_base_url: str = ""
    tts_fallback_api_key: str = ""
    tts_fallback_model: str = ""
    tts_fallback_voice: str = ""

    # Silero (neural) ignores hiss and comfort noise that WebRTC's GMM hears as speech for
    # seconds after a turn. "silero" runs it only when a permissive WebRTC gate hears something
    # (ivr/audio/gated_vad.py), so listening to silence costs about what WebRTC alone costs.
    vad: Literal["silero", "webrtc"] = "silero"
    vad_mode: int = Field(2, ge=0, le=3)
    silero_threshold: float = Field(0.5, gt=0.0, lt=1.0)
    endpoint_silence_ms: int = Field(300, ge=60, le=5000)
    min_speech_ms: int = Field(100, ge=20, le=5000)
    # Speculative turns: after this much silence the caller's words so far are transcribed and
    # the reply requested while the endpoint silence still runs; kept if the turn ends on the
    # same words, thrown away (requests cancelled) if the caller goes on. 0 = off.
    speculate_after_ms: int = Field(60, ge=0, le=5000)
    # End of turn beyond silence: the words at a pause decide first ("my number is" waits, a
    # yes/no answer ends at once); when they don't, "smart-turn" asks the Smart Turn v3 audio
    # model (shipped in the pipecat-ai wheel, run off the event loop), which may lengthen the
    # wait. Off by default: on 8 kHz phone audio it called 3 of 5 finished questions unfinished
    # (bench/turn_taking.py), adding a second to those turns.
    turn_model: Literal["smart-turn", "off"] = "off"
    # How far ahead of Twilio's playout clock we keep audio queued: the sender wakes when only
    # the lead is left and tops it up by the refill in one go (fewer wake-ups under load); the
    # two bound what a `clear` discards.
    playout_lead_ms: int = Field(600, ge=100, le=2000)
    playout_refill_ms: int = Field(400, ge=0, le=2000)
    # Provider connections: when a caller begins to speak, every HTTP provider idle longer than
    # this gets a connection opened, so the turn's requests skip the TCP and TLS handshakes
    # (servers close idle ones: uvicorn and vLLM after 5 s). 0 = off.
    preconnect_idle_ms: int = Field(4000, ge=0, le=600_000)

    redis_url: str = ""
    redis_prefix: str = "ivr:"
    call_ttl_seconds: int = 86400
    resume_prompt: str = "Sorry, we had a brief technical problem. Let's continue."
    # None: CLOUD_HEARD_WITHIN when STT, TTS and the LLM are all cloud providers, else off;
    # 0: off.
    heard_within_ms: int | None = Field(None, ge=0, le=10_000)
    # Longest a call waits on Redis for one operation, in ms (a healthy Redis answers in ~1 ms);
    # past it the call goes on in degraded mode and the write is reconciled when Redis answers.
    redis_budget_ms: int = Field(150, ge=10, le=10_000)
    # Signs stream tokens so any instance checks them without Redis: the same on every instance.
    # Empty: derived from TWILIO_AUTH_TOKEN.
    stream_token_secret: str = ""
    # Seconds a stream token (and so a call waiting for its stream) is good for; a call whose
    # stream never connected by then (plus CLOCK_SKEW_S) ends as never_connected.
    stream_token_ttl_s: float = Field(120.0, ge=1, le=3600)
    # Seconds a call whose stream dropped waits for a new one before it ends as dropped; at
    # least a token's life longer than CLOCK_SKEW_S (a resumed stream may connect until then).
    resume_window_s: float = Field(150.0, ge=1, le=4 * 3600)

    # Admission (README: Operations). Concurrent calls this instance carries; 0 = unlimited.
    max_calls: int = Field(0, ge=0)
    # Median event-loop lag over the last 2 s above this (ms) = overloaded; 0 = never.
    max_loop_lag_ms: int = Field(100, ge=0)
    # Median of how late the calls' audio is taken up (last 2 s) above this (ms) = overloaded
    # too: /readyz unready, webhooks get the overflow (ivr.obs.backlog); 0 = never.
    max_inbound_backlog_ms: int = Field(250, ge=0)
    # What a new call hears when this instance cannot take it: a busy <Reject>, a <Dial> to
    # overflow_number, or a short apology and hang-up.
    overflow: Literal["reject", "redirect", "apology"] = "apology"
    overflow_number: str = ""
    # On SIGTERM: seconds to let (or move) calls finish before the process exits anyway.
    drain_seconds: float = Field(300.0, ge=0)
    # Seconds an idle HTTP connection stays open: above the idle timeout of the proxy in front,
    # which must close first (a request sent as we close is reset, not answered).
    http_keep_alive_s: int = Field(75, ge=1)
    # The event loop `ivr serve` runs on. uvloop (libuv) handles a socket event in about half
    # the CPU of asyncio's own loop, and a process carrying calls does little else
    # (bench/capacity.py); "asyncio" is there to rule the loop out when chasing a bug.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # What parses the media streams' WebSocket frames (ivr.media_server): "picows" (C, on the
    # same port, ~half the CPU per message of a listening call) or "asgi" (uvicorn + Starlette,
    # what any embedding ASGI server runs), to rule picows out when chasing a bug.
    media_server: Literal["picows", "asgi"] = "picows"

    flows_dir: str = "flows"
    admin_token: str = ""
    # A second admin token: with it, ?pii=true shows a call's numbers and texts unmasked.
    admin_pii_token: str = ""
    instance_id: str = ""

    # Call recording (flows say which calls): to a directory or an S3-compatible bucket.
    recording_dir: str = ""
    recording_s3_bucket: str = ""
    # An S3-compatible server (MinIO, Ceph, R2...); empty: AWS. Credentials: boto3's chain
    # (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, an instance role).
    recording_s3_url: str = ""
    recording_s3_prefix: str = "recordings/"
    recording_s3_region: str = "us-east-1"
    recording_format: Literal["flac", "opus"] = "flac"
    # Recordings older than this are deleted (at start and every hour); 0 = kept forever.
    recording_retention_days: float = Field(0.0, ge=0)
    # A call is recorded up to this long (its audio waits in memory, 16 kB/s, until it ends).
    recording_max_minutes: float = Field(60.0, gt=0, le=240)
    # Outbound calls (POST /calls, `ivr dial`): the caller ID (a Twilio number, E.164), and
    # Twilio's async answering machine detection on top of ours ("" = ours only).
    outbound_from: str = ""
    twilio_amd: Literal["", "Enable", "DetectMessageEnd"] = ""

    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    # Personal data in logs: off, `pii_*` values are redacted and phone/card numbers masked.
    log_pii: bool = False

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

    @model_validator(mode="after")
    def _one_recording_sink(self) -> Settings:
        if self.recording_dir and self.recording_s3_bucket:
            raise ValueError(
                "IVR_RECORDING_DIR and IVR_RECORDING_S3_BUCKET are both set: recordings go to "
                "one place, set only one of them"
            )
        return self

    @model_validator(mode="after")
    def _resume_window_outlives_a_token(self) -> Settings:
        least = self.stream_token_ttl_s + CLOCK_SKEW_S
        if self.resume_window_s < least:
            raise ValueError(
                f"IVR_RESUME_WINDOW_S={self.resume_window_s:g} is shorter than a stream token's "
                f"life: a resumed stream may connect until its token expires, so it must be at "
                f"least IVR_STREAM_TOKEN_TTL_S + {CLOCK_SKEW_S:g} = {least:g}"
            )
        return self

    @model_validator(mode="after")
    def _overflow_has_a_number(self) -> Settings:
        if self.overflow == "redirect" and not _E164.fullmatch(self.overflow_number):
            raise ValueError(
                "IVR_OVERFLOW=redirect needs IVR_OVERFLOW_NUMBER in E.164 form such as "
                f"+14155550100, got {self.overflow_number!r}"
            )
        return self

    @property
    def public_ws_base(self) -> str:
        """The wss:// (or ws:// for plain http) base that Twilio connects the stream to."""
        parts = urlsplit(self.public_url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return f"{scheme}://{parts.netloc}{parts.path}"

    @property
    def stt_answer_timeout(self) -> float:
        """IVR_STT_TIMEOUT, or the default for the configured engine."""
        if self.stt_timeout is not None:
            return self.stt_timeout
        return LOCAL_STT if self.stt_provider in OFFLINE_STT else CLOUD_STT

    @property
    def llm_first_token_limit(self) -> float:
        """IVR_LLM_FIRST_TOKEN_TIMEOUT, or the default for a cloud or the offline model."""
        if self.llm_first_token_timeout is not None:
            return self.llm_first_token_timeout
        return LOCAL_LLM_FIRST_TOKEN if self.use_local_llm else CLOUD_LLM_FIRST_TOKEN

    @property
    def llm_stall_limit(self) -> float:
        """IVR_LLM_STALL_TIMEOUT, or the default for a cloud or the offline model."""
        if self.llm_stall_timeout is not None:
            return self.llm_stall_timeout
        return LOCAL_LLM_STALL if self.use_local_llm else CLOUD_LLM_STALL

    @property
    def heard_within(self) -> float | None:
        """IVR_HEARD_WITHIN_MS in seconds, or the cloud default; None when off."""
        if self.heard_within_ms is not None:
            return self.heard_within_ms / 1000 or None
        cloud = self.stt_provider not in OFFLINE_STT and self.tts_provider not in OFFLINE_TTS
        return CLOUD_HEARD_WITHIN if cloud and not self.use_local_llm else None

    @property
    def use_local_llm(self) -> bool:
        if self.llm_provider != "auto":
            return self.llm_provider == "local"
        return not self.llm_api_key
