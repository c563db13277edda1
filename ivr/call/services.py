"""Everything a call's stream needs, wired once per process and handed to each stream.

``ivr.gateway.build_gateway`` builds one ``CallServices``; the stream handler and the call
session read only this object, never the settings or the gateway, so ``ivr.call`` depends on
nothing above it and a test can build a call from real parts in a few lines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ivr.audio.endpointer import Endpointer
from ivr.call.live import LiveCalls
from ivr.call.prompts import PromptCache
from ivr.call.turn_end import EndOfTurnDetector
from ivr.callio.io import CallIO
from ivr.control.connect import StreamConnector
from ivr.control.tokens import StreamTokens
from ivr.control.warm import WarmTransfers
from ivr.control.webhook_auth import StreamAuth
from ivr.recording.service import Recordings
from ivr.state.base import CallRecord, CallStore
from ivr.stt.base import SpeechToText, StreamingSpeechToText
from ivr.telephony.rest import TwilioRest
from ivr.tts.base import TextToSpeech


class Conversation(Protocol):
    """What a call does once its stream is up (the flow runner, bound to the call's flow)."""

    async def run(self, io: CallIO, record: CallRecord) -> None:
        """Drive the call through ``io`` until the flow ends; ``record`` is as last stored."""
        ...


@dataclass(frozen=True, slots=True)
class CallServices:
    """The per-process parts every call shares (read-only; one instance per gateway)."""

    instance_id: str
    """This instance's name in call records."""
    store: CallStore
    stt: SpeechToText
    tts: TextToSpeech
    llm_name: str
    """The LLM provider's label, for per-provider metrics."""
    prompts: PromptCache
    conversation: Conversation
    new_endpointer: Callable[[], Endpointer]
    """A fresh endpointer (with its own VAD) for one call; closed when the call ends."""
    playout_lead: float
    """Seconds of audio kept queued at Twilio ahead of its playout clock, at least."""
    playout_refill: float
    """Seconds the sender tops that up by in one wake-up (``AudioPlayer``)."""
    heard_within: float | None
    """When a provider fails, the apology is heard within this of the caller's end (None: off)."""
    auth: StreamAuth
    tokens: StreamTokens
    """Signs and checks the one-call tokens in stream URLs (any instance, no Redis needed)."""
    connector: StreamConnector
    """Builds the ``<Connect><Stream>`` TwiML for a call (webhook, resume, planned move)."""
    live: LiveCalls
    """The streams this process carries now (admission counts them, a drain moves them)."""
    rest: TwilioRest | None = None
    """Twilio's REST API (transfers by call update), when credentials are configured."""
    warm: WarmTransfers | None = None
    """Warm transfers (conference, briefed agent); None without REST credentials."""
    recordings: Recordings | None = None
    """Saves the recordings of calls whose record says so; None when no sink is configured."""
    turn_model: EndOfTurnDetector | None = None
    """The process's audio end-of-turn model (None: turns end on words and silence alone)."""
    preconnect: Callable[[], None] | None = None
    """Opens connections to the providers that have been idle (called as a caller begins to
    speak: the turn's requests then find them open); None: off."""
    streaming_stt: StreamingSpeechToText | None = None
    """A streaming STT (``IVR_STT_PROVIDER=deepgram`` ...): each call opens one session on it
    at ``start`` and ``stt`` only serves what is not a call (None: ``stt`` hears the calls)."""
