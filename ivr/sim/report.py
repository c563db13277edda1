"""What a simulated call reports: turns with latency as the caller heard it, streams, marks,
clears, protocol violations and the TwiML Twilio received. Times are seconds since the call was
placed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ivr.sim.playout import Violation


@dataclass(slots=True)
class TurnReport:
    caller_text: str | None
    """What the caller said/pressed; None for the bot's greeting."""
    caller_start_t: float
    caller_end_t: float
    """End of caller speech (greeting: when the stream started)."""
    bot_first_audio_t: float | None = None
    latency_s: float | None = None
    """caller_end_t -> first bot sample played at the caller."""
    bot_audio_seconds: float = 0.0
    bot_audio_end_t: float | None = None
    """When the last bot audio of this turn finished playing."""
    interrupted: bool = False
    """A ``clear`` arrived during this bot turn."""
    bot_text: str | None = None


@dataclass(slots=True)
class StreamReport:
    url: str
    stream_sid: str
    started_t: float
    ended_t: float = 0.0
    ended_by: str = ""
    """``caller`` (stop sent), ``gateway`` (it closed the socket), ``rest`` (a REST update
    replaced the TwiML: stop sent) or ``handshake-failed``."""
    custom_parameters: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class CallReport:
    call_sid: str
    account_sid: str
    turns: list[TurnReport] = field(default_factory=list)
    streams: list[StreamReport] = field(default_factory=list)
    marks_echoed: int = 0
    marks_cleared: int = 0
    clears: list[float] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    twiml: list[str] = field(default_factory=list)
    """Every TwiML document received: voice webhook first, then each action response."""
    closing_twiml: str | None = None
    resume_gaps_s: list[float] = field(default_factory=list)
    """Gateway closed a stream -> the next stream started (when the action resumed the call)."""
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    rest_update_t: list[float] = field(default_factory=list)
    """When each REST update of this call reached the fake REST API."""
    bot_audio_s: float = 0.0
    """All the bot audio the caller heard (played, not cleared), in seconds."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format_transcript(self) -> str:
        lines = [f"call {self.call_sid}  ({self.duration_s:.1f} s)"]
        for s in self.streams:
            lines.append(f"{s.started_t:7.2f}  stream {s.stream_sid} ({s.url})")
        for t in self.turns:
            if t.caller_text is not None:
                lines.append(f"{t.caller_start_t:7.2f}  CALLER  {t.caller_text}")
            lines.append(bot_line(t))
        for s in self.streams:
            lines.append(f"{s.ended_t:7.2f}  stream {s.stream_sid} ended by {s.ended_by}")
        if self.resume_gaps_s:
            lines.append("resume gaps: " + ", ".join(f"{g:.2f} s" for g in self.resume_gaps_s))
        lines.append(f"closing TwiML: {self.closing_twiml or '(none)'}")
        lines.append(
            f"marks echoed {self.marks_echoed} ({self.marks_cleared} by clear), "
            f"clears {len(self.clears)}, protocol violations {len(self.violations)}"
        )
        lines += [f"  violation {v.t:.2f} {v.code}: {v.reason}" for v in self.violations]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def bot_line(t: TurnReport) -> str:
    if t.bot_first_audio_t is None:
        return f"{t.caller_end_t:7.2f}  BOT     (no audio)"
    said = f'  "{t.bot_text}"' if t.bot_text else ""
    cut = "  [interrupted]" if t.interrupted else ""
    return (
        f"{t.bot_first_audio_t:7.2f}  BOT     {t.bot_audio_seconds:.2f} s audio, "
        f"latency {t.latency_s:.3f} s{cut}{said}"
    )
