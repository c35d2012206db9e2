"""The controller: an explicit state machine on the driver that runs the worker group.

It places workers, forms membership generations (a rendezvous per generation), drives the step loop
through ``run``/``poll``/``request_stop`` and, on a failure, regroups the survivors at the last step
boundary without restarting them.

Each non-terminal state is a handler that returns ``(next state, reason)``; :meth:`Controller.step` runs
the current state's handler and makes the transition (controller/state.py's table enforces and logs it).
A handler that returns its own state stays. A helper that finds the run must end raises :class:`RunEnded`
(the failure budget spent, a checkpoint that does not fit): ``step`` makes it the move to FAILED, so no
caller checks the state again. Entering a terminal state does the ending's work (:meth:`_move`).

What it owns, each an object of its own: the :class:`~elastictrain.controller.monitor.WorkerMonitor`
(observation, failure detection), the :class:`~elastictrain.controller.former.GenerationFormer` (the
rendezvous and state sync of a new generation), the open
:class:`~elastictrain.controller.recovery.Recovery` record, the
:class:`~elastictrain.controller.budget.FailureBudget`, the
:class:`~elastictrain.controller.gather.SourceGatherer` (where a generation's state comes from) and the
:class:`~elastictrain.controller.endings.Endings` (final checkpoints and model). Decisions come from
:mod:`elastictrain.controller.policy`; this module executes them.
"""

from __future__ import annotations

import gc
import logging
import operator
import time
from collections.abc import Callable
from typing import Any

import ray

from elastictrain.config import JobConfig
from elastictrain.controller import policy
from elastictrain.controller.admission import admit
from elastictrain.controller.budget import FailureBudget
from elastictrain.controller.commits import Committer
from elastictrain.controller.endings import Endings
from elastictrain.controller.former import FormationFailed, GenerationFormer
from elastictrain.controller.gather import CheckpointLoadFailed, Previous, SourceGatherer, SurvivorLost
from elastictrain.controller.group import Slot, SlotState, WorkerGroup, describe_remote_error
from elastictrain.controller.kinds import FailureKind
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.monitor import POLL_INTERVAL_S, Killed, WorkerMonitor
from elastictrain.controller.recovery import Recovery
from elastictrain.controller.state import TERMINAL, State, StateMachine
from elastictrain.events import EventLog
from elastictrain.parallel.layout import Layout, resolve, spec_from_config
from elastictrain.task import Task

log = logging.getLogger("elastictrain.controller")
_RANK, _INDEX = operator.attrgetter("rank"), operator.attrgetter("index")  # sort keys without tuples

Transition = tuple[State, str]  # (next state, why): the current state to stay
EXIT_CHECKPOINT = 3  # a checkpoint error (elastictrain/exit_codes.py), not a worker failure
EXIT_CODES = {State.FINISHED: 0, State.FAILED: 1, State.PREEMPTED: 75}
# how long a recovery waits for a prebuilt standby's take (its set-up only names the slot); past it the
# recovery forms without the replacement, which joins by growing as a cold one does
PREBUILT_TAKE_WAIT_S = 5.0


class RunEnded(Exception):
    """Raised by a helper that finds the run must fail (the budget spent, nothing fits, a checkpoint that
    does not load or fit: ``code`` 3); :meth:`Controller.step` makes it the move to FAILED."""

    def __init__(self, reason: str, code: int = 1) -> None:
        super().__init__(reason)
        self.reason, self.code = reason, code


