"""Worker side: asynchronous sharded saves with DCP, one :class:`CheckpointWriter` per rank.

Contract (every rank of the group):
* call :meth:`CheckpointWriter.save_async` for the SAME steps, in the same order (the step loop does);
* each call yields exactly one :class:`ShardReport` later, from :meth:`completed`/:meth:`wait`: files this
  rank wrote with size + SHA-256, or an error. The controller commits a step when all ranks reported ok.

Why one background thread and a "ticket" per call: DCP's save is a sequence of collectives on the
checkpoint group, so ranks must run the same saves in the same order. Whether a rank is "busy" (when_busy
= "skip") is a local, racy observation, so ranks could disagree on which step to save. Instead every call,
skipped or not, queues an entry; the thread starts each entry with a tiny all-reduce that checks all ranks
staged the same step and that rank 0 found the step directory writable. If not, every rank abandons that
entry with an error report: never a mismatched collective, never a checkpoint mixing two steps.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.dcp_io import HashingFileSystem, HashingWriter, S3Mode
from elastictrain.checkpoint.dcp_quiet import quiet_single_process_notice
from elastictrain.checkpoint.errors import CheckpointError, root_causes
from elastictrain.checkpoint.manifest import MANIFEST_NAME, ShardReport, attempt_dir_name, step_dir_name
from elastictrain.checkpoint.staging import Staged, StagingPool
from elastictrain.config import CheckpointConfig

_SKIPPED = "skipped: a previous save was still in flight on this rank (checkpoint.when_busy=skip)"


@dataclass
class _Entry:
    step: int
    staged: Staged | None  # None: this rank skipped the step (busy)
    stage_s: float
    records: tuple[dict[str, Any], ...] = ()  # step records the save carries (ShardReport.records)


_CLOSE = object()


def _describe_failure(exc: BaseException, step: int, step_uri: str) -> str:
    """One line per failed rank, storage errors in words (disk full, bucket missing...)."""
    parts = []
    for rank, cause in root_causes(exc):
        who = f"rank {rank}: " if rank is not None else ""
        parts.append(who + storage.describe_error(cause, step_uri, "writing"))
    return f"save of step {step} failed: " + "; ".join(parts)


class CheckpointWriter:
    """Asynchronous DCP saves of one rank into ``<root_uri>/step_<step:09d>/``.

    ``process_group``: a dedicated gloo group created by the caller with a timeout (a dead peer then turns
    a save into an error report instead of a hang); ``None`` only when ``world_size == 1``.
    Not thread-safe: call it from the training thread only. Close it on every path (:meth:`close`).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        root_uri: str,
        rank: int,
        world_size: int,
        process_group: Any,
        *,
        storage_options: dict[str, Any] | None = None,
        s3_mode: S3Mode = "buffer",
        close_timeout_s: float = 120.0,
        generation: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if process_group is None and world_size != 1:
            raise ValueError(f"world_size={world_size} needs a process_group (a gloo group for checkpoints)")
        self._cfg = cfg
        self._root_uri = root_uri.rstrip("/")
        self._rank, self._world = rank, world_size
        self._pg = process_group
        self._s3_mode = s3_mode
        self._close_timeout_s = close_timeout_s
        self._fs, self._root = storage.open_fs(self._root_uri, storage_options or dict(cfg.storage_options))
        self._pool = StagingPool(keep=cfg.max_in_flight)
        self._slots = threading.BoundedSemaphore(cfg.max_in_flight)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._done: list[ShardReport] = []
        self._cond = threading.Condition()
        self._outstanding = 0
        self._closed = False
        self._abandoned = False
        # Each attempt in its own place: a generation writes step_<n>/<attempt>/, so a save of the same step
        # by another generation (a just-in-time save after a shrink, a zombie thread of an abandoned save)
        # never writes into the files a manifest names.
        self._generation = generation
        self._attempt = attempt_dir_name(generation)
        self._saved_steps: set[int] = set()
        self._unwritten: set[int] = set()  # steps whose save finished without writing (may be saved again)
        self._thread = threading.Thread(target=self._run, name=f"ckpt-writer-rank{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ training thread

    def save_async(self, step: int, state: dict[str, Any], wait: bool | None = None,
                   records: tuple[dict[str, Any], ...] = ()) -> bool:
        """Stage ``state`` to host memory and save it in the background. Copies from CPU tensors are done
        when this returns; from CUDA tensors they are queued (``elastictrain.checkpoint.host_copy``).

        Returns True if a save was started; False if ``when_busy == "skip"`` and ``max_in_flight`` saves
        are still running (a report with a "skipped" error follows), or this step was queued already.
        ``wait``: override ``when_busy`` (True: wait for a free slot). ``records``: step records (JSON,
        :func:`~elastictrain.checkpoint.carried.carry`) the save's report carries into the manifest. Raises
        CheckpointError when closed.
        """
        if self._closed:
            raise CheckpointError(f"checkpoint writer for {self._root_uri} is closed; create a new one")
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        if step in self._saved_steps:  # one save per (step, generation): the first one stands
            return False
        self._saved_steps.add(step)
        blocking = self._cfg.when_busy == "wait" if wait is None else wait
        if not self._slots.acquire(blocking=blocking):
            self._enqueue(_Entry(step, None, 0.0))
            return False
        t0 = time.perf_counter()
        try:
            staged = self._pool.stage(state)
        except BaseException:
            self._slots.release()
            raise
        self._enqueue(_Entry(step, staged, time.perf_counter() - t0, tuple(records)))
        return True

    def _enqueue(self, entry: _Entry) -> None:
        with self._cond:
            self._outstanding += 1
        self._queue.put(entry)

    def completed(self) -> list[ShardReport]:
        """Reports of saves finished (ok or failed) since the last call; never blocks."""
        with self._cond:
            out, self._done = self._done, []
        return out

    def wait(self, timeout: float | None = None) -> list[ShardReport]:
        """Block until every queued save finished (or ``timeout`` s passed); return :meth:`completed`."""
        with self._cond:
            self._cond.wait_for(lambda: self._outstanding == 0, timeout=timeout)
        return self.completed()

    @property
    def in_flight(self) -> int:
        """Saves queued or running on this rank."""
        with self._cond:
            return self._outstanding

    def has_saved(self, step: int) -> bool:
        """True if a save of ``step`` was already queued by this writer (this generation)."""
        return step in self._saved_steps

    def forget_unwritten(self, step: int) -> bool:
        """If the save of ``step`` finished without writing (skipped while busy, refused, failed: every
        rank agrees on that through the entry's all-reduce), forget it so the step can be saved again and
        return True. False while it is in flight or if it wrote."""
        with self._cond:
            if step in self._unwritten:
                self._unwritten.discard(step)
                self._saved_steps.discard(step)
                return True
        return False

    def abandon(self) -> list[ShardReport]:
        """The membership changed: give up in-flight saves at once and stop. Returns the reports of saves
        that had already finished (they may still commit); queued and running saves report nothing, so
        they never commit. The thread is not joined: one blocked on storage or in a collective of the
        checkpoint group (which the caller tears down) ends on its own, writing only into its attempt
        directory, which no manifest names. Idempotent."""
        with self._cond:
            self._abandoned = True
            done, self._done = self._done, []
            self._outstanding = 0
            self._cond.notify_all()
        if not self._closed:
            self._closed = True
            self._queue.put(_CLOSE)
        return done

    def close(self) -> None:
        """Drain in-flight saves (bounded by ``close_timeout_s``) and stop the thread. Idempotent.

        A save stuck on a dead peer ends when the group's collective timeout fires; if even that does not
        happen within the bound the (daemon) thread is abandoned and its save reported nowhere.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join(self._close_timeout_s)
        self._pool.clear()

    def running(self) -> bool:
        """True while the writer's thread runs (after :meth:`abandon` it ends on its own)."""
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the writer's thread to end (after :meth:`close` or :meth:`abandon`)."""
        self._thread.join(timeout)

    # ---------------------------------------------------------------------------------- background thread

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is _CLOSE:
                return
            report = None if self._abandoned else self._execute(entry)
            if entry.staged is not None:
                self._pool.release(entry.staged)
                self._slots.release()
            with self._cond:
                if self._abandoned:  # never reported, so never committed
                    continue
                if report.error is not None:
                    self._unwritten.add(entry.step)
                self._done.append(report)
                self._outstanding -= 1
                self._cond.notify_all()

    def _execute(self, entry: _Entry) -> ShardReport:
        t0 = time.perf_counter()
        step_uri = storage.join(self._root_uri, step_dir_name(entry.step))
        step_path = storage.join(self._root, step_dir_name(entry.step))
        data_uri, data_path = step_uri, step_path
        if self._attempt:
            data_uri, data_path = storage.join(step_uri, self._attempt), storage.join(step_path, self._attempt)
        files: dict = {}
        try:
            refusal = self._prepare_dir(step_path, step_uri, data_path, data_uri) if entry.staged is not None else _SKIPPED
            refusal = self._agree(entry, refusal)
            if refusal is None:
                hfs = HashingFileSystem(self._fs, data_path, data_uri, self._s3_mode)
                try:
                    writer = HashingWriter(hfs)
                    entry.staged.wait()  # copies from a GPU land while the step thread trains on
                    if self._pg is None:
                        quiet_single_process_notice()  # a one-rank save: DCP's notice saying so is noise
                    dcp.save(entry.staged.state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
                    prefix = self._attempt + "/" if self._attempt else ""
                    files = {prefix + rel: info for rel, info in writer.written.items()}
                finally:
                    hfs.close()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported, never raised into training
            refusal = _describe_failure(e, entry.step, step_uri)
        return ShardReport(entry.step, self._rank, files if refusal is None else {}, refusal, entry.stage_s,
                           time.perf_counter() - t0, generation=self._generation, records=entry.records)

    def _prepare_dir(self, step_path: str, step_uri: str, data_path: str, data_uri: str) -> str | None:
        """Rank 0 only: refuse a committed step; clear leftovers of a crashed attempt of this generation
        (only its own attempt directory: other attempts may still be written by abandoned threads)."""
        if self._rank != 0:
            return None
        manifest = storage.join(step_path, MANIFEST_NAME)
        if storage.guarded("checking", step_uri, lambda: self._fs.exists(manifest)):
            return f"step {step_uri} is already committed; refusing to overwrite a committed checkpoint"
        storage.remove_tree(self._fs, data_path, data_uri)
        return None

    def _agree(self, entry: _Entry, refusal: str | None) -> str | None:
        """All ranks must have staged the same step and nobody refused; returns the reason if not.

        This all-reduce doubles as the barrier after rank 0 cleared the directory."""
        if self._pg is None:
            return refusal
        ok = 1 if refusal is None else 0
        vec = torch.tensor([ok, entry.step, -entry.step], dtype=torch.int64)
        dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=self._pg)
        all_ok, lo, hi = int(vec[0]), int(vec[1]), -int(vec[2])
        if refusal is not None:
            return refusal
        if lo != hi:
            return f"ranks disagree on the step to save ({lo}..{hi}); abandoned (the step loop must call save_async on every rank)"
        if not all_ok:
            return f"abandoned step {entry.step}: another rank skipped it (busy) or refused the directory"
        return None
