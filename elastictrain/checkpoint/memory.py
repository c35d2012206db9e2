"""The peer memory tier: every rank's snapshot kept in host memory by a keeper actor on ANOTHER node.

Gemini (SOSP'23) keeps each machine's checkpoint in a peer machine's CPU memory; so do we. Every
``checkpoint.memory_every_steps`` steps each rank takes a collective-free snapshot of its own DCP state
(:func:`~elastictrain.checkpoint.memory_dcp.take_snapshot`: its shards of parameters and optimizer state,
plus step and data cursor) and sends it straight to a :class:`ShardKeeper`, one per node, that the
controller placed on a node other than the rank's own (:func:`keeper_ring`). The driver never touches the
bytes: it only reads the keepers' catalogues (chunk metadata) to decide, and the next generation's ranks
pull the chunks they need from the keepers through a DCP reader
(:class:`~elastictrain.checkpoint.memory_dcp.SnapshotReader` over :class:`KeeperSource`), resharding to
any new layout or world size.

Why keeper actors and not the Ray object store: an object belongs to the worker that put it, and Ray
loses an object whose owner died even when a copy sits on another node -- exactly the failure this tier
exists for. A keeper actor owns the bytes in its own heap, on a node chosen by the controller, and
outlives the workers. A keeper dies with its node; that is why a rank never uses its own node's keeper
(unless the cluster has a single node, where the tier then covers process deaths only).

The keeper holds the newest :data:`KEEP_PER_RANK` snapshots of each (generation, rank) -- two, so that
a complete set of one step survives while the next step's pushes are in flight -- inside a byte budget.
When a put would exceed the budget, the oldest puts of other ranks are evicted; a snapshot larger than
the whole budget is rejected. Every put returns a :class:`PutResult`; the worker reports rejected ones
to the controller, which emits ``memory_snapshot_rejected`` and a log line (never silent). A snapshot taken
and then dropped -- replaced by the next before it was sent, left unsent when the replicator closed, or
evicted from a keeper for the budget -- is a :class:`Dropped` in the replicator's reports, which the
controller turns into a ``memory_snapshot_dropped`` event that says whether the documented bound on lost
work (about K steps, two intervals with one in flight) still holds.

Stall: the snapshot copy on the step thread is the only stall (from CUDA it is only queued: the copy runs
on a side stream, see ``checkpoint/host_copy.py``); serialising and sending it to the keeper runs on the
replicator's background thread while training continues.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from elastictrain.checkpoint.memory_dcp import Key, Packed, Snapshot, SnapshotMeta, pack, take_snapshot, unpack

KEEP_PER_RANK = 2


@dataclass(frozen=True)
class PutResult:
    accepted: bool
    reason: str
    evicted: list[tuple[int, int, int]] = field(default_factory=list)  # (generation, rank, step) dropped
    step: int = -1
    rank: int = -1


@dataclass(frozen=True)
class Dropped:
    """A snapshot that was taken but is no longer (or never was) in a keeper, and what that does to the
    bound on lost work. ``cause``: ``replaced_unsent``, ``unsent_at_close`` or ``evicted``."""

    generation: int
    rank: int
    step: int
    cause: str
    reason: str
    bound_holds: bool


def drops_of(result: PutResult) -> list[Dropped]:
    """The evictions a keeper made to keep ``result``'s snapshot within its budget. Each leaves that rank
    fewer than two snapshots: while the next one is in flight no complete step may remain, so a failure
    then falls back to an older source -- the bound of about two intervals does not hold."""
    return [Dropped(g, r, st, "evicted", f"evicted from its keeper to keep rank {result.rank} step "
                    f"{result.step} within checkpoint.memory_budget_gib; lost work may exceed two "
                    "memory_every_steps intervals while a rank's next snapshot is in flight (raise the budget)",
                    bound_holds=False)
            for g, r, st in result.evicted]


class KeeperState:
    """The keeper's bookkeeping, separate from Ray so it can be tested directly."""

    def __init__(self, budget_bytes: int, lease: str | None = None) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"ShardKeeper budget must be > 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._snaps: dict[tuple[int, int, int], tuple[Snapshot, int]] = {}  # (gen, rank, step) -> (snap, seq)
        self._seq = 0
        # the run this keeper serves (SourceGatherer.lease; None: any sender): a pooled keeper (workers.reuse)
        # refuses a put of a run it no longer serves, however late it arrives (snapshot keys repeat across runs)
        self.lease: str | None = lease

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (sized once the job's state bytes are known); the next put keeps within it."""
        if budget_bytes <= 0:
            raise ValueError(f"ShardKeeper budget must be > 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes

    def put(self, snap: Snapshot, lease: str | None = None) -> PutResult:
        m = snap.meta
        key, size = (m.generation, m.rank, m.step), m.nbytes
        where = f"rank {m.rank} step {m.step} (generation {m.generation})"
        if self.lease is not None and lease != self.lease:
            return PutResult(False, f"{where}: sent for a run this keeper no longer serves; ignored",
                             step=m.step, rank=m.rank)
        mine = sorted(k for k in self._snaps if k[:2] == key[:2])
        if key in self._snaps or (len(mine) >= KEEP_PER_RANK and m.step < mine[0][2]):
            return PutResult(False, f"{where}: not newer than the kept steps {[k[2] for k in mine]}; ignored",
                             step=m.step, rank=m.rank)
        if size > self.budget:
            return PutResult(False, f"{where}: {size} bytes exceed the keeper budget of {self.budget} bytes",
                             step=m.step, rank=m.rank)
        for old in mine[: max(0, len(mine) - KEEP_PER_RANK + 1)]:  # this rank's oldest make room first
            del self._snaps[old]
        used = sum(s.meta.nbytes for s, _ in self._snaps.values())
        evicted = []
        for k, _ in sorted(self._snaps.items(), key=lambda kv: kv[1][1]):  # oldest put first
            if used + size <= self.budget:
                break
            evicted.append(k)
            used -= self._snaps.pop(k)[0].meta.nbytes
        self._seq += 1
        self._snaps[key] = (snap, self._seq)
        why = f"kept {where} ({size} bytes)"
        if evicted:
            why += f"; evicted {evicted} to stay within {self.budget} bytes"
        return PutResult(True, why, evicted, step=m.step, rank=m.rank)

    def catalog(self) -> list[SnapshotMeta]:
        return [s.meta for s, _ in self._snaps.values()]

    def fetch(self, generation: int, rank: int, step: int, keys: Iterable[Key]) -> dict[Key, Any]:
        got = self._snaps.get((generation, rank, step))
        if got is None:
            raise KeyError(f"no snapshot of rank {rank} step {step} (generation {generation}) is kept here")
        return got[0].fetch(keys)

    def stats(self) -> dict[str, int]:
        return {"bytes": sum(s.meta.nbytes for s, _ in self._snaps.values()), "entries": len(self._snaps)}

    def reset(self, budget_bytes: int, lease: str | None = None) -> dict[str, int]:
        """Empty, as a new keeper of ``budget_bytes`` serving ``lease``: every snapshot dropped, the budget
        and the put order reset (a pooled keeper serving another run, ``workers.reuse``). Returns
        :meth:`stats` after."""
        self.set_budget(budget_bytes)
        self._snaps.clear()
        self._seq = 0
        self.lease = lease
        return self.stats()


@ray.remote(num_cpus=0)
class ShardKeeper:
    """Per-node Ray actor holding other nodes' rank snapshots (see module doc)."""

    def __init__(self, budget_bytes: int, lease: str | None = None) -> None:
        self._state = KeeperState(budget_bytes, lease)

    def put(self, snap: Snapshot, lease: str | None = None) -> PutResult:
        return self._state.put(snap, lease)

    def set_budget(self, budget_bytes: int) -> None:
        self._state.set_budget(budget_bytes)

    def catalog(self) -> list[SnapshotMeta]:
        return self._state.catalog()

    def fetch(self, generation: int, rank: int, step: int, keys: list[Key]) -> Packed:
        return pack(self._state.fetch(generation, rank, step, keys))

    def fetch_many(self, requests: list[tuple[int, int, int, list[Key]]]) -> list[Packed]:
        """Chunks of several snapshots in one call, one :class:`Packed` per request (``fetch``'s arguments):
        a loading rank asks each keeper once, not once per snapshot it holds (the keeper serves one call at a
        time, so separate calls queue behind each other and every other loading rank's)."""
        return [pack(self._state.fetch(*r)) for r in requests]

    def stats(self) -> dict[str, int]:
        return self._state.stats()

    def reset(self, budget_bytes: int, lease: str | None = None) -> dict[str, int]:
        """Drop every snapshot, take ``budget_bytes`` and serve ``lease`` only: the keeper is given back to
        the driver's pool or taken from it (controller/keeper_pool.py). Returns ``stats()`` after: 0 bytes,
        0 entries."""
        return self._state.reset(budget_bytes, lease)


class KeeperSource:
    """A snapshot held by an actor -- a keeper, or a live survivor (``Worker.hold_snapshot``) -- as a
    :class:`~elastictrain.checkpoint.memory_dcp.SnapshotSource`: anything with a remote
    ``fetch(generation, rank, step, keys)`` answering with a :class:`~elastictrain.checkpoint.memory_dcp.Packed`
    (one buffer). The loading rank pulls exactly the chunks its new shards need,
    actor -> rank, not via the driver."""

    def __init__(self, keeper: Any, meta: SnapshotMeta, timeout_s: float | None = None, batched: bool = False) -> None:
        self.keeper, self.meta, self.timeout_s = keeper, meta, timeout_s
        # a ShardKeeper holds many ranks' snapshots and answers ``fetch_many``; a survivor holds its own only
        self.batch_key = keeper if batched else None

    def fetch(self, keys: Iterable[Key]) -> dict[Key, Any]:
        return self.start_fetch(keys)()

    def start_fetch(self, keys: Iterable[Key]) -> Callable[[], dict[Key, Any]]:
        """Ask for ``keys`` now; the returned function waits for them (reads from several sources overlap)."""
        m = self.meta
        ref = self.keeper.fetch.remote(m.generation, m.rank, m.step, list(keys))
        return lambda: unpack(ray.get(ref, timeout=self.timeout_s))

    @staticmethod
    def start_fetch_batch(requests: Sequence[tuple["KeeperSource", Iterable[Key]]]) -> list[Callable[[], dict[Key, Any]]]:
        """``start_fetch`` for several sources of one keeper (same ``batch_key``) in one ``fetch_many`` call."""
        first = requests[0][0]
        ref = first.keeper.fetch_many.remote([(s.meta.generation, s.meta.rank, s.meta.step, list(keys))
                                              for s, keys in requests])
        got: list[Any] = []

        def waiter(i: int) -> Callable[[], dict[Key, Any]]:
            def wait() -> dict[Key, Any]:
                if not got:
                    got.extend(ray.get(ref, timeout=first.timeout_s))
                return unpack(got[i])
            return wait

        return [waiter(i) for i in range(len(requests))]


def keeper_ring(member_nodes: Sequence[str], keeper_nodes: Sequence[str]) -> list[str | None]:
    """For each member's node, the node whose keeper takes its snapshots: the next keeper node after its
    own in sorted ring order, never its own unless it is the only one; None if there is no keeper."""
    ring = sorted(set(keeper_nodes))
    out: list[str | None] = []
    for node in member_nodes:
        others = [n for n in ring if n != node]
        if not others:
            out.append(ring[0] if ring else None)
            continue
        after = [n for n in others if n > node]
        out.append(after[0] if after else others[0])
    return out


class MemoryReplicator:
    """Worker side of the tier: snapshot this rank's state and send it to its keeper in the background.

    :meth:`push` copies the state into host memory (the stall; returns when a copy from CPU tensors is
    complete, so the caller may mutate them right away; a copy from CUDA tensors is queued, and the step
    loop waits for it before its optimizer step) and hands the snapshot to a sender thread, which waits
    for the copy before sending. At most one snapshot waits: a newer push replaces an older one not yet
    sent. With ``keep_own`` (the keeper is on another node) the newest two snapshots taken stay in this
    rank's memory too (:meth:`own`): a node lost with its keeper takes the snapshots it kept for other
    nodes' ranks, and those ranks serve their own instead (two, like the keeper: the lost rank's newest may
    not have reached its keeper). A push refills the host buffers of the older one (steady state: a plain
    copy into memory already faulted in); without ``keep_own``, those of the newest once it is sent (one
    set of host buffers, as the rank's copies would die with the keeper's node anyway).
    :meth:`reports` returns what the keeper said (and the stall seconds) since the last call; :meth:`close`
    stops the thread. ``coord``/``sizes``: the rank's coordinate on its layout's snapshot axes and their
    sizes (``MeshDims.snapshot_coord`` / ``snapshot_sizes``), recorded in every snapshot.
    """

    def __init__(self, keeper: Any, rank: int, generation: int = 0, timeout_s: float = 60.0,
                 keep_own: bool = True, coord: dict[str, int] | None = None,
                 sizes: dict[str, int] | None = None, lease: str | None = None) -> None:
        self._keeper, self._rank, self._generation, self._timeout_s = keeper, rank, generation, timeout_s
        self._lease = lease  # the run's lease on its keepers (KeeperState.lease)
        # recorded in every snapshot (coverage)
        self._stage = {"coord": dict(coord or {}), "sizes": dict(sizes or {})}
        self._keep = 2 if keep_own else 1
        self._cv = threading.Condition()
        self._next: Snapshot | None = None
        self._sending: Snapshot | None = None
        self._own: list[Snapshot] = []  # the newest ``_keep`` taken, oldest first (waiting, in flight or sent)
        self._closed = False
        self._results: list[PutResult] = []
        self._dropped: list[Dropped] = []
        self.stall_s = 0.0
        self.snapshots = 0
        self._thread = threading.Thread(target=self._send_loop, name="memory-tier-sender", daemon=True)
        self._thread.start()

    def push(self, step: int, state_dict: dict[str, Any], records: Sequence[Any] = ()) -> None:
        """Snapshot ``state_dict`` as step ``step`` and queue it for the keeper. ``records``: step records the
        snapshot carries (``SnapshotMeta.records``: the reporting rank's newest, for ``Ledger.replay``)."""
        t0 = time.perf_counter()
        with self._cv:
            reuse = None
            if len(self._own) == self._keep:  # the oldest drops out now; its buffers are refilled unless in flight
                old = self._own.pop(0)
                reuse = None if old is self._sending or old is self._next else old
        snap = take_snapshot(state_dict, rank=self._rank, step=step, generation=self._generation, reuse=reuse,
                             records=records, **self._stage)
        with self._cv:
            self.stall_s += time.perf_counter() - t0
            self.snapshots += 1
            if self._next is not None:  # replaced before it was sent: it never reaches the keeper
                self._dropped.append(Dropped(
                    self._generation, self._rank, self._next.meta.step, "replaced_unsent",
                    f"replaced by step {step} before it was sent: sending to the keeper is slower than one "
                    "snapshot every memory_every_steps steps, so lost work may exceed two intervals until it "
                    "catches up (raise memory_every_steps)", bound_holds=False))
            self._next = snap  # replaces one not sent yet (still one of this rank's own two)
            self._own.append(snap)
            self._cv.notify_all()

    def own(self) -> list[Snapshot]:
        """This rank's newest two snapshots (with ``keep_own``; else the newest), oldest first, whatever its
        keeper did with them (served to the next generation by ``Worker.fetch``). Read them only while no
        step runs: a push refills the oldest."""
        with self._cv:
            return list(self._own)

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._next is None and not self._closed:
                    self._cv.wait()
                if self._next is None:
                    return
                snap, self._next, self._sending = self._next, None, self._next
            try:
                result = ray.get(self._keeper.put.remote(snap, self._lease), timeout=self._timeout_s)
            except Exception as e:  # noqa: BLE001 - keeper died or timed out: a lost replica, not a failed step
                result = PutResult(False, f"sending rank {snap.meta.rank} step {snap.meta.step} to its keeper "
                                          f"failed: {type(e).__name__}: {e}", step=snap.meta.step,
                                   rank=snap.meta.rank)
            with self._cv:
                self._results.append(result)
                self._dropped.extend(drops_of(result))
                self._sending = None
                self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing waits or is being sent (a condition, not a sleep). False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._next is None and self._sending is None, timeout=timeout)

    def reports(self) -> dict[str, Any]:
        """Results, drops and stall since the last call: ``{"results": [PutResult], "dropped": [Dropped],
        "stall_s", "snapshots"}``."""
        with self._cv:
            out = {"results": self._results, "dropped": self._dropped, "stall_s": self.stall_s,
                   "snapshots": self.snapshots}
            self._results, self._dropped, self.stall_s, self.snapshots = [], [], 0.0, 0
        return out

    def close(self, timeout: float | None = None) -> None:
        """Send what waits (bounded by ``timeout``), then stop the sender thread."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            if self._next is not None:  # its generation ended first; the next one snapshots its own state
                self._dropped.append(Dropped(
                    self._generation, self._rank, self._next.meta.step, "unsent_at_close",
                    f"generation {self._generation} ended before it was sent; until the next generation's "
                    "first snapshot the tier holds older steps only", bound_holds=False))
            self._next = None
            self._cv.notify_all()
        self._thread.join(timeout)
