"""Twilio Media Streams wire protocol: the only module that sees Twilio's raw JSON.

Inbound text frames become typed messages (``parse_message``); outbound audio, marks and
clears are serialised here (``media_message`` & co). Signatures and TwiML live here too, so
everything that must match Twilio byte for byte is in one place.
"""

from __future__ import annotations

import binascii
import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from twilio.request_validator import RequestValidator
from twilio.twiml.voice_response import Connect, Dial, VoiceResponse

from ivr.errors import ProtocolError

# Twilio sends 20 ms (160 byte) frames; anything far larger is not audio we asked for.
MAX_MEDIA_BYTES = 8000
MAX_MESSAGE_CHARS = 64 * 1024


@dataclass(frozen=True, slots=True)
class Connected:
    protocol: str
    version: str


@dataclass(frozen=True, slots=True)
class Start:
    stream_sid: str
    call_sid: str
    account_sid: str
    custom_parameters: dict[str, str] = field(default_factory=dict)
    sequence: int = 0


@dataclass(frozen=True, slots=True)
class Media:
    payload: bytes
    """Raw mu-law 8 kHz bytes."""
    timestamp_ms: int
    chunk: int
    sequence: int


@dataclass(frozen=True, slots=True)
class Dtmf:
    digit: str
    sequence: int


@dataclass(frozen=True, slots=True)
class Mark:
    name: str
    sequence: int


@dataclass(frozen=True, slots=True)
class Stop:
    call_sid: str
    sequence: int


@dataclass(frozen=True, slots=True)
class Unknown:
    event: str


InboundMessage = Connected | Start | Media | Dtmf | Mark | Stop | Unknown

DTMF_DIGITS = frozenset("0123456789*#ABCD")


def parse_message(text: str | bytes) -> InboundMessage:
    """Parse one WebSocket text frame from Twilio; raise ``ProtocolError`` saying what is wrong."""
    if isinstance(text, bytes):
        raise ProtocolError("binary_frame", "Twilio sends text frames only")
    if len(text) > MAX_MESSAGE_CHARS:
        raise ProtocolError("oversized_frame", f"{len(text)} characters")
    try:
        # orjson: strict JSON (no NaN, Infinity or 1e999), nesting bounded at 1024 levels
        # without recursion, every failure a ValueError; a third of json's time a message.
        msg = orjson.loads(text)
    except ValueError as exc:
        raise ProtocolError("bad_json", str(exc)) from exc
    if not isinstance(msg, dict):
        raise ProtocolError("bad_json", "message is not a JSON object")
    event = msg.get("event")
    parser = _PARSERS.get(event) if isinstance(event, str) else None
    if parser is None:
        return Unknown(event=str(event)[:40])
    try:
        return parser(msg)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        # OverflowError: int() of an infinite float. orjson refuses 1e999 at parse; kept so
        # that a parser which lets one through still cannot end the stream.
        raise ProtocolError(f"bad_{event}", f"{type(exc).__name__}: {exc}") from exc


def _seq(msg: Mapping[str, Any]) -> int:
    return int(msg.get("sequenceNumber", 0))


def _parse_connected(msg: Mapping[str, Any]) -> Connected:
    return Connected(protocol=str(msg.get("protocol", "")), version=str(msg.get("version", "")))


def _parse_start(msg: Mapping[str, Any]) -> Start:
    start = msg["start"]
    params = start.get("customParameters") or {}
    if not isinstance(params, dict):
        raise TypeError("customParameters is not an object")
    fmt = start.get("mediaFormat") or {}
    if fmt and (fmt.get("encoding") != "audio/x-mulaw" or int(fmt.get("sampleRate", 8000)) != 8000):
        raise ValueError(f"unsupported mediaFormat {fmt}")
    stream_sid = str(start.get("streamSid") or msg["streamSid"])
    return Start(
        stream_sid=stream_sid,
        call_sid=str(start["callSid"]),
        account_sid=str(start.get("accountSid", "")),
        custom_parameters={str(k): str(v) for k, v in params.items()},
        sequence=_seq(msg),
    )


def _parse_media(msg: Mapping[str, Any]) -> Media:
    media = msg["media"]
    track = media.get("track", "inbound")
    if track != "inbound":
        raise ValueError(f"unexpected track {track!r}")
    encoded = media["payload"]
    if not isinstance(encoded, str):
        raise TypeError("payload is not a string")
    if len(encoded) > MAX_MEDIA_BYTES * 4 // 3 + 4:
        raise ValueError(f"payload of {len(encoded)} base64 chars exceeds {MAX_MEDIA_BYTES} bytes")
    try:  # strict: what b64decode(validate=True) checks, without its regex
        payload = binascii.a2b_base64(encoded, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"payload is not base64: {exc}") from exc
    if not payload:
        raise ValueError("empty payload")
    return Media(
        payload=payload,
        timestamp_ms=int(media.get("timestamp", 0)),
        chunk=int(media.get("chunk", 0)),
        sequence=_seq(msg),
    )


