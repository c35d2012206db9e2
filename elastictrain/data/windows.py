"""Next-token windows over a prepared corpus, read by range (no worker loads the corpus).

:class:`PreparedWindows` is the map-style dataset of a prepared split (:mod:`elastictrain.data.shards`): sample
``i`` is the token range ``[i*seq_len, i*seq_len + seq_len + 1)`` of the split's stream (its shards
concatenated), exactly as :class:`~elastictrain.data.datasets.TokenWindows` slices an in-memory tensor, so the
global sample cursor indexes it unchanged. A POSIX (Lustre) path is read with one ``pread`` per window piece:
the kernel's page cache keeps what was read, shared and reclaimable, and the process maps nothing (a memory
map would count every page a long run touched, and its fault-around neighbours, in the worker's RSS). Any
other fsspec URL (``s3://``) is read by ranged reads, a batch at a time: its windows' byte ranges sorted, merged
where they touch or lie close (:mod:`elastictrain.byte_ranges`) and fetched in one ``cat_ranges`` call, the
windows cut back out in the batch's own order; :meth:`PreparedWindows.prefetch` starts this step's and the
next ``train.read_ahead_steps`` steps' batches in background threads. What a worker holds is bounded by
those steps' windows, whatever the corpus size.
"""

from __future__ import annotations

import bisect
import operator
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from elastictrain.byte_ranges import MERGE_GAP, fetch
from elastictrain.data.shards import Manifest, PreparedDataError, join, numpy_dtype, read_manifest

__all__ = ["PreparedWindows"]

Key = tuple[int, ...]

# Batches read at once per worker (each one cat_ranges call; S3 answers in a round trip, a few overlap it).
_READ_THREADS = 4
_OPEN_FILES = 64  # local shards kept open (a corpus of many thousand shards must not exhaust descriptors)


