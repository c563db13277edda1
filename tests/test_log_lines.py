"""Log lines stay whole when processes share one stderr, as ``ivr serve --workers`` do (a pipe
under Kubernetes or Compose, a file here): every line is one JSON event."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LINES_PER_PROCESS = 3000

WRITER = f"""
import structlog
from ivr.obs.logging import configure_logging
configure_logging("json", "info")
log = structlog.get_logger("ivr.test")
for i in range({LINES_PER_PROCESS}):
    log.info("test.line", worker=__import__("sys").argv[1], i=i, pad="x" * 200)
"""


def test_processes_sharing_stderr_never_splice_each_others_lines(tmp_path: Path) -> None:
    out = tmp_path / "shared.log"
    with out.open("wb") as shared:  # one open file, inherited by both, as workers share it
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, name], stdout=shared, stderr=shared)
            for name in ("a", "b")
        ]
        for writer in writers:
            assert writer.wait(60) == 0
    bad = []
    seen: dict[str, int] = {"a": 0, "b": 0}
    for line in out.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        seen[event["worker"]] += 1
    assert not bad, f"{len(bad)} spliced lines, e.g. {bad[0][:300]!r}"
    assert seen == {"a": LINES_PER_PROCESS, "b": LINES_PER_PROCESS}
