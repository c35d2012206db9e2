"""Worker processes kept warm between runs of one driver process (``workers.reuse``).

Ray starts every actor in a fresh interpreter, and a worker's start is seconds of CPU (Ray's worker boot,
torch, DTensor, ``torch._dynamo``: docs/perf/2026-11-28-suite-time.md). A driver that calls
``Trainer(...).fit()`` again and again (a sweep, a notebook, the test suite) pays that per worker per run.
With ``workers.reuse`` a run that ended ``finished`` hands its workers' processes to :data:`POOL`, emptied of the
run (:meth:`Worker.retire <elastictrain.worker.actor.Worker.retire>`), and the next run of the same driver
takes them instead of starting processes (``Worker.reuse``: the run's config and task, then the set-up of
a fresh worker).

Why the rules are what they are:

- Placement. Removing a placement group kills the actors in it, and the group of a run is removed when the
  run ends. A reusable worker is therefore created outside the group: ``num_cpus=0`` and pinned (hard node
  affinity) to the node of its slot's bundle, which holds the resources, as the standby process is
  (controller/group.py). ``workers.placement_strategy`` still decides the nodes (the bundles are placed
  by it, the workers follow them); a lost node takes the worker with it, as it would in the bundle; a
  slot whose bundle is not placed yet (waiting for capacity, re-placing after a node loss) gets an actor
  in the bundle as before, which is never pooled. The pool holds no resources between runs.
- Threads. Ray sets ``OMP_NUM_THREADS`` of an actor from the CPUs it asked for (1 for ``num_cpus=0``:
  ``ray/_private/utils.py set_omp_num_threads_if_unset``), after the preload imported torch, so it only
  reaches child processes; the set-up sets torch's threads and ``OMP_NUM_THREADS`` to
  ``workers.cpus_per_worker`` itself, so a worker in the bundle and one outside it compute alike.
- The key (:class:`PoolKey`): everything that makes one process differ from another that this driver
  could start now: the Ray session and job (a new ``ray.init`` is another job, whose actors these are
  not), the job's runtime environment (its env vars), ``workers.cpus_per_worker`` and the task's code
  (:func:`task_identity`: the files that define the task's callables, by path and content digest; an
  edited task file imported by name would otherwise keep running the old module a warm process has
  imported). The node is matched per worker (a worker is taken only for a bundle on its node). A run
  takes only processes of its own key; idle processes of other keys stay (a later run of their key takes
  them: the suite's files alternate tasks and ``cpus_per_worker``). A run with reuse off neither takes
  from the pool nor empties it; :meth:`WarmPool.clear` empties it (a test whose promise needs it).
- Who takes from the pool: every spawn of a placed slot (the first generation's workers, a replacement
  after a failure, a grow-back, an extra slot): a warm process answers ``reuse`` (its set-up) in a
  fraction of a fresh one's start. Under ``workers.standby`` an idle pooled process on the node stands in
  for the standby there (none is started while one waits: it would be a second process ready for the
  same replacement).
- How many it holds: a run that ends gives back its retired workers, and what the pool held that the run
  did not take stays beside them (a 2-worker run after a 4-worker one leaves 2 idle; other keys' idle
  processes), within two bounds per node (:func:`bounded`), the most recently used kept first (the run's
  own, then the pool's in the order they were given back), the extras, the least recently used, killed:
  of each key, as many as the node's CPUs hold workers of that key's ``workers.cpus_per_worker``
  (:func:`key_cap`: one run of the key cannot place more there at once, each bundle taking
  ``cpus_per_worker``, so a process beyond that could never be taken by one run); and of all keys
  together, two per CPU of the node (:func:`node_total`; at least two): every idle process holds its
  interpreter's memory (torch imported: hundreds of MiB), so a driver's pool holds at most two processes
  per CPU of each node. The bound is per key so that a run of one key does not evict another key's
  processes while the node has room: with one cap for all keys, a run of 1.5-CPU workers on 4 CPUs
  (2 fit) killed every idle 1-CPU process beyond 2, which the next 1-CPU run then started again
  (tests/test_warm_pool.py).
- What is pooled: only CPU workers (a GPU process's CUDA context is not given back), only processes
  created for reuse (outside the placement group, never a standby), only from a run that ended
  ``finished``, only members or ready spares (a worker killed, hung, timed out or failed was killed
  by then), and only when the worker itself agrees (``Worker.retire`` answers False after a step it
  failed by its own error, when a fault fired in it (``slow`` and ``nan`` do not count), when its
  process group did not go, or when a checkpoint writer it abandoned still runs) within
  ``timeouts.poll_s``. A survivor of a failure and a replacement that trained through to the clean end
  are pooled: the aborted generations' groups were destroyed at the next rendezvous (their gloo
  connections severed first), and ``retire`` drops what they left (stores, held snapshots, step
  records, the runner with its abort flag, DTensor's mesh caches, compiled code, environment
  variables); tests/test_pool_faulted.py holds that such a process trains bitwise like a fresh one and
  that its threads and open files do not grow run after run. Everything else is killed as without
  reuse.
- The peer memory tier's keepers are pooled beside the workers under the same switch, by rules of their
  own (controller/keeper_pool.py).
- Lifetime. The pooled actors are owned by this driver: Ray kills them with the driver's job (at
  ``ray.shutdown``, or when the driver exits), so nothing outlives the driver; :meth:`WarmPool.clear`
  kills them earlier.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, fields
from typing import Any

import ray

from elastictrain.config import JobConfig


@dataclass(frozen=True)
class PoolKey:
    """What must be equal for a process to serve another run (see the module's docstring)."""

    session: str  # the Ray session (GCS address) and this driver's job id
    runtime_env: str  # the job's runtime environment, as JSON (env vars, working dir, ...)
    cpus_per_worker: float
    task: str  # task_identity()


@dataclass(frozen=True)
class Warm:
    """A pooled worker process: its actor handle and where it runs."""

    actor: Any
    pid: int
    ip: str
    node_id: str
    session: str  # PoolKey.session of the run that pooled it: killed only while that session is this driver's


def _callables(task: Any) -> list[Any]:
    """The task's callables (and its pipeline hooks'), unwrapped from ``functools.partial`` and bound methods."""
    out: list[Any] = []
    todo = [getattr(task, f.name) for f in fields(task)] if hasattr(task, "__dataclass_fields__") else []
    while todo:
        value = todo.pop()
        if value is None or isinstance(value, (str, int, float, bool)):
            continue
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):  # PipelineHooks
            todo.extend(getattr(value, f.name) for f in fields(value))
            continue
        if hasattr(value, "func"):  # functools.partial
            todo.append(value.func)
            todo.extend(v for v in (*value.args, *value.keywords.values()) if callable(v))
            continue
        out.append(getattr(value, "__func__", value))
    return out


