"""Row blocks for ``task.init_from``'s ranged reader: a tensor sharded on a dimension after its first (a
tensor-parallel row-wise layer's input features) is read by the ranks that share its rows as contiguous blocks
of whole rows, one per rank, and redistributed into each rank's columns with one all-to-all of their group.

The problem it solves: safetensors store a tensor in C order, so a rank holding columns ``[c0, c1)`` of every
row needs one short strided piece per row: either one GET per row (millions per rank for a 405B model at tp 8)
or whole rows read and the other columns dropped (tp times the bytes it holds). Here the ``n`` ranks of the
sharding mesh dimension (the tp group) hold the same rows and together all columns, so rank ``j`` reads rows
``[r_j, r_{j+1})`` whole (one range: 1/n of the group's rows), cuts them into each peer's columns and sends
them; it receives its own columns of every peer's rows. Bytes read per rank: its share; GETs per tensor:
one range (merged with its neighbours as any range is, :mod:`elastictrain.byte_ranges`).

When it applies (:func:`plan_row_block`, pure): a DTensor of at least two dimensions whose placements shard
exactly one dimension ``d >= 1``, on exactly one mesh dimension of more than one rank, with plain
``Shard(d)`` (a ``_StridedShard`` interleaves; two mesh dimensions on the columns would need a
two-level exchange); every other mesh dimension replicates or shards dimension 0 (FSDP's rows: the same rows
for the whole group, since the tp coordinate does not move them). Anything else keeps the per-slice path
(its slice is then rows: one range already, or it is a layout this exchange does not cover) -- and local
paths always do: torch's ``HuggingFaceStorageReader`` copies a column slice out of a memory map, no request
per row to save. Dimensions 0..d-1 are flattened into the rows (1..d-1 are whole), so a 3-d tensor sharded
on its last dimension splits ``lengths[0] * shape[1]`` rows.

:func:`pack` and :func:`unpack` are the pure halves of the exchange (bytes in, bytes out, for a list of
tensors of one group); :func:`exchange` is the one collective between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RowBlock", "RowJob", "plan_row_block", "row_jobs", "pack", "recv_sizes", "unpack", "exchange"]


@dataclass(frozen=True)
class RowBlock:
    """One tensor's exchange as seen by one rank of the group: peer ``j`` reads flattened rows
    ``[first_row + bounds[j], first_row + bounds[j + 1])`` whole and holds columns ``cols[j]`` (offset,
    length) of dimension ``dim``; this rank is peer ``me`` and holds the slice ``offsets`` / ``lengths``."""

    dim: int
    first_row: int  # global index of the group's first row (rows: dimensions 0..dim-1 flattened)
    bounds: tuple[int, ...]  # n + 1 row counts from first_row
    row_bytes: int  # one flattened row: prod(shape[dim:]) elements
    inner_bytes: int  # one index of ``dim``: prod(shape[dim + 1:]) elements
    cols: tuple[tuple[int, int], ...]
    me: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def peers(self) -> int:
        return len(self.cols)

    def rows(self, j: int) -> int:
        return self.bounds[j + 1] - self.bounds[j]

    def read_range(self) -> tuple[int, int]:
        """This rank's bytes ``[start, end)`` relative to the tensor's first byte: its block of rows."""
        start = (self.first_row + self.bounds[self.me]) * self.row_bytes
        return start, start + self.rows(self.me) * self.row_bytes

    def send_bytes(self, j: int) -> int:
        """Bytes this rank sends peer ``j``: its rows, ``j``'s columns."""
        return self.rows(self.me) * self.cols[j][1] * self.inner_bytes

    def recv_bytes(self, j: int) -> int:
        """Bytes this rank receives from peer ``j``: ``j``'s rows, its own columns."""
        return self.rows(j) * self.cols[self.me][1] * self.inner_bytes


