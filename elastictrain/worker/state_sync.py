"""Bring replicated state (DDP: model, optimizer, step) from one live rank to all others, in memory.

Joiners receive their state from a live peer, never from storage. Only the small structure travels
pickled (the optimizer's pytree spec, its non-tensor leaves, tensor shapes and dtypes); tensors travel with
``dist.broadcast`` with bounded extra memory: a contiguous tensor is broadcast in place, in slices of at
most ``chunk_bytes``; small tensors are packed into one reused bucket of at most ``chunk_bytes`` per
broadcast. Extra memory is at most one bucket (plus a contiguous copy of a non-contiguous tensor).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor leaf in the pickled header: receivers allocate it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Runs of consecutive small tensors of one dtype, each run at most ``chunk_bytes``; a tensor of at
    least ``chunk_bytes / 4`` is a run of its own (sent in place). Same order on every rank."""
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        big = _nbytes(t) * 4 >= chunk_bytes
        if run and (big or t.dtype != run[0].dtype or size + _nbytes(t) > chunk_bytes):
            yield run
            run, size = [], 0
        if big:
            yield [t]
            continue
        run.append(t)
        size += _nbytes(t)
    if run:
        yield run


def _broadcast_in_place(t: torch.Tensor, src: int, group: Any, chunk_bytes: int) -> None:
    flat = t.detach() if t.is_contiguous() else t.detach().contiguous()
    flat = flat.view(-1)
    step = max(1, chunk_bytes // max(1, t.element_size()))
    for start in range(0, flat.numel(), step):
        dist.broadcast(flat[start:start + step], src=src, group=group)
    if flat.data_ptr() != t.data_ptr():
        with torch.no_grad():
            t.copy_(flat.view_as(t))


def _broadcast_chunked(tensors: list[torch.Tensor], src: int, group: Any, chunk_bytes: int) -> None:
    bucket: torch.Tensor | None = None
    for run in _buckets(tensors, chunk_bytes):
        if len(run) == 1:
            _broadcast_in_place(run[0], src, group, chunk_bytes)
            continue
        n = sum(t.numel() for t in run)
        if bucket is None or bucket.dtype != run[0].dtype or bucket.numel() < n:
            bucket = torch.empty(max(n, chunk_bytes // run[0].element_size()), dtype=run[0].dtype)
        flat, offset = bucket[:n], 0
        with torch.no_grad():
            for t in run:
                flat[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in run:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, *, src: int, group: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Make every rank's model, optimizer and step equal to rank ``src``'s. Collective. Returns the step.
    Raises RuntimeError if the ranks' models have different structures."""
    rank = dist.get_rank(group)
    model_tensors = list(model.state_dict().values())
    header: list[Any] = [None]
    opt_tensors: list[torch.Tensor] = []
    if rank == src:
        leaves, spec = pytree.tree_flatten(optimizer.state_dict())
        opt_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        slots = [_TensorSlot(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves]
        header[0] = {"step": step, "spec": pytree.treespec_dumps(spec), "leaves": slots,
                     "model": [(tuple(t.shape), t.dtype) for t in model_tensors]}
    dist.broadcast_object_list(header, src=src, group=group)
    meta = header[0]
    mine = [(tuple(t.shape), t.dtype) for t in model_tensors]
    if meta["model"] != mine:
        raise RuntimeError(
            f"model structure differs between ranks ({len(meta['model'])} vs {len(mine)} tensors, or their "
            "shapes/dtypes): every worker must build the same model"
        )
    leaves = meta["leaves"]
    if rank != src:
        leaves = [torch.empty(x.shape, dtype=x.dtype) if isinstance(x, _TensorSlot) else x for x in leaves]
        opt_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    _broadcast_chunked(model_tensors + opt_tensors, src, group, chunk_bytes)
    if rank != src:
        optimizer.load_state_dict(pytree.tree_unflatten(leaves, pytree.treespec_loads(meta["spec"])))
    return int(meta["step"])
