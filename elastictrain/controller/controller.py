"""The controller: an explicit state machine on the driver that runs the worker group.

It places workers, forms membership generations (a rendezvous per generation), drives the step loop
through ``run``/``poll``/``request_stop`` and, on a failure, regroups the survivors at the last step
boundary without restarting them. Decisions come from :mod:`elastictrain.controller.policy`; this module
executes them. ``step()`` advances one iteration, so tests can drive it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from elastictrain.config import JobConfig
from elastictrain.controller import policy
from elastictrain.controller.commits import Committer
from elastictrain.controller.drain import DrainWatcher
from elastictrain.controller.group import Slot, SlotState, WorkerGroup
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.state import State, StateMachine
from elastictrain.data.cursor import check_layout
from elastictrain.events import EventLog
from elastictrain.task import Task

log = logging.getLogger("elastictrain.controller")

# Poll cadence while healthy: a dead worker is seen at once through its run ref; polls carry step records
# and feed the hang watchdog (whose bound is >= timeouts.watchdog_floor_s, seconds).
POLL_INTERVAL_S = 0.5
MEMORY_BUDGET = 4 << 30  # bytes the in-memory replica keeper may hold


@dataclass
class Failure:
    slot: int
    rank: int | None
    kind: str  # process_died | hang | exception | node_lost | setup_failed | straggler
    reason: str
    detected_at: float
    last_progress: float
    last_step: int  # the most advanced step any rank had completed when the failure was seen


class Controller:
    def __init__(self, config: JobConfig, task: Task, events: EventLog, store: Any = None,
                 resume_manifest: Any = None) -> None:
        self.config = config
        self.task = task
        self.events = events
        self.sm = StateMachine()
        self.group = WorkerGroup(config, task)
        self.ledger = Ledger(events, config.train.steps, config.train.global_batch, config.workers.max)
        self.store = store
        self.ckpt_root = getattr(store, "root_uri", None)
        self.resume_manifest = resume_manifest
        self.committer = Committer(config, events, store, self._checkpoint_meta())
        self.generation = -1
        self.world_size = 0
        self.failures_by_slot: dict[int, int] = {}
        self.pending_failures: list[Failure] = []
        self.run_refs: dict[Any, Slot] = {}
        self.poll_refs: dict[int, tuple[Any, float]] = {}
        self.waiting_since: float | None = None
        self.open_failure: Failure | None = None
        self.preempt_reason: str | None = None
        self.final_error: str | None = None
        self.exit_code = 0
        self.reported_stragglers: set[int] = set()
        self.final_state: dict[str, Any] | None = None
        self.final_digest: dict[str, Any] | None = None
        self.recovery_source = "peer"
        self.generation_started_at, self.generation_start_step = 0.0, 0
        self.keeper = self._start_keeper()
        self.drains = DrainWatcher(ray.get_runtime_context().gcs_address)

    # ------------------------------------------------------------------ public
    def run(self) -> dict[str, Any]:
        try:
            while not self.sm.terminal:
                self.step()
        finally:
            self.group.shutdown()
        return self.summary()

    def request_preemption(self, reason: str) -> None:
        """Called from a signal handler or a drain notice: stop at a step boundary, checkpoint, exit."""
        self.preempt_reason = self.preempt_reason or reason

    def step(self) -> None:
        """One iteration of the state machine."""
        handler = {
            State.STARTING: self._starting, State.RUNNING: self._running, State.RECOVERING: self._recovering,
            State.RESIZING: self._resizing, State.CHECKPOINTING: self._checkpointing,
        }[self.sm.state]
        handler()

    # ------------------------------------------------------------------ states
    def _starting(self) -> None:
        t = self.config.timeouts
        for slot in self.group.slots:
            self.group.spawn(slot.index)
        deadline = time.time() + t.restart_grace_s
        while time.time() < deadline:
            for slot in self.group.collect_ready(timeout=POLL_INTERVAL_S):
                self._on_setup_done(slot)
            ready = self.group.by_state(SlotState.READY)
            if len(ready) == len(self.group.slots):
                break
            starting = self.group.by_state(SlotState.STARTING)
            if not starting and len(ready) >= self.config.workers.min:
                break
            if self.preempt_reason:
                return self._finish(State.PREEMPTED, self.preempt_reason, code=75)
        ready = self.group.by_state(SlotState.READY)
        decision = self._membership(len(ready), current=self.config.workers.max)
        if decision.action != "go":
            return self._fail(f"could not start {self.config.workers.min} workers within "
                              f"timeouts.restart_grace_s={t.restart_grace_s:g}: {decision.reason}")
        chosen = sorted(ready, key=lambda s: s.index)[: decision.world_size]
        if not self._form_generation(chosen, reason="start", resume=self.resume_manifest):
            return self.sm.to(State.RECOVERING, "a worker failed during the first rendezvous")
        self.sm.to(State.RUNNING, f"{decision.world_size} workers joined generation {self.generation}")

    def _running(self) -> None:
        self._pump(POLL_INTERVAL_S)
        if self.pending_failures:
            return self.sm.to(State.RECOVERING, self.pending_failures[0].reason)
        results = self._finished_runs()
        if results is not None:
            if all(r["status"] == "done" for r in results):
                return self._finish(State.FINISHED, f"reached step {self.config.train.steps}")
            errors = "; ".join(f"slot {r['slot']}: {r['error']}" for r in results if r.get("error"))
            return self.sm.to(State.RECOVERING, f"the group left its step loop ({errors or 'stopped'})")
        if self.preempt_reason:
            self._stop_members()
            return self.sm.to(State.CHECKPOINTING, self.preempt_reason)
        if self._can_grow():
            self._stop_members()
            self.sm.to(State.RESIZING, "replacement workers are ready: growing at the next step boundary")

    def _resizing(self) -> None:
        self._pump(POLL_INTERVAL_S)
        if self.pending_failures:
            return self.sm.to(State.RECOVERING, self.pending_failures[0].reason)
        results = self._finished_runs()
        if results is None:
            return
        if all(r["status"] == "done" for r in results):
            return self._finish(State.FINISHED, f"reached step {self.config.train.steps}")
        if self.preempt_reason:
            return self.sm.to(State.CHECKPOINTING, self.preempt_reason)
        self._regroup(reason="grow")
        if self.sm.state is State.RESIZING:  # told to wait (a joiner vanished): wait where the clock runs
            self.sm.to(State.RECOVERING, "growing had to wait for workers")

    def _recovering(self) -> None:
        killed = self._kill_failed()
        # Survivors come back from `run` at the failed step's boundary (their collectives fail fast).
        self._drain_runs(timeout=self.config.timeouts.collective_s)
        self._account_failures(killed)
        if self.sm.state is not State.RECOVERING or self.pending_failures:
            return  # failed, or a survivor failed as well: handled in the next iteration
        for slot in self.group.collect_ready(timeout=0):
            self._on_setup_done(slot)
        if self.preempt_reason:
            return self.sm.to(State.CHECKPOINTING, self.preempt_reason)
        self._regroup(reason="recover")

    def _checkpointing(self) -> None:
        """Preempted: the members stopped at a step boundary; write a just-in-time checkpoint and exit."""
        self._drain_runs(timeout=self.config.timeouts.collective_s)
        step = self.ledger.last_step
        members = [s for s in self.group.members() if s.state is SlotState.MEMBER]
        saved = False
        if self.config.checkpoint.on_preempt and self.store is not None and members and step:
            saved = self._save_now(members, step)
        self.events.emit("preempted", step=step, checkpoint=saved, reason=self.preempt_reason)
        self._finish(State.PREEMPTED, self.preempt_reason or "preempted", code=75)

    # ------------------------------------------------------------------ generations
    def _membership(self, available: int, current: int) -> policy.Membership:
        w, tr = self.config.workers, self.config.train
        return policy.decide_membership(
            available=available, current=current, mode=self.config.recovery.mode, min_workers=w.min,
            max_workers=w.max, global_batch=tr.global_batch, micro_batch=tr.micro_batch,
            waiting_since=self.waiting_since, now=time.time(),
            wait_limit_s=self.config.recovery.min_workers_wait_s,
        )

    def _regroup(self, reason: str) -> None:
        """Form the next generation from survivors and ready joiners, or wait, or fail."""
        for slot in self.group.collect_ready(timeout=0):
            self._on_setup_done(slot)
        survivors = [s for s in self.group.slots if s.state is SlotState.MEMBER]
        ready = self.group.by_state(SlotState.READY)
        decision = self._membership(len(survivors) + len(ready), current=self.world_size)
        if decision.action == "fail":
            return self._fail(decision.reason)
        if decision.action == "wait":
            if self.waiting_since is None:
                self.waiting_since = time.time()
                self.events.emit("worker_lost", world_size=len(survivors), reason=decision.reason)
            for slot in self.group.collect_ready(timeout=POLL_INTERVAL_S):
                self._on_setup_done(slot)
            return
        self.waiting_since = None
        chosen = self._choose_members(survivors, ready, decision.world_size)
        old = self.world_size
        resume = None
        if not any(s.has_state for s in chosen):
            resume = self._durable_fallback()
            if self.sm.state is State.FAILED:
                return
        if not self._form_generation(chosen, reason=reason, resume=resume):
            if self.sm.state is not State.RECOVERING:
                self.sm.to(State.RECOVERING, "a worker failed during the rendezvous")
            return
        if old != self.world_size:
            self.events.emit("resized", old_world_size=old, new_world_size=self.world_size,
                             accum=check_layout(self.config.train.global_batch, self.config.train.micro_batch,
                                                self.world_size), step=self.ledger.last_step,
                             reason=decision.reason)
        self.sm.to(State.RUNNING, f"generation {self.generation} with {self.world_size} workers ({reason})")

    def _start_keeper(self) -> Any:
        """The in-memory replica tier: a keeper actor on the driver's node (not a worker's)."""
        if not self.config.checkpoint.memory_every_steps:
            return None
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from elastictrain.checkpoint import ShardKeeper

        here = ray.get_runtime_context().get_node_id()
        return ShardKeeper.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=True)).remote(MEMORY_BUDGET)

    def _memory_snapshot(self) -> dict[str, Any] | None:
        if self.keeper is None:
            return None
        try:
            got = ray.get(self.keeper.get.remote(0), timeout=self.config.timeouts.poll_s)
        except Exception as e:  # noqa: BLE001 - the keeper is a cache; durable storage remains
            self.events.emit("worker_lost", world_size=0, reason=f"in-memory replica unavailable: {e}")
            return None
        return None if got is None else got[1]

    def _durable_fallback(self) -> Any:
        """No live worker holds training state: take the newest of the in-memory replica and the newest
        committed checkpoint; with neither the run restarts from step 0, said loudly in the events."""
        manifest = None
        if self.store is not None:
            manifest, skipped = self.store.latest_valid()
            for why in skipped:
                self.events.emit("checkpoint_failed", step=None, reason=f"skipped on recovery: {why}")
        snapshot = self._memory_snapshot()
        if snapshot is not None and (manifest is None or snapshot["step"] >= manifest.step):
            return snapshot
        if manifest is None:
            self.events.emit("worker_lost", world_size=0, step=0,
                             reason="every worker holding training state was lost and no committed checkpoint "
                                    "exists: restarting from step 0")
            self.ledger.last_step = 0
            self.recovery_source = "scratch"
        return manifest

    def _choose_members(self, survivors: list[Slot], ready: list[Slot], world: int) -> list[Slot]:
        if self.config.recovery.mode == "strict":
            # Keep ranks: survivors keep theirs, joiners take the ranks of the dead.
            by_rank = {s.rank: s for s in survivors}
            joiners = iter(sorted(ready, key=lambda s: s.index))
            return [by_rank[r] if r in by_rank else next(joiners) for r in range(world)]
        keep = sorted(survivors, key=lambda s: (s.rank if s.rank is not None else 1 << 30, s.index))
        extra = sorted(ready, key=lambda s: s.index)
        return (keep + extra)[:world]

    def _form_generation(self, chosen: list[Slot], reason: str, resume: Any = None) -> bool:
        """Rendezvous ``chosen`` (in rank order) as a new generation, sync state from the most advanced
        survivor, and start the step loop. False if a member failed on the way (recorded as a failure)."""
        self._poll_members_blocking()
        self.ledger.flush_partial()
        self.generation += 1
        gen, world = self.generation, len(chosen)
        for s in self.group.members():
            if s not in chosen:  # a member dropped by the decision goes back to READY
                s.state = SlotState.READY
        t = self.config.timeouts
        try:
            host, port = ray.get(chosen[0].actor.open_store.remote(gen), timeout=t.poll_s)
            ray.get([s.actor.join.remote(gen, r, world, host, port) for r, s in enumerate(chosen)],
                    timeout=t.restart_grace_s)
            if isinstance(resume, dict):  # an in-memory replica: rank 0 takes it, sync spreads it
                step = ray.get(chosen[0].actor.load_snapshot.remote(resume), timeout=t.restart_grace_s)
                chosen[0].has_state, chosen[0].info["step"] = True, step
                self.recovery_source = "memory"
                self.ledger.last_step = step
            elif resume is not None:
                root = self.ckpt_root
                ray.get([s.actor.load.remote(resume, root) for s in chosen], timeout=t.restart_grace_s)
                for s in chosen:
                    s.has_state = True
                self.recovery_source = "checkpoint"
                self.ledger.last_step = int(resume.step)
                self.events.emit("resumed", step=int(resume.step), world_size=world,
                                 from_world_size=getattr(resume, "world_size", None), uri=root)
            src = policy.pick_source({r: self._slot_step(s) for r, s in enumerate(chosen) if s.has_state}
                                     or {0: 0})
            steps = ray.get([s.actor.sync.remote(src) for s in chosen], timeout=t.restart_grace_s)
        except Exception as e:  # noqa: BLE001 - any member failing here is a failure like any other
            self._detect_dead(chosen, f"failed during rendezvous of generation {gen}: {e}")
            return False
        for r, s in enumerate(chosen):
            first_time = s.rank is None and not s.has_state
            s.state, s.rank, s.has_state = SlotState.MEMBER, r, True
            if first_time or reason == "start":
                self.events.emit("worker_started", rank=r, slot=s.index, pid=s.info.get("pid"),
                                 node_id=s.info.get("node_id"), generation=gen, setup_s=s.info.get("setup_s"))
        self.world_size = world
        self.generation_started_at, self.generation_start_step = time.time(), steps[0]
        accum = check_layout(self.config.train.global_batch, self.config.train.micro_batch, world)
        self.ledger.new_generation(gen, world, accum)
        self.ledger.last_step = max(self.ledger.last_step, steps[0])
        self.events.emit("generation_started", generation=gen, world_size=world, accum=accum, step=steps[0],
                         source_rank=src, reason=reason)
        if reason == "start":
            self.recovery_source = "peer"
        else:
            self._close_recovery(start_step=steps[0])
        if self.keeper is not None:
            ray.get([s.actor.attach_keeper.remote(self.keeper) for s in chosen], timeout=t.poll_s)
        self.run_refs = {s.actor.run.remote(self.config.train.steps): s for s in chosen}
        return True

    def _slot_step(self, slot: Slot) -> int:
        return int(slot.info.get("step", 0))

    def _close_recovery(self, start_step: int) -> None:
        """The new generation stands: account the recovery. ``lost_steps`` counts completed steps that must
        be redone (0 when a survivor held the newest state); the step in flight is lost time, not a step."""
        source, self.recovery_source = self.recovery_source, "peer"
        if self.open_failure is None:
            return
        f, now = self.open_failure, time.time()
        lost = max(0, f.last_step - start_step)
        self.ledger.recoveries += 1
        self.ledger.lost_steps += lost
        self.ledger.add_time("recovery", now - f.detected_at)
        self.events.emit("recovered", source=source,
                         recovery_s=round(now - f.detected_at, 3), downtime_s=round(now - f.last_progress, 3),
                         lost_steps=lost, step=start_step, world_size=self.world_size)
        self.open_failure = None

    # ------------------------------------------------------------------ observing workers
    def _pump(self, timeout: float) -> None:
        """Wait a little for run results, poll members, turn records into events, watch for hangs."""
        refs = list(self.run_refs)
        ended, running = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        if running and not ended:  # wake at the first run that ends (a death, a failed step) or at `timeout`
            ray.wait(running, num_returns=1, timeout=timeout)
        elif ended and running:  # some ranks left the loop: the rest follow within a step; don't spin
            ray.wait(running, num_returns=len(running), timeout=min(timeout, 0.05))
        self._poll_members()
        for slot in self.group.collect_ready(timeout=0):
            self._on_setup_done(slot)
        self._check_runs()
        self._watchdog()
        self._check_stragglers()
        self._check_drains()

    def _poll_members(self) -> None:
        now = time.time()
        for slot in self.group.members():
            if slot.index not in self.poll_refs:
                self.poll_refs[slot.index] = (slot.actor.poll.remote(), now)
        refs = {ref: idx for idx, (ref, _) in self.poll_refs.items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            idx = refs[ref]
            del self.poll_refs[idx]
            slot = self.group.slots[idx]
            try:
                result = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead actor is found by its run ref
                continue
            self._take_poll(slot, result)

    def _take_poll(self, slot: Slot, result: dict[str, Any]) -> None:
        slot.info["step"] = result["step"]
        slot.info["phase"], slot.info["phase_since"] = result["phase"], result["phase_since"]
        for record in result["records"]:
            if slot.rank is not None:
                for ev in self.ledger.add(slot.rank, record):
                    self.committer.expect(ev["step"], ev["world_size"])
        for item in result["ckpt"]:
            self.committer.take(slot.rank if slot.rank is not None else -1, item)

    def _check_runs(self) -> None:
        done = [ref for ref in self.run_refs if _is_ready(ref)]
        for ref in done:
            slot = self.run_refs[ref]
            if slot.state is SlotState.DEAD:
                continue
            try:
                res = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - the actor died
                self._add_failure(slot, "process_died", f"worker process died: {type(e).__name__}")
                continue
            slot.info["step"] = res["step"]
            slot.info["result"] = res
            if res["status"] == "error":
                self._add_failure(slot, "exception", res["error"])
            elif res["status"] == "peer_failed":  # a peer broke the step: find it without waiting for Ray
                for peer in self.run_refs.values():
                    if peer.state is SlotState.MEMBER and self.group.process_gone(peer):
                        self._add_failure(peer, "process_died", "worker process died (seen by its peers)")

    def _finished_runs(self) -> list[dict[str, Any]] | None:
        """All members' run results, once every one has returned (else None)."""
        if not self.run_refs or not all(_is_ready(r) for r in self.run_refs):
            return None
        results = []
        for ref, slot in self.run_refs.items():
            try:
                results.append(ray.get(ref))
            except Exception:  # noqa: BLE001
                return None
        self._poll_members_blocking()
        self.run_refs = {}
        return results

    def _poll_members_blocking(self) -> None:
        """Take every outstanding poll, then poll each live member once more: no record is dropped."""
        timeout = self.config.timeouts.poll_s
        outstanding, self.poll_refs = self.poll_refs, {}
        for idx, (ref, _) in outstanding.items():
            slot = self.group.slots[idx]
            if slot.state is SlotState.DEAD:
                continue
            try:
                self._take_poll(slot, ray.get(ref, timeout=timeout))
            except Exception:  # noqa: BLE001 - dead or unresponsive: found by its run ref / watchdog
                pass
        for slot in self.group.members():
            try:
                self._take_poll(slot, ray.get(slot.actor.poll.remote(), timeout=timeout))
            except Exception:  # noqa: BLE001
                pass

    def _watchdog(self) -> None:
        if not self.run_refs:
            return
        now = time.time()
        # Progress as any rank reports it, and never before this generation began; until the generation
        # completed a step (DDP rebuild, warm-up) the bound is the cap, not one derived from steady steps.
        progress = max(self.ledger.last_progress, self.ledger.latest_record_at, self.generation_started_at)
        warm = self.ledger.latest_record_step > self.generation_start_step
        bound = policy.hang_bound(self.ledger.step_times if warm else [], self.config.timeouts)
        if now - progress < bound:
            return
        suspects = [self.group.slots[i] for i, (_, since) in self.poll_refs.items() if now - since > bound]
        if not suspects:  # all answer: the one stuck outside a collective while others wait is hung
            members = self.group.members()
            waiting = [s for s in members if s.info.get("phase") == "collective"]
            if waiting:
                suspects = [s for s in members if s.info.get("phase") == "compute"
                            and now - s.info.get("phase_since", now) > bound]
        for slot in suspects:
            self._add_failure(slot, "hang", f"no progress for {now - progress:.1f}s "
                                            f"(bound {bound:.1f}s from observed step times)")

    def _check_drains(self) -> None:
        """A drain notice for a node that hosts workers is a preemption: stop at a step boundary, write a
        just-in-time checkpoint, exit 75 (the job is resubmitted and resumes)."""
        draining = self.drains.draining()
        hit = sorted({s.info.get("node_id") for s in self.group.members()} & draining)
        if hit:
            self.request_preemption(f"Ray drain notice for node {', '.join(hit)}")

    def _check_stragglers(self) -> None:
        r = self.config.recovery
        found = policy.find_stragglers(self.ledger.compute_times, r.straggler_factor, r.straggler_window)
        for rank, reason in found.items():
            if rank in self.reported_stragglers:
                continue
            self.reported_stragglers.add(rank)
            slot = next((s for s in self.group.members() if s.rank == rank), None)
            node = slot.info.get("node_id") if slot else None
            self.events.emit("straggler", rank=rank, node_id=node, evicted=r.evict_stragglers, reason=reason)
            if r.evict_stragglers and slot is not None and self.world_size > self.config.workers.min:
                self._add_failure(slot, "straggler", reason)

    # ------------------------------------------------------------------ failures
    def _add_failure(self, slot: Slot, kind: str, reason: str) -> None:
        if slot.state is SlotState.DEAD or any(f.slot == slot.index for f in self.pending_failures):
            return
        known = max([self.ledger.last_step] + [int(s.info.get("step", 0)) for s in self.group.members()])
        self.pending_failures.append(Failure(slot.index, slot.rank, kind, reason, time.time(),
                                             self.ledger.last_progress, known))

    def _detect_dead(self, slots: list[Slot], reason: str) -> None:
        """After a failed collective call: find which of ``slots`` is dead or unresponsive."""
        refs = {s.actor.poll.remote(): s for s in slots if s.actor is not None}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        for ref, slot in refs.items():
            ok = ref in done
            if ok:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001
                    ok = False
            if not ok:
                self._add_failure(slot, "process_died", reason)
        if not self.pending_failures and slots:
            self._add_failure(slots[0], "exception", reason)

    def _kill_failed(self) -> list[tuple[Failure, str, str | None]]:
        """Kill the failed workers at once (a stopped one blocks its peers' collectives until then).
        Returns (failure, kind, node) for accounting once the survivors' last records are in."""
        failures, self.pending_failures = self.pending_failures, []
        alive_nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")} if failures else set()
        out = []
        for f in failures:
            slot = self.group.slots[f.slot]
            node = slot.info.get("node_id")
            lost = node is not None and node not in alive_nodes
            kind = "node_lost" if lost and f.kind in ("process_died", "hang") else f.kind
            pid = slot.info.get("pid")
            self.group.kill(slot)
            slot.info.update(pid=pid, node_id=node)  # kept for the event
            self.run_refs = {ref: s for ref, s in self.run_refs.items() if s is not slot}
            self.poll_refs.pop(slot.index, None)
            out.append((f, kind, node))
        return out

    def _account_failures(self, killed: list[tuple[Failure, str, str | None]]) -> None:
        """Emit the failure events (timed from the true last progress, now that the survivors' records
        are in), apply the failure budget, and start the replacements."""
        for f, kind, node in killed:
            slot = self.group.slots[f.slot]
            f.last_progress = min(f.detected_at, max(f.last_progress, self.ledger.latest_record_at))
            self.ledger.failures += 1
            self.failures_by_slot[f.slot] = self.failures_by_slot.get(f.slot, 0) + 1
            self.ledger.add_time("detection", f.detected_at - f.last_progress)
            self.events.emit("failure", kind=kind, rank=f.rank, slot=f.slot, node_id=node,
                             pid=slot.info.get("pid"), detected_after_s=round(f.detected_at - f.last_progress, 3),
                             step=max(self.ledger.last_step, self.ledger.latest_record_step), reason=f.reason)
            if self.open_failure is None:
                self.open_failure = f
        verdict = policy.failure_verdict(self.ledger.failures, self.failures_by_slot, self.config.recovery)
        if verdict:
            return self._fail(verdict)
        for f, _, _ in killed:
            self.group.spawn(f.slot)  # the replacement starts while the survivors carry on

    def _drain_runs(self, timeout: float) -> None:
        """Wait for every member's ``run`` to return and take their last records; a member that does not
        return is recorded as hung (handled by the next recovery iteration)."""
        if not self.run_refs:
            return
        ray.wait(list(self.run_refs), num_returns=len(self.run_refs), timeout=timeout)
        self._check_runs()
        for ref, slot in list(self.run_refs.items()):
            if not _is_ready(ref) and slot.state is SlotState.MEMBER:
                self._add_failure(slot, "hang", f"did not leave the failed step within {timeout:g}s")
        self._poll_members_blocking()
        self.run_refs = {}

    def _stop_members(self) -> None:
        for slot in self.group.members():
            slot.actor.request_stop.remote()

    def _can_grow(self) -> bool:
        ready = self.group.by_state(SlotState.READY)
        if not ready or self.world_size >= self.config.workers.max:
            return False
        return self._membership(self.world_size + len(ready), self.world_size).world_size > self.world_size

    def _on_setup_done(self, slot: Slot) -> None:
        if slot.state is SlotState.DEAD and "error" in slot.info:
            self.ledger.failures += 1
            self.failures_by_slot[slot.index] = self.failures_by_slot.get(slot.index, 0) + 1
            self.events.emit("failure", kind="setup_failed", rank=None, slot=slot.index, node_id=None,
                             detected_after_s=0.0, step=self.ledger.last_step, reason=slot.info["error"])
            verdict = policy.failure_verdict(self.ledger.failures, self.failures_by_slot, self.config.recovery)
            if verdict:
                return self._fail(verdict)
            self.group.spawn(slot.index)

    # ------------------------------------------------------------------ checkpoints and endings
    def _checkpoint_meta(self) -> dict[str, Any]:
        c = self.config
        config = c.model_dump(mode="json")
        for section in (config["checkpoint"], config["task"]["data"]):  # credentials never reach storage
            section["storage_options"] = {k: "<redacted>" for k in section["storage_options"]}
        return {"plan": c.parallel.plan, "global_batch": c.train.global_batch, "seed": c.train.seed,
                "config": config, "run_id": c.stable_id}

    def _save_now(self, members: list[Slot], step: int) -> bool:
        t = self.config.timeouts
        try:
            ray.get([s.actor.save.remote(step) for s in members], timeout=t.poll_s)
            self.committer.expect(step, len(members))
            for s in members:
                for report in ray.get(s.actor.flush_checkpoints.remote(), timeout=t.poll_s):
                    self.committer.take(s.rank, report)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"just-in-time save failed: {e}")
            return False
        return step in self.committer.committed_steps

    def _flush_checkpoints(self) -> None:
        for s in self.group.members():
            try:
                for report in ray.get(s.actor.flush_checkpoints.remote(), timeout=self.config.timeouts.poll_s):
                    self.committer.take(s.rank, report)
                self._take_poll(s, ray.get(s.actor.poll.remote(), timeout=self.config.timeouts.poll_s))
            except Exception as e:  # noqa: BLE001
                self.events.emit("checkpoint_failed", step=self.ledger.last_step, reason=f"final drain: {e}")

    def _finish(self, state: State, reason: str, code: int = 0) -> None:
        if state is State.FINISHED:
            self._flush_checkpoints()
            self.ledger.flush_partial()
            members = self.group.members()
            if members:
                rank0 = members[0].actor
                self.final_digest = ray.get(rank0.digest.remote(), timeout=self.config.timeouts.poll_s)
                if self.config.train.save_final_model:
                    self.final_state = ray.get(rank0.parameters.remote(), timeout=self.config.timeouts.poll_s)
        self.exit_code = code
        self.sm.to(state, reason)

    def _fail(self, reason: str) -> None:
        self.final_error = reason
        self.exit_code = 1
        self.events.emit("run_failed", step=self.ledger.last_step, reason=reason,
                         last_checkpoint=(self.committer.committed_steps or [None])[-1])
        self.sm.to(State.FAILED, reason)

    def summary(self) -> dict[str, Any]:
        self.ledger.add_time("checkpoint_stall", self.committer.stall_s)
        return self.ledger.summary(self.sm.state.value, {
            "error": self.final_error, "exit_code": self.exit_code, "generations": self.generation + 1,
            "checkpoints_committed": self.committer.committed_steps,
            "final_model_sha256": (self.final_digest or {}).get("sha256"),
        })


def _is_ready(ref: Any) -> bool:
    done, _ = ray.wait([ref], timeout=0)
    return bool(done)