class PreparedWindows:
    """Windows of ``seq_len + 1`` tokens over split ``split`` of the prepared corpus at ``uri``.

    Raises PreparedDataError when the manifest is missing or malformed, or the split is too short for one
    window. ``prefetch(batches)`` (remote URIs) starts reading those batches in background threads; call
    :meth:`close` to stop them (the worker process ending stops them too: the threads are daemons).
    ``merge_gap``: bytes between two windows' ranges read as one (default
    :data:`elastictrain.byte_ranges.MERGE_GAP`).
    """

    def __init__(self, uri: str, seq_len: int, split: str = "train",
                 storage_options: dict[str, Any] | None = None, manifest: Manifest | None = None,
                 merge_gap: int = MERGE_GAP) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.uri, self.seq_len, self.split, self.merge_gap = uri, seq_len, split, merge_gap
        self.storage_options = dict(storage_options or {})
        self.manifest = manifest or read_manifest(uri, self.storage_options)
        shards = self.manifest.splits.get(split) or ()
        total = sum(s.tokens for s in shards)
        if total < seq_len + 1:
            raise PreparedDataError(
                f"split {split!r} of {uri!r} has {total} tokens but one window of seq_len={seq_len} needs "
                f"{seq_len + 1}; use a shorter seq_len or prepare more text")
        self.shards = [s for s in shards if s.tokens]
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards]).tolist()  # token offset of each shard
        self.dtype = numpy_dtype(self.manifest.dtype)
        self._len = (total - 1) // seq_len
        import fsspec

        self._fs, self._root = fsspec.core.url_to_fs(uri, **self.storage_options)
        self.local = "file" in (self._fs.protocol if isinstance(self._fs.protocol, tuple) else (self._fs.protocol,))
        self._fds: dict[int, int] = {}
        self._ahead: dict[Key, Future] = {}  # a prefetched batch's windows, [len(key), seq_len + 1]
        self._held_by: dict[int, Key] = {}  # window -> a prefetched batch holding it (for ``dataset[i]``)
        # prefetched batches handed out by ``batch`` and still asked for: not read again (the step loop's
        # read-ahead asks for a batch at every step until it trains it, and took it at the first)
        self._taken: set[Key] = set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # Pickled to the workers: no open maps, pools or file systems travel.
    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "seq_len": self.seq_len, "split": self.split,
                "storage_options": self.storage_options, "manifest": self.manifest, "merge_gap": self.merge_gap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __len__(self) -> int:
        return self._len

    def fingerprint(self) -> dict[str, Any]:
        """The dataset fingerprint from the manifest (no data read): window count, split, corpus and
        tokenizer digests. A checkpoint over another corpus or tokenizer differs here and is refused."""
        return {"len": self._len, "split": self.split, "corpus": self.manifest.digest(),
                "tokenizer": self.manifest.tokenizer_sha256[:16]}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = self._check(index)
        with self._lock:
            key = self._held_by.get(i)
            ahead = self._ahead.get(key) if key is not None else None
        tokens = ahead.result()[key.index(i)] if ahead is not None else self.read_windows([i])[0]
        x = torch.from_numpy(tokens.astype(np.int64))
        return {"input": x[:-1], "target": x[1:]}

    def batch(self, ids: Any) -> dict[str, torch.Tensor]:
        """The windows ``ids`` as one batch: exactly ``_default_collate([self[i] for i in ids])`` of the step loop
        (``input`` and ``target`` stacked, int64, contiguous), read into one array instead of one tensor per
        window (the step loop's read-ahead thread holds Python's interpreter lock for less of the step): the
        prefetched batch of these ids if there is one, else one coalesced read (:meth:`read_windows`)."""
        key = tuple(self._check(i) for i in ids)
        with self._lock:
            ahead = self._ahead.pop(key, None)
            if ahead is not None:
                self._taken.add(key)
        tokens = ahead.result() if ahead is not None else self.read_windows(key)
        x = torch.from_numpy(tokens.astype(np.int64))
        return {"input": x[:, :-1].contiguous(), "target": x[:, 1:].contiguous()}

    def prefetch(self, batches: Any) -> None:
        """Read the batches ``batches`` (sequences of window ids: the current and the next steps' micro-batches
        of this rank) in background threads, in order, each with one coalesced read (remote URIs; a local path
        needs none). Batches asked for before and not among them are dropped, so what waits is bounded by the
        windows of the batches last asked for; one :meth:`batch` already took is not read again while it
        stays asked for (asked for again after it was dropped, it is read again)."""
        if self.local:
            return
        keys = [tuple(int(i) for i in ids) for ids in batches]
        keys = [k for k in keys if k and all(0 <= i < self._len for i in k)]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="elastictrain-read-ahead")
            wanted = set(keys)
            for key in [k for k in self._ahead if k not in wanted]:  # e.g. another rank's after a regroup
                self._ahead.pop(key).cancel()
            self._taken &= wanted
            for key in keys:
                if key not in self._ahead and key not in self._taken:
                    self._ahead[key] = self._pool.submit(self.read_windows, key)
            self._held_by = {i: key for key in self._ahead for i in key}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
        self._held_by.clear()
        self._taken.clear()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # ------------------------------------------------------------------ reading
    def _check(self, index: Any) -> int:
        i = operator.index(index)
        if not 0 <= i < self._len:
            raise IndexError(f"sample index {i} out of range [0, {self._len})")
        return i

    def read_windows(self, ids: Any) -> np.ndarray:
        """The windows ``ids`` (in that order) as rows of one ``[len(ids), seq_len + 1]`` array of the corpus
        dtype: one ``pread`` per window piece on a local path; elsewhere every piece's byte range in one
        coalesced ``cat_ranges`` call (:func:`elastictrain.byte_ranges.fetch`). Raises IndexError for an id out
        of range, PreparedDataError for a shard shorter than the manifest says."""
        ids = [self._check(i) for i in ids]
        out = np.empty((len(ids), self.seq_len + 1), dtype=self.dtype)
        if self.local:
            for j, i in enumerate(ids):
                out[j] = self.read_tokens(i * self.seq_len, i * self.seq_len + self.seq_len + 1)
            return out
        size = self.dtype.itemsize
        pieces = [(j, k, lo, hi) for j, i in enumerate(ids)
                  for k, lo, hi in self._pieces(i * self.seq_len, (i + 1) * self.seq_len + 1)]
        got = fetch(self._fs, [(join(self._root, self.shards[k].name), lo * size, hi * size)
                               for _, k, lo, hi in pieces], self.merge_gap)
        col = [0] * len(ids)
        for (j, k, lo, hi), data in zip(pieces, got):
            self._check_length(k, lo, hi, len(data))
            out[j, col[j]:col[j] + hi - lo] = np.frombuffer(data, dtype=self.dtype)
            col[j] += hi - lo
        return out

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) in that shard of each shard's part of tokens ``[start, stop)``."""
        out = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            lo = start - self.starts[k]
            hi = min(stop, self.starts[k + 1]) - self.starts[k]
            out.append((k, lo, hi))
            start = self.starts[k] + hi
            k += 1
        return out

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream, across shard boundaries (one read per shard part)."""
        parts = [self._read_shard(k, lo, hi) for k, lo, hi in self._pieces(start, stop)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _read_shard(self, k: int, lo: int, hi: int) -> np.ndarray:
        size = self.dtype.itemsize
        if self.local:
            data = os.pread(self._fd(k), (hi - lo) * size, lo * size)
        else:
            data = self._fs.cat_file(join(self._root, self.shards[k].name), start=lo * size, end=hi * size)
        self._check_length(k, lo, hi, len(data))
        return np.frombuffer(data, dtype=self.dtype)

    def _check_length(self, k: int, lo: int, hi: int, got: int) -> None:
        if got != (hi - lo) * self.dtype.itemsize:
            raise PreparedDataError(f"short read from {self.shards[k].name} of {self.uri!r}: {got} bytes "
                                    f"for tokens [{lo}, {hi}); the shard is shorter than its manifest says")

    def _fd(self, k: int) -> int:
        """An open descriptor of local shard ``k`` (at most _OPEN_FILES kept, least recently used closed)."""
        with self._lock:
            fd = self._fds.pop(k, None)
            if fd is None:
                fd = os.open(join(self._root, self.shards[k].name), os.O_RDONLY)
            self._fds[k] = fd  # most recent last
            while len(self._fds) > _OPEN_FILES:
                os.close(self._fds.pop(next(iter(self._fds))))
            return fd
