"""Process-table checks the pool tests share (tests/test_warm_pool.py, tests/test_pool_faulted.py)."""

from __future__ import annotations

import time


def process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (``R``, ``S``, ``Z``...), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def running(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")


def wait_gone(pids: list[int], timeout: float = 120.0) -> list[int]:
    """Wait (bounded, generous: a loaded machine) until none of ``pids`` runs; the ones still running."""
    deadline = time.time() + timeout
    alive = list(pids)
    while alive and time.time() < deadline:
        alive = [p for p in alive if running(p)]
        if alive:
            time.sleep(0.2)  # polling a condition (the kernel's process table), not a timing window
    return alive
