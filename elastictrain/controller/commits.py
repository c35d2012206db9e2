"""The checkpoint commit protocol on the driver: collect every rank's shard report for a save, then
write the manifest (the commit) and apply retention. A save is keyed by (step, generation): each
generation writes its own attempt directory and needs the reports of every rank of THAT generation (a
just-in-time save after a shrink commits at the new world size). A save whose reports cannot all arrive
(a rank died, the membership changed and the save was abandoned, a write failed) is never committed."""

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
        self._reports: dict[tuple[int, int | None], dict[int, Any]] = defaultdict(dict)
        self._world: dict[int | None, int] = {}  # world size of each generation
        self.stall_s = 0.0
        self.committed_steps: list[int] = []

    def new_generation(self, generation: int, world_size: int) -> None:
        """Saves of ``generation`` commit when ``world_size`` ranks reported."""
        self._world[generation] = world_size

    def take(self, rank: int, item: Any) -> None:
        """One item from a worker's poll: a staging note (``{"staged", "stall_s"}``) or a ShardReport."""
        if isinstance(item, dict):
            if rank == 0:
                self.stall_s += item["stall_s"]
            return
        if item.step in self.committed_steps:  # another generation's attempt already committed this step
            return
        key = (item.step, item.generation)
        self._reports[key][item.rank] = item
        self._maybe_commit(key)

    def _maybe_commit(self, key: tuple[int, int | None]) -> None:
        step, generation = key
        reports = self._reports[key]
        world = self._world.get(generation)
        if world is None or len(reports) < world:
            return
        del self._reports[key]
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
            self.store.retain(c.keep_last, c.keep_every)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"retention failed (checkpoint kept): {e}")
