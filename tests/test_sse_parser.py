"""Server-sent events taken from whatever pieces the socket hands over (``SseParser``).

The adapters' own tests (``test_openai_providers.py``) read real HTTP streams; these cut one
stream at every byte, which a real socket only does by chance.
"""

from __future__ import annotations

import json

import pytest

from ivr.providers.openai_http import MAX_SSE_LINE, SseParser, StreamErrorEvent

STREAM = (
    b": a comment\r\n\r\n"
    b'data: {"n": 1}\n\n'
    b"event: message\r\n"
    b'data: {"n":\r\n'
    b"data: 2}\r\n\r\n"
    b'data: {"n": 3, "text": "caf\xc3\xa9"}\n\n'
    b"data: [DONE]\n\n"
    b'data: {"n": 4}\n\n'
)
EVENTS = [{"n": 1}, {"n": 2}, {"n": 3, "text": "café"}]


def parse(pieces: list[bytes]) -> list[object]:
    parser = SseParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    events += parser.finish()
    assert parser.error is None
    return events


def test_a_stream_cut_anywhere_gives_the_same_events_and_stops_at_done() -> None:
    assert parse([STREAM]) == EVENTS
    for cut in range(1, len(STREAM)):
        assert parse([STREAM[:cut], STREAM[cut:]]) == EVENTS, cut
    assert parse([STREAM[i : i + 1] for i in range(len(STREAM))]) == EVENTS


def test_the_last_event_counts_without_its_blank_line_or_newline() -> None:
    assert parse([b'data: {"n": 1}\n\ndata: {"n": 2}']) == [{"n": 1}, {"n": 2}]
    assert parse([b'data: {"n": 1}\n']) == [{"n": 1}]


def test_the_events_before_an_error_are_handed_over_and_nothing_after_it() -> None:
    parser = SseParser()
    error = b'event: error\ndata: {"error": {"message": "overloaded"}}\n\n'
    assert parser.feed(b'data: {"n": 1}\n\n' + error + b'data: {"n": 2}\n\n') == [{"n": 1}]
    assert isinstance(parser.error, StreamErrorEvent) and "overloaded" in str(parser.error)
    assert parser.feed(b'data: {"n": 3}\n\n') == [] and parser.finish() == []


def test_data_that_is_not_json_is_the_streams_error() -> None:
    parser = SseParser()
    assert parser.feed(b'data: {"n": 1}\n\ndata: {"n": \n\n') == [{"n": 1}]
    assert isinstance(parser.error, json.JSONDecodeError)


@pytest.mark.parametrize("pieces", [1, 64])
def test_a_line_that_never_ends_is_refused_once_it_is_too_long(pieces: int) -> None:
    parser = SseParser()
    piece = b"data: " + b"x" * (MAX_SSE_LINE // pieces)
    for _ in range(pieces):
        parser.feed(piece)
    assert isinstance(parser.error, ValueError) and "longer than" in str(parser.error)