class Controller:
    def __init__(self, config: JobConfig, task: Task, events: EventLog, store: Any = None,
                 resume_manifest: Any = None, group: WorkerGroup | None = None, resume_plan: Any = None,
                 planned: Any = None) -> None:
        """``group``: the worker group to drive (default: a real :class:`WorkerGroup`; tests pass a fake
        one with the same interface to step the state machine through its paths). ``resume_plan``: the driver's
        :class:`~elastictrain.checkpoint.resume.ResumeDecision` (lineage, fingerprint). ``planned``: the start-time
        choice of ``parallel.plan: auto`` (:class:`~elastictrain.planner.job.Choice`): each generation formed
        at another world size is then re-planned (:meth:`_replan`). Raising, it leaves nothing behind: the
        group it made (its placement groups hold the cluster's CPUs), the keepers and the commit thread."""
        try:
            self._build(config, task, events, store, resume_manifest, group, resume_plan, planned)
        except BaseException:
            self._close_partial(own_group=group is None)
            raise

    def _close_partial(self, own_group: bool) -> None:
        """What a construction that raised had made so far, closed (never raises over its cause)."""
        built = self.__dict__
        for name, close in (("group", "shutdown"), ("sources", "close"), ("committer", "close")):
            part = built.get(name)
            if part is None or (name == "group" and not own_group):
                continue
            try:
                getattr(part, close)()
            except Exception:  # noqa: BLE001 - the construction's own error is the one to raise
                log.debug("closing %s after a failed start", name, exc_info=True)

    def _build(self, config: JobConfig, task: Task, events: EventLog, store: Any, resume_manifest: Any,
               group: WorkerGroup | None, resume_plan: Any, planned: Any) -> None:
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
        self.resume_manifest = resume_manifest
        self._setup_respawns: list[int] = []  # slots whose set-up failed, respawned once the others' are known
        self.lineage = getattr(resume_plan, "lineage", None)  # retention and fallback touch only this trajectory
        self.driver_fingerprint = dict(getattr(resume_plan, "fingerprint", {}) or {})
        self.reference_fingerprint: dict[str, Any] | None = None  # model/optimizer/data of the first worker
        self.committer = Committer(config, events, store, self._checkpoint_meta())
        self.generation = -1
        self.world_size = 0
        self.budget = FailureBudget(config.recovery, len(self.group.slots))
        self.recovery = Recovery()  # the open recovery's record (a fresh one once a generation stands)
        self.preempt_reason: str | None = None
        self.final_error: str | None = None
        self.exit_code = 0
        # where the workers write the final model when no committed checkpoint holds it (the Trainer sets
        # RUN_DIR/final_model)
        self.final_model_root: str | None = None
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
        self.former = GenerationFormer(config, self.group, self.ledger, self.committer, events, self.monitor,
                                       self.sources, store, self.lineage, self.layout)
        self.endings = Endings(config, self.group, self.ledger, self.committer, events, self.monitor, store)
        self.handlers: dict[State, Callable[[], Transition]] = {
            State.STARTING: self._starting, State.RUNNING: self._running, State.RECOVERING: self._recovering,
            State.RESIZING: self._resizing, State.CHECKPOINTING: self._checkpointing,
        }

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
                        # is far cheaper at 10,000 ranks, and one landing in a recovery no longer doubles its
                        # decision time (benchmarks/scale.py, node scenario).
                        gc.freeze()
                        frozen = True
                except Exception as e:  # noqa: BLE001 - never escapes: summary.json and run_finished follow
                    log.debug("controller error in state %s", state.name, exc_info=True)
                    self._fail(f"controller error while {state.value}: {describe_remote_error(e)} (last "
                               f"committed checkpoint: {(self.committer.committed_steps or [None])[-1]})")
        finally:
            if self._ended_clean():  # workers.reuse: its processes may serve this driver's next run
                self.group.keep_warm()
            self.group.shutdown()
            self.sources.close()  # the peer tier's keepers (actors of this run, holding its snapshots)
            self.committer.drain(timeout=self.config.timeouts.poll_s)  # commits queued before the end
            self.committer.close()
            if frozen:
                gc.unfreeze()  # a driver used as a library: its objects are collectable again
        return self.summary()

    def _ended_clean(self) -> bool:
        """Finished: its live workers trained through to the clean end (the failed ones were killed), and
        each says itself whether it may be pooled (``Worker.retire``: not after its own error or a fault
        fired in it). The rule for ``workers.reuse``, controller/warm_pool.py."""
        return self.sm.state is State.FINISHED

    def request_preemption(self, reason: str) -> None:
        """Called from a signal handler or a drain notice: stop at a step boundary, checkpoint, exit."""
        self.preempt_reason = self.preempt_reason or reason

    def step(self) -> None:
        """One iteration of the state machine: the current state's handler decides the next state and why;
        the move is made here (a helper's :class:`RunEnded` is the move to FAILED)."""
        try:
            nxt, why = self.handlers[self.sm.state]()
            code = None
        except RunEnded as e:
            nxt, why, code = State.FAILED, e.reason, e.code
        self._move(nxt, why, code)

    # ------------------------------------------------------------------ transitions
    def _move(self, nxt: State, why: str, code: int | None = None) -> None:
        """Take the transition to ``nxt`` (none when it is the current state). Entering FINISHED first
        does the run's last work, which may end it FAILED instead; entering FAILED records the error and
        emits ``run_failed``; a terminal state sets the exit code (``code``, else its documented one)."""
        if nxt is self.sm.state:
            return
        if nxt is State.FINISHED:
            try:
                self._wrap_up()
            except RunEnded as e:
                nxt, why, code = State.FAILED, e.reason, e.code
        if nxt is State.FAILED:
            self.final_error = why
            self.events.emit("run_failed", step=self.ledger.last_step, reason=why,
                             last_checkpoint=(self.committer.committed_steps or [None])[-1])
        if nxt in TERMINAL:
            self.exit_code = EXIT_CODES[nxt] if code is None else code
        self.sm.to(nxt, why)

    def _fail(self, reason: str, code: int = 1) -> None:
        """End the run FAILED now (from outside a handler: the run loop's last resort). Terminal states are
        final: the first ending stands."""
        if not self.sm.terminal:
            self._move(State.FAILED, reason, code)

    # ------------------------------------------------------------------ states
    def _starting(self) -> Transition:
        t = self.config.timeouts
        for slot in self.group.slots:
            self.group.spawn(slot.index)
        self.group.start_first_standby()  # after the workers: Ray starts their processes first
        deadline = time.time() + t.restart_grace_s
        while time.time() < deadline:
            # a deterministic set-up failure, or a checkpoint that does not fit
            self._setups_done(self.group.collect_ready(timeout=POLL_INTERVAL_S))
            ready = self.group.by_state(SlotState.READY)
            if len(ready) == len(self.group.slots):
                break
            # Start with what is there: once `min` are ready, slots still waiting for capacity join later.
            starting = [s for s in self.group.by_state(SlotState.STARTING) if self.group.placed(s)]
            if not starting and len(ready) >= self.config.workers.min:
                break
            if self.preempt_reason:
                return State.PREEMPTED, self.preempt_reason
        ready = self.group.by_state(SlotState.READY)
        decision = self._membership(len(ready), current=self.config.workers.max)
        if decision.action != "go":
            unplaced = [s for s in self.group.by_state(SlotState.STARTING) if not self.group.placed(s)]
            why = f"; {len(unplaced)} could not be placed: {self.group.shortfall()}" if unplaced else ""
            return State.FAILED, (f"could not start {self.config.workers.min} workers within "
                                  f"timeouts.restart_grace_s={t.restart_grace_s:g}: {decision.reason}{why}")
        chosen = sorted(ready, key=lambda s: s.index)[: decision.world_size]
        self._replan(len(chosen))
        if not self._form_generation(chosen, reason="start", resume=self.resume_manifest):
            return State.RECOVERING, "a worker failed during the first rendezvous"
        return State.RUNNING, f"{decision.world_size} workers joined generation {self.generation}"

    def _running(self) -> Transition:
        self._observe()
        if self.ledger.last_step > self.monitor.start_step:  # back to speed: the next standby may start
            self.group.start_due_standby()
        if self.monitor.pending_failures:
            return State.RECOVERING, self.monitor.pending_failures[0].reason
        results = self.monitor.finished_runs()
        if results is not None:
            if all(r["status"] == "done" for r in results):
                return State.FINISHED, f"reached step {self.config.train.steps}"
            errors = "; ".join(f"slot {r['slot']}: {r['error']}" for r in results if r.get("error"))
            reason = f"the group left its step loop and no worker was found dead ({errors or 'stopped'})"
            self._count_group_failure(reason)
            return State.RECOVERING, reason
        if self.preempt_reason:
            self._stop_members()
            return State.CHECKPOINTING, self.preempt_reason
        if self._can_grow():
            self._stop_members()
            return State.RESIZING, "replacement workers are ready: growing at the next step boundary"
        return State.RUNNING, ""

    def _resizing(self) -> Transition:
        self._observe()
        if self.monitor.pending_failures:
            return State.RECOVERING, self.monitor.pending_failures[0].reason
        results = self.monitor.finished_runs()
        if results is None:
            return State.RESIZING, ""
        if all(r["status"] == "done" for r in results):
            return State.FINISHED, f"reached step {self.config.train.steps}"
        if self.preempt_reason:
            return State.CHECKPOINTING, self.preempt_reason
        nxt, why = self._regroup(reason="grow")
        if nxt is State.RESIZING:  # told to wait (a joiner vanished): wait where the clock runs
            return State.RECOVERING, "growing had to wait for workers"
        return nxt, why

    def _recovering(self) -> Transition:
        killed = self.monitor.kill_failed()
        if killed:
            self._abort_survivors()
            self.sources.ask_peer_tier(self.generation)
        # Survivors come back from `run` at the failed step's boundary (their collectives fail fast).
        self.monitor.drain_runs(timeout=self.config.timeouts.collective_s)
        self._account_failures(killed)
        nxt: Transition = (State.RECOVERING, "")  # a survivor failed as well: handled in the next iteration
        if not self.monitor.pending_failures:
            self._take_prebuilt()
            self._setups_done(self.group.collect_ready(timeout=0))
            drain = self.monitor.check_drains()  # a drain notice while recovering (or waiting) preempts too
            if drain:
                self.request_preemption(drain)
            nxt = (State.CHECKPOINTING, self.preempt_reason) if self.preempt_reason else self._regroup("recover")
        # the survivors train again (or wait, or regroup once more): now the replacements start
        self.monitor.start_replacements()
        return nxt

    def _take_prebuilt(self) -> None:
        """A replacement the standby serves with its set-up ahead done starts now, at detection, and the
        recovery waits for its take (it only names the slot: milliseconds, bounded by
        :data:`PREBUILT_TAKE_WAIT_S`), so the recovery generation forms at full size with it, as with a spare:
        no generation of the survivors alone, no step at the smaller size, no second rendezvous to grow back
        (docs/perf/2026-11-28-drill-cost.md). Past the bound it joins later by growing, as a cold one does."""
        refs = self.monitor.start_prebuilt_replacements()
        if refs:
            self.rt.wait(refs, num_returns=len(refs), timeout=PREBUILT_TAKE_WAIT_S)

    def _checkpointing(self) -> Transition:
        """Preempted: the members stopped at a step boundary; write a just-in-time checkpoint and exit.
        Preempted while recovering (or waiting for workers), the survivors left their process groups and
        hold no writer: they first regroup -- with whoever is ready -- to save (``_regroup_to_save``)."""
        self.monitor.drain_runs(timeout=self.config.timeouts.collective_s)
        save = self.config.checkpoint.on_preempt and self.store is not None
        if save and self.sm.history and self.sm.history[-1][0] is State.RECOVERING:
            save = self._regroup_to_save()
        step = self.ledger.last_step
        members = [s for s in self.group.members() if s.state is SlotState.MEMBER]
        saved = False
        if save and members and step:
            saved = self.endings.save_now(members, step)
        self.events.emit("preempted", step=step, checkpoint=saved, reason=self.preempt_reason)
        return State.PREEMPTED, self.preempt_reason or "preempted"

    def _wrap_up(self) -> None:
        """Entering FINISHED: the last reports and commits, the final checkpoint and model. Raises
        :class:`RunEnded` when the last steps were non-finite or a member failed at the end."""
        self.endings.flush_checkpoints()
        self.ledger.flush_partial()
        self._check_nonfinite()  # the last steps' records came with the members' last polls
        members = self.group.members()
        self.endings.save_final(members)
        try:
            self.endings.gather_final_model(members, self.final_model_root)
        except Exception as e:  # noqa: BLE001 - a worker dying here ends the run like any other error
            raise RunEnded(self.endings.failed_at_end(e)) from None

    # ------------------------------------------------------------------ observing and failures
    def _observe(self) -> None:
        """One poll interval of the monitor; act on what it saw (set-ups ended, a drain notice,
        non-finite steps)."""
        seen = self.monitor.pump(POLL_INTERVAL_S)
        self._setups_done(seen.ready)
        if seen.drain:
            self.request_preemption(seen.drain)
        self._check_nonfinite()

    def _account_failures(self, killed: list[Killed]) -> None:
        """The killed workers' failures: reported (events), charged to the budget (:class:`RunEnded` when
        it is spent), their replacements queued (started by ``monitor.start_replacements``, or by
        :meth:`_take_prebuilt` where the standby serves one prebuilt)."""
        records = self.monitor.report_failures(killed)
        if killed and self.recovery.failure is None:
            self.recovery.failure = killed[0][0]
        verdict = self.budget.charge(records)
        if verdict:
            raise RunEnded(verdict)
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

    def _setups_done(self, slots: list[Slot]) -> None:
        """The set-ups that ended since the last look (``collect_ready``), each judged
        (:meth:`_on_setup_done`), then the failed ones respawned (:meth:`_respawn_failed_setups`): after the
        whole batch, so a failure is judged beside the others that ended with it."""
        for slot in slots:
            self._on_setup_done(slot)
        self._respawn_failed_setups()

    def _on_setup_done(self, slot: Slot) -> None:
        """A worker's set-up ended: admitted (or refused), or its failure charged (a set-up failure every
        slot repeats alike ends the run: :class:`RunEnded`) and the slot queued for its respawn
        (:meth:`_respawn_failed_setups`)."""
        if slot.state is SlotState.READY:
            self._admit(slot)  # may refuse it (fingerprint differs) or end the run (exit 3)
        if slot.state is not SlotState.DEAD or "error" not in slot.info:
            self.budget.any_setup_ok = True
            return
        self.ledger.failures += 1
        self.events.emit("failure", kind=FailureKind.SETUP_FAILED, rank=None, slot=slot.index, node_id=None,
                         detected_after_s=0.0, step=self.ledger.last_step, reason=slot.info["error"])
        verdict = self.budget.judge(policy.FailureRecord(time.time(), slot.index, FailureKind.SETUP_FAILED,
                                                         slot.info["error"], 0))
        if verdict:
            raise RunEnded(verdict)
        self._setup_respawns.append(slot.index)  # respawned by _setups_done

    def _respawn_failed_setups(self) -> None:
        """Respawn the slots whose set-up failed, but while no set-up has succeeded yet, only once no other
        slot's set-up is in flight: the others' outcomes decide whether the failure is deterministic (every
        slot alike ends the run, ``policy.setup_verdict``), and a slot respawned meanwhile (a warm process
        fails in a fraction of a second, a fresh one's set-up takes seconds) would fail again and be charged
        twice for one cause."""
        if not self._setup_respawns:
            return
        if not self.budget.any_setup_ok and self.group.by_state(SlotState.STARTING):
            return
        due, self._setup_respawns = self._setup_respawns, []
        for index in due:
            self.group.spawn(index)

    def _check_nonfinite(self) -> None:
        """``recovery.max_nonfinite_steps`` steps in a row had their update skipped (non-finite loss or
        gradient norm): the run fails (exit 1, :class:`RunEnded`), naming the last such step and its rank."""
        limit = self.config.recovery.max_nonfinite_steps
        worst = self.ledger.nonfinite_worst
        if worst is None or worst[0] < limit:
            return
        count, step, why = worst
        raise RunEnded(f"{count} steps in a row non-finite (recovery.max_nonfinite_steps={limit}), their updates "
                       f"skipped; the last, step {step}: {why}. Look at that rank's data and the learning rate, "
                       "or raise recovery.max_nonfinite_steps")

    def _count_group_failure(self, reason: str) -> None:
        """The group left its loop with errors but nobody is dead (e.g. a rank's own error mistaken for a
        peer's, or a collective timeout): a failure of the group, charged to the budget (:class:`RunEnded`
        when it is spent)."""
        self.ledger.failures += 1
        progress = max(0, self.ledger.last_step - self.monitor.start_step)
        self.events.emit("failure", kind=FailureKind.GROUP_FAILED, rank=None, slot=None, node_id=None, pid=None,
                         detected_after_s=0.0, step=self.ledger.last_step, reason=reason)
        verdict = self.budget.judge(policy.FailureRecord(time.time(), None, FailureKind.GROUP_FAILED, reason, progress))
        if verdict:
            raise RunEnded(verdict)

    def _admit(self, slot: Slot) -> None:
        """Check a worker that finished its set-up against the run's fingerprint (controller/admission.py):
        refuse it (killed), or end the run (exit 3: the checkpoint does not fit the job)."""
        decision = admit(slot.info.get("fingerprint"), self.reference_fingerprint,
                         getattr(self.resume_manifest, "meta", None) if self.resume_manifest is not None
                         and not isinstance(self.resume_manifest, dict) else None,
                         self.config.checkpoint.accept_changes, self.config.stable_id,
                         getattr(self.resume_manifest, "location", ""))
        if decision.action == "checkpoint_error":
            raise RunEnded(decision.reason, code=EXIT_CHECKPOINT)
        if decision.action == "refuse":
            slot.info = {**slot.info, "error": f"refused: {decision.reason}"}
            self.group.kill(slot)
            return
        if self.reference_fingerprint is None and decision.reference is not None:
            self.reference_fingerprint = decision.reference
            self.committer.meta["fingerprint"] = {**self.driver_fingerprint, **decision.reference}

    def _stop_members(self) -> None:
        for slot in self.group.members():
            slot.actor.request_stop.remote(self.generation)  # a late one must not stop the next generation

    def _can_grow(self) -> bool:
        ready = self.group.by_state(SlotState.READY)
        if not ready or self.world_size >= self.config.workers.max:
            return False
        return self._membership(self.world_size + len(ready), self.world_size).world_size > self.world_size

    def _regroup_to_save(self) -> bool:
        """Finish the interrupted recovery far enough to save: survivors and ready joiners form a generation
        (any world size the plan runs at) restored from the best source, and start no step loop; the
        caller then saves it. Nothing to do when the best source is a committed checkpoint or step 0: a save
        would hold nothing newer. On any failure the preemption goes on without a checkpoint (said in a
        ``warning``): it must end within the grace period. True if the members can save."""
        self._setups_done(self.group.collect_ready(timeout=0))
        survivors = sorted((s for s in self.group.slots if s.state is SlotState.MEMBER), key=lambda s: s.rank)
        ready = sorted(self.group.by_state(SlotState.READY), key=lambda s: s.index)
        decision = policy.save_membership(available=len(survivors) + len(ready), spec=self.plan_spec)
        why = None
        if decision.action != "go":
            why = decision.reason
        else:
            chosen = (survivors + ready)[: decision.world_size]
            self._replan(len(chosen))
            try:
                resume = self._recovery_source(chosen, self.world_size, survivors)
            except (SurvivorLost, CheckpointLoadFailed) as e:
                resume, why = None, str(e)
            if why is None and (self.recovery.source in ("checkpoint", "scratch")):
                why = f"nothing newer than what storage holds to save ({self.recovery.reason})"
            elif why is None and not self._form_generation(chosen, reason="preempt", resume=resume, start=False):
                why = "a worker failed while regrouping to save"
        if why is not None:
            self.events.emit("warning", source="preemption", reason=f"preempted while recovering: no "
                             f"just-in-time checkpoint ({why})")
        return why is None

    # ------------------------------------------------------------------ generations
    def _membership(self, available: int, current: int) -> policy.Membership:
        w, tr = self.config.workers, self.config.train
        return policy.decide_membership(
            available=available, current=current, mode=self.config.recovery.mode, min_workers=w.min,
            max_workers=w.max, global_batch=tr.global_batch, micro_batch=tr.micro_batch,
            waiting_since=self.recovery.waiting_since, now=time.time(),
            wait_limit_s=self.config.recovery.min_workers_wait_s, plan=self.plan_spec.plan,
            shard_size=self.plan_spec.shard_size, spec=self.plan_spec,
            valid=self.replanner.runs_at if self.replanner is not None else None,
        )

    def layout(self, world_size: int) -> Layout:
        """The mesh and accumulation a generation of ``world_size`` workers uses (parallel/layout.py)."""
        return resolve(self.plan_spec, world_size)

    def _replan(self, world: int) -> None:
        """``parallel.plan: auto``: the layout of the next generation, of ``world`` workers. At the running
        generation's size its layout stays; at another the planner decides (planner/replan.py: keep the
        running family, or switch where the move pays for itself, or move because the family cannot run or
        fit there), a ``replanned`` event says what and why, and :meth:`layout` answers with the choice. A
        fixed plan: nothing to do. Raises :class:`RunEnded` when nothing runnable fits at ``world``."""
        if self.replanner is None or self.generation_layout is None:
            return
        old = self.generation_layout
        if old.dims.world_size == world:
            self.plan_spec = self.generation_spec
            return
        got = self.replanner.decide(old, self.generation_spec, world, self.config.train.steps - self.ledger.last_step)
        if got is None:
            raise RunEnded(f"parallel.plan=auto: no runnable layout fits at world size {world} (the running layout "
                           f"is {old.reason}); add capacity or set a fixed parallel.plan")
        self.plan_spec = got.spec
        log.info("replanned at world size %d: %s", world, got.decision.reason)
        self.events.emit("replanned", generation=self.generation + 1, step=self.ledger.last_step, **got.as_event())

    def _regroup(self, reason: str) -> Transition:
        """Form the next generation from survivors and ready joiners (RUNNING), or wait (the current
        state), or fail."""
        self._setups_done(self.group.collect_ready(timeout=0))
        survivors = [s for s in self.group.slots if s.state is SlotState.MEMBER]
        ready = self.group.by_state(SlotState.READY)
        # before any generation formed (the first rendezvous failed) the run's size is the one it starts at;
        # strict mode keeps the current size, and 0 chose no one: the recovery looped, forming nothing
        decision = self._membership(len(survivors) + len(ready), current=self.world_size or self.config.workers.max)
        if decision.action == "fail":
            return State.FAILED, decision.reason
        if decision.action == "wait":
            self.monitor.start_replacements()  # nothing trains until workers come: no reason to hold them back
            if self.recovery.waiting_since is None:
                self.recovery.waiting_since = time.time()
                self.events.emit("worker_lost", world_size=len(survivors), reason=decision.reason)
            self._setups_done(self.group.collect_ready(timeout=POLL_INTERVAL_S))
            return self.sm.state, decision.reason
        self.recovery.waiting_since = None
        chosen = self._choose_members(survivors, ready, decision.world_size)
        old = self.world_size
        self._replan(len(chosen))
        try:
            resume = self._recovery_source(chosen, old, survivors)
        except SurvivorLost as e:  # a survivor serving its shards died: recorded as its failure
            self.monitor.detect_dead(e.holders, str(e), e.outcomes)
            return State.RECOVERING, "a survivor failed while serving its state"
        except CheckpointLoadFailed as e:  # storage failed and nothing else holds the state: exit 3
            raise RunEnded(str(e), code=EXIT_CHECKPOINT) from None
        if not self._form_generation(chosen, reason=reason, resume=resume):
            return State.RECOVERING, "a worker failed during the rendezvous"
        if old and old != self.world_size:  # (0: no generation had formed, nothing was resized)
            self.events.emit("resized", old_world_size=old, new_world_size=self.world_size,
                             accum=self.layout(self.world_size).accum, step=self.ledger.last_step,
                             reason=decision.reason)
        return State.RUNNING, f"generation {self.generation} with {self.world_size} workers ({reason})"

    # ------------------------------------------------------------------ recovery sources
    def _recovery_source(self, chosen: list[Slot], old_world: int, alive: list[Slot] = ()) -> Any:
        """Where the next generation's state comes from (:meth:`SourceGatherer.gather`): None when live
        survivors hold it all (the broadcast path) or nothing does (step 0, announced here), a
        :class:`PeerRestore`, or a manifest. Records the source and why in the open recovery record (the
        ``recovered`` event). ``alive``: every live member of the previous generation, chosen or not."""
        known = [self.ledger.last_step, self.ledger.latest_record_step]
        if self.recovery.failure is not None:
            known.append(self.recovery.failure.last_step)
        prev = Previous(self.prev_generation, self.prev_ranks, old_world, self.generation_layout if old_world else None)
        got = self.sources.gather(chosen, alive, prev, self.generation, known, next_layout=self.layout(len(chosen)))
        self.recovery.source, self.recovery.reason, self.recovery.last_step = got.kind, got.reason, got.last_step
        log.info("recovery source: %s", got.reason)
        if got.kind == "scratch" and self.sm.state is not State.CHECKPOINTING:  # (preempted: nothing restarts)
            self.events.emit("worker_lost", world_size=0, step=0,
                             reason="every worker holding training state was lost and no other source holds "
                                    f"it: restarting from step 0 ({got.reason})")
            for s in chosen:  # (the ledger rewinds to step 0 once the generation forms: GenerationFormer.form)
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
        """Form the next generation of ``chosen`` (:meth:`GenerationFormer.form`), take it as the current
        one, close the open recovery and start its step loop (not with ``start=False``: a generation that
        only saves). False if a member failed on the way (recorded as a failure); a checkpoint that does
        not load ends the run (:class:`RunEnded`, exit 3)."""
        self.generation += 1
        try:
            formed = self.former.form(chosen, self.generation, reason, self.recovery, resume, start)
        except CheckpointLoadFailed as e:  # the checkpoint's fault, not the workers': exit 3, no crash loop
            raise RunEnded(str(e), code=EXIT_CHECKPOINT) from None
        except FormationFailed:
            return False
        self.prev_ranks, self.prev_generation = {s.index: r for r, s in enumerate(formed.members)}, formed.generation
        self.generation_layout, self.generation_spec = formed.layout, self.plan_spec
        self.world_size = len(formed.members)
        if reason != "start":
            self.recovery.close(formed.start_step, self.world_size, self.ledger, self.events)
        self.recovery = Recovery()
        if start:
            self.former.start(formed)
        return True

    # ------------------------------------------------------------------ checkpoints and endings
    def _checkpoint_meta(self) -> dict[str, Any]:
        c = self.config
        config = c.model_dump(mode="json")
        for section in (config["checkpoint"], config["task"]["data"]):  # credentials never reach storage
            section["storage_options"] = {k: "<redacted>" for k in section["storage_options"]}
        return {"plan": c.parallel.plan, "global_batch": c.train.global_batch, "seed": c.train.seed,
                "config": config, "run_id": c.stable_id, "lineage": self.lineage,
                "fingerprint": dict(self.driver_fingerprint)}

    def summary(self) -> dict[str, Any]:
        self.ledger.add_time("checkpoint_stall", self.committer.stall_s)
        return self.ledger.summary(self.sm.state.value, {
            "error": self.final_error, "exit_code": self.exit_code, "generations": self.generation + 1,
            "checkpoints_committed": self.committer.committed_steps,
            "final_model_sha256": (self.endings.final_digest or {}).get("sha256"),
            "final_model": self.endings.final_model_uri,
            "memory_snapshots": self.monitor.memory_snapshots,
            "memory_snapshot_stall_s": round(self.monitor.memory_stall_s, 6),
        })


def gpus_per_node() -> int | None:
    """GPUs of the smallest alive GPU node (hsdp's default shard group size), or None without GPUs."""
    counts = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
    counts = [c for c in counts if c > 0]
    return min(counts) if counts else None


def gpu_types() -> list[str]:
    """Ray's ``accelerator_type`` of each alive GPU node that declares one (``parallel.float8``'s pre-flight)."""
    return [k.split(":", 1)[1] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("GPU", 0) > 0
            for k in n["Resources"] if k.startswith("accelerator_type:")]


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
