"""What the simulated caller does: a list of steps, loaded from YAML or plain strings.

YAML (a list, or a mapping with ``steps`` and timing options)::

    turn_gap: 0.7          # bot turn is over after this much silence once it started
    max_wait: 10           # never wait longer than this for the bot
    steps:
      - "Hi, I'd like to check my balance"      # a plain string is a say step
      - say: "My account number is"
      - press: "1234#"
      - wav: recordings/noise.wav
      - silence: 2.5
      - barge_in: {say: "stop, stop", after: 0.8}
      - hangup:

Audio is rendered (TTS, WAV decode, resampling) before the call starts, so synthesis time never
shows up in measured latencies.
"""

from __future__ import annotations

import asyncio
import inspect
import wave
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
import soxr
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ivr.errors import IvrError
from ivr.sim.playout import FRAME_BYTES, SAMPLE_RATE, ULAW_SILENCE, ulaw_encode

Synthesize = Callable[[str], "tuple[bytes, int] | Awaitable[tuple[bytes, int]]"]
"""text -> (PCM16 mono bytes, sample rate); sync or async."""

_TRIM_LEVEL = 200  # about -44 dBFS: below this, leading/trailing samples count as silence
_TRIM_KEEP = 80  # 10 ms kept at each edge so onsets are not clipped


class ScriptError(IvrError):
    """A call script is invalid; the message names the file and step."""


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Say(_Step):
    kind: Literal["say"] = "say"
    say: str = Field(min_length=1)
    wait: bool = True
    """Wait for the bot to finish its turn before speaking."""


class Wav(_Step):
    kind: Literal["wav"] = "wav"
    wav: Path
    wait: bool = True


class Press(_Step):
    kind: Literal["press"] = "press"
    press: str = Field(pattern=r"^[0-9*#]+$")
    gap: float = Field(0.3, ge=0.05, le=5)
    """Seconds between keys."""
    wait: bool = True


class Silence(_Step):
    kind: Literal["silence"] = "silence"
    silence: float = Field(ge=0, le=600)


class BargeInSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    say: str | None = Field(None, min_length=1)
    wav: Path | None = None
    """Instead of ``say``: a recording (a cough, a door) played over the bot."""
    after: float = Field(0.8, ge=0, le=60)
    """Seconds into the bot's audio before the caller starts talking over it."""

    @model_validator(mode="after")
    def _one_source(self) -> BargeInSpec:
        if (self.say is None) == (self.wav is None):
            raise ValueError("barge_in needs exactly one of 'say' or 'wav'")
        return self


class BargeIn(_Step):
    kind: Literal["barge_in"] = "barge_in"
    barge_in: BargeInSpec


class Hangup(_Step):
    kind: Literal["hangup"] = "hangup"
    hangup: None = None


Step = Annotated[Say | Wav | Press | Silence | BargeIn | Hangup, Field(discriminator="kind")]


