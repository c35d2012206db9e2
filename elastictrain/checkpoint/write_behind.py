"""Local checkpoint files written so that the page cache neither slows the write nor fills up with it.

Where the time went (``benchmarks/checkpoint.py``, 384 MiB, ext4 on a VM): ``write()`` into a NEW file ran
at ~270 MiB/s while the same bytes written into page-cache pages the kernel had just freed ran at
~1.5 GiB/s, and the final ``fsync`` then waited for every byte at once. The slow part is the first touch of
page-cache memory the kernel has not recycled lately (on a VM: memory the host has to back first); a
checkpoint writes its whole size into the cache on every save and never reads it back.

So :class:`WriteBehindFile`, every ``window`` bytes, asks the kernel to start writing back what was written
so far and to drop the pages that are already on disk (``posix_fadvise(DONTNEED)`` does both: it starts
asynchronous write-back of dirty pages in the range and evicts the clean ones). The file's footprint in the
cache stays at a few windows, the same warm pages are recycled for the rest of the file, and by the end
only the last window is left for ``fsync``. After ``fsync`` the whole file is dropped: the bytes are on
disk, and page cache is charged to a container's memory limit. The advice is only advice: where the call
is missing (not Linux) or refused (a file system without a page cache) the file is written plainly.
"""

from __future__ import annotations

import io
import os
from typing import Any

WINDOW = 16 * 2**20  # bytes between write-back kicks: small enough to stay in cache, big enough to batch IO
_BUFFER = 2**20  # coalesces torch.save's small header writes; large chunks go straight through

_fadvise = getattr(os, "posix_fadvise", None)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 0)


class WriteBehindFile(io.RawIOBase):
    """Write-only local file: streams its pages to disk while being written; :meth:`finish` makes it
    durable (fsync) and drops it from the page cache. ``tell`` counts bytes written."""

    def __init__(self, path: str, window: int = WINDOW) -> None:
        super().__init__()
        if window <= 0:
            raise ValueError(f"write-behind window must be > 0 bytes, got {window}")
        self._f = open(path, "wb", buffering=_BUFFER)  # noqa: SIM115 - closed in close()
        self._fd = self._f.fileno()
        self._window = window
        self._pos = 0
        self._kicked = 0  # bytes [0, _kicked) were handed to write-back
        self._advice = _fadvise is not None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self._pos += n
        if self._pos - self._kicked >= self._window:
            self._f.flush()
            # from one window back: pages whose write-back the previous kick started are clean by now
            start = max(0, self._kicked - self._window)
            self._advise(start, self._pos - start)
            self._kicked = self._pos
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._f.flush()

    def finish(self) -> None:
        """Flush, fsync, and drop the file's pages from the cache (they are on disk now)."""
        self._f.flush()
        os.fsync(self._fd)
        self._advise(0, 0)  # length 0: to the end of the file

    def close(self) -> None:
        if not self.closed:
            try:
                super().close()  # flushes through self.flush, so before the file goes
            finally:
                self._f.close()

    def _advise(self, offset: int, length: int) -> None:
        if not self._advice:
            return
        try:
            _fadvise(self._fd, offset, length, _DONTNEED)
        except OSError:  # advice refused (e.g. a file system without a page cache): write plainly
            self._advice = False
