"""The step loop's batch read-ahead: the next step's micro-batches assembled in a thread while this step computes.

A micro-batch is a pure function of its sample ids (``collate([dataset[i] for i in ids])``), and the ids are a
pure function of (seed, step, rank, world size): so :class:`BatchPrefetcher` keys each assembled batch by its
ids alone, and a batch taken from it is exactly the batch a synchronous read gives. Nothing about the step,
the rank or the layout is cached: after a failure, a restore to an earlier step or a re-plan at another world
size, the ids asked for differ and a stale batch is never handed out (it is dropped at the next
:meth:`~BatchPrefetcher.schedule`, or at once by :meth:`~BatchPrefetcher.reset`).

The loop (worker/loop.py) calls :meth:`~BatchPrefetcher.schedule` at the start of step ``s`` with the
micro-batches of its rank of steps ``s .. s + train.read_ahead_steps`` (in step order, none past
``train.steps``), then :meth:`~BatchPrefetcher.take` per micro-batch in its "data" phase: a step waits only
for what is not ready yet (the first step of a generation reads its own batches; every later one finds them
assembled, and a slow read has ``read_ahead_steps`` steps to land). What a worker holds is bounded by those
``read_ahead_steps + 1`` steps' batches.
benchmarks/data.py measures the data wait through this same object.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["BatchPrefetcher"]

Key = tuple[int, ...]


class BatchPrefetcher:
    """Assemble micro-batches of ``dataset`` with ``collate`` in one background thread, keyed by sample ids.

    ``dataset[i]`` and ``collate`` must be pure functions of their inputs and safe to call from a thread
    beside the step (neither may touch the global RNG); a dataset with ``prefetch(batches)`` (a prepared
    corpus) is also asked to start its own ranged reads of the scheduled batches (one coalesced read each). ``batch``: a function of the ids that
    returns exactly ``collate`` of their items, faster (``PreparedWindows.batch`` with the default collate). Call :meth:`close` when done: it
    drops what is pending and stops the thread.
    """

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any],
                 batch: Callable[[list[int]], Any] | None = None) -> None:
        self.dataset, self.collate, self.batch = dataset, collate, batch
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="elastictrain-batch-ahead")
        self._pending: dict[Key, Future] = {}
        self._lock = threading.Lock()

    def assemble(self, ids: Sequence[int]) -> Any:
        """The batch of ``ids``, read and collated now (what :meth:`take` returns, prefetched or not); through
        ``batch(ids)`` when given (a dataset's own batch read, equal to ``collate`` of its items)."""
        if self.batch is not None:
            return self.batch([int(i) for i in ids])
        return self.collate([self.dataset[int(i)] for i in ids])

    def schedule(self, batches: Sequence[Sequence[int]]) -> None:
        """Start assembling ``batches`` (lists of sample ids: this step's and the next steps' micro-batches),
        in order; pending batches not among them are dropped (another step's, rank's or layout's)."""
        keys = [tuple(int(i) for i in ids) for ids in batches]
        prefetch = getattr(self.dataset, "prefetch", None)
        if prefetch is not None:  # the dataset's own parallel ranged reads (S3); the thread then finds them
            prefetch(keys)
        with self._lock:
            if self._pool is None:
                raise RuntimeError("BatchPrefetcher.schedule after close()")
            wanted = set(keys)
            for key in [k for k in self._pending if k not in wanted]:
                self._pending.pop(key).cancel()
            for key in keys:
                if key not in self._pending:
                    self._pending[key] = self._pool.submit(self.assemble, key)

    def take(self, ids: Sequence[int]) -> Any:
        """The batch of ``ids``: the one the thread assembles if it was scheduled (waiting for it if it is not
        ready: the thread takes batches in the order scheduled, this step's first), else read now. Raises
        what ``dataset[i]`` or ``collate`` raised for it."""
        key = tuple(int(i) for i in ids)
        with self._lock:
            future = self._pending.pop(key, None)
        return self.assemble(key) if future is None else future.result()

    def reset(self) -> None:
        """Drop every pending batch (a regroup, a restore): the next step schedules its own."""
        with self._lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()

    def close(self) -> None:
        """Drop pending batches and stop the thread (a batch being assembled finishes in the background)."""
        self.reset()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
