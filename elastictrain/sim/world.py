"""The simulated cluster: nodes, fake workers on a wall-clock step timeline, injected faults, and the
:class:`~elastictrain.controller.runtime.Runtime` the controller waits through.

A generation's members complete step ``s0 + k`` at ``t0 + k * step_s`` (``t0``: its last ``run`` call),
as one collective: a killed member breaks the step in flight (its peers' ``run`` return ``peer_failed``
at once, as gloo's closed sockets make them), a stopped one (a hang) stalls it until it is killed, a stop
request ends ``run`` at the next step boundary. Calls resolve when the timeline says they would; ``wait``
sleeps until the next thing can happen, so the controller sees real time pass. The fake workers answer in
the driver's thread, and their answers count as the driver's CPU: building a poll's step records stands
for what deserializing them costs a Ray driver (timing each answer apart cost more than the answers, at
half a millisecond a ``thread_time`` call on a loaded machine). The two calls a failed step makes the
driver pay per rank (:meth:`SimWorld.get`, the run watch's scan) are charged no more than Ray's
(``benchmarks/scale.py --ray-get 10000``; the figures: docs/perf/2026-11-24-control-plane-scale.md): the
simulated decision is a lower bound of the one on Ray.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray.exceptions

from elastictrain import worker_reply
from elastictrain.sim import machine
from elastictrain.worker.loop import StepRecord

INF = math.inf


@dataclass
class Timeline:
    """One generation's collective progress."""

    gen: int
    world: int
    accum: int
    step_s: float
    members: set[int] = field(default_factory=set)  # slots
    s0: int = 0
    t0: float | None = None  # the last member's run() call
    target: int = 0
    stop_at: float | None = None
    broken_at: float | None = None  # a member died: the step in flight fails
    stall_at: float | None = None   # a member stopped (hang): the step in flight never completes
    synced: bool = False
    running: int = 0  # members whose run() was called
    _cached: dict[str, Any] = field(default_factory=dict, repr=False)

    def _raw(self, t: float) -> int:
        if self.t0 is None:
            return self.s0
        return min(self.target, self.s0 + max(0, int((t - self.t0) / self.step_s)))

    def _key(self) -> tuple:
        return self.t0, self.target, self.stop_at, self.broken_at, self.stall_at

    def cap(self) -> float:
        """The step count that can be reached at all (inf: no stall, no break)."""
        key = self._key()
        if self._cached.get("cap", (None,))[0] != key:
            caps = [self._raw(x) for x in (self.broken_at, self.stall_at) if x is not None]
            self._cached["cap"] = (key, min(caps) if caps else INF)
        return self._cached["cap"][1]

    def completed(self, t: float) -> int:
        return int(min(self._raw(t), self.cap()))

    def step_end(self, k: int) -> float:
        return INF if self.t0 is None else self.t0 + (k - self.s0) * self.step_s

    def run_end(self) -> tuple[float, str, int]:
        """When a healthy member's ``run`` returns, with its status and step (inf: not foreseeable).
        Cached until the timeline changes: every member's calls ask it."""
        key = self._key()
        if self._cached.get("end", (None,))[0] != key:
            self._cached["end"] = (key, self._run_end())
        return self._cached["end"][1]

    def _run_end(self) -> tuple[float, str, int]:
        if self.t0 is None:
            return INF, "", 0
        ends = []
        cap = self.cap()
        if self.target <= cap:
            ends.append((self.step_end(self.target), "done", self.target))
        if self.stop_at is not None:
            k = min(self.target, self._raw(self.stop_at) + 1)
            if k <= cap:
                ends.append((self.step_end(k), "done" if k >= self.target else "stopped", k))
        if self.broken_at is not None:
            ends.append((self.broken_at, "peer_failed", self.completed(self.broken_at)))
        return min(ends, default=(INF, "", 0))


class SimRef:
    """A call's result: ``end`` (when it resolves, computed by the world) and its value or error."""

    __slots__ = ("kind", "worker", "created", "value", "args")

    def __init__(self, kind: str, worker: SimWorker, value: Any = None, args: tuple = ()) -> None:
        self.kind, self.worker, self.created, self.value, self.args = kind, worker, time.time(), value, args


