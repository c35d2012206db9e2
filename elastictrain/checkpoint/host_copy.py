"""Copies of training state into host memory that do not stall a GPU step.

On CPU a copy is a plain ``copy_`` and is complete when :func:`copy_to_host` returns. For CUDA sources the
copies are queued on a side CUDA stream of this process into pinned host buffers (DMA) and
:func:`copy_to_host` returns at once with a :class:`PendingCopy`: the next step's forward and backward run
on the compute stream while the copy engine drains the state. Two rules keep that correct:

* whoever reads the host buffers waits first (:meth:`PendingCopy.wait`: the checkpoint writer's thread,
  the peer tier's sender, a ``fetch``);
* nothing writes the sources in place before their copy is done: the step loop calls
  :func:`before_state_write` right before the optimizer step (the compute stream waits for every copy
  queued so far, a GPU-side wait that costs the CPU nothing), and :func:`settle` (a CPU-side wait) before
  a membership change replaces or reloads the state.

Source memory is marked as used by the side stream (``record_stream``), so freeing a source (a rank
releasing its model after a failed step) never hands its memory to a new tensor before the copy read it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

_lock = threading.Lock()
_pending: list[Any] = []   # CUDA events of copies the compute stream has not waited for yet
_streams: dict[int, Any] = {}


class PendingCopy:
    """A queued device -> host copy; ``wait()`` returns once the host buffers hold the data."""

    __slots__ = ("_event",)

    def __init__(self, event: Any = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


DONE = PendingCopy()


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)
        return _streams[index]


def copy_to_host(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> PendingCopy:
    """Copy each ``(host, source)`` pair: CPU sources now, CUDA sources on the side stream (queued after
    everything the compute stream has queued, so the copy sees the finished step). Host buffers for CUDA
    sources should be pinned (else the copy is synchronous). Returns the pending copy to wait on."""
    on_cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for host, src in pairs:
            if src.is_cuda:
                on_cuda.append((host, src))
            else:
                host.copy_(src.detach())
    if not on_cuda:
        return DONE
    device = on_cuda[0][1].device
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(stream):
        for host, src in on_cuda:
            host.copy_(src.detach(), non_blocking=host.is_pinned())
            src.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    with _lock:
        _pending.append(event)
    return PendingCopy(event)


def before_state_write() -> None:
    """Make the current CUDA stream wait for every copy queued so far (GPU-side; no CPU wait). Call right
    before the optimizer step or any other in-place write of the copied state."""
    with _lock:
        events, _pending[:] = list(_pending), []
    for event in events:
        torch.cuda.current_stream().wait_event(event)


def settle() -> None:
    """Wait (CPU-side) for every queued copy: before the state is replaced, reloaded or re-sharded."""
    with _lock:
        events, _pending[:] = list(_pending), []
    for event in events:
        event.synchronize()
