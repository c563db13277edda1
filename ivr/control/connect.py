"""The ``<Connect action><Stream>`` TwiML that puts a call on a media stream, and what a stream
that lands on an instance without the call's record can rebuild from it.

Every stream Twilio opens for us comes from here: the voice webhook's first stream, the
``<Connect action>``'s resumed stream, and the drain's planned move (a REST redirect). The
stream URL carries a signed one-use token (``ivr.control.tokens``); the ``<Parameter>``s carry
what an instance needs to carry a call it has no record of (Redis unreachable): the numbers and
the pinned flow. The action URL's query carries the flow and the stream count, so the action
request can be answered without the record too. Every stream asks for Twilio's status callback,
the only place Twilio says why a stream failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode

from ivr.control.tokens import StreamTokens, issue
from ivr.state.base import CallRecord, CallStatus, CallStore
from ivr.telephony import twilio
from ivr.telephony.twilio import Start

ACTION_PATH = "/twilio/after-stream"
STREAM_PATH = "/twilio/stream/"
STREAM_STATUS_PATH = "/twilio/stream-status"
"""Twilio's ``<Stream statusCallback>``: stream-started, -stopped, -error (``status_callbacks``)."""
MAX_PARAMETER_CHARS = 200
"""Longest ``<Parameter>`` value we take from a ``start`` (ours are far shorter)."""


@dataclass(frozen=True, slots=True)
class CallParams:
    """What travels with a stream: enough to carry the call without its stored record."""

    call_sid: str
    from_number: str = ""
    to_number: str = ""
    flow_name: str = ""
    flow_version: str = ""
    streams: int = 0
    """Streams counted against the resume limit so far."""

    @classmethod
    def of(cls, record: CallRecord) -> CallParams:
        return cls(
            record.call_sid,
            record.from_number,
            record.to_number,
            record.flow_name,
            record.flow_version,
            record.stream_count,
        )


class StreamConnector:
    """Builds the TwiML that connects a call to a new stream through the public URL (so the
    load balancer picks the instance)."""

    def __init__(
        self, tokens: StreamTokens, store: CallStore, public_url: str, public_ws_base: str
    ) -> None:
        self.tokens = tokens
        self._store = store
        self._public_url = public_url
        self._public_ws_base = public_ws_base

    async def twiml(self, call: CallParams, *, planned: bool = False) -> str:
        """``<Connect action><Stream>`` for ``call`` with a fresh token; ``planned`` marks a
        move (the call resumes without an apology and the stream does not count)."""
        token = await issue(self.tokens, self._store, call.call_sid, planned)
        query = urlencode(
            {"flow": call.flow_name, "version": call.flow_version, "streams": call.streams}
        )
        return twilio.connect_stream_twiml(
            stream_url=f"{self._public_ws_base}{STREAM_PATH}{token}",
            action_url=f"{self._public_url}{ACTION_PATH}?{query}",
            status_callback=f"{self._public_url}{STREAM_STATUS_PATH}",
            parameters={
                "CallSid": call.call_sid,
                "From": call.from_number,
                "To": call.to_number,
                "FlowName": call.flow_name,
                "FlowVersion": call.flow_version,
            },
        )


def record_from_start(start: Start, instance_id: str) -> CallRecord:
    """A call record rebuilt from a stream's ``start``: what this instance knows of a call whose
    stored record it cannot read. The flow starts from its beginning."""
    params = {k: v[:MAX_PARAMETER_CHARS] for k, v in start.custom_parameters.items()}
    return CallRecord(
        call_sid=start.call_sid,
        account_sid=start.account_sid,
        from_number=params.get("From", ""),
        to_number=params.get("To", ""),
        flow_name=params.get("FlowName", ""),
        flow_version=params.get("FlowVersion", ""),
        status=CallStatus.RINGING,
        instance_id=instance_id,
    )
