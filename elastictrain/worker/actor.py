"""The Ray actor that hosts one worker: its process, its torch.distributed groups and its step loop.

The actor is threaded (``max_concurrency`` > 1) so the controller can ``poll`` and ``request_stop`` while
``run`` executes steps. Healthy actors survive every membership change: ``join`` only swaps the process
group (a fresh TCPStore per generation, hosted by the new rank 0) and re-applies the layout on a new
DeviceMesh, and ``sync`` brings state from a live peer (within ``join`` when the controller names the
source there: one call per rank instead of two).

Sharded layouts (fsdp/hsdp) rebuild model and optimizer per generation and load their state through a
DCP StorageReader (:meth:`Worker.restore_from`), resharded into the new mesh: survivors' held snapshots
(:meth:`Worker.hold_snapshot`, also after a clean stop for a grow), the peer memory tier's keepers, or the
durable checkpoint.

Under ``workers.reuse`` a process outlives its run: a run that ended ``finished`` retires it (:meth:`Worker.retire`:
everything the run built dropped, the process put back as it was when the actor was created) and the
driver's next run hands it a new config and task (:meth:`Worker.reuse`); controller/warm_pool.py says when.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import gc
import os
import socket
import threading
import time
from typing import Any

# No garbage collection during the imports below (torch, DTensor, FSDP: every worker process's start): they
# allocate ~300k long-lived objects, and the collections they set off found nothing to free but cost a
# quarter of the imports' CPU (docs/perf/2026-11-28-suite-time.md). Turned back on right after them; an
# import that fails leaves it off in a process that cannot work anyway.
_GC_WAS_ON = gc.isenabled()
gc.disable()

import ray
import torch
import torch.distributed as dist

from elastictrain import worker_reply
from elastictrain.config import JobConfig
from elastictrain.logs import configure_worker_logging, one_line, set_worker_rank
from elastictrain.parallel.mesh import worker_device
from elastictrain.parallel.layout import Layout, resolve, spec_from_config
from elastictrain.task import Task
from elastictrain.worker import import_priority
from elastictrain.worker.errors import classify_step_error
from elastictrain.worker.faults import FaultInjector, InjectedFault
from elastictrain.worker.gloo_sever import Connections, Snapshot
from elastictrain.worker.loop import StepRunner
from elastictrain.worker.state_sync import broadcast_state

if _GC_WAS_ON:
    gc.enable()


STATE_GROUP = "state"
"""The concurrency group (one thread) of every Worker method that touches the model, its mesh or its
process groups. One thread because DTensor's sharding caches are thread-local and keyed by a DeviceMesh
that compares equal across generations of the same shape: clearing them when a generation builds its mesh
(``parallel.mesh.build_mesh``) must reach the thread that later runs steps, loads, saves and gathers on it;
and because those calls are collectives that must not overlap anyway."""

# step records the reporting rank's peer-tier snapshots carry (SnapshotMeta.records, for Ledger.replay): the
# newest, more than the controller's poll interval holds unless steps are very short (bounded: they travel
# to the keeper with every snapshot)
RECORDS_CARRIED = 64

_on_state_thread = ray.method(concurrency_group=STATE_GROUP)

# What this process looked like when its first Worker was created (workers.reuse: a retired worker is put back
# to it): its environment variables and the global torch generator's state.
_FRESH: dict[str, Any] = {}


def _remember_fresh() -> None:
    if not _FRESH:
        _FRESH["env"] = dict(os.environ)
        _FRESH["rng"] = torch.random.get_rng_state()


def _back_to_fresh() -> None:
    """Environment variables and the global torch generator as at the first Worker's creation."""
    env = _FRESH["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    torch.random.set_rng_state(_FRESH["rng"])


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit use)
        return socket.gethostbyname(socket.gethostname())


def _fingerprint(runner: StepRunner) -> dict[str, Any]:
    """Model, optimizer and dataset fingerprints: the controller admits only workers that match the run's."""
    from elastictrain.checkpoint.compat import model_fingerprint, optimizer_fingerprint
    from elastictrain.data.fingerprint import dataset_fingerprint

    return {"model": model_fingerprint(runner.model), "optimizer": optimizer_fingerprint(runner.optimizer),
            "data": dataset_fingerprint(runner.dataset)}


def _device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA H100 80GB HBM3)``: what the worker computes on, for its start event."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def _freeze_imported_objects() -> None:
    """Exempt what the imports created (~300k objects: torch, Ray, this package; they live as long as the
    process) from every later garbage collection (``gc.freeze``). A full collection otherwise scans them
    all: measured 0.17-0.22 s on this package's worker, paid at random inside steps and on the recovery
    path (``_release_groups`` collects so a dead generation's groups close: the survivors' drain under
    fsdp took 1.0 s, most of it in collections). ``torch._dynamo`` is imported first: FSDP2 and DTensor
    import it (and ~220 modules with it) on their first call, and a collection scanning those costs
    35-40 ms more. Called before the model, data and groups exist, so nothing that can become garbage
    is frozen."""
    import torch._dynamo  # noqa: F401 - imported for the freeze (see above), 0.6 s once per process

    gc.freeze()


