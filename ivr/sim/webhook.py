"""Twilio's HTTP side of a call: the signed voice webhook and <Connect action> requests, and
reading the <Connect><Stream> out of the TwiML that comes back."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx
from twilio.request_validator import RequestValidator


@dataclass(frozen=True, slots=True)
class CallIds:
    call_sid: str
    account_sid: str
    from_: str
    to: str
    direction: str = "inbound"
    """``outbound-api`` for a call placed through the REST API."""


@dataclass(frozen=True, slots=True)
class StreamTwiml:
    url: str
    parameters: dict[str, str]
    action: str | None
    method: str
    status_callback: str | None = None
    """``<Stream statusCallback>``: where Twilio reports stream-started/-stopped/-error."""


class TwilioSide:
    """Signed HTTP requests to the gateway, addressed by public URL, sent to the real one."""

    def __init__(
        self, http: httpx.AsyncClient, http_base: str, public_base: str, token: str, ids: CallIds
    ) -> None:
        self.http = http
        self.http_base = http_base.rstrip("/")
        self.public_base = public_base.rstrip("/")
        self.validator = RequestValidator(token)
        self.ids = ids

    def params(self, status: str) -> dict[str, str]:
        i = self.ids
        return {
            "AccountSid": i.account_sid,
            "ApiVersion": "2010-04-01",
            "CallSid": i.call_sid,
            "CallStatus": status,
            "Called": i.to,
            "Caller": i.from_,
            "Direction": i.direction,
            "From": i.from_,
            "To": i.to,
        }

    async def request(
        self,
        public_url: str,
        params: dict[str, str],
        method: str = "POST",
        expect: tuple[int, ...] = (200,),
    ) -> str:
        public_url = urljoin(self.public_base + "/", public_url)
        if method.upper() == "GET":
            public_url += ("&" if "?" in public_url else "?") + str(httpx.QueryParams(params))
            params = {}
        sig = self.validator.compute_signature(public_url, params)
        real = rebase(public_url, self.http_base)
        resp = await self.http.request(
            method.upper(), real, data=params or None, headers={"X-Twilio-Signature": sig}
        )
        if resp.status_code not in expect:
            raise CallFailed(f"{method} {public_url} -> HTTP {resp.status_code}: {resp.text[:200]}")
        return resp.text


class CallFailed(Exception):
    """Twilio would play its 'application error' message here (11200) and hang up."""


def rebase(public_url: str, real_base: str) -> str:
    p, r = urlsplit(public_url), urlsplit(real_base)
    return urlunsplit((r.scheme, r.netloc, p.path, p.query, ""))


def parse_stream(twiml: str) -> StreamTwiml | None:
    try:
        root = ET.fromstring(twiml)
    except ET.ParseError as e:
        raise CallFailed(f"TwiML is not XML: {e}") from e
    if root.tag != "Response":
        raise CallFailed(f"TwiML root is <{root.tag}>, not <Response>")
    for conn in root.iter("Connect"):
        st = conn.find("Stream")
        if st is None or not st.get("url"):
            continue
        params = {p.get("name", ""): p.get("value", "") for p in st.findall("Parameter")}
        return StreamTwiml(
            st.get("url", ""),
            params,
            conn.get("action"),
            conn.get("method", "POST"),
            st.get("statusCallback"),
        )
    return None
