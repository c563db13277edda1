"""One call of the echo scenario (issue 22), for the echo benchmark and the scenario tests.

The flow is one LLM agent with no greeting (``FLOW``; serve it as the default route). The
caller says ``LINE``, then stays silent (or, with ``talk_after_s``, interrupts for real that
long into the bot's reply: double talk) while the bot answers with ``REPLY``, five sentences
streamed as tokens, in real speech (``BotVoice``) streamed as 24 kHz PCM in 40 ms chunks at
``pace`` x real time. Twilio plays it on its frame clock and the caller's line carries it back
(``LineEcho``); the STT transcribes exactly what the line carried (``LineTranscriber``), so an
echo that gets through comes back as the bot's own words, and the bot answers itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ivr.audio.levels import active_level_db
from ivr.sim.caller import place_call
from ivr.sim.echo import LineEcho, LineRecord
from ivr.sim.playout import SAMPLE_RATE, LinkDelay
from ivr.sim.report import CallReport
from ivr.sim.script import script_from_data
from ivr.testing.bot_speech import BotVoice, SpeechCatalogue, caller_lines
from ivr.testing.line_stt import Heard, LineTranscriber
from ivr.testing.openai_server import ChatScript, FakeOpenAIServer, Fault
from ivr.testing.openai_wire import JsonDict

LINE = "Hi, can you tell me your opening hours and what a service costs?"
INTERRUPTION = "Sorry, can I talk to someone about my bill?"
REPLY = (
    "Of course. We are open from nine in the morning to six in the evening, Monday to Friday. "
    "On Saturdays we open at ten and close at four, and we are closed on Sundays. "
    "A basic service costs forty five dollars and takes about an hour. "
    "A full overhaul is one hundred and twenty dollars, and we keep the bike for two days."
)
FLOW = """
name: echo
start: agent
defaults: {no_input_timeout: 60}
nodes:
  agent:
    kind: agent
    system: You answer questions about a bike shop.
    max_turns: 50
    on_max_turns: bye
  bye: {kind: hangup}
"""
TTS_CHUNK_BYTES = 1920
"""40 ms of 24 kHz PCM16: what cloud TTS streams in."""
MISSED_AFTER_S = 3.0
"""No ``clear`` this long after the caller's onset: the interruption was missed."""

Pcm = npt.NDArray[np.float64]
_WORD_CHARS = str.maketrans({c: " " for c in ",.?!;:"})


def words(text: str) -> list[str]:
    return text.lower().translate(_WORD_CHARS).split()


def is_prefix(head: list[str], whole: list[str]) -> bool:
    """``head`` is a strict opening of ``whole``, word for word."""
    return len(head) < len(whole) and whole[: len(head)] == head


def is_own_words(text: str) -> bool:
    """Caller text made of the bot's reply (an echo transcribed), not of the caller's lines."""
    said = words(text)
    if not said:
        return False
    reply, caller = set(words(REPLY)), set(words(f"{LINE} {INTERRUPTION}"))
    in_reply = sum(w in reply for w in said) / len(said)
    in_caller = sum(w in caller for w in said) / len(said)
    return in_reply >= 0.6 and in_reply > in_caller


def user_text(request: JsonDict | None) -> str:
    """The last caller message of a chat request."""
    for message in reversed((request or {}).get("messages") or []):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


BACKGROUND_TALKERS = (
    ("en-us+m1", "The game went into overtime after a long and very even first half."),
    ("en-us+f2", "I told her we would meet at the station before the train left."),
    ("en-us+m4", "Prices at the market went up again this week for most vegetables."),
    ("en-us+f1", "Can you pass me the salt and the bread from the other table?"),
    ("en-gb-x-rp", "The minister said the new road will open by the end of the year."),
    ("en-us+m6", "We watched the whole series in one weekend and it was worth it."),
    ("en-us+f5", "Turn left at the lights and then keep going past the old church."),
    ("en-gb-scotland", "The forecast says rain in the north and sunshine further south."),
)
"""Eight talkers for babble (a café, a TV's crowd); the first alone is someone in the room."""


