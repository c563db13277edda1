"""Whether a media stream may connect.

The handshake is refused (close 1008, which Twilio sees as a 403) unless the signature over the
``wss://`` URL is valid and the per-call token in the path was minted by a webhook
(``ivr.control.tokens``); the stream's ``start`` must then name the same CallSid. A draining
instance answers 503 instead, so that a load balancer may retry elsewhere with the token unspent.
"""

from __future__ import annotations

import structlog

from ivr.control.tokens import StreamClaims, StreamTokens, TokenRefused, admit
from ivr.control.webhook_auth import StreamAuth
from ivr.obs import metrics
from ivr.state.base import CallStore, StoreError
from ivr.telephony.media_socket import MediaSocket

log = structlog.get_logger("ivr.stream")

POLICY_VIOLATION = 1008


async def authorise_stream(
    ws: MediaSocket,
    token: str,
    *,
    auth: StreamAuth,
    tokens: StreamTokens,
    store: CallStore,
    draining: bool,
) -> StreamClaims | None:
    """The token's claims when the stream may connect; None when it was refused (and closed)."""
    signatures = auth.signatures
    if signatures is not None:
        if not signatures.check_stream(ws.path, ws.header("x-twilio-signature")):
            log.warning("stream.bad_signature", url=signatures.stream_url(ws.path))
            metrics.PROTOCOL_ERRORS.labels("bad_signature").inc()
            await ws.close(POLICY_VIOLATION)
            return None
    elif not auth.accepts_unsigned:
        await ws.close(POLICY_VIOLATION)
        return None
    if draining:
        # Not 403: a load balancer may retry a 503 on another instance, with the token unspent.
        log.info("stream.refused_draining")
        await ws.refuse(503, "draining")
        return None
    try:
        return await admit(tokens, store, token)
    except TokenRefused as exc:
        log.warning("stream.token_refused", reason=exc.reason, detail=str(exc))
        metrics.PROTOCOL_ERRORS.labels(exc.reason).inc()
    except StoreError as exc:  # not StoreUnavailable (the store degrades instead): a bug
        log.error("stream.token_store_failed", error=repr(exc))
    await ws.close(POLICY_VIOLATION)
    return None
