"""A simulated Twilio caller: voice webhook + Media Streams, for driving the gateway offline."""

from ivr.sim.caller import CallReport, TurnReport, place_call
from ivr.sim.cli import run_cli
from ivr.sim.playout import TwilioPlayout
from ivr.sim.script import Script, ScriptError, load_script, script_from_strings

__all__ = [
    "CallReport",
    "Script",
    "ScriptError",
    "TurnReport",
    "TwilioPlayout",
    "load_script",
    "place_call",
    "run_cli",
    "script_from_strings",
]
