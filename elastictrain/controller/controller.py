"""The controller: an explicit state machine on the driver that runs the worker group.

It places workers, forms membership generations (a rendezvous per generation), drives the step loop
through ``run``/``poll``/``request_stop`` and, on a failure, regroups the survivors at the last step
boundary without restarting them. Decisions come from :mod:`elastictrain.controller.policy`; this module
executes them. Where a new generation's state comes from (survivors, the peer memory tier, the durable
checkpoint) is gathered by :mod:`elastictrain.controller.gather`. ``step()`` advances one iteration, so
tests can drive it.
"""

from __future__ import annotations

import gc
import logging
import operator
import time
from typing import Any

import ray

from elastictrain.config import JobConfig
from elastictrain.controller import policy
from elastictrain.controller.admission import admit
from elastictrain.controller.budget import FailureBudget
from elastictrain.controller.commits import Committer
from elastictrain.controller.gather import (CheckpointLoadFailed, PeerRestore, Previous, SourceGatherer,
                                            SurvivorLost, slot_step)
from elastictrain.controller.group import (MemberCallFailed, Slot, SlotState, WorkerGroup, call_members,
                                           call_outcomes, describe_remote_error)
from elastictrain.controller.kinds import FailureKind
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.detect import Failure
from elastictrain.controller.monitor import POLL_INTERVAL_S, Killed, WorkerMonitor
from elastictrain.controller.state import State, StateMachine
from elastictrain.parallel.placement import arrange
from elastictrain.parallel.plan import Layout, resolve, spec_from_config
from elastictrain.events import EventLog
from elastictrain.task import Task

log = logging.getLogger("elastictrain.controller")
_RANK, _INDEX = operator.attrgetter("rank"), operator.attrgetter("index")  # sort keys without tuples


