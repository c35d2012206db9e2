"""Local checkpoint files leave the page cache once they are on disk, and are byte-exact.

Residency is read with ``mincore(2)`` on a mapping of the file (no timing): a save that left its whole size
in the cache is what made the writer slow (see :mod:`elastictrain.checkpoint.write_behind`).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

from elastictrain.checkpoint import CheckpointWriter
from elastictrain.checkpoint.write_behind import WriteBehindFile
from elastictrain.config import CheckpointConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/posix_fadvise are Linux")


def resident_fraction(path: Path) -> float:
    """Share of ``path``'s pages in the page cache."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private and writable: from_buffer works
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        del anchor
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        mm.close()
    return sum(v & 1 for v in vec) / pages


@pytest.fixture
def caching_dir(tmp_path: Path) -> Path:
    """``tmp_path`` if its file system keeps freshly written pages cached and lets a file's clean pages go
    when asked (else nothing to observe). tmpfs (a basetemp in /dev/shm or a tmpfs /tmp) keeps every page:
    its pages are the file, no write-behind can drop them, and the tests below would fail with nothing
    broken."""
    control = tmp_path / "control.bin"
    with open(control, "wb") as f:
        f.write(os.urandom(4 * 2**20))
        f.flush()
        os.fsync(f.fileno())
        if resident_fraction(control) < 0.5:
            pytest.skip(f"{tmp_path} does not keep written pages in the page cache")
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # what the write-behind asks, at the end
    if resident_fraction(control) > 0.5:
        pytest.skip(f"{tmp_path} keeps a file's pages after they were written and dropped (tmpfs?)")
    control.unlink()
    return tmp_path


def test_write_behind_file_is_byte_exact_and_leaves_the_cache(caching_dir: Path) -> None:
    path = caching_dir / "f.bin"
    chunks = [os.urandom(n) for n in (7, 300_000, 1, 2**20 + 3, 5 * 2**20, 64, 3 * 2**20 + 11)]
    with WriteBehindFile(str(path), window=2**20) as f:
        for c in chunks:
            assert f.write(memoryview(c)) == len(c)
        assert f.tell() == sum(map(len, chunks))
        f.finish()
    assert path.read_bytes() == b"".join(chunks)
    # read_bytes pulled it back in; write it again and look before anyone reads it
    with WriteBehindFile(str(path), window=2**20) as f:
        for c in chunks:
            f.write(c)
        f.finish()
    assert resident_fraction(path) < 0.1
    with pytest.raises(ValueError, match="window"):
        WriteBehindFile(str(caching_dir / "g.bin"), window=0)


def test_a_saved_checkpoint_does_not_stay_in_the_page_cache(caching_dir: Path) -> None:
    """Old writer: the whole shard stayed cached after its fsync (~1.0 resident)."""
    state = {"w": torch.randn(3 * 2**20), "v": torch.randn(2**20), "step": 3}
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait"), str(caching_dir / "ck"), 0, 1, None)
    try:
        writer.save_async(3, state)
        (report,) = writer.wait(60)
    finally:
        writer.close()
    assert report.error is None, report.error
    shards = [p for p in (caching_dir / "ck").rglob("*.distcp")]
    assert shards and sum(p.stat().st_size for p in shards) > 16 * 2**20
    for p in shards:
        assert resident_fraction(p) < 0.1, f"{p.name}: {resident_fraction(p):.2f} of its pages still cached"
        rel = str(p.relative_to(caching_dir / "ck" / "step_000000003"))
        assert report.files[rel].sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
