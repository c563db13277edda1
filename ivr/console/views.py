"""What the console shows of a call record: summaries for lists, and one call in detail.

Everything here is a pure function of a ``CallRecord``; masking follows the admin API (numbers
masked, and phone- or card-like text anywhere, unless ``pii``).

The record keeps what the caller heard (``history``, bot text cut at a barge-in), one latency
breakdown per answered turn (``turns``, see ``ivr.call.turns.TurnTimings.breakdown``) and its
timeline (``timeline``: key presses, barge-ins, node changes; ``ivr.callio.timeline``). A bot line
is shown as cut off when a barge-in on the timeline heard exactly it (with the words the
caller did not hear, which the barge-in also keeps), or when it stops
mid-sentence and the caller spoke next (records written before the timeline existed). Key
presses are shown only to the PII token; others see one ``*`` per key.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from typing import Any

from ivr.obs.pii import mask_speech
from ivr.state import outcomes
from ivr.state.base import CallRecord, mask

STAGES: tuple[tuple[str, str, float], ...] = (
    ("endpoint_silence", "endpoint silence", 0.6),
    ("stt", "STT", 0.5),
    ("llm_ttft", "LLM first token", 0.6),
    ("llm_first_clause", "first sentence", 0.9),
    ("tts_ttfb", "TTS first byte", 0.4),
    ("gateway", "gateway", 0.05),
    ("heard", "heard", 1.8),
)
"""(key in the turn record, label, seconds above which the stage counts as slow)."""
TOTAL_SLOW = 1.5
"""End of caller speech to first bot audio sent: above this a turn counts as slow."""
_SENTENCE_END = (".", "!", "?", "…", '"', "'", ")")


def outcome_of(record: CallRecord) -> str:
    """How the call ended (``ivr.state.outcomes``, the same word as ``call.ended`` and
    ``ivr_calls_total``), or ``live``. Records of the previous version are read too."""
    ended = outcomes.outcome_of(record)
    return ended.value if ended is not None else "live"


def summary(record: CallRecord, *, pii: bool) -> dict[str, Any]:
    """One row of the active or ended list."""
    number = (lambda n: n) if pii else mask
    ended = outcomes.outcome_of(record)
    return {
        "call_sid": record.call_sid,
        "caller": number(record.from_number),
        "called": number(record.to_number),
        "flow": record.flow_name,
        "node": record.node or "",
        "status": str(record.status),
        "outcome": ended.value if ended is not None else "live",
        "outcome_meaning": outcomes.MEANING[ended] if ended is not None else "in progress",
        "twilio_status": record.twilio_status,
        "billed_s": record.billed_seconds,
        "instance": record.instance_id or "",
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
        "ended_at": record.ended_at.isoformat() if record.ended_at else None,
        "duration_s": _duration(record),
        "turns": len(record.turns),
        "recordings": len(record.recordings),
        "version": record.version,
    }


def detail(record: CallRecord, *, pii: bool, events: list[dict[str, Any]]) -> dict[str, Any]:
    """One call: its summary, transcript as heard, latency waterfall per turn, and events."""
    view = record.view(pii=pii)
    out = summary(record, pii=pii)
    barged = {
        _heard(e.get("heard")): _heard(e.get("unheard"))
        for e in record.timeline
        if e.get("kind") == "barge_in" and e.get("heard")
    }
    out["transcript"] = transcript(view, barged)
    out["waterfall"] = [waterfall(turn) for turn in record.turns]
    out["totals"] = totals(record.turns)
    out["transfer_to"] = view.get("transfer_to") or ""
    out["end_action"] = record.end_action
    out["events"] = timeline_events(record, events, pii=pii)
    return out


def timeline_events(
    record: CallRecord, seen: list[dict[str, Any]], *, pii: bool
) -> list[dict[str, Any]]:
    """The record's timeline and what the console saw (``seen``), oldest first. Node changes
    come from the record when it has them (every instance writes them), else from ``seen``."""
    kept = [_timeline_event(e, pii) for e in record.timeline]
    if any(e.get("kind") == "node" for e in record.timeline):
        seen = [e for e in seen if e.get("kind") not in ("node", "seen")]
    merged = kept + [_masked_event(e, pii) for e in seen]
    return sorted(merged, key=lambda e: str(e.get("at", "")))


def transcript(view: dict[str, Any], barged: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Caller and bot lines (the bot's as heard) and tool calls, in order; a bot line whose
    text a barge-in heard (``barged``: heard text, as ``_heard`` keeps it, to the words that
    were not heard) is cut, and carries those words as ``unheard``."""
    barged = barged or {}
    flow_history = view.get("flow_state", {}).get("history")
    items: list[dict[str, Any]] = flow_history or view.get("history") or []
    lines: list[dict[str, Any]] = []
    for item in items:
        role, text = item.get("role"), item.get("content") or ""
        if role == "user" and text:
            lines.append({"who": "caller", "text": text})
        elif role == "assistant":
            if text:
                cut = bool(item.get("interrupted")) or _heard(text) in barged
                line = {"who": "bot", "text": text, "cut": cut}
                if barged.get(_heard(text)):
                    line["unheard"] = barged[_heard(text)]
                lines.append(line)
            for call in item.get("tool_calls") or []:
                lines.append({"who": "tool", "text": f"{call['name']}({call['arguments']})"})
        elif role == "tool":
            lines.append({"who": "tool_result", "text": text})
    for line, after in itertools.pairwise(lines):
        if line["who"] == "bot" and after["who"] == "caller" and _stops_mid_sentence(line["text"]):
            line["cut"] = True
    return lines