def background_voices(talkers: int) -> Pcm:
    """``talkers`` of ``BACKGROUND_TALKERS`` talking at once (each looped from its own start
    point), 8 kHz on the int16 scale: babble for 8, a voice across the room for 1."""
    import soxr

    from ivr.tts.espeak_local import synthesize_pcm16

    seconds = 8 * SAMPLE_RATE
    mix = np.zeros(seconds)
    for i, (voice, text) in enumerate(BACKGROUND_TALKERS[:talkers]):
        pcm, rate = synthesize_pcm16(text, voice=voice)
        x = soxr.resample(np.frombuffer(pcm, dtype="<i2").astype(np.float64), rate, SAMPLE_RATE)
        x = x / max(1.0, float(np.sqrt(np.mean(x * x))))
        mix += np.roll(np.resize(x, seconds), i * seconds // max(1, talkers))
    return mix


@dataclass(frozen=True, slots=True)
class Voices:
    """The bot's voice and the caller's, rendered once for any number of calls."""

    bot: BotVoice
    caller: SpeechCatalogue
    caller_speaks: Callable[[str], tuple[bytes, int]]

    def caller_level_dbfs(self) -> float:
        """The active speech level of the caller's line (as ``active_level_db`` measures)."""
        return active_level_db(self.caller.audio_of(LINE))

    @classmethod
    async def render(cls, bot_voice: str = "piper") -> Voices:
        from ivr.callio.sentences import SentenceChunker
        from ivr.tts.espeak_local import synthesize_pcm16

        chunker = SentenceChunker()  # the pieces the gateway will ask the TTS for
        bot = await BotVoice.render(chunker.push(REPLY) + chunker.flush(), voice=bot_voice)
        caller, speaks = caller_lines([LINE, INTERRUPTION], synthesize_pcm16)
        return cls(bot, caller, speaks)


@dataclass(slots=True)
class EchoCall:
    """What one call showed."""

    report: CallReport
    requests: list[str]
    """The caller text of every LLM request made during the call, in order."""
    heard: list[Heard]
    """What the line STT answered, in order."""
    false_clears: list[float]
    """``clear``s that reached the caller while they were silent (seconds into the call)."""
    first_pause_s: float | None
    """The first false ``clear``, from the first audio of the reply."""
    clear_latency_s: float | None
    """Double talk: the caller's onset (their clip's first frame queued) to the ``clear``."""

    @property
    def turns_taken(self) -> list[str]:
        """The caller texts the bot answered: ``requests`` less speculations the caller talked
        past (a request on the opening words of the request that followed it)."""
        return [
            text
            for text, after in zip(self.requests, [*self.requests[1:], None], strict=True)
            if after is None or not is_prefix(words(text), words(after))
        ]

    @property
    def own_requests(self) -> int:
        return sum(is_own_words(text) for text in self.requests)


async def echo_call(
    base_url: str,
    fake: FakeOpenAIServer,
    voices: Voices,
    *,
    auth_token: str,
    public_url: str,
    echo: LineEcho | None,
    frame_clock: bool = True,
    link: LinkDelay | None = None,
    pace: float = 4.0,
    talk_after_s: float | None = None,
    listen_s: float = 18.0,
    stt_delay_s: float = 0.15,
    llm_first_token_s: float = 0.14,
) -> EchoCall:
    """One call of the scenario against the gateway at ``base_url`` whose providers are
    ``fake`` (its scripts are set here)."""
    record = LineRecord()
    stt = LineTranscriber(record, voices.bot.catalogue, voices.caller)
    fake.transcribe = stt
    fake.speak = voices.bot.speak
    fake.speech_chunk_bytes = TTS_CHUNK_BYTES
    fake.speech_chunk_delay = TTS_CHUNK_BYTES / 48000 / pace
    reply = ChatScript(text=REPLY, first_token_delay=llm_first_token_s, token_delay=0.01)
    fake.chat = lambda request: reply
    fake.faults["transcriptions"] = Fault(delay=stt_delay_s)
    chats_before = len(fake.requests_for("chat"))
    steps: list[dict[str, object]] = [{"silence": 1.0}, {"say": LINE}]
    if talk_after_s is not None:
        steps.append({"barge_in": {"say": INTERRUPTION, "after": talk_after_s}})
    steps += [{"silence": listen_s}, {"hangup": None}]
    report = await place_call(
        base_url,
        script=script_from_data({"steps": steps, "wait_for_greeting": False}),
        auth_token=auth_token,
        public_base_url=public_url,
        echo=echo,
        frame_clock=frame_clock,
        link=link,
        line_record=record,
        synthesize=voices.caller_speaks,
    )
    requests = [user_text(r.json) for r in fake.requests_for("chat")[chats_before:]]
    return EchoCall(report, requests, list(stt.heard), *_clears(report))


def _clears(report: CallReport) -> tuple[list[float], float | None, float | None]:
    """(false clears, the first of them from the reply's first audio, double talk's clear
    latency)."""
    said = [t for t in report.turns if t.caller_text is not None]
    spoken = [(t.caller_start_t, t.caller_end_t + 1.0) for t in said]
    false = [c for c in report.clears if not any(a <= c <= b for a, b in spoken)]
    reply = next((t for t in report.turns if t.caller_text == LINE), None)
    start = reply.bot_first_audio_t if reply is not None else None
    first_pause = false[0] - start if false and start is not None else None
    latency = None
    talk = [t for t in said if t.caller_text == INTERRUPTION]
    if talk:
        onset = talk[0].caller_start_t
        later = [c - onset for c in report.clears if onset - 0.02 <= c <= onset + MISSED_AFTER_S]
        latency = min(later) if later else None
    return false, first_pause, latency
