"""The simulated caller: Twilio's voice webhook plus its Media Streams server, driven by a script.

``place_call`` does what Twilio does for one inbound call: signed voice webhook, ``<Connect>
<Stream>`` over WebSocket (signed handshake, ``connected``/``start``/real-time ``media``/``dtmf``/
``mark`` echoes/``stop``), then the signed ``<Connect action>`` request when the gateway closes
the stream, following a new ``<Connect><Stream>`` if that is what comes back. The Twilio side is
written from the protocol reference, not from the gateway's parser, so each checks the other.

All times in the report are seconds since the call was placed. The report types live in
``ivr.sim.report``, the HTTP side in ``ivr.sim.webhook``, the line and its Media Streams in
``ivr.sim.line``, the script runner in ``ivr.sim.script_runner``, the tally after the call in
``ivr.sim.call_summary``, the command line in ``ivr.sim.cli``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from ivr.sim.call_summary import Transcriber, finish_report
from ivr.sim.callbacks import TwilioCallbacks
from ivr.sim.echo import LineEcho, LineRecord
from ivr.sim.line import Line, MediaSession
from ivr.sim.playout import LinkDelay, Violation
from ivr.sim.report import CallReport, StreamReport, TurnReport
from ivr.sim.rest_api import FakeTwilioRestApi
from ivr.sim.script import Script, Synthesize, render_script, script_from_data
from ivr.sim.script_runner import run_script
from ivr.sim.webhook import (
    CallFailed,
    CallIds,
    StreamTwiml,
    TwilioSide,
    parse_stream,
    rebase,
)


@dataclass(frozen=True, slots=True)
class OutboundAnswer:
    """A call the gateway placed through the REST API, answered: what Twilio then requests."""

    call_sid: str
    url: str
    """The call's ``Url``: the TwiML for the answered call."""
    method: str = "POST"
    streaming: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the callee's audio starts reaching the gateway (its first stream starts): the
    moment the simulated callee starts talking, so what hears it (Twilio's AMD) starts then."""


@dataclass(frozen=True, slots=True)
class _FirstRequest:
    url: str
    status: str
    method: str = "POST"


async def place_call(
    http_base: str,
    *,
    script: Script | Sequence[str],
    auth_token: str,
    public_base_url: str | None = None,
    ws_base: str | None = None,
    from_: str = "+15550001111",
    to: str = "+15550002222",
    record_path: str | Path | None = None,
    transcriber: Transcriber | None = None,
    synthesize: Synthesize | None = None,
    comfort_noise: bool = False,
    open_timeout: float = 10.0,
    rest_api: FakeTwilioRestApi | None = None,
    echo: LineEcho | None = None,
    outbound: OutboundAnswer | None = None,
    call_status_url: str | None = None,
    frame_clock: bool = False,
    line_record: LineRecord | None = None,
    link: LinkDelay | None = None,
) -> CallReport:
    """Place one inbound call at the gateway and run ``script`` on it, in real time.

    With ``rest_api`` the call belongs to its account and can be updated through it (a REST
    redirect ends the stream with ``stop`` and its TwiML takes over, as on Twilio). With
    ``echo`` the line feeds the bot's own audio back (``ivr.sim.echo``). ``frame_clock``: the
    bot's audio plays on Twilio's 20 ms tick. ``line_record`` keeps what the line sent.
    ``link``: the gateway's messages reach Twilio's playout that much later. With
    ``outbound`` this is the callee of a call the gateway placed: Twilio asks the call's
    ``Url`` (not the voice webhook) once the callee has picked up, and ``script`` is the callee.
    With ``call_status_url`` (the number's status callback, a public URL) Twilio reports the
    call ``completed`` with its duration when it is over; streams whose TwiML asks for status
    callbacks get them either way (``ivr.sim.callbacks``).
    """
    script = script if isinstance(script, Script) else script_from_data(list(script))
    steps = await render_script(script, synthesize)
    ids, first = _call_ids(rest_api, outbound, from_, to)
    ws_base = ws_base or http_base.replace("https://", "wss://").replace("http://", "ws://")
    report = CallReport(ids.call_sid, ids.account_sid)
    line = _new_line(ids, rest_api, outbound, comfort_noise, echo, frame_clock, line_record, link)
    async with httpx.AsyncClient(timeout=10.0) as http:
        tw = TwilioSide(http, http_base, public_base_url or http_base, auth_token, ids)
        line.callbacks = TwilioCallbacks(tw, report, line.t0, call_status_url)
        runner = asyncio.create_task(run_script(line, steps, script))
        try:
            await _drive(line, tw, ws_base, report, open_timeout, first)
        except CallFailed as e:
            report.errors.append(str(e))
        finally:
            await _hang_up(line, runner, rest_api, ids.call_sid)
    report.rest_update_t = [line.rel(u.t) for u in line.rest_updates]
    await finish_report(line, report, record_path, transcriber)
    return report


def _call_ids(
    rest_api: FakeTwilioRestApi | None, outbound: OutboundAnswer | None, from_: str, to: str
) -> tuple[CallIds, _FirstRequest]:
    """The call's ids and Twilio's first request: the voice webhook, or an answered call's Url."""
    account_sid = rest_api.account_sid if rest_api else "AC" + secrets.token_hex(16)
    if outbound is None:
        ids = CallIds("CA" + secrets.token_hex(16), account_sid, from_, to)
        return ids, _FirstRequest("/twilio/voice", "ringing")
    ids = CallIds(outbound.call_sid, account_sid, from_, to, "outbound-api")
    return ids, _FirstRequest(outbound.url, "in-progress", outbound.method)


def _new_line(
    ids: CallIds,
    rest_api: FakeTwilioRestApi | None,
    outbound: OutboundAnswer | None,
    comfort_noise: bool,
    echo: LineEcho | None,
    frame_clock: bool,
    record: LineRecord | None,
    link: LinkDelay | None,
) -> Line:
    """The call's line, from now. With the REST stand-in the call is on its account: updates
    reach the line, and its conference rooms can hold the call."""
    line = Line(
        time.monotonic(),
        comfort_noise,
        echo,
        outbound.streaming if outbound else None,
        frame_clock=frame_clock,
        record=record,
        link=link,
    )
    if rest_api is not None:
        rest_api.add_call(ids.call_sid, from_=ids.from_, to=ids.to, control=line.on_rest_update)
        line.conference = rest_api.conference_host
    return line


async def _hang_up(
    line: Line, runner: asyncio.Task[None], rest_api: FakeTwilioRestApi | None, call_sid: str
) -> None:
    """The call is over: stop the script, end the call on the account, say so to the callbacks."""
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    if rest_api is not None:
        rest_api.end_call(call_sid)
    if line.callbacks is not None:
        line.callbacks.call_over("completed", round(line.rel(time.monotonic())))
        await line.callbacks.aclose()


async def _drive(
    line: Line,
    tw: TwilioSide,
    ws_base: str,
    report: CallReport,
    open_timeout: float,
    first: _FirstRequest,
) -> None:
    twiml = await tw.request(first.url, tw.params(first.status), first.method)
    closed_at: float | None = None
    while True:
        report.twiml.append(twiml)
        stream = parse_stream(twiml)
        if stream is None:
            back = await _hold_in_conference(line, tw, twiml)
            if back is not None:  # taken off a conference's hold by a REST redirect
                twiml = back
                continue
            report.closing_twiml = twiml
            return
        if line.hangup.is_set():
            return
        s = await _connect_stream(line, tw, stream, ws_base, report, open_timeout)
        if closed_at is not None and s.started_t:
            report.resume_gaps_s.append(s.started_t - closed_at)
        if s.ended_by == "caller":
            return
        if s.ended_by == "rest":
            next_twiml = await _after_rest_update(line, tw)
            if next_twiml is None:
                return
            twiml = next_twiml
            continue
        closed_at = s.ended_t  # both relative to the call start
        if stream.action is None:
            return  # no action: the call goes on to the next verb, of which there is none
        twiml = await tw.request(stream.action, tw.params("in-progress"), stream.method)


async def _hold_in_conference(line: Line, tw: TwilioSide, twiml: str) -> str | None:
    """Wait in the ``<Dial><Conference>`` of ``twiml`` (if the stand-in hosts rooms) until a
    REST redirect takes the call elsewhere: its TwiML. None: the call ended there."""
    if line.conference is None or "<Conference" not in twiml:
        return None
    how = await line.conference.hold(tw.ids.call_sid, twiml, line.redirected, line.hangup)
    return await _after_rest_update(line, tw) if how == "rest" else None


async def _after_rest_update(line: Line, tw: TwilioSide) -> str | None:
    """The TwiML a REST update put in charge (None: the update ended the call)."""
    update = line.rest_updates[-1]
    line.redirected.clear()
    if update.status == "completed":
        return None
    if update.twiml is not None:
        return update.twiml
    assert update.url is not None  # the fake REST API only accepts Twiml, Url or Status
    return await tw.request(update.url, tw.params("in-progress"), update.method)


async def _connect_stream(
    line: Line,
    tw: TwilioSide,
    stream: StreamTwiml,
    ws_base: str,
    report: CallReport,
    open_s: float,
) -> StreamReport:
    url = _check_stream_url(stream.url, line, report)
    info = StreamReport(stream.url, "", 0.0, custom_parameters=dict(stream.parameters))
    report.streams.append(info)
    # Twilio signs the wss:// URL it connects to, with no parameters.
    headers = {"X-Twilio-Signature": tw.validator.compute_signature(url, {})}
    outcome = "handshake-failed"
    try:
        async with connect(
            # Twilio does not negotiate permessage-deflate; neither does its stand-in.
            rebase(url, ws_base),
            additional_headers=headers,
            open_timeout=open_s,
            compression=None,
        ) as ws:
            session = MediaSession(line, ws, tw.ids, stream)
            info.stream_sid = session.sid
            try:
                outcome = await session.run()
            finally:
                info.started_t = line.rel(session.started_t) if session.started_t else 0.0
                if session.started_t and line.callbacks is not None:
                    line.callbacks.stream_event(stream, session.sid, "stream-stopped")
    except InvalidStatus as e:
        report.errors.append(f"31920 stream handshake to {url}: HTTP {e.response.status_code}")
        _stream_error(line, stream, f"31920 handshake: HTTP {e.response.status_code}")
    except (InvalidHandshake, OSError, TimeoutError) as e:
        report.errors.append(f"31920 stream handshake to {url} failed: {e!r}")
        _stream_error(line, stream, f"31920 handshake failed: {type(e).__name__}")
    info.ended_by = outcome
    info.ended_t = line.rel(time.monotonic())
    return info


def _stream_error(line: Line, stream: StreamTwiml, error: str) -> None:
    if line.callbacks is not None:  # a stream that never started has a sid all the same
        line.callbacks.stream_event(stream, "MZ" + secrets.token_hex(16), "stream-error", error)


def _check_stream_url(url: str, line: Line, report: CallReport) -> str:
    """Twilio only dials wss:// and drops query strings; flag both, connect like Twilio would."""
    parts = urlsplit(url)
    now = time.monotonic()
    if parts.scheme != "wss":
        reason = f"<Stream url> must be wss://, got {parts.scheme}://"
        report.violations.append(Violation(line.rel(now), "31922", reason, url))
    if parts.query:
        reason = "<Stream url> has a query string; Twilio does not deliver it"
        report.violations.append(Violation(line.rel(now), "stream-url-query", reason, url))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


__all__ = ["CallReport", "LineEcho", "StreamReport", "Transcriber", "TurnReport", "place_call"]
