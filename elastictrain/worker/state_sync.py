"""Bring replicated state (DDP: model, optimizer, step) from one live rank to all others, in memory.

Joiners receive their state from a live peer, never from storage. Only the small structure travels
pickled (the optimizer's pytree spec, its non-tensor leaves, tensor shapes and dtypes); tensors travel with
``dist.broadcast`` with bounded extra memory: a contiguous tensor is broadcast in place, in slices of at
most ``chunk_bytes``; small tensors are packed into one reused bucket of at most ``chunk_bytes`` per
broadcast. Extra memory is at most one bucket (plus a contiguous copy of a non-contiguous tensor).

Every tensor a receiver allocates (optimizer state, buckets) is on its device of the type the source's
tensor has, so every broadcast pairs the same backend on all ranks (``cpu:gloo,cuda:nccl`` picks by device).
Tested with ``meta`` standing in for CUDA (tests/test_state_sync.py); it has never run on two GPUs.
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
    """Stands for a tensor leaf in the pickled header: receivers allocate it (:func:`allocate_leaves`) on
    their own device of the same type as the source's (``device_type``): Adam's moments live with the
    parameters (CUDA), its ``step`` counters on the CPU."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str = "cpu"


def local_devices(model: torch.nn.Module) -> dict[str, torch.device]:
    """This rank's device of each type its model uses (e.g. ``{"cpu": cpu, "cuda": cuda:3}``): where a
    receiver allocates a tensor the source holds on a device of that type."""
    out = {"cpu": torch.device("cpu")}
    for t in [*model.parameters(), *model.buffers()]:
        out.setdefault(t.device.type, t.device)
    return out


def allocate_leaves(leaves: list[Any], devices: dict[str, torch.device]) -> list[Any]:
    """PURE (allocation only). The receiver's optimizer leaves: a tensor for each :class:`_TensorSlot`, on
    ``devices[slot.device_type]`` -- the same device type as the source's, so each broadcast pairs the same
    backend on every rank (NCCL with NCCL; a CPU receiver of a CUDA source would pair gloo with NCCL).
    Raises RuntimeError if this rank has no device of that type."""
    out = []
    for x in leaves:
        if isinstance(x, _TensorSlot):
            if x.device_type not in devices:
                raise RuntimeError(f"the source holds optimizer state on {x.device_type} but this rank's model "
                                   f"uses {sorted(devices)}: every worker must use the same device type")
            x = torch.empty(x.shape, dtype=x.dtype, device=devices[x.device_type])
        out.append(x)
    return out


def bucket_for(run: list[torch.Tensor], bucket: torch.Tensor | None, chunk_bytes: int) -> torch.Tensor:
    """The packing buffer for ``run`` (tensors of one dtype and one device): ``bucket`` reused when it fits,
    else a new one on the run's device (a CPU bucket for CUDA tensors would send them over gloo)."""
    n = sum(t.numel() for t in run)
    first = run[0]
    if bucket is not None and bucket.dtype == first.dtype and bucket.device == first.device and bucket.numel() >= n:
        return bucket
    return torch.empty(max(n, chunk_bytes // first.element_size()), dtype=first.dtype, device=first.device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(tensors: list[torch.Tensor], chunk_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Runs of consecutive small tensors of one dtype and device, each run at most ``chunk_bytes``; a tensor
    of at least ``chunk_bytes / 4`` is a run of its own (sent in place). Same order on every rank."""
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        big = _nbytes(t) * 4 >= chunk_bytes
        if run and (big or t.dtype != run[0].dtype or t.device != run[0].device or size + _nbytes(t) > chunk_bytes):
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
        bucket = bucket_for(run, bucket, chunk_bytes)
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
        slots = [_TensorSlot(tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else x
                 for x in leaves]
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
        leaves = allocate_leaves(leaves, local_devices(model))
        opt_tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    _broadcast_chunked(model_tensors + opt_tensors, src, group, chunk_bytes)
    if rank != src:
        optimizer.load_state_dict(pytree.tree_unflatten(leaves, pytree.treespec_loads(meta["spec"])))
    return int(meta["step"])
