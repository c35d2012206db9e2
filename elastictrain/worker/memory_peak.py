"""This worker's peak memory since its previous reading: host RSS and, on a GPU, device memory.

Read once per step by the step loop (``StepRecord.memory``), so each step reports the high-water mark of the
process over that step: everything from the previous step's end (a checkpoint's staging, a restore, the
set-up before the first step) up to this step's end is in exactly one step's figure.

Host: the kernel's RSS high-water mark (``VmHWM`` in ``/proc/self/status``), reset to the current RSS after
each reading by writing ``5`` to ``/proc/self/clear_refs`` (Linux). A kernel or container that refuses the
reset leaves ``VmHWM`` since the process started (:func:`host_reset_works` tells which); without ``/proc``
the figure is ``getrusage``'s maximum RSS, never reset. Its cost: docs/perf/2026-11-28-memory-reading.md.

Device (CUDA): ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (the caching allocator's own
counters, no device sync), reset by ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import resource
import sys

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_MIB = 1024 * 1024
_reset_ok: bool | None = None  # None: not tried yet


def _vm_hwm_kib() -> int | None:
    try:
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_host() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_reset_works() -> bool:
    """Whether the host high-water mark can be reset here (else each figure is the peak since start)."""
    global _reset_ok
    if _reset_ok is None:
        _reset_ok = _reset_host()
    return _reset_ok


def reset_host() -> None:
    """Reset the host high-water mark to the current RSS (where the kernel allows: :func:`host_reset_works`):
    a worker process reused for another run (``workers.reuse``) reports that run's peaks, not an earlier one's."""
    if host_reset_works():
        _reset_host()


def read_and_reset(device: torch.device) -> dict[str, float]:
    """``{"host_mib": ...}`` plus, on CUDA, ``{"alloc_mib": ..., "reserved_mib": ...}``: the peaks since the
    previous call (or the process start), in MiB; then the marks are reset to the current use."""
    kib = _vm_hwm_kib()
    if kib is None:  # no /proc (not Linux): the maximum RSS of the process's life
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib = maxrss // 1024 if sys.platform == "darwin" else maxrss  # bytes on macOS, KiB on Linux
    elif host_reset_works():
        _reset_host()
    out = {"host_mib": round(kib / 1024, 1)}
    if device.type == "cuda":
        out["alloc_mib"] = round(torch.cuda.max_memory_allocated(device) / _MIB, 1)
        out["reserved_mib"] = round(torch.cuda.max_memory_reserved(device) / _MIB, 1)
        torch.cuda.reset_peak_memory_stats(device)
    return out
