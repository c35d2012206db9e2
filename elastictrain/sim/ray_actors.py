"""Lightweight Ray actors that speak the worker protocol the controller speaks (``setup``, ``open_store``,
``join``, ``sync``, ``run``, ``poll``, ``request_stop``, ...) and "train" by completing a step every
``step_s`` seconds: the Ray variant of the simulation (:mod:`elastictrain.sim.ray_run` drives them with the
real controller). No torch: this module imports the standard library, Ray and the result's wire format
(:mod:`elastictrain.worker_reply`) only, and an actor process imports nothing else (:meth:`SimActor.imported` lets a test check ``sys.modules``).

A generation's "collective" is a star of plain TCP connections to a hub in its rank 0's process (opened by
``open_store``, as the real rank 0 hosts the TCPStore): ``join`` is a rendezvous (every member says hello
with the step it holds; the hub tells all of them every member's step), ``run`` starts the step clock once
every member called it (step ``s0 + k`` completes at ``t0 + k * step_s`` on every member), a stop request
is agreed on a step boundary ahead, and a member's death closes its socket (the kernel does it for a
SIGKILLed process): the hub then closes every connection, so every peer's ``run`` returns ``peer_failed``
at once, as gloo's closed sockets make a real step fail. A dead rank 0 takes the hub with it: same effect.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from elastictrain import worker_reply


@dataclass
class Record:
    """A completed step, with the fields of ``elastictrain.worker.loop.StepRecord`` the controller reads
    (that module imports torch)."""

    step: int
    loss: float
    world_size: int
    accum: int
    step_s: float
    compute_s: float
    finished_at: float
    sample_ids: list[int] = field(default_factory=list)
    pipeline: dict[str, Any] | None = None
    mesh: str | None = None  # the real record's layout as built: the fake builds none
    # the real record's throughput, evaluation, memory and skip fields: the fake reports none of them
    tokens: int = 0
    flops_per_token: float | None = None
    peak_flops: float | None = None
    devices: int = 1
    compile_s: float | None = None
    eval_loss: float | None = None
    memory: dict[str, float] | None = None
    skipped: str | None = None
    tokens_per_expert: dict[str, list[int]] | None = None  # (a mixture-of-experts model's router counts)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class Hub:
    """One generation's rendezvous and failure fan-out, on a thread of rank 0's process."""

    def __init__(self, host: str, step_s: float, full_world: int = 0, degraded_step_s: float | None = None) -> None:
        self.step_s = step_s
        # a world below ``full_world`` steps every ``degraded_step_s`` (when given): the pace is the hub's,
        # sent with "go", so every member of a generation keeps the same clock
        self.full_world, self.degraded_step_s = full_world, degraded_step_s
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.conns: dict[socket.socket, bytes] = {}
        self.world = 0
        self.held: dict[int, int] = {}
        self.runs: list[int] = []
        self.t0: float | None = None
        self.s0 = 0
        self.stop_wanted = False
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="sim-hub", daemon=True)
        self.thread.start()

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for conn in list(self.conns):
            try:
                _send(conn, msg)
            except OSError:
                self.close()
                return

    def _serve(self) -> None:
        while not self.closed:
            for key, _ in self.sel.select(timeout=0.5):
                if self.closed:
                    return
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self.conns[conn] = b""
                    self.sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:  # a member left or died: the generation's collective is broken
                    self.close()
                    return
                buf = self.conns[conn] + data
                *lines, self.conns[conn] = buf.split(b"\n")
                for line in lines:
                    self._take(json.loads(line))

    def _take(self, msg: dict[str, Any]) -> None:
        if "hello" in msg:
            self.world = msg["world"]
            self.held[msg["hello"]] = msg["held"]
            if len(self.held) == self.world:
                self._broadcast({"held": [self.held[r] for r in range(self.world)]})
        elif "run" in msg:
            self.runs.append(msg["run"])
            if len(self.runs) == self.world:
                self.t0, self.s0 = time.time(), max(self.runs)
                if self.degraded_step_s is not None and self.world < self.full_world:
                    self.step_s = self.degraded_step_s
                self._broadcast({"go": self.t0, "s0": self.s0, "pace": self.step_s})
                if self.stop_wanted:
                    self._stop()
        elif "stop" in msg and not self.stop_wanted:
            self.stop_wanted = True
            if self.t0 is not None:
                self._stop()

    def _stop(self) -> None:
        # two boundaries ahead: every member hears of it before it reaches that step
        done = self.s0 + int((time.time() - self.t0) / self.step_s)
        self._broadcast({"stopat": done + 2})

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in list(self.conns):
            conn.close()
        self.listener.close()


class SimActor:
    """One simulated worker process (use :func:`sim_actor_class` for the Ray actor class)."""

    def __init__(self, step_s: float, collective_s: float, full_world: int = 0,
                 degraded_step_s: float | None = None) -> None:
        self.step_s, self.collective_s = step_s, collective_s
        self.full_world, self.degraded_step_s = full_world, degraded_step_s  # the hub's pace (see Hub)
        self.slot = -1
        self.gen: int | None = None
        self.rank = 0
        self.world = 0
        self.step = 0
        self.accum = 1
        self.hub: Hub | None = None
        self.conn: socket.socket | None = None
        self.send_lock = threading.Lock()
        # join, sync and run take turns, as on the real worker's one state thread (its STATE_GROUP): a run
        # of a generation whose formation failed ends before the next join starts
        self.state_lock = threading.RLock()
        self.cond = threading.Condition()
        self.view: dict[str, Any] = {}
        self.records: collections.deque = collections.deque()
        self.status = "created"
        self.phase_since = time.time()

    def imported(self, name: str) -> bool:
        """Whether module ``name`` is imported in this process."""
        return name in sys.modules

    def setup(self, slot: int) -> dict[str, Any]:
        self.slot, self.status = slot, "ready"
        return {"slot": slot, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "setup_s": 0.0}

    def open_store(self, generation: int) -> tuple[str, int]:
        if self.hub is not None:
            self.hub.close()
        host = ray.util.get_node_ip_address()
        self.hub = Hub(host, self.step_s, self.full_world, self.degraded_step_s)
        return host, self.hub.port

    def _leave(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def join(self, generation: int, rank: int, world_size: int, host: str, port: int, accum: int = 1,
             restore: bool = False, sync_src: int | None = None) -> int | None:
        """The worker's ``join`` with the layout's accumulation for the layout, and whether it was asked to
        restore (then it returns the step it holds, as ``load_peer`` would); with ``sync_src``, then
        :meth:`sync` (the worker's ``join`` does the same)."""
        with self.state_lock:
            return self._join(generation, rank, world_size, host, port, accum, restore, sync_src)

    def _join(self, generation: int, rank: int, world_size: int, host: str, port: int, accum: int,
              restore: bool, sync_src: int | None) -> int | None:
        self._leave()
        self.accum = accum
        self.gen, self.rank, self.world = generation, rank, world_size
        with self.cond:
            self.view = {}
        self.conn = socket.create_connection((host, port), timeout=self.collective_s)
        self.conn.settimeout(None)
        threading.Thread(target=self._read, args=(self.conn,), name="sim-member", daemon=True).start()
        self._say({"hello": rank, "world": world_size, "held": self.step})
        self._await("held")
        self.status = "joined"
        if sync_src is not None:
            return self.sync(sync_src)
        return self.step if restore else None

    def _say(self, msg: dict[str, Any]) -> None:
        with self.send_lock:
            if self.conn is not None:
                try:
                    _send(self.conn, msg)
                except OSError:
                    pass  # the hub is gone: the reader marks the generation broken

    def _read(self, conn: socket.socket) -> None:
        buf = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            with self.cond:
                if conn is not self.conn:
                    return  # a generation this member left
                if not data:
                    self.view["broken"] = True
                    self.cond.notify_all()
                    return
                *lines, buf = (buf + data).split(b"\n")
                for line in lines:
                    self.view.update(json.loads(line))
                self.cond.notify_all()

    def _await(self, key: str) -> Any:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.view or "broken" in self.view, self.collective_s):
                raise TimeoutError(f"simulated collective: no {key!r} from the hub in {self.collective_s} s")
            if key not in self.view:
                raise ConnectionError("simulated collective: a peer failed")
            return self.view[key]

    def sync(self, src: int) -> int:
        with self.state_lock:
            self.step = self._await("held")[src]
            return self.step

    def run(self, target_step: int, joined: Any = None) -> bytes:
        """The worker's ``run``: ``joined`` is the answer of this generation's ``join`` when the controller
        sent the run right behind it (its ref as argument: Ray starts this call only after that join
        returned, and fails it with the join's error when the join failed)."""
        with self.state_lock:
            return self._run(target_step)

    def _run(self, target_step: int) -> bytes:
        self.status = "running"
        self._say({"run": self.step})
        try:
            t0, s0 = self._await("go"), self.view["s0"]
        except ConnectionError:
            return self._result("peer_failed")
        pace = self.view.get("pace", self.step_s)
        while self.step < target_step:
            end = t0 + (self.step + 1 - s0) * pace
            with self.cond:
                self.cond.wait_for(lambda: "broken" in self.view or time.time() >= end, max(0.0, end - time.time()))
                if "broken" in self.view and time.time() < end:
                    return self._result("peer_failed")
                stop_at = self.view.get("stopat")
            self.step += 1
            self.phase_since = end
            self.records.append(Record(self.step, 1.0, self.world, self.accum, pace, pace / 2, end))
            if stop_at is not None and self.step >= stop_at and self.step < target_step:
                return self._result("stopped")
        return self._result("done")

    def _result(self, status: str) -> bytes:
        self.status = "joined"
        return worker_reply.pack(status, self.step, None, self.slot)  # as a worker answers

    def poll(self, after: int | None = None) -> dict[str, Any]:
        records = []
        while self.records:
            r = self.records.popleft()
            if after is None or r.step > after:
                records.append(r)
        return {"slot": self.slot, "status": self.status, "step": self.step,
                "phase": "compute" if self.status == "running" else "idle", "phase_since": self.phase_since,
                "records": records, "ckpt": [], "memory": [], "now": time.time()}

    def request_stop(self, generation: int | None = None) -> None:
        if generation is None or generation == self.gen:
            self._say({"stop": 1})

    def abort_group(self, generation: int | None = None, sever: bool = False) -> str:
        return "noop"

    def flush_checkpoints(self) -> list[Any]:
        return []

    def own_snapshots(self) -> list[Any]:
        return []

    def finish(self, final_root: str | None = None, storage_options: Any = None) -> dict[str, Any]:
        # no model: an empty digest part, and nothing written (the simulator's controller has no run dir)
        return {"rank": self.rank, "step": self.step, "digest": {}, "report": None}

    def shutdown(self) -> None:
        self._leave()
        if self.hub is not None:
            self.hub.close()


def sim_actor_class() -> Any:
    """The Ray actor class for :class:`SimActor`: threaded, so ``poll`` and ``request_stop`` run beside
    ``run``."""
    return ray.remote(max_concurrency=4)(SimActor)
