"""The Ray actor that hosts one worker: its process, its torch.distributed groups and its step loop.

The actor is threaded (``max_concurrency`` > 1) so the controller can ``poll`` and ``request_stop`` while
``run`` executes steps. Healthy actors survive every membership change: ``join`` only swaps the process
group (a fresh TCPStore per generation, hosted by the new rank 0), and ``sync`` brings state from a live
peer.
"""

from __future__ import annotations

import collections
import datetime
import os
import socket
import threading
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from elastictrain.config import JobConfig
from elastictrain.task import Task
from elastictrain.worker.errors import classify_step_error
from elastictrain.worker.faults import FaultInjector, InjectedFault
from elastictrain.worker.loop import StepRunner
from elastictrain.worker.state_sync import broadcast_state


def _node_ip() -> str:
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit use)
        return socket.gethostbyname(socket.gethostname())


class Worker:
    """One training worker. Use :func:`worker_actor_class` to get the Ray actor class."""

    def __init__(self, config: JobConfig, task: Task, slot: int) -> None:
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
        self._ckpt_events: collections.deque = collections.deque()
        self._status = "created"
        self._replicator: Any = None

    # ------------------------------------------------------------------ life cycle
    def setup(self) -> dict[str, Any]:
        """The slow start-up (imports, model build, dataset): done while the others keep training."""
        t0 = time.perf_counter()
        threads = max(1, int(self.config.workers.cpus_per_worker))
        torch.set_num_threads(threads)
        faults = FaultInjector(self.config.faults)
        self.runner = StepRunner(self.task, self.config.train, faults, audit=self.config.train.audit_samples)
        self._status = "ready"
        ctx = ray.get_runtime_context()
        return {
            "slot": self.slot, "pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": _node_ip(),
            "setup_s": time.perf_counter() - t0, "dataset_len": self.runner.dataset_len,
            "params": sum(p.numel() for p in self.runner.model.parameters()),
        }

    def open_store(self, generation: int) -> tuple[str, int]:
        """Host the rendezvous store of a new generation (called on its rank 0). Returns host, port."""
        timeout = datetime.timedelta(seconds=self.config.timeouts.collective_s)
        store = dist.TCPStore(_node_ip(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self._stores = {generation: store}
        return _node_ip(), store.port

    def join(self, generation: int, rank: int, world_size: int, host: str, port: int) -> None:
        """Leave the old process group (if any) and join generation ``generation``. Collective over the
        new members: all of them must call it concurrently."""
        self._leave_group()
        timeout = datetime.timedelta(seconds=self.config.timeouts.collective_s)
        store = self._stores.get(generation) if rank == 0 else None
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self._store = store
        backend = "cpu:gloo,cuda:nccl" if self.config.workers.use_gpu else "gloo"
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"gen{generation}", store), rank=rank,
            world_size=world_size, timeout=timeout,
        )
        self._ckpt_group = dist.new_group(backend="gloo", timeout=timeout)
        self.runner.attach(rank, world_size, generation)
        self._open_writer(rank, world_size, generation)
        self._status = "joined"

    def sync(self, src: int) -> int:
        """Broadcast model, optimizer and step from rank ``src`` (a live peer). Collective."""
        r = self.runner
        r.step = broadcast_state(r.model, r.optimizer, r.step, src=src)
        return r.step

    def _leave_group(self) -> None:
        if self._writer is not None:  # a membership change abandons in-flight saves (they never commit)
            self._ckpt_events.extend(self._writer.abandon())
        self._writer = None
        if self.runner is not None:
            self.runner.detach()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer may not tear down cleanly; it is dropped
                pass
        self._ckpt_group = None

    # ------------------------------------------------------------------ the loop
    def run(self, target_step: int) -> dict[str, Any]:
        """Run steps until ``target_step`` completed steps, a stop request, or a failure.

        Returns ``{"status": done|stopped|peer_failed|error, "step": completed steps, "error": text}``.
        A failed step is discarded: gradients dropped, no optimizer step applied on this rank.
        """
        r = self.runner
        self._status = "running"
        try:
            while r.step < target_step:
                try:
                    record, stop = r.run_step(self._stop.is_set())
                except InjectedFault as e:
                    r.discard_partial_step()
                    return self._result("error", str(e))
                except Exception as e:  # noqa: BLE001 - classified below, reported to the controller
                    # Not by phase: a rank's own error in its last backward is its own failure.
                    r.discard_partial_step()
                    return self._result(classify_step_error(e), f"{type(e).__name__}: {e}")
                self._records.append(record)
                self._after_step(record.step)
                if stop:
                    return self._result("stopped")
            return self._result("done")
        finally:
            self._stop.clear()
            self._status = "joined"

    def _result(self, status: str, error: str | None = None) -> dict[str, Any]:
        return {"status": status, "step": self.runner.step, "error": error, "slot": self.slot}

    def request_stop(self) -> None:
        """Ask the group to stop at the next step boundary (all ranks agree through the step's all-reduce)."""
        self._stop.set()

    def poll(self) -> dict[str, Any]:
        """Progress since the last poll: completed step records, checkpoint reports, current phase."""
        records = []
        while self._records:
            records.append(self._records.popleft())
        reports = []
        while self._ckpt_events:
            reports.append(self._ckpt_events.popleft())
        if self._writer is not None:
            reports.extend(self._writer.completed())
        r = self.runner
        return {
            "slot": self.slot, "status": self._status, "step": r.step if r else 0,
            "phase": r.phase if r else "idle", "phase_since": r.phase_since if r else time.time(),
            "records": records, "ckpt": reports, "now": time.time(),
        }

    # ------------------------------------------------------------------ checkpoints
    def _root_uri(self) -> str | None:
        c = self.config.checkpoint
        return None if c.uri is None else c.uri.rstrip("/") + "/" + self.config.stable_id

    def _open_writer(self, rank: int, world_size: int, generation: int) -> None:
        root = self._root_uri()
        if root is None or not (self.config.checkpoint.every_steps or self.config.checkpoint.on_preempt):
            return
        from elastictrain.checkpoint import CheckpointWriter

        self._writer = CheckpointWriter(self.config.checkpoint, root, rank, world_size, self._ckpt_group,
                                        storage_options=dict(self.config.checkpoint.storage_options),
                                        generation=generation)

    def _after_step(self, step: int) -> None:
        every = self.config.checkpoint.every_steps
        if self._writer is not None and every and step % every == 0:
            self.save(step)
        k = self.config.checkpoint.memory_every_steps
        if self._replicator is not None and self.runner.rank == 0 and k and step % k == 0:
            # Replicated (DDP) state: rank 0's copy is everyone's. ray.put copies it before returning.
            r = self.runner
            self._replicator.push_async(step, {"step": step, "model": r.model.state_dict(),
                                               "optim": r.optimizer.state_dict()})

    def attach_keeper(self, keeper: Any) -> None:
        """Use ``keeper`` (a ShardKeeper on another node) as the in-memory replica tier."""
        from elastictrain.checkpoint import MemoryReplicator

        self._replicator = MemoryReplicator(keeper, rank=0)

    def load_snapshot(self, snapshot: dict[str, Any]) -> int:
        """Take state from an in-memory replica (the keeper's copy). Only this rank; peers get it by sync."""
        r = self.runner
        r.model.load_state_dict(snapshot["model"])
        r.optimizer.load_state_dict(snapshot["optim"])
        r.step = int(snapshot["step"])
        return r.step

    def save(self, step: int | None = None) -> bool:
        """Start an asynchronous checkpoint of the current state (collective over the group)."""
        from elastictrain.checkpoint import app_state

        if self._writer is None:
            return False
        step = self.runner.step if step is None else step
        if self._writer.has_saved(step):  # one save per (step, generation): e.g. a just-in-time save on a
            return True                   # periodic-save step; its report comes from the first save
        t0 = time.perf_counter()
        started = self._writer.save_async(step, app_state(self.runner.model, self.runner.optimizer))
        if started:  # a skipped save is reported by the writer itself (a ShardReport with the reason)
            self._ckpt_events.append({"staged": step, "stall_s": time.perf_counter() - t0})
        return started

    def flush_checkpoints(self) -> list[Any]:
        """Wait for in-flight saves and return their reports (used before exit)."""
        if self._writer is None:
            return []
        return list(self._writer.wait(timeout=self.config.timeouts.poll_s))

    def load(self, manifest: Any, root_uri: str) -> int:
        """Load a committed checkpoint into model and optimizer (collective; reshards as needed)."""
        from elastictrain.checkpoint import load_checkpoint, app_state, apply_app_state

        r = self.runner
        state = app_state(r.model, r.optimizer)
        load_checkpoint(manifest, root_uri, state, process_group=self._ckpt_group,
                        storage_options=dict(self.config.checkpoint.storage_options))
        apply_app_state(r.model, r.optimizer, state)
        r.step = int(manifest.step)
        return r.step

    # ------------------------------------------------------------------ inspection
    def digest(self) -> dict[str, Any]:
        return self.runner.state_digest()

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.runner.model.state_dict().items()}

    def shutdown(self) -> None:
        self._leave_group()


def worker_actor_class() -> Any:
    """The Ray actor class for :class:`Worker` (threaded so poll/stop run beside ``run``)."""
    return ray.remote(max_concurrency=4)(Worker)