class _Remote:
    __slots__ = ("worker", "name")

    def __init__(self, worker: SimWorker, name: str) -> None:
        self.worker, self.name = worker, name

    def remote(self, *args: Any, **kwargs: Any) -> SimRef:
        world = self.worker.world
        world._advance()  # a fault due by now has happened before the call is answered
        world.calls[self.name] += 1
        return getattr(self.worker, "_" + self.name)(*args, **kwargs)


class SimWorker:
    """One fake worker process; ``worker.<method>.remote(...)`` answers like the real actor's."""

    def __init__(self, world: SimWorld, slot: int, node: str) -> None:
        self.world, self.slot, self.node = world, slot, node
        self.dead_at: float | None = None
        self.stopped_at: float | None = None
        self.tl: Timeline | None = None
        self.rank: int | None = None
        self.held = 0
        self.polled = 0  # last step handed out in a poll
        self.compute_s = world.step_s * 0.5

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Remote(self, name)

    def _now(self, value: Any) -> SimRef:
        return SimRef("value", self, value)

    def _setup(self, slot: int) -> SimRef:
        return SimRef("setup", self, {"slot": slot, "pid": None, "node_id": self.node, "ip": "sim",
                                      "setup_s": self.world.setup_s})

    def _open_store(self, generation: int) -> SimRef:
        return self._now(("sim", 0))

    def _join(self, gen: int, rank: int, world: int, host: str, port: int, layout: Any = None,
              restore: Any = None, sync_src: int | None = None) -> SimRef:
        tl = self.world.timeline(gen, world, getattr(layout, "accum", 1))
        self._leave()
        tl.members.add(self.slot)
        self.tl, self.rank, self.polled = tl, rank, self.held
        # joined and synced: the broadcast's value is taken when every member joined (the result is read)
        return self._now(None) if sync_src is None else SimRef("synced", self)

    def _leave(self) -> None:
        if self.tl is not None:
            self.held = self._step_now()
            self.tl = None

    def _sync(self, src: int) -> SimRef:
        return self._now(self._synced())

    def _synced(self) -> int:
        tl = self.tl
        if not tl.synced:  # the group takes the most advanced member's state (the broadcast)
            tl.s0, tl.synced = max(self.world.workers[s].held for s in tl.members), True
        self.held = self.polled = tl.s0
        return tl.s0

    def _run(self, target: int, joined: SimRef | None = None) -> SimRef:
        if joined is not None:  # sent right behind the join, that join's call as argument: taken first, as Ray does
            self.world._result(joined)
        tl = self.tl
        tl.running += 1
        if tl.running == len(tl.members):  # the first step's collective needs every member in the loop
            tl.t0, tl.target = time.time(), target
        return SimRef("run", self)

    def _poll(self, after: int | None = None) -> SimRef:
        if self.world.running(self):  # polled while its generation trains (not at a formation or an end)
            self.world.calls["poll_running"] += 1
            self.world.calls["poll_running_rank0"] += self.rank == 0
        if self.stopped_at is not None or self.dead_at is not None:
            return SimRef("poll", self)  # never answers (stopped) or fails (dead)
        return self._now(self._poll_result(after))

    def _poll_result(self, after: int | None) -> dict[str, Any]:
        now = time.time()
        tl = self.tl
        done = self._step_now(now)
        first = self.polled + 1 if after is None else max(self.polled + 1, after + 1)
        records = []
        if tl is not None and tl.t0 is not None:
            loss = 1.0
            for k in range(first, done + 1):
                records.append(StepRecord(k, loss, tl.world, tl.accum, tl.step_s, self.compute_s, tl.step_end(k)))
        self.polled = max(self.polled, done)
        phase, since = "idle", now
        if tl is not None and tl.t0 is not None and self.world.running(self):
            if tl.stall_at is not None:
                phase, since = "collective", tl.stall_at
            else:
                phase, since = "compute", tl.step_end(done)
        return {"slot": self.slot, "status": "running", "step": done, "phase": phase, "phase_since": since,
                "records": records, "ckpt": [], "memory": [], "now": now}

    def _step_now(self, now: float | None = None) -> int:
        tl = self.tl
        if tl is None or tl.t0 is None:
            return self.held
        now = time.time() if now is None else now
        end, _, step = tl.run_end()
        return step if end <= now else tl.completed(now)

    def _request_stop(self, generation: int | None = None) -> SimRef:
        tl = self.tl
        if tl is not None and (generation is None or tl.gen == generation) and tl.stop_at is None:
            tl.stop_at = time.time()
        return self._now(None)

    def _abort_group(self, generation: int | None = None, sever: bool = False) -> SimRef:
        return self._now("noop")

    def _flush_checkpoints(self) -> SimRef:
        return self._now([])

    def _own_snapshots(self) -> SimRef:
        return self._now([])

    def _attach_keeper(self, keeper: Any, elsewhere: bool = False, lease: str | None = None) -> SimRef:
        return self._now(None)

    def _finish(self, final_root: str | None = None, storage_options: Any = None) -> SimRef:
        # no model: an empty digest part, and nothing written (the simulator's controller has no run dir)
        return self._now({"rank": self.rank, "step": self._step_now(), "digest": {}, "report": None})

    def _shutdown(self) -> SimRef:
        return self._now(None)