def _parse_dtmf(msg: Mapping[str, Any]) -> Dtmf:
    digit = str(msg["dtmf"]["digit"])
    if digit not in DTMF_DIGITS:
        raise ValueError(f"unknown DTMF digit {digit!r}")
    return Dtmf(digit=digit, sequence=_seq(msg))


def _parse_mark(msg: Mapping[str, Any]) -> Mark:
    return Mark(name=str(msg["mark"]["name"]), sequence=_seq(msg))


def _parse_stop(msg: Mapping[str, Any]) -> Stop:
    stop = msg.get("stop") or {}
    return Stop(call_sid=str(stop.get("callSid", "")), sequence=_seq(msg))


_PARSERS: dict[str, Callable[[Mapping[str, Any]], InboundMessage]] = {
    "connected": _parse_connected,
    "start": _parse_start,
    "media": _parse_media,
    "dtmf": _parse_dtmf,
    "mark": _parse_mark,
    "stop": _parse_stop,
}


# -- outbound -------------------------------------------------------------------------------


def media_message(stream_sid: str, ulaw: bytes) -> str:
    if not ulaw or len(ulaw) % 160:
        raise ValueError(f"outbound media must be whole 20 ms frames, got {len(ulaw)} bytes")
    # Formatted rather than json.dumps'd (every 100 ms of bot audio): base64 needs no
    # escaping, and the stream's part is escaped once per stream.
    payload = binascii.b2a_base64(ulaw, newline=False).decode("ascii")
    return f'{_media_head(stream_sid)}{payload}"}}}}'


@functools.lru_cache(maxsize=4096)
def _media_head(stream_sid: str) -> str:
    """A media message up to its payload, for ``stream_sid`` (one per live stream)."""
    return f'{{"event":"media","streamSid":{json.dumps(stream_sid)},"media":{{"payload":"'


def mark_message(stream_sid: str, name: str) -> str:
    return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def clear_message(stream_sid: str) -> str:
    return json.dumps({"event": "clear", "streamSid": stream_sid})


# -- TwiML ----------------------------------------------------------------------------------


def connect_stream_twiml(
    stream_url: str,
    action_url: str,
    parameters: Mapping[str, str],
    status_callback: str | None = None,
) -> str:
    """``<Connect action><Stream url statusCallback>`` with per-call ``<Parameter>``s (no query
    strings); the status callback gets stream-started, stream-stopped and stream-error."""
    response = VoiceResponse()
    connect = Connect(action=action_url, method="POST")
    callback = {"status_callback": status_callback, "status_callback_method": "POST"}
    stream = connect.stream(url=stream_url, **(callback if status_callback else {}))
    for name, value in parameters.items():
        stream.parameter(name=name, value=value)
    response.append(connect)
    return str(response.to_xml())


def dial_twiml(number: str, caller_id: str | None = None) -> str:
    response = VoiceResponse()
    dial = Dial(caller_id=caller_id) if caller_id else Dial()
    dial.number(number)
    response.append(dial)
    return str(response.to_xml())


def hangup_twiml() -> str:
    response = VoiceResponse()
    response.hangup()
    return str(response.to_xml())


def reject_twiml(message: str) -> str:
    response = VoiceResponse()
    response.say(message)
    response.hangup()
    return str(response.to_xml())


# -- signatures -----------------------------------------------------------------------------


class SignatureChecker:
    """Checks ``X-Twilio-Signature`` against URLs rebuilt from the configured public base URL."""

    def __init__(self, auth_token: str, public_url: str, public_ws_base: str) -> None:
        self._validator = RequestValidator(auth_token)
        self._public_url = public_url
        self._public_ws_base = public_ws_base

    def webhook_url(self, path: str, query: str = "") -> str:
        return self._public_url + path + (f"?{query}" if query else "")

    def stream_url(self, path: str) -> str:
        return self._public_ws_base + path

    def check_webhook(self, path: str, query: str, form: Mapping[str, str], signature: str) -> bool:
        url = self.webhook_url(path, query)
        return bool(self._validator.validate(url, dict(form), signature))

    def check_stream(self, path: str, signature: str) -> bool:
        return bool(self._validator.validate(self.stream_url(path), {}, signature))