def _nccl_environment(run_id: str, slot: int) -> None:
    """Torch's NCCL settings for a GPU worker, set before its first process group (torch reads them then).
    The flight recorder keeps the last 2,000 collectives and dumps them on a watchdog timeout into
    ``$TMPDIR/elastictrain-nccl/<run id>/slot<slot>-rank<r>`` on the worker's node (the controller also asks
    live members for it on a stall: ``Worker.flight_record``). ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``
    (SkipCleanUp): a collective that times out (``timeouts.collective_s``) dumps the recorder and ends the
    process, which the controller sees as a death and recovers from, instead of a wait that never ends (0)
    or a teardown that may hang in ``ncclCommAbort`` (1). Set whatever the environment held: Ray sets 1
    when it is unset."""
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), "elastictrain-nccl", run_id)
    os.makedirs(folder, exist_ok=True)
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, f"slot{slot}-rank"))


class Worker:
    """One training worker. Use :func:`worker_actor_class` to get the Ray actor class."""

    def __init__(self, config: JobConfig, task: Task, slot: int) -> None:
        if slot >= 0:  # a standby (slot -1) stays at the low priority until taken (worker/import_priority.py)
            import_priority.restore(by="init")
        _remember_fresh()
        # failed a step by its own error, or a fault acted here: never reused (retire says False). A survivor
        # (a peer's failure broke its step, the controller aborted its generation) is not: retire clears
        # what the aborted generations left (controller/warm_pool.py)
        self._tainted = False
        self._abandoned: list[Any] = []  # checkpoint writers given up at a membership change (retire waits for them)
        self.config = config
        self.task = task
        self.slot = slot
        self.runner: StepRunner | None = None
        self._store: Any = None
        self._stores: dict[int, Any] = {}
        self._ckpt_group: Any = None
        self._writer: Any = None
        self._stop = threading.Event()
        self._records: collections.deque = collections.deque()
        self._recent: collections.deque = collections.deque(maxlen=RECORDS_CARRIED)  # polled or not
        self._ckpt_events: collections.deque = collections.deque()
        self._status = "created"
        self._replicator: Any = None
        self._log = configure_worker_logging(slot)  # one line each, "[rank r/w slot s gen g]" prefixed
        self._memory_reports: list[dict[str, Any]] = []
        self._held: Any = None  # a survivor's snapshot served to the next generation (sharded layouts)
        self._connections = Connections()  # the current generation's gloo connections (``_release_groups``)

    # ------------------------------------------------------------------ life cycle
    @_on_state_thread
    def setup(self, slot: int | None = None) -> dict[str, Any]:
        """The slow start-up (imports, model build, dataset): done while the others keep training. ``slot``:
        the slot this process takes (a standby started ahead was created without one). A standby runs it
        ahead with no slot (:meth:`WorkerGroup._start_standby`); taking the standby calls it again with
        the slot, which then only names the slot: the model and data it built are a fresh worker's (built
        from the config and seed alone, never joined to a group), and ``prebuilt`` says so. Under
        ``parallel.compile`` the set-up ahead also compiles that model's blocks
        (:meth:`StepRunner.compile_ahead`): the replacement's first step then compiles nothing (ddp, fsdp)
        or hits torch's compile caches; a take while it runs waits for it (it is the replacement's work)."""
        t0 = time.perf_counter()
        if slot is not None:  # taken (if a standby): train at the training priority; wake() is the fast path
            import_priority.restore(by="take")
        if slot is not None and slot != self.slot:
            self.slot = slot
            self._log = configure_worker_logging(slot)
        prebuilt = self.runner is not None
        if not prebuilt:
            _freeze_imported_objects()
            threads = max(1, int(self.config.workers.cpus_per_worker))
            torch.set_num_threads(threads)
            # what Ray sets for an actor that asked for the CPUs; one outside its bundle (workers.reuse) asked
            # for none and got 1 (controller/warm_pool.py): children (data loaders) see the same either way
            os.environ["OMP_NUM_THREADS"] = str(threads)
            faults = FaultInjector(self.config.faults)
            if self.config.workers.use_gpu:
                _nccl_environment(self.config.stable_id, self.slot)
            self.runner = StepRunner(self.task, self.config.train, faults,
                                     audit=self.config.train.audit_samples, parallel=self.config.parallel,
                                     device=worker_device(self.config.workers.use_gpu), stop=self._stop)
            if slot is None and self.slot < 0:  # a standby ahead: parallel.compile's work too, off the recovery
                self.runner.compile_ahead()
        self._status = "ready"
        ctx = ray.get_runtime_context()
        return {
            "slot": self.slot, "pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": _node_ip(),
            "device": _device_name(self.runner.device),
            "setup_s": time.perf_counter() - t0, "prebuilt": prebuilt, "dataset_len": self.runner.dataset_len,
            "params": sum(p.numel() for p in self.runner.model.parameters()),
            # the whole training state, estimated: parameters plus two optimizer moments (Adam's); sizes the
            # peer memory tier (checkpoint/tier_budget.py)
            "state_bytes": 3 * sum(p.numel() * p.element_size() for p in self.runner.model.parameters()),
            "fingerprint": _fingerprint(self.runner),
        }

    @_on_state_thread
    def retire(self) -> bool:
        """End of a run that ended ``finished`` under ``workers.reuse``: close what the run opened (:meth:`shutdown`)
        and drop everything it built (model, optimizer, data, held snapshots, stores, DTensor's mesh caches,
        ``torch._dynamo``'s compiled code), put the environment variables and the global torch generator
        back as they were at this process's first creation, let the garbage collector see everything again
        (the next set-up freezes what is left, as a fresh one does) and reset the host memory high-water
        mark. A survivor of a failure (a peer died or failed, the controller aborted its generation) is
        retired like any other: the aborted generations' process groups were destroyed at the next join
        (their connections severed first), their stores and snapshots are dropped here, and a checkpoint
        writer abandoned at a membership change must have ended. Returns False, doing nothing, if this
        process failed a step by its own error or a fault fired in it (kill, hang, raise, abort, stall;
        ``slow`` and ``nan`` do not count), or its process group did not go, or an abandoned writer's
        thread is still running after ``timeouts.collective_s``: the group kills it instead."""
        from elastictrain.parallel.mesh import forget_earlier_meshes
        from elastictrain.worker import memory_peak

        if self._tainted or (self.runner is not None and self.runner.faults.touched):
            return False
        self.shutdown()
        if dist.is_initialized() or not self._writers_gone():
            return False
        self.runner = None
        self._held = self._store = self._writer = self._ckpt_group = self._replicator = None
        self._stores = {}
        self._records.clear()
        self._recent.clear()
        self._ckpt_events.clear()
        self._memory_reports = []
        forget_earlier_meshes()
        import torch._dynamo

        torch._dynamo.reset()
        _back_to_fresh()
        gc.unfreeze()
        gc.collect()
        memory_peak.reset_host()
        self._status = "retired"
        return True

    def _writers_gone(self) -> bool:
        """Every checkpoint writer abandoned at a membership change has ended (its thread ends on its own:
        an in-flight save finishes or fails with its group), waited for up to ``timeouts.collective_s``."""
        deadline = time.monotonic() + self.config.timeouts.collective_s
        for writer in self._abandoned:
            writer.join(max(0.0, deadline - time.monotonic()))
        self._abandoned = [w for w in self._abandoned if w.running()]
        return not self._abandoned

    @_on_state_thread
    def reuse(self, config: JobConfig, task: Task, slot: int) -> dict[str, Any]:
        """A retired process (:meth:`retire`) takes a slot of a new run: this worker is created anew with
        the run's ``config`` and ``task`` and set up as a fresh one is (:meth:`setup`, whose answer this is:
        the model and data built from the config and seed alone, ``prebuilt`` false)."""
        if self._status != "retired":
            raise RuntimeError(f"reuse of a worker in status {self._status!r}: only a retired one is reused")
        self.__init__(config, task, slot)
        return self.setup(slot)

    def wake(self) -> dict[str, Any]:
        """A standby process was taken: put it back at the training priority now (not on the state thread,
        where its set-up ahead may still run). Returns :func:`import_priority.report`."""
        import_priority.restore(by="take")
        return import_priority.report()

    def open_store(self, generation: int) -> tuple[str, int]:
        """Host the rendezvous store of a new generation (called on its rank 0). Returns host, port."""
        timeout = datetime.timedelta(seconds=self.config.timeouts.collective_s)
        store = dist.TCPStore(_node_ip(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self._stores = {generation: store}
        return _node_ip(), store.port

    @_on_state_thread
    def join(self, generation: int, rank: int, world_size: int, host: str, port: int,
             layout: Layout | None = None, restore: list[Any] | None = None,
             sync_src: int | None = None) -> int | None:
        """Leave the old process group (if any), join generation ``generation`` and apply ``layout``
        (default: the config's plan resolved at ``world_size``). Collective over the new members: all of
        them must call it concurrently. ``restore`` (snapshot sources, see :meth:`load_peer`): load them
        right after the rebuild and return the step -- one call instead of two, and a rank that finished its
        rebuild loads while slower ones still rebuild (loads are collective-free). ``sync_src``: then
        :meth:`sync` from that rank and return the step -- the controller's one round of calls per member
        for a rendezvous whose state source it knows before (never with ``restore``)."""
        if restore is not None and sync_src is not None:
            raise ValueError("join: restore and sync_src exclude each other (sync after every member restored)")
        held = self.runner.state.step if getattr(self.runner, "state", None) is not None else 0
        self.runner.faults.fire(rank=rank, step=held, point="join", generation=generation)
        self._leave_group()
        if not dist.is_initialized():
            # torch names a new group's store prefix by its count of groups made, and an init_process_group
            # that failed (a peer died in the rendezvous) leaves that count advanced: a fresh peer would then
            # wait under another prefix, every later rendezvous timing out. destroy_process_group resets it
            # to 0 on the normal path (torch/distributed/distributed_c10d.py); do the same after a failure.
            dist.distributed_c10d._world.group_count = 0
        set_worker_rank(rank, world_size, generation)
        timeout = datetime.timedelta(seconds=self.config.timeouts.collective_s)
        store = self._stores.get(generation) if rank == 0 else None
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._store = store
        backend = "cpu:gloo,cuda:nccl" if self.config.workers.use_gpu else "gloo"
        before = Snapshot.take()  # the generation's gloo connections are the ones opened from here on
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"gen{generation}", store), rank=rank,
            world_size=world_size, timeout=timeout,
        )
        self._ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
        layout = layout or resolve(spec_from_config(self.config), world_size)
        # A rebuilt (sharded) model is the seeded initial state (step 0, identical on every rank) until a
        # restore step (``restore`` below, restore_from) loads the generation's state into it.
        self.runner.attach(rank, world_size, generation, layout)  # builds the mesh: its groups connect here
        self._connections = Connections.opened_since(before)
        # a stop asked of an earlier generation that arrived after its run returned ends here (after attach:
        # one arriving from now on names an earlier generation than the runner's and is ignored)
        self._stop.clear()
        self._open_writer(rank, world_size, generation)
        self._status = "joined"
        if restore is not None:
            return self.load_peer(restore)
        return None if sync_src is None else self.sync(sync_src)

    @_on_state_thread
    def sync(self, src: int) -> int:
        """Make every rank's state rank ``src``'s (a live peer). Collective. Replicated layouts broadcast
        src's state (at step 0 with the task's ``init_weights``, src first loads them). Sharded ones hold a
        consistent state already (restored from a reader in this generation), or start at step 0: then any
        rank whose shards have no values yet (a meta build, ``parallel.meta_init`` or a rebuild) makes every
        rank load the initial values (``init_from_seed``: the task's ``init_weights``, else the seeded ones).
        Raises RuntimeError if their steps differ or a rank past step 0 has no values."""
        self._held = None  # every member has loaded (the controller syncs after all loads): none reads it now
        r = self.runner
        if r.replicated:
            if r.rank == src and r.step == 0 and r.uninitialized:  # the task's init_weights: src reads them
                r.init_from_seed()
            r.step = broadcast_state(r.model, r.optimizer, r.step, src=src)
            r.uninitialized = False
            return r.step
        views: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(views, (r.step, r.uninitialized))
        steps = [step for step, _ in views]
        if len(set(steps)) > 1:
            raise RuntimeError(f"ranks hold different steps {steps} after the restore: a sharded state is "
                               "loaded from survivors' snapshots, the peer tier or a checkpoint, never merged")
        if any(empty for _, empty in views):
            if r.step != 0:
                raise RuntimeError(f"ranks {[i for i, (_, e) in enumerate(views) if e]} hold no values at step "
                                   f"{r.step}: they were rebuilt and not restored")
            r.init_from_seed()
        return r.step

    @_on_state_thread
    def restore_from(self, reader: Any) -> int:
        """Load this rank's state from any DCP StorageReader (durable checkpoint, in-memory snapshots),
        resharded into the current layout. Collective-free (``TrainingState.load_from``). Returns the step."""
        step = self.runner.state.load_from(reader)
        self.runner.uninitialized = False
        return step

    def abort_group(self, generation: int | None = None, sever: bool = False) -> str:
        """The controller learned of a peer's death (or of a stall nobody is blamed for): make this rank's
        collectives of generation ``generation`` (None: the current one) stop waiting, and its step in
        flight never commit. Ignored when this worker is in another generation already (a late call must
        not abort the next one). First the runner's abort flag (``StepRunner.abort``): a step between its
        word and its optimizer is discarded (``_commit_gate``). NCCL: then abort every communicator
        (``_abort_process_group``), so a blocked collective or device sync ends at once instead of at the
        timeout. gloo: a dead peer's closed sockets already fail gloo's collectives (``ProcessGroupGloo.abort``
        does not wake a blocked one); ``sever`` (the stall fallback, where every member is alive and waits)
        shuts this rank's connections of the generation (worker/gloo_sever.py), which fails its collectives
        and its peers'. Returns what was done. Checked on one GPU (abort, then a new generation trains on:
        ``tests/test_gpu.py``); a live rank blocked in an NCCL collective on a dead one needs two GPUs and has
        not run."""
        r = self.runner
        if r is None or not r.abort(generation):
            return "other generation"
        if not dist.is_initialized():
            return "marked"
        if not self.config.workers.use_gpu:
            return f"marked, severed {self._connections.sever()}" if sever else "marked"
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # noqa: BLE001 - already aborted or destroyed
            return f"marked, abort failed: {e}"
        return "aborted"

    def flight_record(self) -> bytes | None:
        """This rank's NCCL flight recorder (torch's trace of its recent collectives, pickled), for the
        controller to write into the run directory on a hang; None without NCCL or a recorder. Not on the
        state thread: answers while a step hangs."""
        if not self.config.workers.use_gpu:
            return None
        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
        try:  # (include collectives, include stack traces, only active)
            return None if dump is None else dump(True, True, False)
        except Exception:  # noqa: BLE001 - no recorder in this torch build, or no NCCL group
            return None

    def _leave_group(self) -> None:
        if self._writer is not None:  # a membership change abandons in-flight saves (they never commit)
            self._ckpt_events.extend(self._writer.abandon())
            self._abandoned = [w for w in (*self._abandoned, self._writer) if w.running()]
        self._writer = None
        if self.runner is not None:
            self.runner.detach()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer may not tear down cleanly; it is dropped
                pass
        self._ckpt_group = None
        self._connections = Connections()

    # ------------------------------------------------------------------ the loop
    @_on_state_thread
    def run(self, target_step: int, joined: Any = None) -> bytes:
        """Run steps until ``target_step`` completed steps, a stop request, or a failure.

        ``joined``: the controller passes this generation's ``join`` call (its ref) here when it sends
        ``run`` before the join answered (``GenerationFormer._run_after``): Ray starts this call only once that
        join returned (its value, unused, arrives here), and a failed join fails this call with the join's
        error before it starts. The order is Ray's, not a wait in here: Ray does not order a threaded
        actor's calls, and a run waiting on the one state thread for its join would hold the thread the
        join needs.

        Returns ``{"status": done|stopped|peer_failed|error, "step": completed steps, "error": text,
        "slot": slot}`` packed (:mod:`elastictrain.worker_reply`: at a failed step the controller takes every
        survivor's result, and Ray hands bytes over for a third of a dict's cost; ``worker_reply.unpack``
        reads it). A failed step is discarded: gradients dropped, no optimizer step applied on this rank.
        """
        res = self._run_steps(target_step)
        return worker_reply.pack(res["status"], res["step"], res["error"], res["slot"])

    def _run_steps(self, target_step: int) -> dict[str, Any]:
        r = self.runner
        self._status = "running"
        failed: dict[str, Any] | None = None
        try:
            while r.step < target_step:
                try:
                    record, stop = r.run_step(self._stop.is_set())
                except InjectedFault as e:
                    r.discard_partial_step()
                    self._log.warning("step %d discarded: %s", r.step + 1, e)
                    failed = self._result("error", str(e))
                    break
                except Exception as e:  # noqa: BLE001 - classified below, reported to the controller
                    # Not by phase: a rank's own error in its last backward is its own failure.
                    r.discard_partial_step()
                    verdict = classify_step_error(e)
                    # One line: torch's collective errors carry pages of C++ frames, not news to anyone.
                    self._log.warning("step %d discarded (%s): %s", r.step + 1, verdict, one_line(e))
                    failed = self._result(verdict, one_line(e))
                    break
                self._records.append(record)
                self._recent.append(record)
                self._after_step(record.step)
                if stop:
                    return self._result("stopped")
            if failed is None:
                return self._result("done")
            if failed["status"] != "peer_failed":  # its own error (a survivor of a peer's is not tainted)
                self._tainted = True
            # outside the except clause: the failed step's frames (and their tensors) are gone by now.
            # Only a survivor releases: a rank that failed by its own error is killed by the controller,
            # which closes its connections anyway.
            if failed["status"] == "peer_failed":
                self._release_groups()
            return failed
        finally:
            self._stop.clear()
            self._status = "joined"

    def _release_groups(self) -> None:
        """A peer broke this rank's step: let go of the generation's process groups entirely, so that a live
        peer blocked in a collective with this rank fails now instead of after ``timeouts.collective_s``.
        That happens whenever a collective's peers are not all neighbours of the dead rank: DDP over 4 gloo
        ranks (a ring all-reduce: rank 3 waits for rank 2, which left when rank 1 died), HSDP (rank 2 in a
        replica all-reduce with rank 0 after rank 1 died).

        First this rank's gloo connections are severed (``worker/gloo_sever.py``): gloo has no working
        abort, and destroying a group waits for the collectives still queued or running on its threads,
        which can be waiting for a live peer that left the same collective (two such ranks then wait for
        each other until ``collective_s``: seen in 2 of 9 kill runs on the 50.7M GPT under DDP). Severed,
        every collective of this rank and of its peers on those connections fails at once, so the
        destruction below returns at once. Then every reference to the groups goes (the DDP wrapper, the
        step's stats handle, the writer's group, the mesh and DTensor's caches and, under a sharded layout,
        the model and optimizer -- after snapshotting this rank's shards, served by ``hold_snapshot`` /
        ``fetch``: parameters and optimizer state of its last completed step). A replicated model is kept:
        it is this rank's whole state."""
        from elastictrain.checkpoint.memory_dcp import take_snapshot
        from elastictrain.parallel.mesh import forget_earlier_meshes

        severed = self._connections.sever()
        self._log.info("severed %d of the generation's %d gloo connections", severed, len(self._connections))
        r = self.runner
        if r.replicated:
            self._leave_group()  # drops the DDP wrapper (runner.detach) and destroys the groups
            r.release_wrappers()
            forget_earlier_meshes()
            gc.collect()
            return
        try:
            self._held = take_snapshot(self._dcp_state(), rank=r.rank, step=r.step, generation=r.generation,
                                       **self._stage())
        except Exception as e:  # noqa: BLE001 - no snapshot: the controller finds another source
            self._log.warning("could not snapshot the state after the failed step: %s", one_line(e))
            self._held = None
        self._leave_group()
        r.release()
        forget_earlier_meshes()
        gc.collect()

    def _result(self, status: str, error: str | None = None) -> dict[str, Any]:
        return {"status": status, "step": self.runner.step, "error": error, "slot": self.slot}

    def request_stop(self, generation: int | None = None) -> None:
        """Ask the group to stop at the next step boundary (all ranks agree through the step's all-reduce).
        ``generation``: the generation the controller means to stop; a request that arrives once this worker
        joined a later one is ignored (it would stop the new generation after one step). A request that
        arrives after ``run`` returned is dropped by the next ``join``."""
        if generation is not None and self.runner is not None and self.runner.generation != generation:
            return
        self._stop.set()

    def poll(self, after: int | None = None) -> dict[str, Any]:
        """Progress since the last poll: completed step records, checkpoint reports, current phase.
        ``after``: send only the records of later steps (older ones are dropped): a rank other than the
        generation's reporting one is polled in turn, for its newest compute times only. Checkpoint reports
        are taken before records: a step's record is queued before its save starts, so a poll that carries
        a save's report carries the record of its step too, or an earlier one did (a committed step is
        always a reported one, however soon after the poll every worker dies)."""
        reports = []
        while self._ckpt_events:
            reports.append(self._ckpt_events.popleft())
        if self._writer is not None:
            reports.extend(self._writer.completed())
        records = []
        dropped_peak: dict[str, float] = {}  # memory of the records not sent: still in the run's peaks
        while self._records:
            record = self._records.popleft()
            if after is None or record.step > after:
                records.append(record)
            else:
                for key, value in (record.memory or {}).items():
                    dropped_peak[key] = max(value, dropped_peak.get(key, 0.0))
        memory, self._memory_reports = self._memory_reports, []
        if self._replicator is not None:
            memory.append(self._memory_report())
        r = self.runner
        return {
            "slot": self.slot, "status": self._status, "step": r.step if r else 0,
            "phase": r.phase if r else "idle", "phase_since": r.phase_since if r else time.time(),
            "records": records, "ckpt": reports, "memory": memory, "now": time.time(),
            "peak": dropped_peak,
            "profiles": r.profiler.take() if r else [],  # train.profile's traces (worker/profile.py)
        }

    # ------------------------------------------------------------------ checkpoints
    def _root_uri(self) -> str | None:
        c = self.config.checkpoint
        return None if c.uri is None else c.uri.rstrip("/") + "/" + self.config.stable_id

    def _open_writer(self, rank: int, world_size: int, generation: int) -> None:
        root = self._root_uri()
        if root is None:  # with durable checkpoints configured there is always a writer: the final state is saved
            return
        from elastictrain.checkpoint import CheckpointWriter

        self._writer = CheckpointWriter(self.config.checkpoint, root, rank, world_size, self._ckpt_group,
                                        storage_options=dict(self.config.checkpoint.storage_options),
                                        generation=generation)

    def _after_step(self, step: int) -> None:
        every = self.config.checkpoint.every_steps
        if self._writer is not None and every and step % every == 0:
            self._start_save(step)
        k = self.config.checkpoint.memory_every_steps
        if self._replicator is not None and k and step % k == 0:
            # A rank with a keeper (the lowest rank of each part of the state: controller/gather.py
            # snapshot_pushers; under DDP rank 0 alone) snapshots its own DCP state; the copy is the stall,
            # sending it to the keeper on another node runs on the replicator's thread. The reporting rank's
            # carries its newest step records: a recovery from it reports the steps the controller never saw.
            records = tuple(self._recent) if self.runner.rank == 0 else ()
            self._replicator.push(step, self._dcp_state(), records=records)

    def _dcp_state(self) -> dict[str, Any]:
        """This rank's training state as a DCP state dict (``TrainingState.state_dict``: model and
        optimizer shards, step and data cursor)."""
        return self.runner.state.state_dict()

    def _stage(self) -> dict[str, dict[str, int]]:
        """This rank's coordinate on its generation's snapshot axes and their sizes
        (:meth:`MeshDims.snapshot_coord`; none: never joined, the whole model), recorded in its snapshots
        for :func:`~elastictrain.checkpoint.memory_dcp.coverage`."""
        r = self.runner
        if r.layout is None:
            return {"coord": {}, "sizes": {}}
        return {"coord": r.layout.dims.snapshot_coord(r.rank), "sizes": r.layout.dims.snapshot_sizes()}

    def attach_keeper(self, keeper: Any, elsewhere: bool = True, lease: str | None = None) -> None:
        """Send this rank's peer-tier snapshots to ``keeper`` (a ShardKeeper on another node) from now on;
        ``None`` turns the tier off. ``elsewhere``: the keeper is on another node, so this rank keeps its
        own newest two snapshots too (``MemoryReplicator``'s ``keep_own``). Call after ``join`` (snapshots
        carry this generation and rank). ``lease``: the run's lease on its keepers (``KeeperState.lease``), sent
        with every snapshot."""
        from elastictrain.checkpoint import MemoryReplicator

        self._close_replicator(timeout=0)
        self._recent.clear()  # an earlier generation's records were taken with its members' last polls
        if keeper is not None:
            r = self.runner
            self._replicator = MemoryReplicator(keeper, rank=r.rank, generation=r.generation,
                                                timeout_s=self.config.timeouts.poll_s, keep_own=elsewhere,
                                                lease=lease, **self._stage())

    def _close_replicator(self, timeout: float | None) -> None:
        if self._replicator is not None:
            self._replicator.close(timeout=timeout)
            self._memory_reports.append(self._memory_report())  # after close: a snapshot left unsent is a drop
            self._replicator = None

    def _memory_report(self) -> dict[str, Any]:
        got = self._replicator.reports()
        return {"stall_s": got["stall_s"], "snapshots": got["snapshots"],
                "rejected": [{"step": p.step, "rank": p.rank, "reason": p.reason}
                             for p in got["results"] if not p.accepted],
                "dropped": [dataclasses.asdict(d) for d in got["dropped"]]}

    @_on_state_thread
    def hold_snapshot(self, expect: tuple[int, int, int] | None = None) -> Any:
        """Snapshot this survivor's current state (collective-free) and keep it to serve ``fetch`` while
        the next generation loads from it (sharded layouts: survivors are a reader source). Returns its
        ``SnapshotMeta``; the previous held snapshot is dropped. A survivor whose step a peer broke took it already
        (``_release_groups``): that one is served. ``expect``: the (generation, rank, step) the controller
        counts on; a held snapshot of exactly that is served even if this runner joined a later generation
        since (a failed rendezvous), and a runner that holds something else raises RuntimeError instead of
        serving another layout or step."""
        from elastictrain.checkpoint.memory_dcp import take_snapshot

        r = self.runner
        held = self._held
        current = (r.generation, r.rank, r.step)
        if held is not None and (held.meta.generation, held.meta.rank, held.meta.step) == (expect or current):
            return held.meta  # taken when this rank's step failed (``_release_groups``): still what is asked
        if expect is not None and current != tuple(expect):
            raise RuntimeError(f"slot {self.slot} holds generation {r.generation} rank {r.rank} step {r.step}, not "
                               f"the generation {expect[0]} rank {expect[1]} step {expect[2]} asked for")
        if r.model is None:
            raise RuntimeError(f"slot {self.slot} released its state after a failed step and holds no snapshot")
        self._held = take_snapshot(self._dcp_state(), rank=r.rank, step=r.step, generation=r.generation,
                                   **self._stage())
        return self._held.meta

    def own_snapshots(self) -> list[Any]:
        """The ``SnapshotMeta``s of this rank's newest two peer-tier snapshots (the newest where its keeper
        shares its node), which it keeps in its own memory too (``MemoryReplicator.own``). The controller
        adds them to the tier's sources: a node lost with its keeper takes the snapshots it kept for other
        nodes' ranks, and a survivor still holds its own. Not on the state thread: answers while a step
        fails or a load runs."""
        rep = self._replicator
        return [] if rep is None else [snap.meta for snap in rep.own()]

    def fetch(self, generation: int, rank: int, step: int, keys: list[Any]) -> Any:
        """Chunks of the snapshot kept by :meth:`hold_snapshot`, or of one of this rank's own peer-tier
        snapshots (:meth:`own_snapshots`), packed (same contract as ``ShardKeeper.fetch``)."""
        from elastictrain.checkpoint.memory_dcp import pack

        rep = self._replicator
        for held in [self._held, *([] if rep is None else rep.own())]:
            if held is not None and (held.meta.generation, held.meta.rank, held.meta.step) == (generation, rank, step):
                return pack(held.fetch(keys))
        raise KeyError(f"slot {self.slot} holds no snapshot of rank {rank} step {step} (generation {generation})")

    @_on_state_thread
    def load_peer(self, sources: list[Any]) -> int:
        """Load state from snapshots (``KeeperSource``s of one step that cover everything: peer-tier
        keepers or survivors) into this rank, resharded into the current layout (``restore_from``,
        collective-free): every member loads the same sources (through ``join(..., restore=sources)``).
        Returns the step;
        raises CursorError if the snapshots' data order differs."""
        from elastictrain.checkpoint.memory_dcp import SnapshotReader

        # a survivor's own snapshot stays held: the others may still be reading it (loads are collective-free);
        # ``sync``, called once every member loaded, drops it
        return self.restore_from(SnapshotReader(sources))

    @_on_state_thread
    def save(self, step: int | None = None) -> bool:
        """A just-in-time checkpoint of the current state (the controller's call, e.g. on preemption):
        collective over the group, waits for a free save slot instead of skipping. If this generation
        saved the step periodically already, that save stands once it wrote; one that wrote nothing
        (skipped while busy, refused) is done again. Returns True if a save of the step stands or started."""
        if self._writer is None:
            return False
        step = self.runner.step if step is None else step
        if self._writer.has_saved(step):
            # its outcome first (agreed by every rank in the save's own all-reduce); its reports go out
            # with the next poll or flush_checkpoints, before the new save's
            # (half of poll_s: the controller's call waits poll_s for this whole method)
            self._ckpt_events.extend(self._writer.wait(timeout=self.config.timeouts.poll_s / 2))
            if not self._writer.forget_unwritten(step):
                return True  # written (or, past the wait, still in flight): one save per (step, generation)
        return self._start_save(step, wait=True)

    def _start_save(self, step: int, wait: bool | None = None) -> bool:
        """Stage the state and queue its asynchronous save (``wait``: see ``CheckpointWriter.save_async``)."""
        if self._writer.has_saved(step):  # one save per (step, generation)
            return True
        from elastictrain.checkpoint.carried import CARRIED_MIN, carry

        t0 = time.perf_counter()
        # the reporting rank's newest records go into the manifest (those no poll took yet, at least a few):
        # a recovery from this checkpoint reports the steps it holds whose events were never written
        records = carry(self._recent, step, keep=max(CARRIED_MIN, len(self._records))) if self.runner.rank == 0 else ()
        started = self._writer.save_async(step, self.runner.state.state_dict(), wait=wait, records=records)
        if started:  # a skipped save is reported by the writer itself (a ShardReport with the reason)
            self._ckpt_events.append({"staged": step, "stall_s": time.perf_counter() - t0})
        return started

    def flush_checkpoints(self) -> list[Any]:
        """Wait for in-flight saves (and peer-tier sends, reported by the next poll) and return every save
        report not yet sent, in order: those a poll has not taken yet, then the writer's (used by a
        just-in-time save and before exit)."""
        if self._replicator is not None:
            self._replicator.flush(timeout=self.config.timeouts.poll_s)
        out = []
        while self._ckpt_events:
            out.append(self._ckpt_events.popleft())
        if self._writer is not None:
            out.extend(self._writer.wait(timeout=self.config.timeouts.poll_s))
        return out

    @_on_state_thread
    def load(self, manifest: Any, root_uri: str) -> int:
        """Load a committed checkpoint (every member calls it; DCP reshards into the current layout)."""
        from torch.distributed.checkpoint.api import CheckpointException

        from elastictrain.checkpoint.dcp_io import SafeReader
        from elastictrain.checkpoint.errors import CheckpointError
        from elastictrain.checkpoint.loader import _describe, checkpoint_dir

        uri = checkpoint_dir(manifest, root_uri)
        try:
            # every file this rank reads is checked against the manifest's size and SHA-256 while read
            step = self.restore_from(SafeReader(uri, dict(self.config.checkpoint.storage_options),
                                                expected=manifest.data_files))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps rank failures (BaseException)
            raise CheckpointError(_describe(e, uri, "loading")) from None
        if step != int(manifest.step):
            raise CheckpointError(f"checkpoint {uri} holds step {step} but its manifest says {manifest.step}")
        self._held = None  # a snapshot held after a failed step is not needed once the checkpoint loaded
        return step

    # ------------------------------------------------------------------ inspection
    @_on_state_thread
    def finish(self, final_root: str | None, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """The end of a finished run (fault point ``finish``): this rank's part of the model digest
        (parallel/digest.py) and, with ``final_root``, its part of the final model written through DCP into
        ``<final_root>/step_<N>/`` (checkpoint/final.py; collective: call on every member). Returns
        ``{"rank", "step", "digest", "report", "peak"}``: hashes and file names only, never the model;
        ``peak`` is this rank's peak memory since its last step (worker/memory_peak.py), so the run's
        per-rank peaks cover the end of the run too."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from elastictrain.worker import memory_peak

        r = self.runner
        r.faults.fire(rank=r.rank, step=r.step, point="finish", generation=r.generation)
        out: dict[str, Any] = {"rank": r.rank, "step": r.step, "digest": r.digest_part(), "report": None}
        if final_root is not None:
            from elastictrain.checkpoint.final import write_final_model

            out["report"] = write_final_model(get_model_state_dict(r.state.model), r.step, r.rank, final_root,
                                              storage_options)
        out["peak"] = memory_peak.read_and_reset(r.device)
        return out

    def shutdown(self) -> None:
        self._close_replicator(timeout=self.config.timeouts.collective_s)
        self._leave_group()
        if getattr(self, "runner", None) is not None:
            self.runner.close_data()


@functools.cache
def worker_actor_class() -> Any:
    """The Ray actor class for :class:`Worker`: threaded so ``poll``, ``request_stop``, ``abort_group`` and
    ``fetch`` run beside ``run`` and ``join`` (a restoring one); every method that touches the model runs on the one
    thread of the ``state`` concurrency group (see :data:`STATE_GROUP`). One per process: Ray exports a class
    to its cluster once per job (again after a new ``ray.init``), and a class made anew for every run was
    exported anew (pickled and disassembled on the driver) by every run of a process."""
    return ray.remote(max_concurrency=4, concurrency_groups={STATE_GROUP: 1})(Worker)
