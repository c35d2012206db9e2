"""Exact CPU seconds of a process tree under load: a cgroup-v1 ``cpuacct`` group (Linux, root).

Wall time on a shared 2-core machine moves with whatever else runs; the CPU a command and everything it
started used (Ray's daemons and workers included: they are its descendants, and a cgroup is inherited)
does not move much (cache contention inflates it a little). Used for the suite's CPU per test and for
benchmarks' per-side CPU. Where ``/sys/fs/cgroup/cpuacct`` is not writable (no root, cgroup v2 only),
:func:`available` is False and callers say so instead of printing a figure.

Three ways in:

* ``python benchmarks/cgroup_cpu.py CMD ...``: runs CMD in a fresh group, prints ``CGROUP_CPU cpu_s=...``
  on stderr and exits with CMD's status.
* ``PYTHONPATH=benchmarks python -m pytest -p cgroup_cpu ...`` (also under ``-n``): each test process moves
  itself into its own group before anything starts, and one JSON line per test (``test``, ``cpu`` seconds,
  ``wall`` seconds, ``worker``) is appended to ``$CGROUP_CPU_OUT`` (default ``cgroup_cpu.jsonl``). A test is
  charged with what its process's tree burned during it: idle processes an earlier test left (a warm pool,
  the session Ray) count where they burn.
* :class:`CpuGroup` from Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct")


def available() -> bool:
    return ROOT.is_dir() and os.access(ROOT, os.W_OK)


class CpuGroup:
    """One cpuacct group: ``join(pid)`` moves a process (its later children follow), ``cpu_s()`` reads it."""

    def __init__(self, name: str | None = None) -> None:
        self.path = ROOT / (name or f"et_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self.path.mkdir(exist_ok=True)

    def join(self, pid: int | None = None) -> None:
        (self.path / "cgroup.procs").write_text(str(pid or os.getpid()))

    def cpu_s(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        """Move what is left in the group to the root, then remove the group."""
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (ROOT / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.path.rmdir()
        except OSError:
            pass


def run(cmd: list[str]) -> tuple[int, float]:
    """(exit status, CPU seconds) of ``cmd`` and everything it started."""
    group = CpuGroup()
    try:
        proc = subprocess.Popen(cmd, preexec_fn=lambda: group.join(os.getpid()))
        rc = proc.wait()
        return rc, group.cpu_s()
    finally:
        group.close()


# ---- pytest plugin ----------------------------------------------------------------------------------------
_group: CpuGroup | None = None


def pytest_configure(config) -> None:  # noqa: ANN001 (pytest's hook)
    global _group
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return  # the xdist controller runs no test
    if not available():
        print("cgroup_cpu: /sys/fs/cgroup/cpuacct is not writable here: no CPU per test", file=sys.stderr)
        return
    _group = CpuGroup()
    _group.join()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001 (pytest's hook)
    if _group is None:
        yield
        return
    before, start = _group.cpu_s(), time.time()
    yield
    row = {"test": item.nodeid, "cpu": round(_group.cpu_s() - before, 3), "wall": round(time.time() - start, 3),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
    with open(os.environ.get("CGROUP_CPU_OUT", "cgroup_cpu.jsonl"), "a") as out:
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/cgroup_cpu.py CMD [ARGS...]")
    if not available():
        sys.exit("cgroup_cpu: /sys/fs/cgroup/cpuacct is not writable here (needs root and cgroup v1 cpuacct)")
    status, cpu = run(sys.argv[1:])
    print(f"CGROUP_CPU cpu_s={cpu:.2f} rc={status}", file=sys.stderr)
    sys.exit(status)
