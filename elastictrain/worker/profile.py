"""``train.profile``: ``torch.profiler`` traces of named steps on named ranks, handed to the driver.

A rank named in ``ranks`` runs each step named in ``steps`` (1-based, as step events count) under
``torch.profiler.profile`` and exports a Chrome trace (JSON); with ``memory: true`` a CUDA rank also records
its allocator history for that step and dumps a memory snapshot (``torch.cuda.memory._dump_snapshot``, a
pickle that https://pytorch.org/memory_viz reads), a CPU rank profiles with ``profile_memory=True`` (the
allocations appear in the trace). The files travel to the driver with the next poll (a worker may be on
another node) and land in ``RUN_DIR/profiles/`` as ``step{S}_rank{R}.json`` (and ``..._memory.pickle``),
one ``profile_saved`` event each. Profiling observes the step: it runs the same operations on the same
values, so the step's numbers are those of an unprofiled step.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from elastictrain.config import ProfileConfig


class StepProfiler:
    """Profiles the steps ``cfg`` names on the ranks it names; :meth:`take` hands the finished files over."""

    def __init__(self, cfg: ProfileConfig | None, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self._done: list[dict[str, Any]] = []

    def wants(self, rank: int, number: int) -> bool:
        return self.cfg is not None and number in self.cfg.steps and rank in self.cfg.ranks

    @contextlib.contextmanager
    def around(self, rank: int, number: int) -> Iterator[None]:
        """Profile the step inside if :meth:`wants` it (else nothing)."""
        if not self.wants(rank, number):
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        memory = bool(self.cfg and self.cfg.memory)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if memory and cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        with tempfile.TemporaryDirectory(prefix="et-profile-") as tmp:
            with profile(activities=activities, profile_memory=memory and not cuda, record_shapes=memory) as prof:
                yield
                if cuda:
                    torch.cuda.synchronize(self.device)
            name = f"step{number}_rank{rank}"
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            item: dict[str, Any] = {"rank": rank, "step": number, "files": {f"{name}.json": _read(trace)}}
            if memory and cuda:
                snap = os.path.join(tmp, "memory.pickle")
                torch.cuda.memory._dump_snapshot(snap)
                torch.cuda.memory._record_memory_history(enabled=None)
                item["files"][f"{name}_memory.pickle"] = _read(snap)
            self._done.append(item)

    def take(self) -> list[dict[str, Any]]:
        """The profiles finished since the last call: ``{"rank", "step", "files": {name: bytes}}`` each."""
        done, self._done = self._done, []
        return done


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
