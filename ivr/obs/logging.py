"""structlog setup: JSON lines in production, a readable console in development.

Call context (call_sid, stream_sid) is bound with contextvars at the call boundary, so every
line a call writes carries it. Caller numbers, transcripts and digits go under ``pii_*`` keys;
unless ``log_pii`` (IVR_LOG_PII) allows personal data, ``PiiFilter`` redacts those and masks
phone and card numbers in every other value (``ivr.obs.pii``).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from ivr.obs.pii import PiiFilter


def configure_logging(
    fmt: str = "json", level: str = "info", *, log_pii: bool = False, stream: TextIO | None = None
) -> None:
    """``stream``: where lines go (default: ``sys.stderr``, looked up for every logger)."""
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=stream is None and sys.stderr.isatty())
    )
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.format_exc_info,  # before the filter: tracebacks quote values
    ]
    if not log_pii:
        processors.append(PiiFilter())
    structlog.configure(
        processors=[
            *processors,
            structlog.processors.TimeStamper(fmt="iso", utc=True),  # after: it is no number
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=_stderr_logger if stream is None else structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    if log_pii:
        structlog.get_logger("ivr.obs").warning(
            "logging.personal_data_enabled", setting="IVR_LOG_PII"
        )


def _stderr_logger(*_args: object) -> structlog.WriteLogger:
    # Look sys.stderr up per logger, not once: whoever swaps it (pytest, a supervisor) must not
    # leave us writing to a closed file. A line is one write: redirected, stderr is unbuffered,
    # and print() writes the text and its newline apart, so ``ivr serve --workers`` processes
    # sharing one stderr spliced each other's lines (a JSON line per event no more).
    return structlog.WriteLogger(file=sys.stderr)
