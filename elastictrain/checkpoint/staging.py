"""Staging: copy a nested state dict into host memory so training may mutate its tensors right away.

On CPU the copy is the whole training stall of an asynchronous checkpoint, so host buffers are reused: a
:class:`StagingPool` keeps the buffers of finished saves and hands them to the next save with the same
tensor layout, which makes a steady-state stage a plain ``memcpy`` into already-faulted-in memory (fresh
allocations would pay a page fault per 4 KiB). DTensors (FSDP2/HSDP shards) stage their local shard and come
back as DTensors over the host copy. Buffers for CUDA sources are pinned and the device -> host copy runs on a
side stream while training goes on (:mod:`elastictrain.checkpoint.host_copy`).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from elastictrain.checkpoint.host_copy import DONE, PendingCopy, copy_to_host

Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass
class Staged:
    """A staged copy: ``state`` (same nesting as the source, tensors replaced by host copies) and the
    flat list of host buffers backing it, to hand back to the pool when the save is done."""

    state: Any
    buffers: list[torch.Tensor]
    signature: Signature
    nbytes: int
    ready: PendingCopy = DONE  # copies from CUDA sources may still be in flight: wait() before reading

    def wait(self) -> None:
        self.ready.wait()


def _split(state: Any) -> tuple[list[Any], Any, list[int]]:
    """Leaves, tree spec and the positions of the tensor leaves (``torch.utils._pytree`` order)."""
    leaves, spec = tree_flatten(state)
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _host(src: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if isinstance(src, DTensor):
        # The host copy of the shard, with the source's global layout (its spec). Not DTensor.from_local: it
        # moves a local tensor to the mesh's device type, i.e. copies a CUDA mesh's staged shard straight
        # back to the GPU (the whole state twice in GPU memory, and slower staging:
        # docs/perf/2026-11-23-code-figures.md). DCP's writer reads the local tensor where it is.
        return DTensor(buf, src._spec, requires_grad=False)
    return buf


def _rebuild(leaves: list[Any], spec: Any, where: list[int], buffers: list[torch.Tensor]) -> Any:
    # python scalars, strings, None: immutable or small; a deep copy keeps later mutation out of the save
    out = [None if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf) for leaf in leaves]
    for i, buf in zip(where, buffers):
        out[i] = _host(leaves[i], buf)
    return tree_unflatten(out, spec)


class StagingPool:
    """Hands out host buffers for staging and takes them back; thread-safe. Keeps at most ``keep`` idle
    buffer sets (one per save that may be in flight)."""

    def __init__(self, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"StagingPool keep must be >= 1, got {keep}")
        self._keep = keep
        self._idle: list[tuple[Signature, list[torch.Tensor]]] = []
        self._lock = threading.Lock()

    def _take(self, signature: Signature, pin: bool) -> list[torch.Tensor]:
        with self._lock:
            for i, (sig, bufs) in enumerate(self._idle):
                if sig == signature:
                    return self._idle.pop(i)[1]
        return [torch.empty(shape, dtype=dtype, pin_memory=pin) for shape, dtype in signature]

    def stage(self, state: Any) -> Staged:
        """Copy every tensor of ``state`` to host memory. CPU sources are copied when this returns; CUDA
        sources are queued on a side stream into pinned buffers (``Staged.wait`` before reading; see
        :mod:`elastictrain.checkpoint.host_copy`)."""
        leaves, spec, where = _split(state)
        sources = [_local(leaves[i]) for i in where]  # DTensors: stage this rank's shard
        signature: Signature = tuple((tuple(t.shape), t.dtype) for t in sources)
        on_cuda = any(t.is_cuda for t in sources)
        buffers = self._take(signature, pin=on_cuda)
        ready = copy_to_host(zip(buffers, sources))
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        return Staged(_rebuild(leaves, spec, where, buffers), buffers, signature, nbytes, ready)

    def release(self, staged: Staged) -> None:
        """Return a finished save's buffers for reuse (the oldest idle set is dropped beyond ``keep``)."""
        staged.wait()  # never refill buffers a copy is still writing
        with self._lock:
            self._idle.append((staged.signature, staged.buffers))
            del self._idle[: max(0, len(self._idle) - self._keep)]

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