def task_identity(config: JobConfig, task: Any) -> str:
    """The task's code, as a warm process would have it imported: a digest of the path and content of every
    file defining one of the task's callables (and, for ``task.kind: python``, the entry's module). A file
    edited between two runs changes it. Modules those files import in turn are not read: edit one of them
    and restart the driver (or set ``workers.reuse: false``). ``task.kind`` itself is not part of it: the
    built-in kinds' callables are defined in the same files (the model each builds is imported in turn,
    from disk, at the next set-up, as a fresh process imports it), so a process that trained one built-in
    kind serves a run of another (tests/test_pool_kinds.py)."""
    modules = {getattr(inspect.getmodule(fn), "__name__", None) for fn in _callables(task)}
    if config.task.kind == "python" and config.task.entry:
        modules.add(config.task.entry.partition(":")[0])
    digest = hashlib.sha256(b"task")
    for name in sorted(m for m in modules if m):
        path = getattr(sys.modules.get(name), "__file__", None)
        digest.update(f"\0{name}\0{path}\0".encode())
        if path:
            try:
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
            except OSError:  # gone since it was imported: never matches a later read
                digest.update(os.urandom(16))
    return digest.hexdigest()


def current_session() -> str | None:
    """This driver's Ray session and job (``<GCS address>/<job id>``), None when Ray is not initialised."""
    try:
        if not ray.is_initialized():
            return None
        ctx = ray.get_runtime_context()
        return f"{ctx.gcs_address}/{ctx.get_job_id()}"
    except Exception:  # noqa: BLE001 - shutting down
        return None


def pool_key(config: JobConfig, task: Any) -> PoolKey:
    """The key of a run of ``config`` and ``task`` in this driver's Ray job (``ray.init`` done)."""
    env = json.dumps(dict(ray.get_runtime_context().runtime_env or {}), sort_keys=True, default=str)
    return PoolKey(current_session() or "", env, float(config.workers.cpus_per_worker), task_identity(config, task))


