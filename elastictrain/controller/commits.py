"""The checkpoint commit protocol on the driver: collect every rank's shard report for a step, then
write the manifest (the commit) and apply retention. A step whose reports cannot all arrive (a rank died,
the membership changed, a write failed) is never committed."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from elastictrain.config import JobConfig
from elastictrain.events import EventLog


class Committer:
    def __init__(self, config: JobConfig, events: EventLog, store: Any, meta: dict[str, Any]) -> None:
        self.config = config
        self.events = events
        self.store = store  # CheckpointStore or None
        self.meta = meta
        self._reports: dict[int, dict[int, Any]] = defaultdict(dict)
        self._world: dict[int, int] = {}
        self.stall_s = 0.0
        self.committed_steps: list[int] = []

    def expect(self, step: int, world_size: int) -> None:
        self._world.setdefault(step, world_size)

    def take(self, rank: int, item: Any) -> None:
        """One item from a worker's poll: a staging note (``{"staged", "stall_s"}``) or a ShardReport."""
        if isinstance(item, dict):
            if rank == 0:
                self.stall_s += item["stall_s"]
            return
        self._reports[item.step][item.rank] = item
        self._maybe_commit(item.step)

    def _maybe_commit(self, step: int) -> None:
        reports = self._reports[step]
        world = self._world.get(step)
        if world is None or len(reports) < world:
            return
        del self._reports[step]
        errors = [f"rank {r.rank}: {r.error}" for r in reports.values() if r.error]
        if errors:
            # A save skipped because storage is slower than the interval (when_busy=skip) is policy, not a fault.
            skipped = any(r.error.startswith("skipped") for r in reports.values() if r.error)
            self.events.emit("checkpoint_skipped" if skipped else "checkpoint_failed", step=step,
                             reason="; ".join(errors))
            return
        try:
            manifest = self.store.commit(step, list(reports.values()), {**self.meta, "world_size": world})
        except Exception as e:  # noqa: BLE001 - storage trouble must not stop training
            self.events.emit("checkpoint_failed", step=step, reason=f"commit failed: {e}")
            return
        files = getattr(manifest, "files", {})
        self.committed_steps.append(step)
        self.events.emit(
            "checkpoint_saved", step=step, world_size=world, files=len(files),
            bytes=sum(getattr(f, "size", 0) for f in files.values()),
            write_s=round(max((r.write_s for r in reports.values()), default=0.0), 4),
        )
        c = self.config.checkpoint
        try:
            self.store.retain(c.keep_last, c.keep_every, lineage=self.meta.get("lineage"))
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"retention failed (checkpoint kept): {e}")
