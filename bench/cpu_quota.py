"""A CPU quota for a process tree, so that a fast machine can stand in for a slower one.

A cgroup (v2's ``cpu.max``, or v1's ``cpu`` controller) lets the processes put in it run
``share`` of one core: every ``PERIOD_US`` they get ``share * PERIOD_US`` of CPU, then wait for
the next period. A gateway held to 0.64 of its core does the same work as on a machine 1/0.64
times slower, so queueing (and with it p95) appears at the same load as there. The period is
short so that a 20 ms tick of frames is not held up for a long stretch at once: the waits are
at most ``(1 - share) * PERIOD_US`` each.

It needs a writable cgroup hierarchy (root, as the bench machines run); otherwise it says so.
Processes forked by one already inside (the gateway's workers) are inside too.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import TracebackType

PERIOD_US = 5000
V2_ROOT = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")


class CpuQuotaUnavailable(RuntimeError):
    """No cgroup this process may write: the quota cannot be applied here."""


class CpuQuota:
    """``with CpuQuota(0.64, "bench-gw") as quota: quota.add(pid)``: ``pid`` (and what it forks
    afterwards) runs at most ``share`` of each of its ``cores`` until the block ends (the group
    is removed then; its processes must have exited)."""

    def __init__(self, share: float, name: str, cores: int = 1) -> None:
        if not 0.05 <= share <= 1.0:
            raise ValueError(f"a CPU share must be within 0.05-1 of a core, got {share}")
        if cores < 1:
            raise ValueError(f"a CPU quota needs at least one core, got {cores}")
        self.share = share
        self.cores = cores
        self._name = f"{name}-{os.getpid()}"
        self._dir: Path | None = None

    def __enter__(self) -> CpuQuota:
        quota_us = round(self.share * self.cores * PERIOD_US)  # a quota spans the group's cores
        try:
            if (V2_ROOT / "cgroup.controllers").exists():
                # v2: the cpu controller must be enabled for the root's children first.
                (V2_ROOT / "cgroup.subtree_control").write_text("+cpu")
                self._dir = V2_ROOT / self._name
                self._dir.mkdir()
                (self._dir / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
            else:
                self._dir = V1_CPU / self._name
                self._dir.mkdir()
                (self._dir / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self._dir / "cpu.cfs_quota_us").write_text(str(quota_us))
        except OSError as exc:
            self._remove()
            raise CpuQuotaUnavailable(
                f"cannot hold a process to {self.share:.2f} of a core: no writable cgroup "
                f"({exc}); run as root on a machine with cgroups mounted at {V2_ROOT}"
            ) from exc
        return self

    def add(self, pid: int) -> None:
        """Put ``pid`` in the group (before it forks: its children then start inside)."""
        assert self._dir is not None, "CpuQuota.add outside its with block"
        (self._dir / "cgroup.procs").write_text(str(pid))

    def throttled_seconds(self) -> float:
        """How long the group's processes were held back by the quota so far."""
        if self._dir is None:
            return 0.0
        stat = dict(
            line.split() for line in (self._dir / "cpu.stat").read_text().splitlines() if line
        )
        if "throttled_usec" in stat:  # v2
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9  # v1, in ns

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._dir is not None:
            with contextlib.suppress(OSError):  # a process still inside keeps it: left behind
                self._dir.rmdir()
            self._dir = None
