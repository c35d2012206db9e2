"""The checkpoint commit protocol on the driver: collect every rank's shard report for a save, then
write the manifest (the commit) and apply retention. A save is keyed by (step, generation): each
generation writes its own attempt directory and needs the reports of every rank of THAT generation (a
just-in-time save after a shrink commits at the new world size). A save whose reports cannot all arrive
(a rank died, the membership changed and the save was abandoned, a write failed) is never committed."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
        self._current: int | None = None  # the newest generation
        self.stall_s = 0.0
        self.committed_steps: list[int] = []
        # Commits and retention talk to storage, which may be slow or stalled: they run on a thread of
        # their own, so the controller keeps watching workers (and recovers) meanwhile.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for queued commits (before a just-in-time save returns, before exit). True if all done."""
        with self._lock:
            pending, self._pending = self._pending, []
        done, not_done = wait(pending, timeout=timeout)
        with self._lock:
            self._pending.extend(not_done)
        return not not_done

    def close(self) -> None:
        """Stop taking commits; a commit stuck on storage is left to finish on its own (never joined)."""
        self._pool.shutdown(wait=False, cancel_futures=False)

    def waiting(self) -> bool:
        """Whether a save of the current generation has some of its ranks' reports and waits for the others
        (the controller then polls every member until they are in). An abandoned save of an earlier
        generation waits for nobody."""
        return any(generation == self._current for _, generation in self._reports)

    def new_generation(self, generation: int, world_size: int) -> None:
        """Saves of ``generation`` commit when ``world_size`` ranks reported."""
        self._world[generation] = world_size
        self._current = generation

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
        future = self._pool.submit(self._commit, step, reports, world)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]

    def _commit(self, step: int, reports: dict[int, Any], world: int) -> None:
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
            stall_s=round(max((r.stage_s for r in reports.values()), default=0.0), 4),
        )
        c = self.config.checkpoint
        try:
            self.store.retain(c.keep_last, c.keep_every, lineage=self.meta.get("lineage"))
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"retention failed (checkpoint kept): {e}")
