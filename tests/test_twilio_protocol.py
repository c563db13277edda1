"""The Twilio wire protocol module: parsing, serialising, TwiML and signatures."""

from __future__ import annotations

import base64
import json
import xml.etree.ElementTree as ET

import pytest
from twilio.request_validator import RequestValidator

from ivr.errors import ProtocolError
from ivr.telephony import twilio
from ivr.telephony.twilio import Dtmf, Mark, Media, Start, Stop, Unknown


def media_json(payload: bytes, seq: int = 3) -> str:
    return json.dumps(
        {
            "event": "media",
            "sequenceNumber": str(seq),
            "media": {
                "track": "inbound",
                "chunk": "2",
                "timestamp": "40",
                "payload": base64.b64encode(payload).decode(),
            },
            "streamSid": "MZ1",
        }
    )


def test_start_message_is_parsed_with_custom_parameters() -> None:
    raw = json.dumps(
        {
            "event": "start",
            "sequenceNumber": "1",
            "start": {
                "accountSid": "AC1",
                "streamSid": "MZ1",
                "callSid": "CA1",
                "tracks": ["inbound"],
                "customParameters": {"From": "+15550001111"},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            },
            "streamSid": "MZ1",
        }
    )
    message = twilio.parse_message(raw)
    assert message == Start("MZ1", "CA1", "AC1", {"From": "+15550001111"}, 1)


def test_media_payload_is_decoded_from_base64() -> None:
    message = twilio.parse_message(media_json(b"\x7f" * 160))
    assert isinstance(message, Media)
    assert message.payload == b"\x7f" * 160
    assert message.timestamp_ms == 40 and message.chunk == 2 and message.sequence == 3


def test_dtmf_mark_and_stop_are_parsed() -> None:
    dtmf = {
        "event": "dtmf",
        "sequenceNumber": "5",
        "dtmf": {"track": "inbound_track", "digit": "#"},
    }
    assert twilio.parse_message(json.dumps(dtmf)) == Dtmf("#", 5)
    mark = {"event": "mark", "sequenceNumber": "6", "mark": {"name": "g1:2"}}
    assert twilio.parse_message(json.dumps(mark)) == Mark("g1:2", 6)
    stop = {"event": "stop", "sequenceNumber": "7", "stop": {"callSid": "CA1"}}
    assert twilio.parse_message(json.dumps(stop)) == Stop("CA1", 7)


def test_unknown_events_are_returned_not_raised() -> None:
    assert twilio.parse_message('{"event": "hello"}') == Unknown("hello")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("{not json", "bad_json"),
        ("[1, 2]", "bad_json"),
        (b"\x00\x01", "binary_frame"),
        ('{"event": "media", "media": {"payload": "@@@@"}}', "bad_media"),
        ('{"event": "media", "media": {"payload": ""}}', "bad_media"),
        ('{"event": "media", "media": {"payload": 5}}', "bad_media"),
        ('{"event": "media"}', "bad_media"),
        ('{"event": "dtmf", "dtmf": {"digit": "x"}}', "bad_dtmf"),
        ('{"event": "start", "start": {"streamSid": "MZ"}}', "bad_start"),
        ('{"event": "mark", "mark": {}}', "bad_mark"),
        ('{"event": "media", "sequenceNumber": "x", "media": {"payload": "AA=="}}', "bad_media"),
        ("x" * (twilio.MAX_MESSAGE_CHARS + 1), "oversized_frame"),
        # A number that is infinite as a double (int() cannot take it: it once killed the
        # receive loop) is refused as JSON, like Infinity and NaN.
        ('{"event": "media", "sequenceNumber": 1e999, "media": {"payload": "AA=="}}', "bad_json"),
        # A lone surrogate escaped is no text (it could never be encoded to log or store).
        ('{"event": "media", "media": {"payload": "AA=="}, "streamSid": "\\ud800"}', "bad_json"),
        ('{"event": "media", "media": {"payload": "AA==", "timestamp": Infinity}}', "bad_json"),
        ('{"event": "mark", "sequenceNumber": NaN, "mark": {"name": "g0:1"}}', "bad_json"),
        # Nested deeper than the parser allows (a RecursionError once ended the stream).
        ('{"event": "media", "x": ' + "[" * 30_000 + "]" * 30_000 + "}", "bad_json"),
    ],
)
def test_malformed_input_raises_protocol_error_naming_the_reason(
    raw: str | bytes, reason: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        twilio.parse_message(raw)
    assert info.value.reason == reason


def test_oversized_media_payload_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        twilio.parse_message(media_json(b"\xff" * (twilio.MAX_MEDIA_BYTES + 160)))


def test_outbound_messages_have_exactly_twilios_shape() -> None:
    media = json.loads(twilio.media_message("MZ9", b"\xff" * 320))
    assert media == {
        "event": "media",
        "streamSid": "MZ9",
        "media": {"payload": base64.b64encode(b"\xff" * 320).decode()},
    }
    assert json.loads(twilio.mark_message("MZ9", "g0:1")) == {
        "event": "mark",
        "streamSid": "MZ9",
        "mark": {"name": "g0:1"},
    }
    assert json.loads(twilio.clear_message("MZ9")) == {"event": "clear", "streamSid": "MZ9"}


def test_outbound_media_must_be_whole_frames() -> None:
    with pytest.raises(ValueError, match="20 ms"):
        twilio.media_message("MZ9", b"\xff" * 100)


def test_connect_stream_twiml_carries_parameters_and_action() -> None:
    xml = twilio.connect_stream_twiml(
        "wss://gw.example.com/twilio/stream/tok",
        "https://gw.example.com/twilio/after-stream",
        {"CallSid": "CA1", "From": "+1555&<>"},
    )
    root = ET.fromstring(xml)
    connect = root.find("Connect")
    assert connect is not None
    assert connect.get("action") == "https://gw.example.com/twilio/after-stream"
    stream = connect.find("Stream")
    assert stream is not None and stream.get("url") == "wss://gw.example.com/twilio/stream/tok"
    params = {p.get("name"): p.get("value") for p in stream.findall("Parameter")}
    assert params == {"CallSid": "CA1", "From": "+1555&<>"}


def test_dial_twiml_dials_the_number() -> None:
    root = ET.fromstring(twilio.dial_twiml("+15551234567"))
    number = root.find("Dial/Number")
    assert number is not None and number.text == "+15551234567"


def test_twilio_published_signature_vector_validates() -> None:
    # twilio-python's own unit test vector (token 12345).
    checker = twilio.SignatureChecker("12345", "https://mycompany.com", "wss://mycompany.com")
    params = {
        "CallSid": "CA1234567890ABCDE",
        "Caller": "+14158675309",
        "Digits": "1234",
        "From": "+14158675309",
        "To": "+18005551212",
    }
    assert checker.check_webhook(
        "/myapp.php", "foo=1&bar=2", params, "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    )
    assert not checker.check_webhook(
        "/myapp.php", "foo=1&bar=3", params, "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    )


def test_stream_signature_is_over_the_wss_url_not_https() -> None:
    checker = twilio.SignatureChecker("tok", "https://gw.example.com", "wss://gw.example.com")
    validator = RequestValidator("tok")
    good = validator.compute_signature("wss://gw.example.com/twilio/stream/abc", {})
    https = validator.compute_signature("https://gw.example.com/twilio/stream/abc", {})
    assert checker.check_stream("/twilio/stream/abc", good)
    assert not checker.check_stream("/twilio/stream/abc", https)
    assert not checker.check_stream("/twilio/stream/abd", good)
