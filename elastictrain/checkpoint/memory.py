"""In-memory tier: each rank's latest snapshot kept by a keeper actor on ANOTHER node.

A lost node loses its workers but not their state: a replacement fetches the snapshot from the peer
node's :class:`ShardKeeper` instead of going back to the last durable checkpoint. The keeper holds one
snapshot per rank (the newest step wins) inside a byte budget; when a put would exceed it, the oldest
snapshots of other ranks are evicted, and a snapshot larger than the whole budget is rejected. Every put
returns a :class:`PutResult` saying which of these happened, so the caller can emit an event.

Placement (which node's keeper a rank pushes to) is the controller's decision, not made here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
import torch


@dataclass(frozen=True)
class PutResult:
    accepted: bool
    reason: str
    evicted: list[tuple[int, int]] = field(default_factory=list)  # (rank, step) dropped to make room


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class KeeperState:
    """The keeper's bookkeeping, separate from Ray so it can be tested directly."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"ShardKeeper budget must be > 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._snaps: dict[int, tuple[int, Any, int, int]] = {}  # rank -> (step, tensors, nbytes, seq)
        self._seq = 0

    def put(self, rank: int, step: int, tensors: Any) -> PutResult:
        size = _nbytes(tensors)
        old = self._snaps.get(rank)
        if old is not None and old[0] > step:
            return PutResult(False, f"rank {rank}: step {step} is older than the kept step {old[0]}; ignored")
        if size > self.budget:
            return PutResult(False, f"rank {rank} step {step}: {size} bytes exceed the keeper budget {self.budget}")
        others = {r: s for r, s in self._snaps.items() if r != rank}
        evicted = []
        used = sum(s[2] for s in others.values())
        for r, snap in sorted(others.items(), key=lambda kv: kv[1][3]):  # oldest put first
            if used + size <= self.budget:
                break
            evicted.append((r, snap[0]))
            used -= snap[2]
            del self._snaps[r]
        self._seq += 1
        self._snaps[rank] = (step, tensors, size, self._seq)
        why = f"kept rank {rank} step {step} ({size} bytes)"
        if evicted:
            why += f"; evicted {evicted} to stay within {self.budget} bytes"
        return PutResult(True, why, evicted)

    def get(self, rank: int, step: int | None = None) -> tuple[int, Any] | None:
        snap = self._snaps.get(rank)
        if snap is None or (step is not None and snap[0] != step):
            return None
        return snap[0], snap[1]

    def stats(self) -> dict[str, int]:
        return {"bytes": sum(s[2] for s in self._snaps.values()), "entries": len(self._snaps)}


@ray.remote(num_cpus=0)
class ShardKeeper:
    """Per-node Ray actor holding other nodes' rank snapshots (see module doc)."""

    def __init__(self, budget_bytes: int) -> None:
        self._state = KeeperState(budget_bytes)

    def put(self, rank: int, step: int, tensors: Any) -> PutResult:
        return self._state.put(rank, step, tensors)

    def get(self, rank: int, step: int | None = None) -> tuple[int, Any] | None:
        return self._state.get(rank, step)

    def stats(self) -> dict[str, int]:
        return self._state.stats()


class MemoryReplicator:
    """Worker side: push this rank's state to a keeper without waiting for it.

    At most one push is in flight; a newer push issued meanwhile replaces any older one still waiting
    (only the latest snapshot matters). ``ray.put`` copies the tensors into the object store before
    :meth:`push_async` returns, so the caller may mutate them right after.
    """

    def __init__(self, keeper: Any, rank: int) -> None:
        self._keeper = keeper
        self._rank = rank
        self._in_flight: Any = None
        self._next: tuple[int, Any] | None = None
        self.results: list[PutResult] = []

    def push_async(self, step: int, state: Any) -> None:
        """Queue ``state`` of ``step`` for the keeper; drops an older queued push."""
        self._next = (step, ray.put(state))
        self.poll()

    def poll(self) -> None:
        """Collect a finished push and start the queued one; never blocks."""
        if self._in_flight is not None:
            ready, _ = ray.wait([self._in_flight], timeout=0)
            if not ready:
                return
            self._collect()
        if self._next is not None:
            step, ref = self._next
            self._next = None
            self._in_flight = self._keeper.put.remote(self._rank, step, ref)

    def _collect(self) -> None:
        try:
            self.results.append(ray.get(self._in_flight))
        except Exception as e:  # noqa: BLE001 - keeper died or errored: a failed replica, not a failed step
            self.results.append(PutResult(False, f"push to keeper failed: {type(e).__name__}: {e}"))
        self._in_flight = None

    def flush(self, timeout: float | None = None) -> list[PutResult]:
        """Wait for the in-flight and queued pushes (each bounded by ``timeout``); return all results."""
        while self._in_flight is not None or self._next is not None:
            if self._in_flight is not None:
                ready, _ = ray.wait([self._in_flight], timeout=timeout)
                if not ready:
                    break
                self._collect()
            self.poll()
        out, self.results = self.results, []
        return out