class SimKeeper:
    """The peer memory tier's keeper of one simulated node (``SimWorld.start_keeper``): it takes its budget
    and answers its catalog like a ``ShardKeeper``; it keeps nothing (simulated workers hold no state and
    send no snapshots), so a recovery asks it and goes on to the survivors."""

    def __init__(self, world: SimWorld, node: str, budget: int) -> None:
        self.world, self.node, self.budget, self.killed = world, node, budget, False

    def __getattr__(self, name: str) -> _KeeperCall:
        if name.startswith("_"):
            raise AttributeError(name)
        return _KeeperCall(self, name)


class _KeeperCall:
    __slots__ = ("keeper", "name")

    def __init__(self, keeper: SimKeeper, name: str) -> None:
        self.keeper, self.name = keeper, name

    def remote(self, *args: Any) -> SimRef:
        self.keeper.world.calls["keeper_" + self.name] += 1
        if self.name == "set_budget":
            self.keeper.budget = int(args[0])
        return SimRef("value", None, [] if self.name == "catalog" else None)


@dataclass
class Fault:
    """Something that happens to the cluster once the current generation completes ``at_step`` (mid-step
    ``at_step + 1``); ``apply(world, t)`` does it and ``at`` records when."""

    at_step: int
    label: str
    apply: Callable[[SimWorld, float], None]
    at: float | None = None
    apply_clock: float = 0.0  # :meth:`SimWorld.own_clock` when it was applied (the driver's next call)
    machine: dict[str, Any] | None = None  # :func:`elastictrain.sim.machine.snapshot` when it was applied


