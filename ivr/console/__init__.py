"""The live call console at ``/console``: active calls, one call's transcript and latency
waterfall as it happens, and the ended calls. Reads the shared call store; never writes it."""

from ivr.console.routes import console_router

__all__ = ["console_router"]