def kill_warm(warm: Warm) -> None:
    """Kill a pooled process: SIGKILL by pid on this node (gone at once), and Ray's kill. Nothing when the
    session it was pooled in is no longer this driver's: Ray killed it with that job, and its pid may be
    another process's by now."""
    if warm.session != current_session():
        return
    try:
        here = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - Ray shut down: its processes went with it
        here = None
    if warm.pid and warm.ip == here:
        try:
            os.kill(warm.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        ray.kill(warm.actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone (its job ended, or Ray shut down)
        pass


def key_cap(cpus: float, cpus_per_worker: float) -> int:
    """PURE. How many idle processes of a key with ``cpus_per_worker`` a node of ``cpus`` CPUs may keep: as
    many workers as its CPUs hold, at least one."""
    return max(1, int(cpus // cpus_per_worker)) if cpus_per_worker > 0 else 1


def node_total(cpus: float) -> int:
    """PURE. How many idle processes of all keys together a node of ``cpus`` CPUs may keep: two per CPU, at
    least two (the memory bound: each holds an interpreter with torch imported)."""
    return max(2, 2 * int(cpus))


def bounded(idle: list[tuple[PoolKey, Warm]], cpus: dict[str, float] | None) -> tuple[list[Warm], list[Warm]]:
    """PURE. ``(keep, kill)`` of ``idle`` (most recently used first): on each node, the first
    :func:`key_cap` processes of each key, and of those the first :func:`node_total` of all keys together,
    are kept; a node absent from ``cpus`` keeps none (it is gone); ``cpus`` None keeps all."""
    if cpus is None:
        return [w for _, w in idle], []
    keep: list[Warm] = []
    kill: list[Warm] = []
    per_key: dict[tuple[PoolKey, str], int] = {}
    per_node: dict[str, int] = {}
    for key, w in idle:
        node = cpus.get(w.node_id)
        n_key, n_node = per_key.get((key, w.node_id), 0), per_node.get(w.node_id, 0)
        if node is not None and n_key < key_cap(node, key.cpus_per_worker) and n_node < node_total(node):
            per_key[(key, w.node_id)] = n_key + 1
            per_node[w.node_id] = n_node + 1
            keep.append(w)
        else:
            kill.append(w)
    return keep, kill


def node_cpus(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """PURE. The CPUs of each alive node (``nodes`` as ``ray.nodes()`` reports them)."""
    return {node["NodeID"]: float((node.get("Resources") or {}).get("CPU", 0.0))
            for node in nodes if node.get("Alive") and node.get("NodeID")}


class WarmPool:
    """The warm processes of this driver, of every key, most recently used first. Thread-safe: runs in
    threads of one driver (tests' background runs) take and release concurrently."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[PoolKey, Warm]] = []  # most recently given back first

    def take(self, key: PoolKey, node_id: str | None) -> Warm | None:
        """A warm process of ``key`` on ``node_id``, removed from the pool; None if there is none. Idle
        processes of other keys stay."""
        with self._lock:
            found = next((i for i, (k, w) in enumerate(self._idle) if k == key and w.node_id == node_id),
                         None) if node_id else None
            return None if found is None else self._idle.pop(found)[1]

    def holds(self, key: PoolKey | None, node_id: str | None) -> bool:
        """True if an idle process of ``key`` runs on ``node_id`` (a spawn there would take it)."""
        with self._lock:
            return key is not None and any(k == key and w.node_id == node_id for k, w in self._idle)

    def release(self, key: PoolKey | None, warm: list[Warm], cpus: dict[str, float] | None = None) -> None:
        """A run ended: keep ``warm`` (that run's retired workers, of ``key``) first, then what the pool still
        holds, of every key, least recently used last, within the bounds of each node of ``cpus`` (its CPUs:
        :func:`bounded`, per key and for all keys together; the least recently used are killed first); no
        ``cpus`` given (Ray going away): that run's workers only. ``key`` None: kill everything."""
        with self._lock:
            held = [(k, w) for k, w in self._idle if w.session == current_session()]  # others died with their job
            given = [(key, w) for w in warm] if key is not None else []
            if key is None:
                keep, extra = [], [w for w in warm] + [w for _, w in held]
            elif cpus is None:
                keep, extra = given, [w for _, w in held]
            else:
                ordered = given + held
                kept, extra = bounded(ordered, cpus)
                ids = {id(w) for w in kept}
                keep = [(k, w) for k, w in ordered if id(w) in ids]
            self._idle = keep
        for w in extra:
            kill_warm(w)

    def clear(self) -> int:
        """Kill every pooled process, of every key; returns how many. Tests whose promise needs an empty
        pool call it (a run with ``workers.reuse: false`` leaves the pool as it is)."""
        with self._lock:
            idle, self._idle = [w for _, w in self._idle], []
        for w in idle:
            kill_warm(w)
        return len(idle)

    def pids(self, key: PoolKey | None = None) -> list[int]:
        """The pids of the pooled processes (of ``key``; None: of every key), for tests and reports."""
        with self._lock:
            return [w.pid for k, w in self._idle if key is None or k == key]


POOL = WarmPool()
"""This driver process's pool (one per process: what it holds is Ray actors owned by this driver)."""
