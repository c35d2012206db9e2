"""Coalesced byte-range reads over fsspec: the pieces a reader needs, merged into few ranged GETs, fetched at once.

Two readers use it on object stores (``s3://``): ``task.init_from``'s safetensors reader (a slice of rows is
one piece; a slice of columns one piece per row, :func:`slice_runs`, where the row blocks of
``models/hf_rows.py`` do not apply) and a prepared corpus's batch of windows
(data/windows.py). :func:`plan_reads` is the pure part: pieces sorted by (file, offset), and two neighbours of
one file merged into one read when the bytes between them are at most ``gap``; :func:`fetch` issues the plan's
reads in one ``fs.cat_ranges`` call (s3fs runs them concurrently) and hands each piece its bytes back, in the
order asked. Local paths never come here: they keep ``pread`` / memory maps.

Why :data:`MERGE_GAP` is 64 KiB (a prepared corpus's windows): a separate GET costs a round trip (first
byte after tens of ms on S3) and a request charge, while 64 KiB more of one response streams in a small
fraction of that at one connection's rate; so a merge at or under it never costs time. Gaps wider than that
are not fetched.

Why :data:`WEIGHTS_MERGE_GAP` is 1 MiB (``task.init_from``): there every rank of the job reads at once, from
one prefix, whose request rate S3 shares among all of them, so a GET costs far more than one connection's
round trip. A tensor-parallel row-wise layer (columns sharded) is read by row blocks (``models/hf_rows.py``:
each tp rank reads 1/tp of its rows in one range, an all-to-all of the tp group gives each its columns), so
the gap only decides how the ranges of different tensors (and a column slice outside the row blocks' cases)
merge; there, at 1 MiB, rows up to that width are read whole rather than one GET per row. The counts behind
both thresholds: docs/perf/2026-11-28-s3-ranges.md; the row blocks': docs/perf/2026-11-28-tp-rows.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MERGE_GAP", "WEIGHTS_MERGE_GAP", "Read", "plan_reads", "fetch", "slice_runs"]

MERGE_GAP = 64 << 10
WEIGHTS_MERGE_GAP = 1 << 20

Piece = tuple[str, int, int]  # (path, start, end): bytes [start, end) of one object


@dataclass(frozen=True)
class Read:
    """One ranged GET: bytes ``[start, end)`` of ``path``."""

    path: str
    start: int
    end: int


def plan_reads(pieces: Sequence[Piece], gap: int = MERGE_GAP) -> tuple[list[Read], list[tuple[int, int]]]:
    """The reads that cover ``pieces`` and, per piece (in the order given), ``(read index, offset of the piece
    in that read)``. Pieces of one path are sorted by offset and a piece joins the read before it when it
    starts at most ``gap`` bytes after that read's end (overlapping and touching pieces always join). An empty
    piece gets ``(-1, 0)`` and no read. Pure; raises ValueError for a negative gap or a piece that ends before
    it starts."""
    if gap < 0:
        raise ValueError(f"gap must be >= 0 bytes, got {gap}")
    for path, start, end in pieces:
        if start < 0 or end < start:
            raise ValueError(f"byte range [{start}, {end}) of {path} is not a range")
    reads: list[Read] = []
    where: list[tuple[int, int]] = [(-1, 0)] * len(pieces)
    for p in sorted((p for p, (_, s, e) in enumerate(pieces) if e > s), key=lambda p: pieces[p]):
        path, start, end = pieces[p]
        last = reads[-1] if reads else None
        if last is not None and last.path == path and start - last.end <= gap:
            reads[-1] = Read(path, last.start, max(last.end, end))
        else:
            reads.append(Read(path, start, end))
        where[p] = (len(reads) - 1, start - reads[-1].start)
    return reads, where


def fetch(fs: Any, pieces: Sequence[Piece], gap: int = MERGE_GAP) -> list[memoryview]:
    """The bytes of each of ``pieces`` (in the order given), read through :func:`plan_reads`' merged reads in
    one ``fs.cat_ranges`` call. A piece past the end of its object comes back short (the caller names it);
    a failed read raises what the file system raised."""
    reads, where = plan_reads(pieces, gap)
    blobs = fs.cat_ranges([r.path for r in reads], [r.start for r in reads], [r.end for r in reads],
                          on_error="raise") if reads else []
    views = [memoryview(b) for b in blobs]
    return [views[r][off:off + end - start] if r >= 0 else memoryview(b"")
            for (r, off), (_, start, end) in zip(where, pieces)]


def slice_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
               itemsize: int) -> list[tuple[int, int]]:
    """The contiguous byte runs, relative to the tensor's first byte and in C order, of the slice
    ``[offsets, offsets + lengths)`` of a C-contiguous tensor of ``shape``: one run when every dimension
    after the first sliced one is whole (a slice of rows), else one run per index of the outer dimensions
    (a slice of columns: one per row). A scalar is one run; an empty slice none."""
    if not shape:
        return [(0, itemsize)]
    if any(n == 0 for n in lengths):
        return []
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = len(shape) - 1  # the outermost dimension from which the slice is one contiguous run
    while k > 0 and offsets[k] == 0 and lengths[k] == shape[k]:
        k -= 1
    run = lengths[k] * strides[k] * itemsize
    inner = offsets[k] * strides[k]
    runs = []
    for index in itertools.product(*(range(offsets[d], offsets[d] + lengths[d]) for d in range(k))):
        start = (sum(i * strides[d] for d, i in enumerate(index)) + inner) * itemsize
        runs.append((start, start + run))
    return runs