def waterfall(turn: dict[str, Any]) -> dict[str, Any]:
    """One turn's stages laid out from the end of caller speech (seconds), slow ones flagged.

    Sequential stages follow each other; "first sentence" starts with the LLM (it includes
    the first token); "gateway" is what remains before the first audio was sent; "heard" spans
    the whole wait, to when the caller heard it (Twilio's queue and the network included).
    """
    value = {key: float(v) for key, v in turn.items() if isinstance(v, int | float)}
    llm_at = value.get("endpoint_silence", 0.0) + value.get("stt", 0.0)
    tts_at = llm_at + value.get("llm_first_clause", value.get("llm_ttft", 0.0))
    gateway_at = tts_at + value.get("tts_ttfb", 0.0)
    total = value.get("total")
    starts = {
        "endpoint_silence": 0.0,
        "stt": value.get("endpoint_silence", 0.0),
        "llm_ttft": llm_at,
        "llm_first_clause": llm_at,
        "tts_ttfb": tts_at,
        "gateway": gateway_at,
        "heard": 0.0,  # drawn whole, under the stages: what the caller waited in all
    }
    stages = []
    for key, label, slow in STAGES:
        if key not in value:
            continue
        length = value[key]
        stages.append(
            {
                "key": key,
                "label": label,
                "start": round(starts[key], 4),
                "length": round(max(0.0, length), 4),
                "seconds": round(value[key], 4),
                "slow": value[key] > slow,
            }
        )
    return {
        "stages": stages,
        "total": round(total, 4) if total is not None else None,
        "heard": round(value["heard"], 4) if "heard" in value else None,
        "slow": total is not None and total > TOTAL_SLOW,
    }


def totals(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage across the call: mean and worst (seconds), and the turn count."""
    out: dict[str, Any] = {"turns": len(turns)}
    for key in [k for k, _, _ in STAGES] + ["total"]:
        values = [float(t[key]) for t in turns if isinstance(t.get(key), int | float)]
        if values:
            out[key] = {"mean": round(sum(values) / len(values), 4), "max": round(max(values), 4)}
    return out


def matches(row: dict[str, Any], query: str, flow: str, outcome: str, date: str) -> bool:
    """The ended-call search: ``query`` in the sid, numbers (as shown), flow, node or outcome;
    ``flow``/``outcome`` exact; ``date`` (YYYY-MM-DD, UTC) the day the call ended."""
    if flow and row["flow"] != flow:
        return False
    if outcome and row["outcome"] != outcome:
        return False
    if date and not (row["ended_at"] or "").startswith(date):
        return False
    if not query:
        return True
    fields = ("call_sid", "caller", "called", "flow", "node", "outcome")
    haystack = " ".join(str(row[f]) for f in fields).lower()
    return query.lower() in haystack


def _duration(record: CallRecord) -> float:
    end = record.ended_at or datetime.now(UTC)
    return round(max(0.0, (end - record.created_at).total_seconds()), 1)


def _stops_mid_sentence(text: str) -> bool:
    return not text.rstrip().endswith(_SENTENCE_END)


def _heard(text: object) -> str:
    return mask_speech(str(text or "")).strip()


def _timeline_event(event: dict[str, Any], pii: bool) -> dict[str, Any]:
    shown = dict(event)
    if not pii and shown.get("kind") == "dtmf":
        shown["digits"] = "*" * len(str(shown.get("digits", "")))
    for key in ("heard", "unheard"):
        if not pii and key in shown:
            shown[key] = mask_speech(str(shown[key]))
    return shown


def _masked_event(event: dict[str, Any], pii: bool) -> dict[str, Any]:
    if pii or "number" not in event:
        return event
    return {**event, "number": mask(str(event["number"]))}
