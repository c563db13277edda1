"""The ivr command as an operator meets it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

FLOWS = Path(__file__).parent.parent / "flows"


def run_ivr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ivr.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_serve_refuses_to_start_on_a_broken_flow_and_says_where(tmp_path: Path) -> None:
    flows = tmp_path / "flows"
    shutil.copytree(FLOWS, flows)
    support = flows / "support.yaml"
    support.write_text(support.read_text().replace("next: main_menu", "next: main_menuu", 1))
    result = run_ivr("serve", "--port", "1", env={"IVR_FLOWS_DIR": str(flows)})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{support}:" in result.stderr and "did you mean 'main_menu'" in result.stderr


def test_invalid_settings_are_reported_without_a_traceback() -> None:
    result = run_ivr("serve", env={"IVR_PUBLIC_URL": "gw.example.com"})
    assert result.returncode == 2
    assert "IVR_PUBLIC_URL must be an absolute" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_command() -> None:
    result = run_ivr("--help")
    assert result.returncode == 0
    for command in ("serve", "demo", "call", "flows", "calls"):
        assert command in result.stdout
