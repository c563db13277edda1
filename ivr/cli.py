"""The ``ivr`` command: serve, call, demo, flows, calls, dial."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from ivr.errors import IvrError


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["call"]:
        # The simulated caller owns its (long) option list.
        from ivr.sim.cli import run_cli

        return run_cli(args_list[1:])
    parser = argparse.ArgumentParser(prog="ivr", description="Telephony voice-AI gateway")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway (FastAPI under uvicorn)")
    serve.add_argument("--host", help="bind address (default IVR_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default IVR_PORT or 8080)")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes sharing the port (SO_REUSEPORT), e.g. one per core; "
        "more than 1 needs IVR_REDIS_URL",
    )
    serve.set_defaults(handler=_serve)

    demo = commands.add_parser(
        "demo", help="start the gateway offline and place one simulated call to it"
    )
    demo.add_argument(
        "--say",
        action="append",
        help="caller line (repeatable): speak these to the general assistant (flows/default.yaml) "
        "instead of the Harbor Bikes call (flows/demo.yaml)",
    )
    demo.add_argument("--record", default="demo-call.wav", help="save what the bot said here")
    demo.add_argument("--tts", choices=["piper", "espeak"], default=None)
    demo.set_defaults(handler=_demo)

    commands.add_parser(
        "call", help="place a simulated Twilio call at a gateway (ivr call --help)", add_help=False
    )
    _add_plugin_commands(commands)
    args = parser.parse_args(args_list)
    if args.command not in ("serve",):
        from ivr.obs.logging import configure_logging

        configure_logging("console", "warning")  # tools print results; logs only for trouble
    try:
        handler = getattr(args, "handler", None) or args.func
        result: int = handler(args)
    except ValidationError as exc:
        print(f"ivr: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    except IvrError as exc:  # e.g. flows that do not validate: say what and where, no traceback
        print(f"ivr: cannot start: {type(exc).__name__}:\n{exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result


def _add_plugin_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ivr.flowtools.cli import add_commands as add_flow_commands
    from ivr.outbound.cli import add_commands as add_dial_commands
    from ivr.state.cli import add_commands as add_store_commands

    add_flow_commands(commands)
    add_dial_commands(commands)
    add_store_commands(commands)


def _serve(args: argparse.Namespace) -> int:
    from ivr.server import run_serving, serve, serve_workers

    if args.workers != 1:
        return serve_workers(args.workers, host=args.host, port=args.port)
    return run_serving(serve(host=args.host, port=args.port))


def _demo(args: argparse.Namespace) -> int:
    from ivr.demo import run_demo

    return asyncio.run(run_demo(lines=args.say, record=args.record, tts=args.tts))


if __name__ == "__main__":
    raise SystemExit(main())