class Script(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    steps: list[Step] = Field(min_length=1)
    turn_gap: float = Field(0.7, gt=0, le=10)
    max_wait: float = Field(10.0, gt=0, le=300)
    wait_for_greeting: bool = True
    """Before the first step, let the bot's greeting finish (bounded by ``max_wait``)."""


_KINDS = ("say", "wav", "press", "silence", "barge_in", "hangup")


def _normalise_step(raw: object) -> object:
    """Plain strings are say steps; a mapping's step kind is whichever known key it has."""
    if isinstance(raw, str):
        return {"kind": "say", "say": raw}
    if isinstance(raw, dict):
        kinds = [k for k in _KINDS if k in raw]
        if len(kinds) == 1:
            return {"kind": kinds[0], **raw}
    return raw  # let validation explain what is wrong


def script_from_data(data: object, *, source: str = "<script>") -> Script:
    """Build a script from parsed YAML/JSON: a list of steps, or a mapping with ``steps``."""
    body: dict[str, Any] = {"steps": data} if isinstance(data, list) else {}
    if isinstance(data, dict):
        body = dict(data)
    elif not isinstance(data, list):
        raise ScriptError(f"{source}: expected a list of steps or a mapping with 'steps'")
    body["steps"] = [_normalise_step(s) for s in body.get("steps") or []]
    try:
        return Script.model_validate(body)
    except ValidationError as e:
        where = "; ".join(
            f"{source}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ScriptError(where) from e


def script_from_strings(lines: Sequence[str], **options: Any) -> Script:
    return script_from_data({"steps": list(lines), **options}, source="<strings>")


def load_script(path: str | Path) -> Script:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ScriptError(f"{path}: {e}") from e
    script = script_from_data(data, source=str(path))
    # WAV paths are relative to the script file, like includes in most tools.
    steps = [_relative_to(s, path.parent) for s in script.steps]
    return script.model_copy(update={"steps": steps})


def _relative_to(step: Step, base: Path) -> Step:
    if isinstance(step, Wav) and not step.wav.is_absolute():
        return step.model_copy(update={"wav": base / step.wav})
    wav = step.barge_in.wav if isinstance(step, BargeIn) else None
    if isinstance(step, BargeIn) and wav is not None and not wav.is_absolute():
        spec = step.barge_in.model_copy(update={"wav": base / wav})
        return step.model_copy(update={"barge_in": spec})
    return step


# -- audio rendering ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rendered:
    """A step with its caller audio ready to send (8 kHz mu-law, whole 20 ms frames)."""

    step: Say | Wav | Press | Silence | BargeIn | Hangup
    audio: bytes = b""

    @property
    def text(self) -> str | None:
        s = self.step
        if isinstance(s, Say):
            return s.say
        if isinstance(s, BargeIn):
            wav = s.barge_in.wav
            return s.barge_in.say if wav is None else f"[wav {wav.name}]"
        if isinstance(s, Wav):
            return f"[wav {s.wav.name}]"
        if isinstance(s, Press):
            return f"[keys {s.press}]"
        return None


def to_line_audio(pcm16: bytes, rate: int) -> bytes:
    """Mono PCM16 at ``rate`` -> trimmed, 8 kHz mu-law padded to whole frames."""
    x: npt.NDArray[np.int16] = np.frombuffer(pcm16, dtype="<i2")
    if rate != SAMPLE_RATE:
        x = soxr.resample(x, rate, SAMPLE_RATE)
    loud = np.flatnonzero(np.abs(x.astype(np.int32)) > _TRIM_LEVEL)
    if loud.size == 0:
        return b""
    x = x[max(0, loud[0] - _TRIM_KEEP) : loud[-1] + 1 + _TRIM_KEEP]
    ulaw = ulaw_encode(x.astype("<i2").tobytes())
    pad = -len(ulaw) % FRAME_BYTES
    return ulaw + bytes([ULAW_SILENCE]) * pad


def read_wav_mono(path: Path) -> tuple[bytes, int]:
    """Any 8/16/32-bit PCM WAV -> mono PCM16 bytes and its sample rate."""
    try:
        with wave.open(str(path), "rb") as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as e:
        raise ScriptError(f"{path}: cannot read WAV: {e}") from e
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.int32) - 128) << 8
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.int32)
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.int64) >> 16
    else:
        raise ScriptError(f"{path}: {8 * width}-bit WAV is not supported (use 8, 16 or 32-bit PCM)")
    mono = x.reshape(-1, channels).mean(axis=1)
    return mono.astype("<i2").tobytes(), rate


def default_synthesize(text: str) -> tuple[bytes, int]:
    """The offline espeak-ng voice (imported lazily: only say steps need it)."""
    from ivr.tts.espeak_local import synthesize_pcm16

    return synthesize_pcm16(text)


async def _synth(synthesize: Synthesize, text: str) -> bytes:
    result = await asyncio.to_thread(synthesize, text)
    if inspect.isawaitable(result):
        result = await result
    pcm, rate = result
    audio = to_line_audio(pcm, rate)
    if not audio:
        raise ScriptError(f"TTS produced no audible audio for {text!r}")
    return audio


async def _wav(path: Path) -> bytes:
    pcm, rate = await asyncio.to_thread(read_wav_mono, path)
    audio = to_line_audio(pcm, rate)
    if not audio:
        raise ScriptError(f"{path}: the WAV is silent")
    return audio


async def render_script(script: Script, synthesize: Synthesize | None = None) -> list[Rendered]:
    """Render every step's caller audio (TTS and WAV decoding run in worker threads)."""
    synth = synthesize or default_synthesize
    out: list[Rendered] = []
    for i, step in enumerate(script.steps):
        try:
            if isinstance(step, Say):
                out.append(Rendered(step, await _synth(synth, step.say)))
            elif isinstance(step, BargeIn) and step.barge_in.say is not None:
                out.append(Rendered(step, await _synth(synth, step.barge_in.say)))
            elif isinstance(step, BargeIn) and step.barge_in.wav is not None:
                out.append(Rendered(step, await _wav(step.barge_in.wav)))
            elif isinstance(step, Wav):
                out.append(Rendered(step, await _wav(step.wav)))
            else:
                out.append(Rendered(step))
        except ScriptError as e:
            raise ScriptError(f"step {i + 1} ({step.kind}): {e}") from e
    return out
