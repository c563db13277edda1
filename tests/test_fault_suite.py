"""Provider fault suite (issue 8), the CI share: one fault of each kind (status, payload, reset,
timeout) per stage (STT, LLM, TTS), each on a real call, and the issue's targets for each.

The calls run exactly as in ``bench/faults.py`` (tests/fault_calls.py): real ``ivr serve``
processes, a few side by side, against ``FakeOpenAIServer``s; the fault hits every request of
one stage during the second of three caller turns. All calls run once per module; each test
below checks one target over every case, so a known miss is marked on that target alone.

The measured table is saved to test-artifacts/fault-suite.txt.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from fault_calls import (
    HEARD_WITHIN_S,
    MAX_DEAD_AIR_S,
    FaultCase,
    FaultResult,
    run_cases,
    subset_cases,
)
from gateway_procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = subset_cases()
LANES = 4
"""Gateways running calls side by side: 12 calls of ~15 s in ~1 min on 2 cores."""
ARTIFACTS = REPO / "test-artifacts"

ANSWER_FOR = {
    "stt": {"not-understood", "reply"},
    "llm": {"apology", "error prompt", "reply"},
    "tts": {"apology", "reply"},
}
"""What the caller may hear on the faulted turn, per stage: the re-ask prompt when speech
recognition fails; the gateway's apology or the flow's error prompt when the model fails; the
pre-synthesised apology when the voice fails; or a whole reply when a retry saved the turn."""

KNOWN_MISSES: dict[tuple[str, str], str] = {}
"""(case, target) pairs that miss today, with the measured numbers: strict xfails, so a fix
shows up as XPASS and fails the run until the entry is removed."""
TARGETS = ("injected", "heard", "answered", "dead_air", "next_turn", "counted")


def case_id(case: FaultCase) -> str:
    return re.sub(r"[^a-z0-9]+", "-", case.label.lower()).strip("-")


def cases_for(target: str) -> list[object]:
    assert target in TARGETS, target
    return [
        pytest.param(
            case,
            id=case_id(case),
            marks=(
                [pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[case.label, target])]
                if (case.label, target) in KNOWN_MISSES
                else []
            ),
        )
        for case in CASES
    ]


def test_known_misses_name_real_cases() -> None:
    labels = {c.label for c in CASES}
    assert all(label in labels and target in TARGETS for label, target in KNOWN_MISSES)


# -- the calls, once for the module ---------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FaultResult]:
    workdir = tmp_path_factory.mktemp("fault-suite")  # gateway logs and call recordings
    done = asyncio.run(run_cases(CASES, workdir, lanes=LANES))
    save_table(done, workdir)
    return {r.fault: r for r in done}


def save_table(done: list[FaultResult], workdir: Path) -> Path:
    lines = [f"{'fault':32} {'heard after':>11}  {'dead air':>8}  {'next':4}  heard / counted"]
    for r in done:
        after = "never" if r.heard_after_s is None else f"{r.heard_after_s:.2f} s"
        counted = ", ".join(f"{k} {v:g}" for k, v in sorted(r.counted.items())) or "-"
        lines.append(
            f"{r.fault:32} {after:>11}  {r.dead_air_s:6.2f} s  {'yes' if r.next_turn else 'NO':4}"
            f"  {r.heard} / {counted}" + (f"  MISS: {'; '.join(r.misses)}" if r.misses else "")
        )
    lines.append(f"(recordings and gateway logs: {workdir})")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / ".gitignore").write_text("*\n")  # the directory ignores itself
    path = ARTIFACTS / "fault-suite.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def result_of(results: dict[str, FaultResult], case: FaultCase) -> FaultResult:
    return results[case.label]


def about(r: FaultResult) -> str:
    """What the call measured, for assertion messages."""
    first = ", ".join("-" if t is None else f"{t:.2f}" for t in r.turn_first_audio_s)
    return (
        f"{r.fault}: heard {r.heard!r}, first audio per turn [{first}] s, "
        f"dead air {r.dead_air_s:.2f} s (turn {r.dead_air_turn}), counted {r.counted}, "
        f"misses {r.misses}"
    )


# -- issue 8's targets, one test each -------------------------------------------------------------


@pytest.mark.parametrize("case", cases_for("injected"))
def test_the_fault_hit_the_stage_and_the_call_ran_clean(
    results: dict[str, FaultResult], case: FaultCase
) -> None:
    r = result_of(results, case)
    assert r.faulted_requests >= 1, f"the fault was never served: {about(r)}"
    assert not r.errors, about(r)


@pytest.mark.parametrize("case", cases_for("heard"))
def test_the_caller_hears_an_answer_in_time(
    results: dict[str, FaultResult], case: FaultCase
) -> None:
    r = result_of(results, case)
    assert r.heard_after_s is not None, f"no bot audio on the faulted turn: {about(r)}"
    assert r.heard_after_s <= HEARD_WITHIN_S, about(r)


@pytest.mark.parametrize("case", cases_for("answered"))
def test_what_the_caller_hears_answers_them(
    results: dict[str, FaultResult], case: FaultCase
) -> None:
    r = result_of(results, case)
    assert r.answered, about(r)
    heard = set(r.heard.split(" + "))
    assert heard & ANSWER_FOR[case.stage], f"expected one of {ANSWER_FOR[case.stage]}: {about(r)}"


@pytest.mark.parametrize("case", cases_for("dead_air"))
def test_no_dead_air_over_two_seconds(results: dict[str, FaultResult], case: FaultCase) -> None:
    r = result_of(results, case)
    assert r.dead_air_s <= MAX_DEAD_AIR_S, about(r)


@pytest.mark.parametrize("case", cases_for("next_turn"))
def test_the_next_turn_is_answered_normally(
    results: dict[str, FaultResult], case: FaultCase
) -> None:
    r = result_of(results, case)
    assert r.next_turn, about(r)


@pytest.mark.parametrize("case", cases_for("counted"))
def test_the_fault_is_counted_by_stage_and_kind(
    results: dict[str, FaultResult], case: FaultCase
) -> None:
    r = result_of(results, case)
    assert r.counted_as(case.stage, case.kind) >= 1, (
        f"not counted as {case.stage}/{case.kind} in ivr_provider_errors_total: {about(r)}"
    )
