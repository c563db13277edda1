"""The size-bar ratchet (scripts/size_bars.py): what it measures and what fails it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _bars() -> ModuleType:
    spec = importlib.util.spec_from_file_location("size_bars", ROOT / "scripts" / "size_bars.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["size_bars"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _function(name: str, lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}() -> None:\n{body}"


def test_each_bar_is_measured_at_its_edge(tmp_path: Path) -> None:
    bars = _bars()
    methods = "".join(_function(f"m{i}", 2, "    ") for i in range(26))
    source = (
        _function("fits", 60)
        + _function("too_long", 61)
        + "class Fits:\n"
        + "".join(_function(f"m{i}", 2, "    ") for i in range(25))
        + "class Crowded:\n"
        + methods
        + "try:\n"
        + _function("hidden", 61, "    ")
        + "except ImportError:\n    pass\n"
        + "# a line\n" * 250
    )
    module = tmp_path / "pkg" / "mod.py"
    module.parent.mkdir()
    module.write_text(source)
    found = {(v.kind, v.name, v.size) for v in bars.measure(module, tmp_path)}
    lines = len(source.splitlines())
    assert found == {
        ("function", "pkg/mod.py:too_long", 61),
        ("class", "pkg/mod.py:Crowded", 26),
        ("function", "pkg/mod.py:hidden", 61),
        ("module", "pkg/mod.py", lines),
    }
    assert lines > 500


def test_a_new_violator_and_a_stale_entry_fail_a_known_one_does_not() -> None:
    bars = _bars()
    found = [
        bars.Violation("module", "ivr/old.py", 700),
        bars.Violation("module", "ivr/new.py", 501),
    ]
    known = {("module", "ivr/old.py"): 650, ("class", "ivr/fixed.py:Gone"): 30}
    new, stale = bars.compare(found, known)
    assert [v.name for v in new] == ["ivr/new.py"]
    assert stale == [("class", "ivr/fixed.py:Gone")]


def test_the_tree_keeps_to_its_list() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "size_bars.py")], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 new" in run.stdout
