"""Next-token windows over a prepared corpus, read by range (no worker loads the corpus).

:class:`PreparedWindows` is the map-style dataset of a prepared split (:mod:`elastictrain.data.shards`): sample
``i`` is the token range ``[i*seq_len, i*seq_len + seq_len + 1)`` of the split's stream (its shards
concatenated), exactly as :class:`~elastictrain.data.datasets.TokenWindows` slices an in-memory tensor, so the
global sample cursor indexes it unchanged. A POSIX (Lustre) path is read with one ``pread`` per window piece:
the kernel's page cache keeps what was read, shared and reclaimable, and the process maps nothing (a memory
map would count every page a long run touched, and its fault-around neighbours, in the worker's RSS). Any
other fsspec URL (``s3://``) is read by ranged reads, with :meth:`PreparedWindows.prefetch` fetching this
and the next step's windows in background threads. What a worker holds is bounded by two steps' windows,
whatever the corpus size.
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

from elastictrain.data.shards import Manifest, PreparedDataError, join, numpy_dtype, read_manifest

__all__ = ["PreparedWindows"]

# Ranged reads in flight at once per worker (S3 answers each in a round trip; a few overlap the latency).
_READ_THREADS = 4
_OPEN_FILES = 64  # local shards kept open (a corpus of many thousand shards must not exhaust descriptors)


class PreparedWindows:
    """Windows of ``seq_len + 1`` tokens over split ``split`` of the prepared corpus at ``uri``.

    Raises PreparedDataError when the manifest is missing or malformed, or the split is too short for one
    window. ``prefetch(ids)`` (remote URIs) starts reading those windows in a background thread; call
    :meth:`close` to stop it (the worker process ending stops it too: the thread is a daemon).
    """

    def __init__(self, uri: str, seq_len: int, split: str = "train",
                 storage_options: dict[str, Any] | None = None, manifest: Manifest | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.uri, self.seq_len, self.split = uri, seq_len, split
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
        self._ahead: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # Pickled to the workers: no open maps, pools or file systems travel.
    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "seq_len": self.seq_len, "split": self.split,
                "storage_options": self.storage_options, "manifest": self.manifest}

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
        i = operator.index(index)
        if not 0 <= i < self._len:
            raise IndexError(f"sample index {i} out of range [0, {self._len})")
        with self._lock:
            ahead = self._ahead.pop(i, None) if self._ahead else None
        tokens = ahead.result() if ahead is not None else self._read_window(i)
        x = torch.from_numpy(tokens.astype(np.int64))
        return {"input": x[:-1], "target": x[1:]}

    def batch(self, ids: Any) -> dict[str, torch.Tensor]:
        """The windows ``ids`` as one batch: exactly ``_default_collate([self[i] for i in ids])`` of the step loop
        (``input`` and ``target`` stacked, int64, contiguous), read into one array instead of one tensor per
        window: the step loop's read-ahead thread holds Python's interpreter lock for less of the step."""
        ids = [operator.index(i) for i in ids]
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for j, i in enumerate(ids):
            if not 0 <= i < self._len:
                raise IndexError(f"sample index {i} out of range [0, {self._len})")
            with self._lock:
                ahead = self._ahead.pop(i, None) if self._ahead else None
            out[j] = ahead.result() if ahead is not None else self._read_window(i)
        x = torch.from_numpy(out)
        return {"input": x[:, :-1].contiguous(), "target": x[:, 1:].contiguous()}

    def prefetch(self, ids: Any) -> None:
        """Read the windows ``ids`` in background threads (remote URIs; a memory map needs none). Call with
        the current and the next step's ids of this rank: windows asked for before and not in ``ids`` are
        dropped, so what waits is bounded by those two steps' windows."""
        if self.local:
            return
        wanted = [int(i) for i in ids if 0 <= int(i) < self._len]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="elastictrain-read-ahead")
            keep = set(wanted)
            for i in [i for i in self._ahead if i not in keep]:  # e.g. another rank's after a regroup
                self._ahead.pop(i).cancel()
            for i in wanted:
                if i not in self._ahead:
                    self._ahead[i] = self._pool.submit(self._read_window, i)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # ------------------------------------------------------------------ reading
    def _read_window(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.read_tokens(start, start + self.seq_len + 1)

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the split's stream, across shard boundaries."""
        parts = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            lo = start - self.starts[k]
            hi = min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(self._read_shard(k, lo, hi))
            start = self.starts[k] + hi
            k += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _read_shard(self, k: int, lo: int, hi: int) -> np.ndarray:
        size = self.dtype.itemsize
        if self.local:
            data = os.pread(self._fd(k), (hi - lo) * size, lo * size)
        else:
            data = self._fs.cat_file(join(self._root, self.shards[k].name), start=lo * size, end=hi * size)
        if len(data) != (hi - lo) * size:
            raise PreparedDataError(f"short read from {self.shards[k].name} of {self.uri!r}: {len(data)} bytes "
                                    f"for tokens [{lo}, {hi}); the shard is shorter than its manifest says")
        return np.frombuffer(data, dtype=self.dtype)

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
