"""Twilio's signed HTTP requests to us (webhooks, ``<Connect action>``, status callbacks)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from starlette.requests import Request

from ivr.telephony.twilio import SignatureChecker

log = structlog.get_logger("ivr.webhook")


@dataclass(frozen=True, slots=True)
class StreamAuth:
    """Who may open a media stream."""

    signatures: SignatureChecker | None
    """Checks ``X-Twilio-Signature``; None when no auth token is configured."""
    allow_unsigned: bool = False
    """Development only: with no auth token, accept unsigned streams instead of refusing."""

    @property
    def accepts_unsigned(self) -> bool:
        return self.signatures is None and self.allow_unsigned


async def signed_form(request: Request, auth: StreamAuth) -> dict[str, str] | None:
    """The request's form when ``X-Twilio-Signature`` is valid for it (checked against the
    public URL, never the Host header); None when it is not."""
    form = {k: str(v) for k, v in (await request.form()).items()}
    if auth.signatures is None:
        return form if auth.accepts_unsigned else None
    signature = request.headers.get("x-twilio-signature", "")
    if auth.signatures.check_webhook(request.url.path, request.url.query, form, signature):
        return form
    log.warning(
        "webhook.bad_signature",
        url=auth.signatures.webhook_url(request.url.path, request.url.query),
        hint="IVR_PUBLIC_URL must be exactly the URL configured at Twilio",
    )
    return None
