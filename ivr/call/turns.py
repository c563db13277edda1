"""Per-turn latency bookkeeping: where the time between the caller's last word and our first
audio went, so the gateway's own share can be told apart from providers and endpointing."""

from __future__ import annotations

from dataclasses import dataclass

from ivr.obs import metrics


@dataclass(slots=True)
class TurnTimings:
    """Wall-clock (monotonic) instants of one turn; ``None`` where the stage did not run."""

    speech_end: float
    """When the caller actually stopped speaking (last voiced frame)."""
    endpoint: float
    """When the endpointer decided the turn was over (speech_end + silence window)."""
    stt_start: float | None = None
    stt_end: float | None = None
    llm_start: float | None = None
    llm_first_token: float | None = None
    first_clause: float | None = None
    """When the first sentence/clause was complete and went to TTS."""
    tts_start: float | None = None
    tts_first_byte: float | None = None
    first_audio: float | None = None
    """When the first bot audio of the reply was sent to Twilio."""
    first_heard: float | None = None
    """When Twilio started playing the reply: the echo of a mark placed after its first 20 ms
    frame, less that frame (the echo's own trip back is included, a few ms)."""
    cached_prompt: bool = False

    def breakdown(self) -> dict[str, float]:
        """Seconds per stage, plus ``gateway`` = what remains once providers are subtracted."""
        out: dict[str, float] = {"endpoint_silence": self.endpoint - self.speech_end}
        if self.stt_start is not None and self.stt_end is not None:
            out["stt"] = self.stt_end - self.stt_start
        if self.llm_start is not None and self.llm_first_token is not None:
            out["llm_ttft"] = self.llm_first_token - self.llm_start
        if self.llm_start is not None and self.first_clause is not None:
            out["llm_first_clause"] = self.first_clause - self.llm_start
        if self.tts_start is not None and self.tts_first_byte is not None:
            out["tts_ttfb"] = self.tts_first_byte - self.tts_start
        if self.first_audio is not None:
            total = self.first_audio - self.speech_end
            out["total"] = total
            providers = (
                out["endpoint_silence"]
                + out.get("stt", 0.0)
                + out.get("llm_first_clause", 0.0)
                + out.get("tts_ttfb", 0.0)
            )
            out["gateway"] = max(0.0, total - providers)
        return out

    def observe(self) -> dict[str, float]:
        parts = self.breakdown()
        if "total" in parts:
            metrics.TURN_LATENCY.observe(parts["total"])
            metrics.GATEWAY_OVERHEAD.observe(parts["gateway"])
        return parts

    def heard(self, at: float, parts: dict[str, float]) -> None:
        """The reply started playing at the caller at ``at``: add ``heard`` to ``parts``."""
        if self.first_heard is not None:
            return
        self.first_heard = at
        parts["heard"] = max(0.0, at - self.speech_end)
        metrics.TURN_HEARD_LATENCY.observe(parts["heard"])


@dataclass(slots=True)
class CallStats:
    """Counts for one call's stream, for its summary log line."""

    barge_ins: int = 0
    provider_errors: int = 0