class _Drains:
    """The drain watcher over the simulated cluster: notices are there as soon as posted (a fault); the
    controller reads them when it checks (once per poll interval). The first read that names a node is
    recorded (:attr:`SimWorld.notice_read`): when the notice reached the controller."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world

    def draining(self, now: float | None = None) -> set[str]:
        hit = set(self.world.draining)
        if hit and self.world.notice_read is None:
            self.world.notice_read = (time.time(), self.world.own_clock())
        return hit

    def take_notice(self) -> str | None:
        return None


class SimWorld:
    """The simulated cluster and the :class:`Runtime` over its calls."""

    def __init__(self, *, step_s: float = 0.02, setup_s: float = 0.05, ranks_per_node: int = 8) -> None:
        self.step_s, self.setup_s, self.ranks_per_node = step_s, setup_s, ranks_per_node
        self.workers: dict[int, SimWorker] = {}
        self.dead_nodes: set[str] = set()
        self.node_back_at: dict[str, float] = {}
        self.draining: set[str] = set()
        self.notice_read: tuple[float, float] | None = None  # (wall, own clock) the controller first read one
        self.timelines: dict[int, Timeline] = {}
        self.faults: list[Fault] = []
        self.calls: Counter[str] = Counter()  # calls made on the workers, by method
        self.slept_s = 0.0  # the driver's waits for calls to resolve (asked, not as long as the OS made them)
        self.crashed: list[SimWorker] = []  # in the order they died (what Ray's death notices tell)
        self.keepers: list[SimKeeper] = []  # the peer tier keepers the controller started (start_keeper)

    def own_clock(self) -> float:
        """The driver's time as if it had a core of its own: its thread's CPU plus its waits for the cluster."""
        return time.thread_time() + self.slept_s

    def sleep(self, seconds: float) -> None:
        """The driver waits for the cluster: counted (:attr:`slept_s`), so that what the controller would
        take on a core of its own is CPU + waits, whatever else the machine runs."""
        seconds = max(0.0, seconds)
        self.slept_s += seconds
        time.sleep(seconds)

    # ------------------------------------------------------------------ cluster
    def node_of(self, slot: int) -> str:
        return f"node{slot // self.ranks_per_node:05d}"

    def spawn(self, slot: int) -> SimWorker:
        w = SimWorker(self, slot, self.node_of(slot))
        self.workers[slot] = w
        return w

    def timeline(self, gen: int, world: int, accum: int) -> Timeline:
        if gen not in self.timelines:
            self.timelines[gen] = Timeline(gen, world, accum, self.step_s)
        return self.timelines[gen]

    def current(self) -> Timeline | None:
        return self.timelines[max(self.timelines)] if self.timelines else None

    def running(self, w: SimWorker) -> bool:
        tl = w.tl
        return tl is not None and tl.run_end()[0] > time.time()

    # ------------------------------------------------------------------ faults
    def crash(self, w: SimWorker, t: float) -> None:
        """The worker's process dies at ``t`` (its calls fail; its generation's step in flight breaks)."""
        if w.dead_at is not None:
            return
        w.dead_at = t
        self.crashed.append(w)
        tl = w.tl
        if tl is not None and tl.broken_at is None and tl.t0 is not None and tl.run_end()[0] > t:
            tl.broken_at = t

    def stop(self, w: SimWorker, t: float) -> None:
        """SIGSTOP: the worker answers nothing and its generation's step in flight never completes."""
        w.stopped_at = t
        if w.tl is not None and w.tl.stall_at is None:
            w.tl.stall_at = t

    def lose_node(self, node: str, t: float) -> None:
        self.dead_nodes.add(node)
        for w in list(self.workers.values()):
            if w.node == node:
                self.crash(w, t)

    def node_back(self, node: str, t: float) -> None:
        self.dead_nodes.discard(node)
        self.node_back_at[node] = t

    def kill(self, w: SimWorker) -> None:
        """``ray.kill`` by the controller."""
        self.crash(w, time.time())

    def _fault_time(self, f: Fault) -> float:
        tl = self.current()
        if tl is None or tl.t0 is None:
            return INF
        return tl.step_end(f.at_step) + tl.step_s / 2

    def _advance(self) -> float:
        now = time.time()
        for f in self.faults:
            if f.at is None:
                t = self._fault_time(f)
                if t <= now:
                    f.at, f.apply_clock, f.machine = t, self.own_clock(), machine.snapshot()
                    f.apply(self, t)
        return now

    def _next_fault(self) -> float:
        return min((self._fault_time(f) for f in self.faults if f.at is None), default=INF)

    # ------------------------------------------------------------------ runtime
    def end_of(self, ref: SimRef) -> float:
        """When ``ref`` resolves (inf: not foreseeable now)."""
        w = ref.worker
        if ref.kind in ("value", "synced"):
            return ref.created
        if ref.kind == "setup":
            if w.dead_at is not None:
                return w.dead_at
            if w.node in self.dead_nodes:
                return INF
            return max(ref.created + self.setup_s, self.node_back_at.get(w.node, 0.0))
        if ref.kind == "poll":
            return INF if w.dead_at is None else max(ref.created, w.dead_at)
        end = INF if w.stopped_at is not None or w.tl is None else w.tl.run_end()[0]
        return min(end, w.dead_at if w.dead_at is not None else INF)

    def _result(self, ref: SimRef) -> Any:
        w = ref.worker
        if ref.kind == "value":
            return ref.value
        if ref.kind == "synced":
            return w._synced()
        if w.dead_at is not None and w.dead_at <= self.end_of(ref):
            raise ray.exceptions.ActorDiedError()
        if ref.kind == "setup":
            return dict(ref.value)
        end, status, step = w.tl.run_end()
        w.held = step
        return worker_reply.pack(status, step, None, w.slot)  # as a worker answers (elastictrain/worker_reply.py)

    def wait(self, refs: Sequence[Any], *, num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        refs = list(refs)
        deadline = INF if timeout is None else time.time() + timeout
        while True:
            now = self._advance()
            ends = [self.end_of(r) for r in refs]
            ready = [r for r, e in zip(refs, ends) if e <= now]
            if len(ready) >= num_returns or now >= deadline:
                ready = ready[:num_returns]
                chosen = set(map(id, ready))
                return ready, [r for r in refs if id(r) not in chosen]
            wake = min([deadline, self._next_fault(), *(e for e in ends if e > now)])
            if wake == INF:
                raise RuntimeError("simulation: waiting forever on calls that never resolve")
            self.sleep(wake - now)

    def get(self, refs: Any, *, timeout: float | None = None) -> Any:
        many = isinstance(refs, list)
        items = refs if many else [refs]
        ready, _ = self.wait(items, num_returns=len(items), timeout=timeout)
        if len(ready) < len(items):
            raise ray.exceptions.GetTimeoutError(f"simulation: {len(items) - len(ready)} calls pending")
        values = [self._result(r) for r in items]
        return values if many else values[0]

    def alive_nodes(self) -> set[str]:
        return {w.node for w in self.workers.values()} - self.dead_nodes

    def drain_watcher(self) -> _Drains:
        return _Drains(self)

    def watch(self, refs: Sequence[Any]) -> SimRunWatch:
        return SimRunWatch(self, refs)

    def start_keeper(self, node: str, budget: int, *, reuse: bool = False, timeout: float | None = None,
                     lease: str | None = None) -> SimKeeper:
        keeper = SimKeeper(self, node, budget)
        self.keepers.append(keeper)
        return keeper

    def stop_keeper(self, keeper: SimKeeper, *, node: str | None = None, reuse: bool = False,
                    timeout: float | None = None) -> None:
        keeper.killed = True

    def free_memory(self, nodes: set[str]) -> list[int]:
        return []  # simulated nodes do not say: the budget is checkpoint.memory_budget_gib's


class SimRunWatch:
    """A generation's ``run`` calls, watched event by event (deaths in order, then the group's end), as
    Ray's notifications would tell them: O(events), not O(calls), per wait."""

    def __init__(self, world: SimWorld, refs: Sequence[Any]) -> None:
        self.world, self.refs = world, list(refs)
        self.by_worker = {r.worker: r for r in self.refs}
        self.told: set[int] = set()
        self.crash_seen = len(world.crashed)
        self.tl = self.refs[0].worker.tl if self.refs else None
        self.all_told = False

    def _scan(self, now: float) -> list[Any]:
        out = []
        crashed = self.world.crashed
        for w in crashed[self.crash_seen:]:
            ref = self.by_worker.get(w)
            if ref is not None and id(ref) not in self.told and self.world.end_of(ref) <= now:
                out.append(ref)
                self.told.add(id(ref))
        self.crash_seen = len(crashed)
        if not self.all_told and self.tl is not None and self.tl.run_end()[0] <= now:
            self.all_told = True  # the loop ended: every call not stopped (hung) returns now
            out += [r for r in self.refs if id(r) not in self.told and self.world.end_of(r) <= now]
        self.told.update(map(id, out))
        return out

    def wait(self, timeout: float) -> list[Any]:
        deadline = time.time() + timeout
        while True:
            now = self.world._advance()
            out = self._scan(now)
            if out or now >= deadline:
                return out
            end = self.tl.run_end()[0] if self.tl is not None and not self.all_told else INF
            self.world.sleep(min(deadline, self.world._next_fault(), end) - now)
