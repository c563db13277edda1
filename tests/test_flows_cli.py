"""`ivr flows ...` as an operator runs it: a subprocess, its output and its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def flows_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ivr.flowtools.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


BAD = "name: bad\nstart: a\nnodes:\n  a:\n    kind: say\n    text: hi\n    next: nowhere\n"


def test_validate_passes_on_the_example_flows() -> None:
    result = flows_cli("validate", str(ROOT / "flows"))
    assert result.returncode == 0, result.stdout + result.stderr
    flows = len([p for p in (ROOT / "flows").glob("*.yaml") if p.name != "routes.yaml"])
    assert f"{flows} flow file(s) checked" in result.stdout and ": ok" in result.stdout


def test_validate_fails_with_file_line_and_column(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(BAD)
    result = flows_cli("validate", str(tmp_path))
    assert result.returncode == 1
    assert (
        f"{tmp_path / 'bad.yaml'}:7:11: error: unknown target 'nowhere' in node 'a'"
        in result.stdout
    )


def test_validate_json_lists_the_problems(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(BAD)
    result = flows_cli("validate", "--json", str(tmp_path / "bad.yaml"))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["files"] == 1
    assert {(p["line"], p["column"]) for p in report["problems"]} == {(7, 11)}


def test_schema_is_a_json_schema_with_every_node_kind() -> None:
    result = flows_cli("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    kinds = {
        d["properties"]["kind"]["const"]
        for d in schema["$defs"].values()
        if "kind" in d.get("properties", {})
    }
    assert kinds == {
        "say",
        "ask",
        "menu",
        "agent",
        "branch",
        "set",
        "http",
        "transfer",
        "hangup",
        "goto",
        "subflow",
        "return",
    }


def test_graph_draws_mermaid_and_dot() -> None:
    mermaid = flows_cli("graph", "support", "--dir", str(ROOT / "flows"))
    assert mermaid.returncode == 0
    assert 'n_main_menu -- "balance / 1" --> n_ask_account' in mermaid.stdout
    dot = flows_cli("graph", str(ROOT / "flows" / "support.yaml"), "--format", "dot")
    assert '"lookup" -> "lookup_failed" [label="on_error"];' in dot.stdout


def test_the_example_conversation_tests_pass() -> None:
    result = flows_cli("test", str(ROOT / "flows"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout


def test_a_failing_conversation_test_fails_the_command_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "f.yaml").write_text(
        BAD.replace("nowhere", "b") + "  b:\n    kind: hangup\n    say: Bye.\n"
    )
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "f_test.yaml").write_text(
        "flow: f\ntests:\n  - name: says hi\n    steps:\n      - {bot_says: hello, ended: hangup}\n"
    )
    result = flows_cli("test", str(tmp_path))
    assert result.returncode == 1
    assert (
        f"{tests / 'f_test.yaml'}:5:9: expected the bot to say 'hello'; it said 'hi Bye.'"
        in result.stdout
    )
