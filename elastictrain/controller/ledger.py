"""Bookkeeping of a run on the driver: step records into ``step`` events, the world size history, the
goodput breakdown (it adds up to wall time) and ``summary.json``. Each step counts once: a step redone
after a restore from an older step supersedes its first attempt (:mod:`~elastictrain.controller.step_book`)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Sequence
from typing import Any

from elastictrain.controller.step_book import StepBook
from elastictrain.events import GOODPUT_BUCKETS, EventLog
from elastictrain.worker.loop import StepRecord

COMPUTE_TIMES_KEPT = 64  # compute times kept per rank (the straggler window looks at the newest)


class Ledger:
    def __init__(self, events: EventLog, total_steps: int, global_batch: int, max_workers: int,
                 keep_compute: int = COMPUTE_TIMES_KEPT, cpu_peak_flops: float | None = None) -> None:
        self.events = events
        self.cpu_peak_flops = cpu_peak_flops  # a CPU worker's FLOP/s (the calibration's), for MFU
        self.book = StepBook()  # per step: what its reported attempt counted (a redo replaces it)
        self.profiles: list[dict[str, Any]] = []
        self.max_workers = max_workers
        self.total_steps = total_steps
        self.global_batch = global_batch
        self.t0 = time.time()
        self.last_step = 0
        self.last_loss: float | None = None
        self.last_eval_loss: float | None = None
        self.last_progress = time.time()  # last time any step completed (the watchdog's reference)
        self.step_times: list[float] = []
        # by rank, the newest only (the straggler window): bounded whatever the run's length
        self.compute_times: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=keep_compute))
        self.world_size_history: list[dict[str, Any]] = []
        self.failures = 0
        self.recoveries = 0
        self.lost_steps = 0
        self.goodput: dict[str, float] = defaultdict(float, dict.fromkeys(GOODPUT_BUCKETS, 0.0))
        self._pending: dict[int, dict[int, StepRecord]] = defaultdict(dict)
        self._world = 0
        self._mesh_told = True
        self._first_step_at: float | None = None
        self.latest_record_at = 0.0
        self.latest_record_step = 0
        # peak memory (worker/memory_peak.py): each rank's over the run, and the highest any rank reported
        # since the previous step event, with its rank (O(1) per record taken, whatever the world size)
        self.memory_by_rank: dict[int, dict[str, float]] = {}
        self._memory_window: dict[str, tuple[float, int]] = {}
        self.nonfinite_in_a_row = 0  # steps in a row whose update was skipped (non-finite)
        # (in a row, step, why) of the longest such run so far, at its last step: a verdict taken after
        # later steps came in (one poll brings several) still sees it
        self.nonfinite_worst: tuple[int, int, str] | None = None

    def new_generation(self, generation: int, world_size: int, accum: int) -> None:
        self._world = world_size
        self._mesh_told = False  # the generation's first step event says the mesh its ranks built
        self.compute_times.clear()  # ranks are renumbered and the accumulation changes: start afresh
        self.world_size_history.append(
            {"generation": generation, "world_size": world_size, "accum": accum, "from_step": self.last_step,
             "time": time.time()})

    def add(self, rank: int, record: StepRecord, complete: bool | None = None) -> list[dict[str, Any]]:
        """Take one rank's record; emit ``step`` events for steps that every rank has reported.

        ``complete=True``: the record is the group's (the generation's reporting rank, see
        :meth:`~elastictrain.controller.monitor.WorkerMonitor._poll_members`): its step completed on every
        rank -- the step's collective finished everywhere -- so it is emitted at once, one record per step
        whatever the world size. ``False``: another rank's record, kept for its compute time and, newest
        first, for the steps a dead reporting rank never reported (:meth:`flush_partial`). ``None``: count
        ranks (every rank reports every step)."""
        # Progress as any rank saw it: a dead rank's last records die with it, so complete steps lag.
        if record.finished_at > self.latest_record_at:
            self.latest_record_at, self.latest_record_step = record.finished_at, record.step
        self.compute_times[rank].append(record.compute_s / max(1, record.accum))  # per micro-batch
        if record.memory:
            self.note_memory(rank, record.memory)
        if complete is not None:
            return self._add_aggregated(rank, record, complete)
        self._pending[record.step][rank] = record
        out = []
        for step in sorted(self._pending):
            if len(self._pending[step]) < self._world or step <= self.last_step:
                if step <= self.last_step:
                    del self._pending[step]
                    continue
                break
            out.append(self._emit(step, self._pending.pop(step), complete=True))
        return out

    def note_memory(self, rank: int, peaks: dict[str, float]) -> None:
        """Take a rank's peak memory (MiB by kind: ``host_mib``, ``alloc_mib``, ``reserved_mib``)."""
        mine = self.memory_by_rank.setdefault(rank, {})
        window = self._memory_window
        for key, value in peaks.items():
            if value > mine.get(key, -1.0):
                mine[key] = value
            if value > window.get(key, (-1.0, 0))[0]:
                window[key] = (value, rank)

    def _memory_fields(self) -> dict[str, Any] | None:
        """The step event's ``memory``: per kind, the highest peak any rank reported since the previous step
        event and that rank (``host_mib``, ``host_rank``, and on GPUs ``alloc_mib``/``alloc_rank``,
        ``reserved_mib``/``reserved_rank``); then the window starts afresh."""
        if not self._memory_window:
            return None
        out: dict[str, Any] = {}
        for key, (value, rank) in sorted(self._memory_window.items()):
            out[key] = value
            out[key.replace("_mib", "_rank")] = rank
        self._memory_window = {}
        return out

    def memory_summary(self) -> dict[str, Any]:
        """``summary.json``'s ``memory``: the run's highest peak per kind with its rank, and every rank's."""
        out: dict[str, Any] = {}
        for rank, peaks in self.memory_by_rank.items():
            for key, value in peaks.items():
                if value > out.get(key, -1.0):
                    out[key], out[key.replace("_mib", "_rank")] = value, rank
        out["by_rank"] = {str(r): dict(p) for r, p in sorted(self.memory_by_rank.items())}
        return out

    def _add_aggregated(self, rank: int, record: StepRecord, complete: bool) -> list[dict[str, Any]]:
        if record.step <= self.last_step:
            return []
        if not complete:  # the lowest rank's record stands for the step (as with every rank reporting)
            held = self._pending[record.step]
            if not held or rank < min(held):
                self._pending[record.step] = {rank: record}
            return []
        for step in [s for s in self._pending if s <= record.step]:
            del self._pending[step]
        return [self._emit(record.step, {rank: record}, complete=True)]

    def flush_partial(self) -> None:
        """At a generation's end: steps some survivor completed are kept (their state is broadcast)."""
        for step in sorted(self._pending):
            if step > self.last_step:
                self._emit(step, self._pending[step], complete=False)
        self._pending.clear()

    def rewind(self, step: int) -> None:
        """The next generation's state is step ``step`` (a restore from the peer memory tier, a durable
        checkpoint, or step 0): the steps after it run again. Their next ``step`` events supersede the ones
        already written (``redone: true``, :meth:`_emit`); records of the old attempts still held are
        dropped. Call after :meth:`replay` (which reports what the restored state holds first)."""
        for held in [s for s in self._pending if s > step]:
            del self._pending[held]
        self.last_step = step

    def replay(self, records: Sequence[StepRecord], up_to: int) -> list[int]:
        """A recovery restored step ``up_to`` from snapshots that carried ``records`` (the reporting rank's
        newest, ``SnapshotMeta.records``): emit, in order and marked ``replayed``, the ``step`` events of the
        steps after the last one reported, up to ``up_to`` -- trained and in the restored state, their
        records died with the workers. A step already reported is never reported again. Returns the steps."""
        done = []
        for record in sorted(records, key=lambda r: r.step):
            if self.last_step < record.step <= up_to:
                self._emit(record.step, {0: record}, complete=True, replayed=True)
                done.append(record.step)
        return done

    def _emit(self, step: int, records: dict[int, StepRecord], complete: bool,
              replayed: bool = False) -> dict[str, Any]:
        first = records[min(records)]
        now = time.time()
        interval = max(1e-9, first.finished_at - self.last_progress) if self.last_step else first.step_s
        if self._first_step_at is None:
            self._first_step_at = now
            self.goodput["startup_s"] += max(0.0, first.finished_at - first.step_s - self.t0)
        self.step_times.append(first.step_s)
        compiling = first.compile_s is not None
        # A step at a smaller world size is only partly productive: the rest of its time is "degraded".
        workers = first.world_size * (first.pipeline["pp"] if first.pipeline else 1)  # world_size is D under pp
        full = 0.0 if compiling else first.step_s * min(1.0, workers / self.max_workers)
        # a compiled generation's first step: compile time, not training (goodput's compile_s)
        counted = {"productive_s": full, "degraded_s": 0.0 if compiling else first.step_s - full,
                   "compile_s": first.step_s if compiling else 0.0}
        tput, per_device, step_mfu = self._throughput(first)
        superseded = self.book.put(step, **counted, tokens_per_s_per_device=per_device, mfu=step_mfu)
        for bucket, seconds in counted.items():
            self.goodput[bucket] += seconds
        lost = 0.0
        if superseded is not None:  # a redo: the first attempt's time was lost work, not training
            for bucket in counted:
                self.goodput[bucket] -= superseded.get(bucket, 0.0)
                lost += superseded.get(bucket, 0.0)
            self.goodput["redone_s"] += lost
        self.last_step, self.last_loss, self.last_progress = step, first.loss, first.finished_at
        recent = self.step_times[-20:]
        eta = (self.total_steps - step) * (sum(recent) / len(recent))
        fields: dict[str, Any] = {
            "step": step, "loss": first.loss, "world_size": first.world_size, "accum": first.accum,
            "samples_per_s": round(self.global_batch / max(1e-9, interval), 3), "step_s": round(first.step_s, 6),
            "eta_s": round(eta, 1), "total_steps": self.total_steps, "final": step == self.total_steps,
            "finished_at": round(first.finished_at, 6),
        }
        fields.update(tput)
        if first.eval_loss is not None:
            fields["eval_loss"] = first.eval_loss
            self.last_eval_loss = first.eval_loss
        if not complete:
            fields["complete"] = False
        if replayed:
            fields["replayed"] = True
        if superseded is not None:  # supersedes the step's earlier event(s): a reader keeps the newest
            fields["redone"], fields["lost_s"] = True, round(lost, 6)
        memory = self._memory_fields()
        if memory:
            fields["memory"] = memory
        if first.skipped:
            fields["skipped"] = True
            self.nonfinite_in_a_row += 1
            if self.nonfinite_worst is None or self.nonfinite_in_a_row > self.nonfinite_worst[0]:
                self.nonfinite_worst = (self.nonfinite_in_a_row, step, first.skipped)
            self.events.emit("step_skipped", step=step, in_a_row=self.nonfinite_in_a_row, reason=first.skipped)
        else:
            self.nonfinite_in_a_row = 0
        if first.mesh and not self._mesh_told:
            fields["mesh"], self._mesh_told = first.mesh, True
        if first.pipeline:  # pp > 1: the schedule's bubble (its timeline) and each rank's measured idle share
            by_rank = {r: rec.pipeline["bubble_measured"] for r, rec in sorted(records.items()) if rec.pipeline}
            fields.update({k: v for k, v in first.pipeline.items() if k != "bubble_measured"})
            fields["bubble_measured"] = round(sum(by_rank.values()) / len(by_rank), 4)
            fields["bubble_by_rank"] = {str(r): v for r, v in by_rank.items()}
        if first.tokens_per_expert:  # MoE: the router's slots per expert of each layer, over all data ranks
            fields["tokens_per_expert"] = first.tokens_per_expert
        ids = first.sample_ids  # gathered from every rank of the step (audit mode)
        if ids:
            fields["sample_ids"] = ids
        return self.events.emit("step", **fields)

    def _throughput(self, record: StepRecord) -> tuple[dict[str, Any], float | None, float | None]:
        """(the step event's fields, tokens/s per device and MFU for the run's medians) of one step from its
        own time (elastictrain/flops.py): tokens/s (whole step and per device) and MFU. A compiled
        generation's first step reports ``compile_s`` and stays out of the medians (None, None)."""
        from elastictrain.flops import mfu

        out: dict[str, Any] = {}
        if record.compile_s is not None:
            out["compile_s"] = round(record.compile_s, 6)
        if not record.tokens or record.step_s <= 0:
            return out, None, None
        tps = record.tokens / record.step_s
        per_device = tps / max(1, record.devices)
        peak = record.peak_flops or self.cpu_peak_flops
        value = mfu(record.flops_per_token, tps, record.devices, peak)
        out.update(tokens_per_s=round(tps, 3), tokens_per_s_per_device=round(per_device, 3),
                   mfu=None if value is None else round(value, 6))
        if record.compile_s is not None:
            return out, None, None
        return out, per_device, value

    def save_profile(self, item: dict[str, Any]) -> None:
        """Write one rank's profile files (worker/profile.py) into ``RUN_DIR/profiles/``; a ``profile_saved``
        event names them."""
        import re

        folder = self.events.path.parent / "profiles"
        folder.mkdir(exist_ok=True)
        written = []
        for name, data in item["files"].items():
            if not re.fullmatch(r"step\d+_rank\d+(_memory)?\.(json|pickle)", name):  # names the worker made
                continue
            (folder / name).write_bytes(data)
            written.append(f"profiles/{name}")
        entry = {"rank": int(item["rank"]), "step": int(item["step"]), "files": written}
        self.profiles.append(entry)
        self.events.emit("profile_saved", **entry)

    def add_time(self, bucket: str, seconds: float) -> None:
        self.goodput[bucket + "_s"] += max(0.0, seconds)

    def summary(self, state: str, extra: dict[str, Any]) -> dict[str, Any]:
        wall = time.time() - self.t0
        buckets = {k: round(v, 6) for k, v in self.goodput.items()}
        buckets["other_s"] = round(max(0.0, wall - sum(self.goodput.values())), 6)
        return {
            "state": state, "final_step": self.last_step, "final_loss": self.last_loss, "wall_s": round(wall, 3),
            **({"final_eval_loss": self.last_eval_loss} if self.last_eval_loss is not None else {}),
            "world_size_history": self.world_size_history, "failures": self.failures,
            "recoveries": self.recoveries, "lost_steps": self.lost_steps, "memory": self.memory_summary(),
            "mfu": _rounded(self.book.median("mfu")),
            "tokens_per_s_per_device": _rounded(self.book.median("tokens_per_s_per_device")),
            "profiles": self.profiles,
            "goodput": {"fraction": round(self.goodput.get("productive_s", 0.0) / wall, 4) if wall else 0.0,
                        **buckets},
            **extra,
        }


def _rounded(value: float | None) -> float | None:
    """A median of the run's per-step figures (None without any), rounded for the summary."""
    return None if value is None else round(value, 6)