def plan_row_block(shape: Sequence[int], itemsize: int, offsets: Sequence[int], lengths: Sequence[int],
                   placements: Sequence[Any], mesh_shape: Sequence[int], coordinate: Sequence[int]
                   ) -> tuple[RowBlock | None, int | None, str]:
    """``(block, mesh dim, reason)`` for a DTensor of global ``shape`` (elements of ``itemsize`` bytes) whose
    local slice on this rank is ``offsets`` / ``lengths``, under ``placements`` on a mesh of ``mesh_shape``
    where this rank is at ``coordinate``; ``block`` and the mesh dimension of the exchange are None where the
    row-block read does not apply, and ``reason`` says why (or what applies). Pure. Raises ValueError when
    the local slice is not the chunk torch's ``Shard`` gives for ``coordinate`` (no layout does that: a bug;
    raised rather than a fall-back, which would leave the group's peers waiting in the exchange)."""
    from torch.distributed.tensor import Replicate, Shard

    if len(shape) < 2:
        return None, None, "fewer than 2 dimensions: its slice is one range"
    columns = []
    for m, p in enumerate(placements):
        if type(p) is Shard:
            if p.dim % len(shape) != 0 and mesh_shape[m] > 1:
                columns.append((m, p.dim % len(shape)))
        elif not isinstance(p, Replicate):
            return None, None, f"placement {p} on mesh dim {m}: only Shard and Replicate are exchanged"
    if not columns:
        return None, None, "no dimension after the first is sharded: its slice is whole rows, one range"
    if len(columns) > 1:
        return None, None, f"dimensions after the first sharded on mesh dims {[m for m, _ in columns]}: per-slice reads"
    m, d = columns[0]
    n = mesh_shape[m]
    cols = tuple((int(o), int(s)) for s, o in (Shard.local_shard_size_and_offset(shape[d], n, j) for j in range(n)))
    for k in range(1, len(shape)):  # torch's own chunking (DTensor): a mismatch is no layout, a bug
        want = cols[coordinate[m]] if k == d else (0, shape[k])
        if (offsets[k], lengths[k]) != want:
            raise ValueError(f"local slice {list(offsets)}+{list(lengths)} of a tensor of shape {list(shape)} under "
                             f"{list(placements)}: dimension {k} is not the chunk {want} torch's Shard gives")
    outer = math.prod(shape[1:d])
    total = lengths[0] * outer
    bounds = tuple(j * total // n for j in range(n + 1))
    inner = math.prod(shape[d + 1:]) * itemsize
    block = RowBlock(d, offsets[0] * outer, bounds, shape[d] * inner, inner, cols, coordinate[m],
                     tuple(offsets), tuple(lengths))
    return block, m, f"dimension {d} sharded over mesh dim {m} ({n} ranks): row blocks exchanged"


def pack(items: Sequence[tuple[RowBlock, Any]]) -> tuple[torch.Tensor, list[int]]:
    """The send buffer of one exchange (uint8: for peer 0 every tensor's piece in order, then for peer 1, ...)
    and its split sizes, from each tensor's block of rows (``items``: (block, its bytes as read))."""
    n = items[0][0].peers if items else 0
    sizes = [sum(b.send_bytes(j) for b, _ in items) for j in range(n)]
    out = np.empty(sum(sizes), dtype=np.uint8)
    pos = 0
    for j in range(n):
        for b, raw in items:
            size = b.send_bytes(j)
            if size:
                off, length = b.cols[j]
                rows = np.frombuffer(raw, dtype=np.uint8).reshape(b.rows(b.me), b.row_bytes // b.inner_bytes,
                                                                  b.inner_bytes)
                out[pos:pos + size].reshape(b.rows(b.me), length, b.inner_bytes)[...] = rows[:, off:off + length]
            pos += size
    return torch.from_numpy(out), sizes


def recv_sizes(blocks: Sequence[RowBlock]) -> list[int]:
    """Bytes this rank receives from each peer in one exchange of ``blocks``."""
    n = blocks[0].peers if blocks else 0
    return [sum(b.recv_bytes(j) for b in blocks) for j in range(n)]


def unpack(blocks: Sequence[RowBlock], received: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's local slice (uint8, C order: ``lengths`` with its last dimension in bytes) from the receive
    buffer of one exchange (from peer 0 every tensor's piece in order, then from peer 1, ...)."""
    parts: list[list[torch.Tensor]] = [[] for _ in blocks]
    pos = 0
    for j in range(blocks[0].peers if blocks else 0):
        for i, b in enumerate(blocks):
            size = b.recv_bytes(j)
            parts[i].append(received[pos:pos + size].view(b.rows(j), b.cols[b.me][1] * b.inner_bytes))
            pos += size
    return [torch.cat(p) if len(p) > 1 else p[0].clone() for p in parts]


def exchange(items: Sequence[tuple[RowBlock, Any]], group: Any, device: torch.device) -> list[torch.Tensor]:
    """Each tensor's local slice (uint8, as :func:`unpack` gives it, on ``device``) from every rank's block of
    rows: one ``all_to_all_single`` over ``group`` (the exchange's mesh dimension; every rank of it calls this
    with the same tensors in the same order). Raises what the collective raises (a peer gone: its timeout)."""
    import torch.distributed as dist

    send, send_split = pack(items)
    blocks = [b for b, _ in items]
    got_split = recv_sizes(blocks)
    received = torch.empty(sum(got_split), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, send.to(device), got_split, send_split, group=group)
    return unpack(blocks, received)


@dataclass(frozen=True)
class RowJob:
    """A tensor read by row blocks on this rank: its plan and the group that exchanges it."""

    block: RowBlock
    group: Any  # the ProcessGroup of the exchange's mesh dimension
    ranks: tuple[int, ...]  # its global ranks: exchanges are batched per group, groups taken in this order
    device: torch.device  # where the collective's buffers live (the local shard's device)


def row_jobs(tensors: dict[str, Any], itemsizes: dict[str, int]) -> dict[str, RowJob]:
    """The tensors of ``tensors`` (name -> the DTensor or plain tensor to fill) that are read by row blocks
    (:func:`plan_row_block`), by name; ``itemsizes``: bytes of one element as stored, by name (the files'
    dtype, not the model's; a name without one is left to the per-slice path). Every rank of a group gets the
    same names: the decision depends only on the global shape, the placements, the mesh and the files."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    jobs = {}
    for name, t in tensors.items():
        if not isinstance(t, DTensor) or name not in itemsizes:
            continue
        mesh = t.device_mesh
        if mesh.get_coordinate() is None:  # not in this tensor's mesh: nothing held
            continue
        lengths, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        block, m, _ = plan_row_block(tuple(t.shape), itemsizes[name], offsets, lengths, t.placements,
                                     tuple(mesh.shape), tuple(mesh.get_coordinate()))
        if block is not None and m is not None:
            group = mesh.get_group(m)
            jobs[name] = RowJob(block, group, tuple(dist.get_process_group_ranks(group)), t.to_local().device)
    return jobs