class Controller:
    def __init__(self, config: JobConfig, task: Task, events: EventLog, store: Any = None,
                 resume_manifest: Any = None, group: WorkerGroup | None = None, resume_plan: Any = None,
                 planned: Any = None) -> None:
        """``group``: the worker group to drive (default: a real :class:`WorkerGroup`; tests pass a fake
        one with the same interface to step the state machine through its paths). ``resume_plan``: the driver's
        :class:`~elastictrain.checkpoint.resume.ResumePlan` (lineage, fingerprint). ``planned``: the start-time
        choice of ``parallel.plan: auto`` (:class:`~elastictrain.planner.job.Choice`): each generation formed
        at another world size is then re-planned (:meth:`_replan`)."""
        self.config = config
        self.task = task
        self.events = events
        self.sm = StateMachine()
        self.group = group if group is not None else WorkerGroup(config, task)
        self.rt = self.group.rt  # how calls on the workers are waited for (Ray, or the simulator's)
        self.ledger = Ledger(events, config.train.steps, config.train.global_batch, config.workers.max,
                             keep_compute=max(64, config.recovery.straggler_window),
                             cpu_peak_flops=_calibrated_flops(config))
        self.store = store
        self.ckpt_root = getattr(store, "root_uri", None)
        self.resume_manifest = resume_manifest
        self.lineage = getattr(resume_plan, "lineage", None)  # retention and fallback touch only this trajectory
        self.driver_fingerprint = dict(getattr(resume_plan, "fingerprint", {}) or {})
        self.reference_fingerprint: dict[str, Any] | None = None  # model/optimizer/data of the first worker
        self.committer = Committer(config, events, store, self._checkpoint_meta())
        self.generation = -1
        self.world_size = 0
        self.budget = FailureBudget(config.recovery, len(self.group.slots))
        self.waiting_since: float | None = None
        self.open_failure: Failure | None = None
        self.preempt_reason: str | None = None
        self.final_error: str | None = None
        self.exit_code = 0
        # where the workers write the final model when no committed checkpoint holds it (the Trainer sets
        # RUN_DIR/final_model); where it is once the run finished (None: not saved)
        self.final_model_root: str | None = None
        self.final_model_uri: str | None = None
        self.final_digest: dict[str, Any] | None = None
        self.recovery_source = "peer"
        self.recovery_reason = ""
        self.recovery_last_step = 0  # newest completed step known when the recovery source was chosen
        self.plan_spec = spec_from_config(config, gpus_per_node() if config.workers.use_gpu else None)
        self.generation_layout: Layout | None = None  # the last generation formed runs this (and generation_spec)
        self.generation_spec = self.plan_spec
        self.replanner = None
        if getattr(planned, "cluster", None) is not None:  # parallel.plan: auto (planner/live.py)
            from elastictrain.planner.live import Replanner

            self.replanner = Replanner(config, planned.cluster, config.parallel.model_shape)
            self.generation_layout = self.layout(planned.world)  # as planned, until a generation forms
        self.prev_ranks: dict[int, int] = {}  # slot index -> rank in the current generation's mesh
        self.prev_generation = -1  # the generation prev_ranks describes (the last one formed)
        m = resume_manifest  # the branch point: a recovery source until the run commits its own
        branch = m if m is not None and not isinstance(m, dict) and hasattr(m, "step") else None
        self.sources = SourceGatherer(config, events, store, self.committer, self.lineage, branch, self.layout,
                                      self.rt)
        self.sources.start_keepers()
        self.monitor = WorkerMonitor(config, self.group, self.ledger, self.committer, events, self.rt.drain_watcher())

    # ------------------------------------------------------------------ public
    def run(self) -> dict[str, Any]:
        frozen = False
        try:
            while not self.sm.terminal:
                state = self.sm.state
                try:
                    self.step()
                    if state is State.STARTING and not frozen:
                        # What exists once the run started (imports, config, slots, the first generation's
                        # objects) lives as long as the run: out of the collector's sight, a full collection
                        # costs ~10 ms instead of 130-225 ms at 10,000 ranks, and one landing in a
                        # recovery no longer doubles its decision time (benchmarks/scale.py, node scenario).
                        gc.freeze()
                        frozen = True
                except Exception as e:  # noqa: BLE001 - never escapes: summary.json and run_finished follow
                    log.debug("controller error in state %s", state.name, exc_info=True)
                    self._fail(f"controller error while {state.value}: {describe_remote_error(e)} (last "
                               f"committed checkpoint: {(self.committer.committed_steps or [None])[-1]})")
        finally:
            self.group.shutdown()
            self.sources.close()  # the peer tier's keepers (actors of this run, holding its snapshots)
            self.committer.drain(timeout=self.config.timeouts.poll_s)  # commits queued before the end
            self.committer.close()
            if frozen:
                gc.unfreeze()  # a driver used as a library: its objects are collectable again
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
            if self.sm.terminal:  # a deterministic set-up failure, or a checkpoint that does not fit (exit 3)
                return
            ready = self.group.by_state(SlotState.READY)
            if len(ready) == len(self.group.slots):
                break
            # Start with what is there: once `min` are ready, slots still waiting for capacity join later.
            starting = [s for s in self.group.by_state(SlotState.STARTING) if self.group.placed(s)]
            if not starting and len(ready) >= self.config.workers.min:
                break
            if self.preempt_reason:
                return self._finish(State.PREEMPTED, self.preempt_reason, code=75)
        ready = self.group.by_state(SlotState.READY)
        decision = self._membership(len(ready), current=self.config.workers.max)
        if decision.action != "go":
            unplaced = [s for s in self.group.by_state(SlotState.STARTING) if not self.group.placed(s)]
            why = f"; {len(unplaced)} could not be placed: {self.group.shortfall()}" if unplaced else ""
            return self._fail(f"could not start {self.config.workers.min} workers within "
                              f"timeouts.restart_grace_s={t.restart_grace_s:g}: {decision.reason}{why}")
        chosen = sorted(ready, key=lambda s: s.index)[: decision.world_size]
        if not self._replan(len(chosen)):
            return
        if not self._form_generation(chosen, reason="start", resume=self.resume_manifest):
            if self.sm.terminal:
                return
            return self.sm.to(State.RECOVERING, "a worker failed during the first rendezvous")
        self.sm.to(State.RUNNING, f"{decision.world_size} workers joined generation {self.generation}")

    def _running(self) -> None:
        self._observe()
        if self._nonfinite_verdict():
            return
        if self.ledger.last_step > self.monitor.start_step:  # trained a step: the first standby may start
            self.group.start_first_standby()
        if self.monitor.pending_failures:
            return self.sm.to(State.RECOVERING, self.monitor.pending_failures[0].reason)
        results = self.monitor.finished_runs()
        if results is not None:
            if all(r["status"] == "done" for r in results):
                return self._finish(State.FINISHED, f"reached step {self.config.train.steps}")
            errors = "; ".join(f"slot {r['slot']}: {r['error']}" for r in results if r.get("error"))
            reason = f"the group left its step loop and no worker was found dead ({errors or 'stopped'})"
            if self._count_group_failure(reason):
                return
            return self.sm.to(State.RECOVERING, reason)
        if self.preempt_reason:
            self._stop_members()
            return self.sm.to(State.CHECKPOINTING, self.preempt_reason)
        if self._can_grow():
            self._stop_members()
            self.sm.to(State.RESIZING, "replacement workers are ready: growing at the next step boundary")

    def _resizing(self) -> None:
        self._observe()
        if self._nonfinite_verdict():
            return
        if self.monitor.pending_failures:
            return self.sm.to(State.RECOVERING, self.monitor.pending_failures[0].reason)
        results = self.monitor.finished_runs()
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
        killed = self.monitor.kill_failed()
        if killed:
            self._abort_survivors()
            self.sources.ask_peer_tier(self.generation)
        # Survivors come back from `run` at the failed step's boundary (their collectives fail fast).
        self.monitor.drain_runs(timeout=self.config.timeouts.collective_s)
        self._account_failures(killed)
        try:
            if self.sm.state is not State.RECOVERING or self.monitor.pending_failures:
                return  # failed, or a survivor failed as well: handled in the next iteration
            for slot in self.group.collect_ready(timeout=0):
                self._on_setup_done(slot)
            drain = self.monitor.check_drains()  # a drain notice while recovering (or waiting for workers) preempts too
            if drain:
                self.request_preemption(drain)
            if self.preempt_reason:
                return self.sm.to(State.CHECKPOINTING, self.preempt_reason)
            self._regroup(reason="recover")
        finally:  # the survivors train again (or wait, or regroup once more): now the replacements start
            if not self.sm.terminal:
                self.monitor.start_replacements()

    def _observe(self) -> None:
        """One poll interval of the monitor; act on what it saw (set-ups ended, a drain notice)."""
        seen = self.monitor.pump(POLL_INTERVAL_S)
        for slot in seen.ready:
            self._on_setup_done(slot)
        if seen.drain:
            self.request_preemption(seen.drain)

    def _account_failures(self, killed: list[Killed]) -> None:
        """The killed workers' failures: reported (events), charged to the budget (the run fails when it
        is spent), their replacements queued (started by ``monitor.start_replacements``)."""
        records = self.monitor.report_failures(killed)
        if killed and self.open_failure is None:
            self.open_failure = killed[0][0]
        verdict = self.budget.charge(records)
        if verdict:
            return self._fail(verdict)
        self.monitor.queue_replacements(killed)

    def _abort_survivors(self) -> None:
        """A member died: survivors abort their communicators (NCCL) so blocked collectives fail now, and
        under a sharded layout their shards no longer make a whole state (restored from a reader)."""
        sharded = bool(self.world_size) and not (self.generation_layout or self.layout(self.world_size)).replicated
        if not (self.config.workers.use_gpu or sharded):
            return  # gloo and a replicated layout: nothing to send, nothing to mark (no pass over the members)
        survivors = [s for s in self.group.members() if s.state is SlotState.MEMBER]
        for s in survivors if self.config.workers.use_gpu else ():  # gloo: a no-op call per rank, not sent
            s.actor.abort_group.remote(self.generation)
        for s in survivors if sharded else ():
            s.has_state = False

    def _checkpointing(self) -> None:
        """Preempted: the members stopped at a step boundary; write a just-in-time checkpoint and exit.
        Preempted while recovering (or waiting for workers), the survivors left their process groups and
        hold no writer: they first regroup -- with whoever is ready -- to save (``_regroup_to_save``)."""
        self.monitor.drain_runs(timeout=self.config.timeouts.collective_s)
        save = self.config.checkpoint.on_preempt and self.store is not None
        if save and self.sm.history and self.sm.history[-1][0] is State.RECOVERING:
            save = self._regroup_to_save()
            if self.sm.terminal:
                return
        step = self.ledger.last_step
        members = [s for s in self.group.members() if s.state is SlotState.MEMBER]
        saved = False
        if save and members and step:
            saved = self._save_now(members, step)
        self.events.emit("preempted", step=step, checkpoint=saved, reason=self.preempt_reason)
        self._finish(State.PREEMPTED, self.preempt_reason or "preempted", code=75)

    def _regroup_to_save(self) -> bool:
        """Finish the interrupted recovery far enough to save: survivors and ready joiners form a generation
        (any world size the plan runs at) restored from the best source, and start no step loop; the
        caller then saves it. Nothing to do when the best source is a committed checkpoint or step 0: a save
        would hold nothing newer. On any failure the preemption goes on without a checkpoint (said in a
        ``warning``): it must end within the grace period. True if the members can save."""
        for slot in self.group.collect_ready(timeout=0):
            self._on_setup_done(slot)
        survivors = sorted((s for s in self.group.slots if s.state is SlotState.MEMBER), key=lambda s: s.rank)
        ready = sorted(self.group.by_state(SlotState.READY), key=lambda s: s.index)
        decision = policy.save_membership(available=len(survivors) + len(ready), spec=self.plan_spec)
        why = None
        if decision.action != "go":
            why = decision.reason
        else:
            chosen = (survivors + ready)[: decision.world_size]
            if not self._replan(len(chosen)):
                return False
            try:
                resume = self._recovery_source(chosen, self.world_size, survivors)
            except (SurvivorLost, CheckpointLoadFailed) as e:
                resume, why = None, str(e)
            if why is None and (self.recovery_source in ("checkpoint", "scratch")):
                why = f"nothing newer than what storage holds to save ({self.recovery_reason})"
            elif why is None and not self._form_generation(chosen, reason="preempt", resume=resume, start=False):
                why = "a worker failed while regrouping to save"
        if why is not None and not self.sm.terminal:
            self.events.emit("warning", source="preemption", reason=f"preempted while recovering: no "
                             f"just-in-time checkpoint ({why})")
        return why is None

    # ------------------------------------------------------------------ generations
    def _membership(self, available: int, current: int) -> policy.Membership:
        w, tr = self.config.workers, self.config.train
        return policy.decide_membership(
            available=available, current=current, mode=self.config.recovery.mode, min_workers=w.min,
            max_workers=w.max, global_batch=tr.global_batch, micro_batch=tr.micro_batch,
            waiting_since=self.waiting_since, now=time.time(),
            wait_limit_s=self.config.recovery.min_workers_wait_s, plan=self.plan_spec.plan,
            shard_size=self.plan_spec.shard_size, spec=self.plan_spec,
            valid=self.replanner.runs_at if self.replanner is not None else None,
        )

    def layout(self, world_size: int) -> Layout:
        """The mesh and accumulation a generation of ``world_size`` workers uses (parallel/plan.py)."""
        return resolve(self.plan_spec, world_size)

    def _replan(self, world: int) -> bool:
        """``parallel.plan: auto``: the layout of the next generation, of ``world`` workers. At the running
        generation's size its layout stays; at another the planner decides (planner/replan.py: keep the
        running family, or switch where the move pays for itself, or move because the family cannot run or
        fit there), a ``replanned`` event says what and why, and :meth:`layout` answers with the choice. A
        fixed plan: nothing to do. False when the run failed (nothing runnable fits at ``world``)."""
        if self.replanner is None or self.generation_layout is None:
            return True
        old = self.generation_layout
        if old.dims.world_size == world:
            self.plan_spec = self.generation_spec
            return True
        got = self.replanner.decide(old, self.generation_spec, world, self.config.train.steps - self.ledger.last_step)
        if got is None:
            self._fail(f"parallel.plan=auto: no runnable layout fits at world size {world} (the running layout is "
                       f"{old.reason}); add capacity or set a fixed parallel.plan")
            return False
        self.plan_spec = got.spec
        log.info("replanned at world size %d: %s", world, got.decision.reason)
        self.events.emit("replanned", generation=self.generation + 1, step=self.ledger.last_step, **got.as_event())
        return True

    def _regroup(self, reason: str) -> None:
        """Form the next generation from survivors and ready joiners, or wait, or fail."""
        for slot in self.group.collect_ready(timeout=0):
            self._on_setup_done(slot)
        survivors = [s for s in self.group.slots if s.state is SlotState.MEMBER]
        ready = self.group.by_state(SlotState.READY)
        # before any generation formed (the first rendezvous failed) the run's size is the one it starts at;
        # strict mode keeps the current size, and 0 chose no one: the recovery looped, forming nothing
        decision = self._membership(len(survivors) + len(ready), current=self.world_size or self.config.workers.max)
        if decision.action == "fail":
            return self._fail(decision.reason)
        if decision.action == "wait":
            self.monitor.start_replacements()  # nothing trains until workers come: no reason to hold them back
            if self.waiting_since is None:
                self.waiting_since = time.time()
                self.events.emit("worker_lost", world_size=len(survivors), reason=decision.reason)
            for slot in self.group.collect_ready(timeout=POLL_INTERVAL_S):
                self._on_setup_done(slot)
            return
        self.waiting_since = None
        chosen = self._choose_members(survivors, ready, decision.world_size)
        old = self.world_size
        if not self._replan(len(chosen)):
            return
        try:
            resume = self._recovery_source(chosen, old, survivors)
        except SurvivorLost as e:  # a survivor serving its shards died: recorded as its failure
            self.monitor.detect_dead(e.holders, str(e), e.outcomes)
            if self.sm.state is not State.RECOVERING:
                self.sm.to(State.RECOVERING, "a survivor failed while serving its state")
            return
        except CheckpointLoadFailed as e:  # storage failed and nothing else holds the state: exit 3
            return self._fail_checkpoint(str(e))
        if not self._form_generation(chosen, reason=reason, resume=resume):
            if self.sm.terminal:
                return
            if self.sm.state is not State.RECOVERING:
                self.sm.to(State.RECOVERING, "a worker failed during the rendezvous")
            return
        if old and old != self.world_size:  # (0: no generation had formed, nothing was resized)
            self.events.emit("resized", old_world_size=old, new_world_size=self.world_size,
                             accum=self.layout(self.world_size).accum, step=self.ledger.last_step,
                             reason=decision.reason)
        self.sm.to(State.RUNNING, f"generation {self.generation} with {self.world_size} workers ({reason})")

    # ------------------------------------------------------------------ recovery sources
    def _recovery_source(self, chosen: list[Slot], old_world: int, alive: list[Slot] = ()) -> Any:
        """Where the next generation's state comes from (:meth:`SourceGatherer.gather`): None when live
        survivors hold it all (the broadcast path) or nothing does (step 0, announced here), a
        :class:`PeerRestore`, or a manifest. Records ``recovery_source``/``recovery_reason`` for the
        ``recovered`` event. ``alive``: every live member of the previous generation, chosen or not."""
        known = [self.ledger.last_step, self.ledger.latest_record_step]
        if self.open_failure is not None:
            known.append(self.open_failure.last_step)
        prev = Previous(self.prev_generation, self.prev_ranks, old_world, self.generation_layout if old_world else None)
        got = self.sources.gather(chosen, alive, prev, self.generation, known, next_layout=self.layout(len(chosen)))
        self.recovery_source, self.recovery_reason, self.recovery_last_step = got.kind, got.reason, got.last_step
        log.info("recovery source: %s", got.reason)
        if got.kind == "scratch" and self.sm.state is not State.CHECKPOINTING:  # (preempted: nothing restarts)
            self.events.emit("worker_lost", world_size=0, step=0,
                             reason="every worker holding training state was lost and no other source holds "
                                    f"it: restarting from step 0 ({got.reason})")
            self.ledger.last_step = 0
            for s in chosen:
                s.has_state = False
        return got.resume

    def _choose_members(self, survivors: list[Slot], ready: list[Slot], world: int) -> list[Slot]:
        if self.config.recovery.mode == "strict":
            # Keep ranks: survivors keep theirs, joiners take the ranks of the dead.
            by_rank = {s.rank: s for s in survivors}
            joiners = iter(sorted(ready, key=lambda s: s.index))
            return [by_rank[r] if r in by_rank else next(joiners) for r in range(world)]
        # survivors are members and have ranks (distinct: one per member); a key without tuples (10,000 ranks)
        keep = sorted(survivors, key=_RANK) if all(s.rank is not None for s in survivors) else sorted(
            survivors, key=lambda s: (s.rank if s.rank is not None else 1 << 30, s.index))
        extra = sorted(ready, key=_INDEX)
        return (keep + extra)[:world]

    def _form_generation(self, chosen: list[Slot], reason: str, resume: Any = None, start: bool = True) -> bool:
        """Rendezvous ``chosen`` (in rank order) as a new generation, sync state from the most advanced
        survivor, and start the step loop (not with ``start=False``: a generation that only saves). False if
        a member failed on the way (recorded as a failure). Under tp or pp the ranks are first given by
        topology (:meth:`_place`).

        Rounds of calls on the members, after the decision: ``open_store`` on rank 0, then ``join`` -- which
        also syncs the state from its source when that is known before the rendezvous (the survivors hold
        it, or step 0) -- with each member's ``run`` sent right behind its ``join``, before any answer
        (:meth:`_run_after`): one round, not two; the last polls of the previous members that need one
        (:meth:`_last_poll_targets`, usually none) are sent first and taken while the members join. A
        restore (the peer tier, a checkpoint) runs between ``join`` and ``sync``: the source is known once
        it is loaded, so ``sync`` is a round of its own and ``run`` follows it; with the peer memory tier
        on, ``run`` follows the keepers' attachment (``attach_keeper`` reads the joined rank)."""
        chosen = self._place(chosen)
        asked = self.monitor.ask_members(self.monitor.last_poll_targets())  # taken while the members join
        self.generation += 1
        gen, world = self.generation, len(chosen)
        self.committer.new_generation(gen, world)
        taken = {s.index for s in chosen}  # by slot index: `in` on a list of Slots is O(N^2)
        for s in self.group.members():
            if s.index not in taken:  # a member dropped by the decision goes back to READY
                s.state = SlotState.READY
        t = self.config.timeouts
        runs: list[tuple[Slot, Any]] | None = None
        try:
            host, port = call_members([(chosen[0], chosen[0].actor.open_store.remote(gen))], t.poll_s,
                                      "opening the rendezvous store", self.rt)[0]
            layout = self.layout(world)
            # a peer restore: every member reads (resharding) from the keepers or survivors as it joins
            peer = resume.sources if isinstance(resume, PeerRestore) else None
            src = None if resume is not None else self._sync_source(chosen)
            joins = [(s, s.actor.join.remote(gen, r, world, host, port, layout, peer, sync_src=src))
                     for r, s in enumerate(chosen)]
            asked = self._take_last_polls(asked)  # (before any run goes out: their records are the old generation's)
            # the state source known and no peer tier to attach in between: each member's `run` goes right
            # behind its `join` (one round of calls, not two), the join's answer its argument (_run_after)
            pipelined = src is not None and start and not self.config.checkpoint.memory_every_steps
            runs = self._run_after(joins) if pipelined else None
            got = call_members(joins, t.restart_grace_s, "join", self.rt)
            if src is not None:  # joined and synced in one round
                steps = got
            elif isinstance(resume, PeerRestore):
                for s, step in zip(chosen, got):
                    s.has_state, s.info["step"] = True, step
                self.recovery_source = resume.kind
                self.ledger.last_step = max(self.ledger.last_step, resume.step) if resume.kind == "peer" else resume.step
            elif resume is not None:
                root = self.ckpt_root
                resume = self._load_checkpoint(chosen, resume, explicit=reason == "start" and
                                               self.config.checkpoint.resume not in ("auto", "never"))
                for s in chosen:
                    s.has_state = True
                self.recovery_source = "checkpoint"
                self.ledger.last_step = int(resume.step)
                self.events.emit("resumed", step=int(resume.step), world_size=world,
                                 from_world_size=getattr(resume, "world_size", None), uri=root)
            if src is None:
                src = self._sync_source(chosen)
                steps = call_members([(s, s.actor.sync.remote(src)) for s in chosen], t.restart_grace_s,
                                     "state sync", self.rt)
        except CheckpointLoadFailed as e:  # the checkpoint's fault, not the workers': exit 3, no crash loop
            self._take_last_polls(asked)
            self._fail_checkpoint(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - any member failing here is a failure like any other
            self.monitor.stray_runs = [ref for _, ref in runs or ()]  # drained by the recovery (_drain_runs), not judged
            self._take_last_polls(asked)  # before _detect_dead polls again: a slot's records stay in order
            # charged to the member whose part failed (its own error quoted), not to whoever comes first
            if isinstance(e, MemberCallFailed):
                self.monitor.detect_dead(chosen, f"failed during rendezvous of generation {gen} ({e.what})", e.outcomes)
            else:
                self.monitor.detect_dead(chosen, f"failed during rendezvous of generation {gen}: {e}")
            return False
        self.prev_ranks, self.prev_generation = {s.index: r for r, s in enumerate(chosen)}, gen
        self.generation_layout, self.generation_spec = layout, self.plan_spec
        for r, s in enumerate(chosen):
            first_time = s.rank is None and not s.has_state
            s.state, s.rank, s.has_state = SlotState.MEMBER, r, True
            s.info.setdefault("joined_step", steps[0])  # progress of this incarnation counts from here
            if first_time or reason == "start":
                self.events.emit("worker_started", rank=r, slot=s.index, pid=s.info.get("pid"),
                                 node_id=s.info.get("node_id"), generation=gen, setup_s=s.info.get("setup_s"),
                                 device=s.info.get("device"), standby=s.info.get("standby", False))
        self.world_size = world
        self.monitor.new_generation(gen, world, time.time(), steps[0])
        accum = layout.accum
        self.ledger.new_generation(gen, world, accum)
        self.ledger.last_step = max(self.ledger.last_step, steps[0])
        self.events.emit("generation_started", generation=gen, world_size=world, accum=accum, step=steps[0],
                         source_rank=src, reason=reason)
        if reason == "start":
            self.recovery_source = "peer"
        else:
            self._close_recovery(start_step=steps[0])
        if not start:
            return True
        if self.config.checkpoint.memory_every_steps:
            self.sources.start_keepers()
            self.sources.size_keepers(chosen, layout)
            keepers = self.sources.keepers_for(chosen)
            try:
                self.rt.get([s.actor.attach_keeper.remote(k, elsewhere) for s, (k, elsewhere) in zip(chosen, keepers)],
                        timeout=t.poll_s)
            except Exception as e:  # noqa: BLE001 - a member that died just now is found by its run ref below
                self.events.emit("warning", source="peer_tier", reason=f"attaching the peer memory tier in "
                                 f"generation {gen} failed: {describe_remote_error(e)}")
        if runs is None:
            runs = [(s, s.actor.run.remote(self.config.train.steps)) for s in chosen]
        self.monitor.watch_runs(runs, aggregate=layout.dims.pp == 1)
        return True

    def _run_after(self, joins: list[tuple[Slot, Any]]) -> list[tuple[Slot, Any]]:
        """Each member's ``run``, sent before its ``join`` answered, with that join's ref as argument: Ray
        runs a call only once its arguments are there, so a run never starts before its own join returned,
        and a failed join fails its run with the join's error without running it (nothing hangs). Not an
        ordering inside the worker: Ray does not order a threaded actor's calls (a join whose arguments go
        through the object store was overtaken by the run sent after it, 14 times in 20), and both share the
        worker's one state thread, so a run waiting there for its join would hold the thread the join
        needs. A formation that fails drops these calls: a member whose join did return runs into the
        broken group (a dead peer's closed sockets), and its next join waits on its state thread for it."""
        return [(s, s.actor.run.remote(self.config.train.steps, ref)) for s, ref in joins]

    def _take_last_polls(self, asked: list[tuple[Slot, Any]]) -> list[tuple[Slot, Any]]:
        """Take the previous members' last polls (:meth:`_ask_members`) and keep the steps only some
        survivor completed (``Ledger.flush_partial``); returns the empty list of polls still to take."""
        if asked:
            self.monitor.take_members(asked)
        self.ledger.flush_partial()
        return []

    @staticmethod
    def _sync_source(chosen: list[Slot]) -> int:
        """The rank whose state every member takes: the most advanced member holding state (rank 0 at
        step 0, when none does)."""
        return policy.pick_source({r: slot_step(s) for r, s in enumerate(chosen) if s.has_state} or {0: 0})

    def _place(self, chosen: list[Slot]) -> list[Slot]:
        """``chosen`` reordered by rank so that a TP group (an hsdp shard group) stays on one node and
        pipeline stages spread across nodes first (parallel/placement.py; members keep their ranks where
        that allows). A group no order keeps on one node is a ``warning`` event, each generation it happens."""
        order, placed = arrange([s.info.get("node_id") for s in chosen], self.layout(len(chosen)).dims)
        if placed is not None:
            log.info("placement: %s", placed.reason)
            for why in placed.warnings:
                self.events.emit("warning", source="placement", reason=why)
        return [chosen[i] for i in order]

    def _load_checkpoint(self, chosen: list[Slot], manifest: Any, explicit: bool) -> Any:
        """Load ``manifest`` on every member (collective). A load error is the checkpoint's (corrupt bytes
        found by a rank's SHA-256 check, a layout that does not fit): unless the checkpoint was named
        explicitly, fall back to the next older checkpoint of this run's lineage. Returns the manifest
        loaded; raises CheckpointLoadFailed when none loads."""
        from elastictrain.checkpoint import CheckpointError

        while True:
            calls = [(s, s.actor.load.remote(manifest, self.ckpt_root)) for s in chosen]
            try:
                self.rt.get([ref for _, ref in calls], timeout=self.config.timeouts.restart_grace_s)
                return manifest
            except Exception as e:  # noqa: BLE001 - classified: checkpoint errors vs worker failures
                cause = getattr(e, "cause", e)
                if not isinstance(cause, CheckpointError):
                    raise MemberCallFailed("checkpoint load", call_outcomes(calls, self.rt), e) from e
                self._collect_errors([ref for _, ref in calls])
                older = (None if explicit or self.store is None
                         else self.store.older_valid(manifest.step, self.lineage))
                where = getattr(manifest, "location", "") or f"step {manifest.step}"
                self.events.emit("checkpoint_failed", step=int(manifest.step),
                                 reason=f"could not load {where}: {cause}" +
                                        (f"; trying step {older.step}" if older is not None else ""))
                if older is None:
                    raise CheckpointLoadFailed(f"could not load checkpoint {where}: {cause}") from None
                manifest = older

    def _collect_errors(self, refs: list[Any]) -> None:
        """Take the results of the other members' calls after one failed: Ray prints an error nobody took
        as an "Unhandled error" traceback on the driver's console, and the first error says it all."""
        done, _ = self.rt.wait(refs, num_returns=len(refs), timeout=self.config.timeouts.poll_s)
        for ref in done:
            try:
                self.rt.get(ref)
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass

    def _fail_checkpoint(self, reason: str) -> None:
        """End the run with exit 3 (the documented checkpoint error), not as a worker failure."""
        if self.sm.terminal:
            return
        self._fail(reason)
        self.exit_code = 3

    def _admit(self, slot: Slot) -> None:
        """Check a worker that finished its set-up against the run's fingerprint (controller/admission.py)."""
        decision = admit(slot.info.get("fingerprint"), self.reference_fingerprint,
                         getattr(self.resume_manifest, "meta", None) if self.resume_manifest is not None
                         and not isinstance(self.resume_manifest, dict) else None,
                         self.config.checkpoint.accept_changes, self.config.stable_id,
                         getattr(self.resume_manifest, "location", ""))
        if decision.action == "checkpoint_error":
            return self._fail_checkpoint(decision.reason)
        if decision.action == "refuse":
            slot.info = {**slot.info, "error": f"refused: {decision.reason}"}
            self.group.kill(slot)
            return
        if self.reference_fingerprint is None and decision.reference is not None:
            self.reference_fingerprint = decision.reference
            self.committer.meta["fingerprint"] = {**self.driver_fingerprint, **decision.reference}

    def _close_recovery(self, start_step: int) -> None:
        """The new generation stands: account the recovery. ``lost_steps`` counts completed steps that must
        be redone (0 when a survivor held the newest state); the step in flight is lost time, not a step."""
        source, self.recovery_source = self.recovery_source, "peer"
        why, self.recovery_reason = self.recovery_reason, ""
        last_known, self.recovery_last_step = self.recovery_last_step, 0
        if self.open_failure is None:
            return
        f, now = self.open_failure, time.time()
        lost = max(0, max(f.last_step, last_known) - start_step)  # as the source decision counted
        self.ledger.recoveries += 1
        self.ledger.lost_steps += lost
        self.ledger.add_time("recovery", now - f.detected_at)
        self.events.emit("recovered", source=source,
                         recovery_s=round(now - f.detected_at, 3), downtime_s=round(now - f.last_progress, 3),
                         lost_steps=lost, step=start_step, world_size=self.world_size, reason=why)
        self.open_failure = None

    def _stop_members(self) -> None:
        for slot in self.group.members():
            slot.actor.request_stop.remote(self.generation)  # a late one must not stop the next generation

    def _can_grow(self) -> bool:
        ready = self.group.by_state(SlotState.READY)
        if not ready or self.world_size >= self.config.workers.max:
            return False
        return self._membership(self.world_size + len(ready), self.world_size).world_size > self.world_size

    def _on_setup_done(self, slot: Slot) -> None:
        if slot.state is SlotState.READY:
            self._admit(slot)  # may refuse it (fingerprint differs) or end the run (exit 3)
            if self.sm.terminal:
                return
        if slot.state is not SlotState.DEAD or "error" not in slot.info:
            self.budget.any_setup_ok = True
            return
        if self.sm.terminal:
            return
        self.ledger.failures += 1
        self.events.emit("failure", kind=FailureKind.SETUP_FAILED, rank=None, slot=slot.index, node_id=None,
                         detected_after_s=0.0, step=self.ledger.last_step, reason=slot.info["error"])
        verdict = self.budget.judge(policy.FailureRecord(time.time(), slot.index, FailureKind.SETUP_FAILED, slot.info["error"], 0))
        if verdict:
            return self._fail(verdict)
        self.group.spawn(slot.index)

    def _nonfinite_verdict(self) -> bool:
        """``recovery.max_nonfinite_steps`` steps in a row had their update skipped (non-finite loss or
        gradient norm): the run fails (exit 1), naming the last such step and its rank. True if it ended."""
        limit = self.config.recovery.max_nonfinite_steps
        worst = self.ledger.nonfinite_worst
        if worst is None or worst[0] < limit:
            return False
        count, step, why = worst
        self._fail(f"{count} steps in a row non-finite (recovery.max_nonfinite_steps={limit}), their updates "
                   f"skipped; the last, step {step}: {why}. Look at that rank's data and the learning rate, or "
                   "raise recovery.max_nonfinite_steps")
        return True

    def _count_group_failure(self, reason: str) -> bool:
        """The group left its loop with errors but nobody is dead (e.g. a rank's own error mistaken for a
        peer's, or a collective timeout): a failure of the group, counted against the budget. True if the
        run ended."""
        self.ledger.failures += 1
        progress = max(0, self.ledger.last_step - self.monitor.start_step)
        self.events.emit("failure", kind=FailureKind.GROUP_FAILED, rank=None, slot=None, node_id=None, pid=None,
                         detected_after_s=0.0, step=self.ledger.last_step, reason=reason)
        verdict = self.budget.judge(policy.FailureRecord(time.time(), None, FailureKind.GROUP_FAILED, reason, progress))
        if verdict:
            self._fail(verdict)
        return verdict is not None

    # ------------------------------------------------------------------ checkpoints and endings
    def _checkpoint_meta(self) -> dict[str, Any]:
        c = self.config
        config = c.model_dump(mode="json")
        for section in (config["checkpoint"], config["task"]["data"]):  # credentials never reach storage
            section["storage_options"] = {k: "<redacted>" for k in section["storage_options"]}
        return {"plan": c.parallel.plan, "global_batch": c.train.global_batch, "seed": c.train.seed,
                "config": config, "run_id": c.stable_id, "lineage": self.lineage,
                "fingerprint": dict(self.driver_fingerprint)}

    def _save_now(self, members: list[Slot], step: int) -> bool:
        t = self.config.timeouts
        try:
            self.rt.get([s.actor.save.remote(step) for s in members], timeout=t.poll_s)
            self._collect_reports(members)
            self.committer.drain(timeout=t.poll_s)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=step, reason=f"just-in-time save failed: {e}")
            return False
        return step in self.committer.committed_steps

    def _save_final(self, members: list[Slot]) -> None:
        """With durable checkpoints configured, the final state is always committed (whatever
        ``every_steps``): running the job again answers "already finished", and extending it resumes here."""
        step = self.ledger.last_step
        if self.store is None or not members or not step or step in self.committer.committed_steps:
            return
        self._save_now(members, step)

    def _collect_reports(self, members: list[Slot]) -> None:
        """Wait for the members' in-flight saves and hand every report to the committer."""
        for s in members:
            for report in self.rt.get(s.actor.flush_checkpoints.remote(), timeout=self.config.timeouts.poll_s):
                self.committer.take(s.rank, report)

    def _flush_checkpoints(self) -> None:
        members = self.group.members()
        try:
            self._collect_reports(members)
            for s in members:
                self.monitor.take_poll(s, self.rt.get(s.actor.poll.remote(), timeout=self.config.timeouts.poll_s))
            self.committer.drain(timeout=self.config.timeouts.poll_s)
        except Exception as e:  # noqa: BLE001
            self.events.emit("checkpoint_failed", step=self.ledger.last_step, reason=f"final drain: {e}")

    def _finish(self, state: State, reason: str, code: int = 0) -> None:
        if self.sm.terminal:  # terminal states are final: the first ending stands
            return
        if state is State.FINISHED:
            self._flush_checkpoints()
            self.ledger.flush_partial()
            if self._nonfinite_verdict():  # the last steps' records came with the members' last polls
                return
            members = self.group.members()
            self._save_final(members)
            try:
                self._gather_final_model(members)
            except Exception as e:  # noqa: BLE001 - a worker dying here ends the run like any other error
                return self._fail(self._finish_failed(e))
        self.exit_code = code
        self.sm.to(state, reason)

    def _gather_final_model(self, members: list[Slot]) -> None:
        """The end of a finished run without gathering the model: every member hashes its own part (the
        digest is combined here from per-parameter sums) and, unless the committed final checkpoint already
        holds the model, writes its part of the final model into ``final_model_root`` (a run root of one
        committed step, checkpoint/final.py). Only hashes and file names come back."""
        if not members:
            return
        from elastictrain.parallel.digest import combine

        t, step = self.config.timeouts.poll_s, self.ledger.last_step
        root = None
        if self.config.train.save_final_model:
            if self.store is not None and step in self.committer.committed_steps:
                self.final_model_uri = self.store.step_uri(step)
            else:
                root = self.final_model_root
        outs = self.rt.get([s.actor.finish.remote(root) for s in members], timeout=t)
        self.final_digest = {"step": step, "sha256": combine([o["digest"] for o in outs])}
        if root is not None:
            from elastictrain.checkpoint.store import CheckpointStore

            manifest = CheckpointStore(root).commit(
                outs[0]["step"], [o["report"] for o in outs],
                {"world_size": len(members), "final_model": True, "run_id": self.config.stable_id,
                 "digest": self.final_digest["sha256"]})
            self.final_model_uri = manifest.location

    def _finish_failed(self, e: Exception) -> str:
        """Why a run that trained every step still failed: a worker died while the final model was gathered."""
        step, last = self.ledger.last_step, (self.committer.committed_steps or [None])[-1]
        if last == step:
            where = (f"the final step is committed (checkpoint of step {last}): running the job again answers "
                     "\"already finished\" and `elastictrain ckpt export` writes the model")
        else:
            where = "no checkpoint is committed" if last is None else f"the last committed checkpoint is step {last}"
        return f"a worker failed while the final model of step {step} was hashed and written: {describe_remote_error(e)}; {where}"

    def _fail(self, reason: str) -> None:
        if self.sm.terminal:  # terminal states are final: the first ending stands
            return
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
            "final_model": self.final_model_uri,
            "memory_snapshots": self.monitor.memory_snapshots,
            "memory_snapshot_stall_s": round(self.monitor.memory_stall_s, 6),
        })


def gpus_per_node() -> int | None:
    """GPUs of the smallest alive GPU node (hsdp's default shard group size), or None without GPUs."""
    counts = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    counts = [c for c in counts if c > 0]
    return min(counts) if counts else None


def _calibrated_flops(config: JobConfig) -> float | None:
    """A CPU worker's FLOP/s for MFU: ``parallel.calibration``'s measured ``flops`` (None without one, on GPU
    workers, whose peak comes from the table in elastictrain/flops.py, or when the file does not read)."""
    if config.workers.use_gpu or not config.parallel.calibration:
        return None
    from elastictrain.planner.cluster import ClusterError, read_calibration

    try:
        value = read_calibration(config.parallel.calibration).get("flops")
    except ClusterError:
        return None
    return float(value) if value else None
