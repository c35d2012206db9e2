"""How the controller watches its workers: polling progress, noticing deaths, hangs, stragglers and drain
notices, and turning them into failures; killing failed workers and reporting them.

An object the controller owns and calls (:class:`WorkerMonitor`), not a mixin: it is given what it
observes with (the group, the ledger, the committer, the event log, the drain watcher) and reads nothing
else of the controller. What it observes comes back as return values -- workers whose set-up ended, a
drain notice, the failures found -- and the controller decides (the failure budget, the state machine).
What counts as a failure is decided by its :class:`~elastictrain.controller.detect.FailureDetector`
(observations in, ``Failure``s out, no Ray).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elastictrain import worker_reply
from elastictrain.config import JobConfig
from elastictrain.controller import policy
from elastictrain.controller.commits import Committer
from elastictrain.controller.detect import CallOutcome, Failure, FailureDetector, WorkerView, blame
from elastictrain.controller.group import Slot, SlotState, WorkerGroup, describe_remote_error
from elastictrain.controller.kinds import OUTCOME_KIND, FailureKind
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.runtime import RunWatch, get_each
from elastictrain.events import EventLog

log = logging.getLogger("elastictrain.controller")

INF = float("inf")
POLL_SWEEP = 64  # members polled per interval besides the reporting rank (their compute times, in turn)
# Poll cadence while healthy: a dead worker is seen at once through its run ref; polls carry step records
# and feed the hang watchdog (whose bound is >= timeouts.watchdog_floor_s, seconds).
POLL_INTERVAL_S = 0.5

Killed = tuple[Failure, FailureKind, "str | None"]  # a killed worker's failure, its kind as charged, its node


@dataclass
class Observed:
    """What one :meth:`WorkerMonitor.pump` saw that the controller acts on."""

    ready: list[Slot] = field(default_factory=list)  # workers whose set-up ended (ready, or failed)
    drain: str | None = None  # a drain notice for a node hosting members: the preemption's reason


class WorkerMonitor:
    """Observation and failure detection for the controller (see module docstring). The controller
    calls :meth:`new_generation` and :meth:`watch_runs` when a generation forms, :meth:`pump` every poll
    interval, and :meth:`kill_failed` / :meth:`drain_runs` / :meth:`report_failures` in a recovery."""

    def __init__(self, config: JobConfig, group: WorkerGroup, ledger: Ledger, committer: Committer,
                 events: EventLog, drains: Any) -> None:
        self.config, self.group, self.rt = config, group, group.rt
        self.ledger, self.committer, self.events = ledger, committer, events
        self.drains = drains  # DrainWatcher: draining() node ids, take_notice()
        self.detector = FailureDetector(config.timeouts)
        self.run_refs: dict[Any, Slot] = {}  # the members' in-flight ``run`` calls
        self.poll_refs: dict[int, tuple[Any, float]] = {}  # slot index -> (in-flight ``poll`` ref, sent at)
        self.reported_stragglers: set[int] = set()
        self.replacements_due: list[int] = []  # slots of failed workers whose replacements are not started yet
        self.memory_stall_s, self.memory_snapshots = 0.0, 0  # the peer tier's reports (summary.json)
        # the generation watched: its number, size, when and at which step it started
        self.generation, self.world_size, self.started_at, self.start_step = -1, 0, 0.0, 0

    @property
    def pending_failures(self) -> list[Failure]:
        return self.detector.pending

    def new_generation(self, generation: int, world_size: int, started_at: float, start_step: int) -> None:
        self.generation, self.world_size, self.started_at, self.start_step = (
            generation, world_size, started_at, start_step)

    def _view(self, slot: Slot, now: float | None = None) -> WorkerView:
        sent = self.poll_refs.get(slot.index)
        return WorkerView(slot.index, slot.rank, slot.info.get("joined_step"), slot.info.get("phase", "idle"),
                          slot.info.get("phase_since", now or time.time()), sent[1] if sent else None,
                          slot.state is SlotState.DEAD)

    def _when(self) -> dict[str, Any]:
        return {"last_progress": self.ledger.last_progress, "known_step": max(self.ledger.last_step, self.known_step)}

    # ------------------------------------------------------------------ observing workers
    # What the driver does per poll interval does not grow with the world size (docs/design.md, "The
    # control plane at scale"): it polls the generation's reporting rank (rank 0: a step it completed is
    # complete on every rank, its collective says so) and POLL_SWEEP other members in turn (their compute
    # times for stragglers), learns of deaths and ended loops from the run watch (Ray's own notices), and
    # polls every member only when it has to: a stalled step (hang blame), a save whose reports are
    # arriving, a pipeline generation (its step events carry every rank's bubble).
    run_watch: RunWatch | None = None
    runs_ended: set[Any] = frozenset()  # type: ignore[assignment] - replaced per generation
    run_ref_of: dict[int, Any] = {}  # slot index -> its ``run`` call (replaced per generation)
    reporter: Slot | None = None  # None: every member reports every step (counted by the ledger)
    sweep: Sequence[Slot] = ()
    sweep_next = 0
    stray_runs: Sequence[Any] = ()  # the ``run`` calls of a formation that failed (drained, never judged)
    known_step = 0  # the newest step a member of this generation reported (polls, run results)
    stragglers_due = False
    stall_polled_at: float | None = None  # when every member was first polled in the current stall
    reporter_now = 0.0  # rank 0's clock when it last answered a poll
    stall_aborted_at: float | None = None  # the progress time of the stall the fallback last aborted
    data_stalls_named: frozenset[tuple[int, float]] = frozenset()  # (slot, phase_since) already named
    taken_at = 0.0  # when the answered polls were last taken

    def watch_runs(self, runs: list[tuple[Slot, Any]], aggregate: bool) -> None:
        """The generation's ``run`` calls (each member's, in rank order) were just made: watch them, and
        choose who reports its steps (``aggregate``: rank 0 for all; else every rank)."""
        self.run_refs = {ref: s for s, ref in runs}
        chosen = [s for s, _ in runs]
        self.run_watch = self.rt.watch(list(self.run_refs))
        self.run_ref_of = {slot.index: ref for ref, slot in self.run_refs.items()}
        self.runs_ended = set()
        self.reporter = chosen[0] if aggregate else None
        self.sweep, self.sweep_next = chosen[1:], 0
        self.known_step = self.start_step
        self.reporter_now = self.started_at

    def pump(self, timeout: float) -> Observed:
        """Wait a little for run results and take them; unless they tell a failure, poll members, turn
        records into events, watch for hangs, stragglers and drain notices. Failures found are pending
        (:attr:`pending_failures`); what else the controller must act on is returned."""
        new: list[Any] = []
        seen = Observed()
        if self.run_watch is not None and len(self.runs_ended) < len(self.run_refs):
            # wake at the first run that ends (a death, a failed step) or at `timeout`; once some ranks
            # left the loop the rest follow within a step: don't spin
            wait = timeout if not self.runs_ended else min(timeout, 0.05)
            new = [ref for ref in self.run_watch.wait(wait) if ref in self.run_refs]
            self.runs_ended.update(new)
        # ended calls first: a death they tell ends the generation, and then nothing else here is needed
        # (the recovery takes the polls still out and asks rank 0 itself); a round of polls sent now would
        # only be waited for before the decision, each a round trip to a member on its way out of the step
        self._check_runs(new)
        if self.pending_failures:
            return seen
        self._poll_members()
        if self.group.count(SlotState.STARTING):
            seen.ready = self.group.collect_ready(timeout=0)
        self._watchdog()
        self._check_stragglers()
        seen.drain = self.check_drains()
        return seen

    def _progress_at(self) -> float:
        """Progress as any rank reports it, and never before this generation began."""
        return max(self.ledger.last_progress, self.ledger.latest_record_at, self.started_at)

    def _step_times(self) -> list[float]:
        """Recent step times once this generation completed a step (DDP rebuild, warm-up: none before)."""
        warm = self.ledger.latest_record_step > self.start_step
        return self.ledger.step_times if warm else []

    def _poll_targets(self, now: float) -> list[Slot]:
        """Whom to poll now (see the note above ``watch_runs``)."""
        progress = self._progress_at()
        bound = policy.suspect_after(self._step_times(), self.config.timeouts, POLL_INTERVAL_S)
        if self.reporter is None:
            stalled = now - progress > bound
        else:  # as rank 0 saw it (its clock, when it last answered), or rank 0 not answering: a driver that
            # was itself held up (a loaded machine) does not take its own lateness for a stalled step
            sent = self.poll_refs.get(self.reporter.index)
            stalled = self.reporter_now - progress > bound or (sent is not None and now - sent[1] > bound)
        stalled = stalled and bool(self.run_refs)
        if stalled and (self.stall_polled_at is None or self.stall_polled_at < progress):
            self.stall_polled_at = INF  # this stall's first poll of everyone: set once all are sent
        if self.reporter is None or stalled or self.committer.waiting():
            self.stragglers_due = True
            return self.group.members()
        n = len(self.sweep)
        picked = [self.sweep[(self.sweep_next + i) % n] for i in range(min(POLL_SWEEP, n))]
        self.sweep_next += len(picked)
        if self.sweep_next >= n:  # every member's compute times came in once more: look for stragglers
            self.sweep_next, self.stragglers_due = self.sweep_next % max(1, n), True
        return [self.reporter, *picked]

    def _poll_members(self) -> None:
        """Take the answered polls, then ask again (:meth:`_poll_targets`): the answers come next interval."""
        self.taken_at = time.time()
        self._take_polls()
        now = time.time()
        after = self.ledger.last_step - self.config.recovery.straggler_window
        for slot in self._poll_targets(now):
            if slot.state is SlotState.MEMBER and slot.index not in self.poll_refs:
                # a non-reporting rank sends only records a straggler check or a dead reporter may need
                ref = slot.actor.poll.remote() if self._reports_all(slot) else slot.actor.poll.remote(after)
                self.poll_refs[slot.index] = (ref, now)
        if self.stall_polled_at == INF:  # (sending 10,000 polls takes a while: the round counts from its end)
            self.stall_polled_at = time.time()

    def _take_polls(self) -> None:
        refs = {ref: idx for idx, (ref, _) in self.poll_refs.items()}
        done, _ = self.rt.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref, (result, error) in zip(done, get_each(self.rt, done)):
            idx = refs[ref]
            del self.poll_refs[idx]
            if error is None:  # (a dead actor is found by its run ref)
                self.take_poll(self.group.slots[idx], result)

    def _reports_all(self, slot: Slot) -> bool:
        """Whether every record of ``slot`` is taken: the reporting rank's, or every rank's without one."""
        return self.reporter is None or slot is self.reporter

    def take_poll(self, slot: Slot, result: dict[str, Any]) -> None:
        # a poll answered before the member's ``run`` ended can be taken after its result (the interval that
        # learns of a death takes the ended calls first; the recovery takes the polls still out): the
        # result's step is then the newer, and a survivor described by the poll's older one no longer
        # covers the state it holds (a tp/sharded recovery from scratch instead of the survivors)
        ref = self.run_ref_of.get(slot.index)
        if ref is None or ref not in self.runs_ended:
            slot.info["step"] = result["step"]
        self.known_step = max(self.known_step, int(result["step"]))
        slot.info["phase"], slot.info["phase_since"] = result["phase"], result["phase_since"]
        complete = None if self.reporter is None else slot is self.reporter
        if complete:
            self.reporter_now = float(result.get("now", time.time()))
        for record in result["records"]:
            if slot.rank is not None:
                self.ledger.add(slot.rank, record, complete)
        if result.get("peak") and slot.rank is not None:  # the memory of records the worker did not send
            self.ledger.note_memory(slot.rank, result["peak"])
        for item in result["ckpt"]:
            self.committer.take(slot.rank if slot.rank is not None else -1, item)
        for report in result.get("memory", ()):
            self._on_memory_report(slot, report)
        for profile in result.get("profiles", ()):
            self.ledger.save_profile(profile)

    def _on_memory_report(self, slot: Slot, report: dict[str, Any]) -> None:
        """A worker's peer-tier report (from its poll): stall time, and every snapshot a keeper refused,
        that could not be sent, or that was dropped (replaced unsent, evicted) -- an event and a log line
        each, never silent."""
        self.memory_stall_s += report["stall_s"]
        self.memory_snapshots += report["snapshots"]
        for r in report["rejected"]:
            log.warning("peer memory tier: snapshot of rank %s step %s not kept: %s", r["rank"], r["step"], r["reason"])
            self.events.emit("memory_snapshot_rejected", rank=r["rank"], slot=slot.index, step=r["step"],
                             reason=r["reason"])
        for d in report.get("dropped", ()):
            log.warning("peer memory tier: snapshot of rank %s step %s dropped (%s): %s", d["rank"], d["step"],
                        d["cause"], d["reason"])
            self.events.emit("memory_snapshot_dropped", rank=d["rank"], slot=slot.index, step=d["step"],
                             generation=d["generation"], cause=d["cause"], bound_holds=d["bound_holds"],
                             reason=d["reason"])

    def _check_runs(self, ended: Sequence[Any]) -> None:
        """Take the ``run`` results in ``ended`` (each once): a death, a rank's own error, a peer's.

        O(ended): at 10,000 ranks a failed step ends every survivor's call at once, so the loop over them
        does only what each result needs (its step; a look at its status), and a peer's ``peer_failed``
        sends the controller looking for the dead process only while no failure of the generation is known
        (:meth:`failure_known`)."""
        peer_failed = False
        known = self.known_step
        run_refs, dead = self.run_refs, SlotState.DEAD
        taken = [(ref, slot) for ref in ended if (slot := run_refs.get(ref)) is not None and slot.state is not dead]
        for (ref, slot), (packed, error) in zip(taken, get_each(self.rt, [ref for ref, _ in taken])):
            if error is not None:  # the actor died
                self._add_failure(slot, FailureKind.PROCESS_DIED, f"worker process died: {describe_remote_error(error)}")
                continue
            res = worker_reply.unpack(packed)
            step, status = res["step"], res["status"]
            slot.info["step"] = step
            if step > known:
                known = int(step)
            if status == "peer_failed":
                peer_failed = True
            elif status == "error":
                self.detector.on_run_result(self._view(slot), res, now=time.time(), **self._when())
        self.known_step = known
        if peer_failed and not self.failure_known():
            # a peer broke the step and no failure is known yet: find the dead without waiting for Ray (once,
            # not per survivor); when Ray's notice or this pass already named one, the survivors' failed step
            # is explained and the scan over every member (a /proc read each on this node) is not made
            for peer in self.run_refs.values():
                if peer.state is SlotState.MEMBER and self.group.process_gone(peer):
                    self._add_failure(peer, FailureKind.PROCESS_DIED, "worker process died (seen by its peers)")

    def failure_known(self) -> bool:
        """A member of this generation failed (pending, or already killed and dropped from the calls):
        what breaks the survivors' step. O(1)."""
        return bool(self.pending_failures) or len(self.run_refs) < len(self.run_ref_of)

    def finished_runs(self) -> list[dict[str, Any]] | None:
        """All members' run results, once every one has returned (else None)."""
        if not self.run_refs or len(self.runs_ended) < len(self.run_refs):
            return None
        if not all(ref in self.runs_ended for ref in self.run_refs):
            return None
        results = []
        for packed, error in get_each(self.rt, list(self.run_refs)):
            if error is not None:
                return None
            results.append(worker_reply.unpack(packed))
        self.poll_members_blocking()
        self.run_refs = {}
        return results

    def poll_members_blocking(self, reporter_only: bool = False) -> None:
        """Take every outstanding poll, then poll each live member once more: no record is dropped.
        ``reporter_only``: ask only the generation's reporting rank again (it holds the complete steps; the
        others' last records and reports are taken when the next generation forms)."""
        members = [self.reporter] if reporter_only and self.reporter is not None else self.group.members()
        self.take_members(self.ask_members(members))

    def ask_members(self, members: Sequence[Slot]) -> list[tuple[Slot, Any]]:
        """Send a poll to each live one of ``members`` without waiting: ``(slot, ref)``, after every poll
        still out, in the order :meth:`take_members` must take them (a slot's earlier poll first: its
        records stay in order). Asked all at once: a round trip for all, not one per member."""
        outstanding, self.poll_refs = self.poll_refs, {}
        asked = [(self.group.slots[idx], ref) for idx, (ref, _) in outstanding.items()
                 if self.group.slots[idx].state is not SlotState.DEAD]
        after = self.ledger.last_step  # (compute times restart with the next generation: no window kept)
        asked += [(slot, slot.actor.poll.remote() if self._reports_all(slot) else slot.actor.poll.remote(after))
                  for slot in members if slot.state is SlotState.MEMBER]
        return asked

    def last_poll_targets(self) -> list[Slot]:
        """The members a generation's formation must poll before the next generation starts (their answers
        are taken while the new members join): all of them while a save of the ending generation waits for
        their reports (:meth:`Committer.waiting`) or when every rank reports its steps (pp); else only a
        member whose run ended past every step reported so far -- its records make the step only some
        survivors completed (``Ledger.flush_partial``). Usually nobody: the generation ended with a poll of
        its reporting rank (a failure) or of every member (a stop), and the others' records (compute times,
        kept by the worker until asked) and reports come with their next poll."""
        members = self.group.members()
        if self.reporter is None or self.committer.waiting():
            return members
        known = max(self.ledger.last_step, self.ledger.latest_record_step)
        return [s for s in members if int(s.info.get("step", 0)) > known]

    def take_members(self, asked: list[tuple[Slot, Any]]) -> None:
        """Take the answers to :meth:`ask_members`' polls, in its order, waiting up to ``timeouts.poll_s``
        for all of them together (one wait, not one per member). A member dead or not answering is skipped:
        its run ref or the watchdog finds it."""
        refs = [ref for _, ref in asked]
        if not refs:
            return
        done = set(self.rt.wait(refs, num_returns=len(refs), timeout=self.config.timeouts.poll_s)[0])
        answered = [(slot, ref) for slot, ref in asked if ref in done]
        for (slot, _), (result, error) in zip(answered, get_each(self.rt, [ref for _, ref in answered])):
            if error is None:  # (else it died after answering nothing)
                self.take_poll(slot, result)

    def _watchdog(self) -> None:
        if not self.run_refs:
            return
        now = time.time()
        # until the generation completed a step (DDP rebuild, warm-up) the bound is the cap, not one
        # derived from steady steps; under the bound nobody can be hung: no member is looked at
        progress, times = self._progress_at(), self._step_times()
        bound = policy.hang_bound(times, self.config.timeouts)
        if now - progress < bound:
            return
        asked = self.stall_polled_at
        if self.reporter is not None and (asked is None or asked < progress or self.taken_at - asked < bound):
            # judge views asked in this stall, once the answers were taken a bound after the last poll was
            # sent: a poll still out then went unanswered for the bound (hung), the others' phases are fresh;
            # a phase from before the stall would blame a healthy rank
            return
        views = [self._view(s, now) for s in self.group.members()]
        for view in self.detector.find_data_stalls(views, now=now, bound=bound):
            self._name_data_stall(view, now, bound)
        found = self.detector.find_hangs(views, now=now, progress_at=progress, step_times=times, **self._when())
        if found or self.pending_failures or self.stall_aborted_at == progress:
            return
        # a member computing is a slow step (a first step compiling), not a stall, and a member reading its
        # data waits on storage (named above): only members that all wait on each other are aborted
        if now - progress >= policy.STALL_FALLBACK_FACTOR * bound and not any(
                v.phase in ("compute", "data") for v in views):
            self._abort_stall(now - progress, bound, progress)

    def _name_data_stall(self, view: WorkerView, now: float, bound: float) -> None:
        """Say once per stall that a member waits on its dataset's reads (``data_stalled``): storage, not
        the worker, so nobody is replaced and the step goes on when the reads return. Past
        ``timeouts.collective_s`` the peers' collective times out and the group regroups (nothing lost)."""
        key = (view.slot, view.phase_since)
        if key in self.data_stalls_named:
            return
        self.data_stalls_named = self.data_stalls_named | {key}
        waited = now - view.phase_since
        reason = (f"rank {view.rank} has waited {waited:.1f}s on its dataset's reads (hang bound {bound:.1f}s): "
                  f"storage is slow or stalled, not the worker, so it is not replaced; the step goes on when the "
                  f"reads return (past timeouts.collective_s={self.config.timeouts.collective_s:g}s the peers' "
                  f"collective times out and the group regroups from memory)")
        self.events.emit("data_stalled", step=self.ledger.last_step, rank=view.rank, waited_s=round(waited, 3),
                         bound_s=round(bound, 3), reason=reason)
        log.warning("%s", reason)

    def _abort_stall(self, stalled_s: float, bound: float, progress: float) -> None:
        """A stall nobody is blamed for (every member answers and none computes: each waits in a collective
        or a device sync, as NCCL ranks whose peer's kernel hangs do) for ``policy.STALL_FALLBACK_FACTOR`` hang
        bounds: keep the NCCL flight recorders (GPU), then abort every member's group (gloo: severed), so
        every ``run`` returns its failed step discarded; the group failure that follows regroups the same
        workers from the newest state known to be whole (``Controller._running``)."""
        self.stall_aborted_at = progress
        members = [s for s in self.group.members() if s.state is SlotState.MEMBER]
        reason = (f"no progress for {stalled_s:.1f}s and no member to blame (each answers, none computes): "
                  f"aborting the group of {len(members)} after {policy.STALL_FALLBACK_FACTOR} hang bounds "
                  f"({bound:.1f}s each)")
        traces = self._keep_flight_records(members) if self.config.workers.use_gpu else None
        self.events.emit("stall_aborted", step=self.ledger.last_step, members=len(members), traces=traces,
                         reason=reason)
        log.warning("%s", reason)
        for s in members:
            s.actor.abort_group.remote(self.generation, True)

    def _keep_flight_records(self, members: Sequence[Slot]) -> str | None:
        """Ask every member for its NCCL flight recorder and write each answer into the run directory's
        ``flight_recorder/`` (``rank<r>.pkl``, torch's format). Returns the folder, or None if none came."""
        refs = {s.actor.flight_record.remote(): s for s in members}
        done, _ = self.rt.wait(list(refs), num_returns=len(refs), timeout=self.config.timeouts.poll_s)
        folder = self.events.path.parent / "flight_recorder"
        wrote = 0
        for ref, (blob, error) in zip(done, get_each(self.rt, done)):
            if error is None and blob:
                folder.mkdir(exist_ok=True)
                (folder / f"rank{refs[ref].rank}.pkl").write_bytes(blob)
                wrote += 1
        return str(folder) if wrote else None

    def check_drains(self) -> str | None:
        """A drain notice for a node that hosts workers is a preemption (the reason returned): stop at a
        step boundary, write a just-in-time checkpoint, exit 75 (the job is resubmitted and resumes)."""
        draining = self.drains.draining()
        notice = self.drains.take_notice()
        if notice:
            log.warning("drain watcher turned off: %s", notice)
            self.events.emit("warning", source="drain_watcher", reason=notice)
        if not draining:  # the usual case: no member is looked at
            return None
        hit = sorted({s.info.get("node_id") for s in self.group.members()} & draining)
        return f"Ray drain notice for node {', '.join(hit)}" if hit else None

    def _check_stragglers(self) -> None:
        """Once every member's compute times came in again (a sweep, or a poll of all), not every interval."""
        if not self.stragglers_due:
            return
        self.stragglers_due = False
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
                self._add_failure(slot, FailureKind.STRAGGLER, reason)

    # ------------------------------------------------------------------ failures
    def _add_failure(self, slot: Slot, kind: FailureKind, reason: str) -> None:
        self.detector.report(self._view(slot), kind, reason, now=time.time(), **self._when())

    def detect_dead(self, slots: list[Slot], reason: str, outcomes: Sequence[CallOutcome] = ()) -> None:
        """After a failed collective call: find which of ``slots`` is dead or unresponsive; if every one
        answers, charge the member(s) whose part of the call failed (``outcomes``, see
        :func:`~elastictrain.controller.detect.blame`), quoting its own error; only when nothing names one,
        the first."""
        refs = {s.actor.poll.remote(): s for s in slots if s.actor is not None}
        done, _ = self.rt.wait(list(refs), num_returns=len(refs), timeout=2.0)
        for ref, slot in refs.items():
            ok = ref in done
            if ok:
                try:
                    self.rt.get(ref)
                except Exception:  # noqa: BLE001
                    ok = False
            if not ok:
                self._add_failure(slot, FailureKind.PROCESS_DIED, reason)
        if self.pending_failures or not slots:
            return
        by_index = {s.index: s for s in slots}
        culprits = [o for o in blame(outcomes) if o.slot in by_index]
        for o in culprits:
            why = o.error or "did not return from the call while its peers did"
            self._add_failure(by_index[o.slot], OUTCOME_KIND[o.status], f"{reason}: {why}")
        if not culprits:
            self._add_failure(slots[0], FailureKind.EXCEPTION, reason)

    def kill_failed(self) -> list[Killed]:
        """Kill the failed workers at once (a stopped one blocks its peers' collectives until then).
        Returns (failure, kind, node) for accounting once the survivors' last records are in."""
        failures = self.detector.take()
        alive_nodes = self.rt.alive_nodes() if failures else set()
        out = []
        for f in failures:
            slot = self.group.slots[f.slot]
            node = slot.info.get("node_id")
            lost = node is not None and node not in alive_nodes
            kind = f.kind.seen_on(node_alive=not lost)
            pid = slot.info.get("pid")
            self.group.kill(slot)
            slot.info.update(pid=pid, node_id=node)  # kept for the event
            self.poll_refs.pop(slot.index, None)
            out.append((f, kind, node))
        for f, _, _ in out:  # O(failures): by slot, not a pass over every member's call
            ref = self.run_ref_of.get(f.slot)
            if ref is not None and ref in self.run_refs:
                del self.run_refs[ref]
        return out

    def report_failures(self, killed: list[Killed]) -> list[policy.FailureRecord]:
        """Emit the failure events (timed from the true last progress, now that the survivors' records
        are in) and return them as the failure budget sees them (the controller judges them, then
        :meth:`queue_replacements`)."""
        for f, kind, node in killed:
            slot = self.group.slots[f.slot]
            f.last_progress = min(f.detected_at, max(f.last_progress, self.ledger.latest_record_at))
            if f.joined_step is not None:  # progress from the survivors' records too: polls lag behind steps
                done = max(self.ledger.last_step, self.ledger.latest_record_step)
                f.progress = max(f.progress, done - f.joined_step)
            self.ledger.failures += 1
            self.ledger.add_time("detection", f.detected_at - f.last_progress)
            self.events.emit("failure", kind=kind, rank=f.rank, slot=f.slot, node_id=node,
                             pid=slot.info.get("pid"), detected_after_s=round(f.detected_at - f.last_progress, 3),
                             step=max(self.ledger.last_step, self.ledger.latest_record_step), reason=f.reason)
        return [policy.FailureRecord(f.detected_at, f.slot, kind, f.reason, f.progress, node) for f, kind, node in killed]

    def queue_replacements(self, killed: list[Killed]) -> None:
        """The budget let the run go on: the killed workers' replacements start at :meth:`start_replacements`
        (one the standby serves prebuilt at :meth:`start_prebuilt_replacements`, at detection)."""
        for f, kind, _ in killed:
            if kind is FailureKind.NODE_LOST:  # before the actor: it goes into the slot's new group
                self.group.replace_lost_placement(f.slot)
            self.replacements_due.append(f.slot)

    def start_prebuilt_replacements(self) -> list[Any]:
        """Start now, of the queued replacements, those the standby serves with its set-up ahead done
        (:meth:`WorkerGroup.standby_prebuilt`): taking it only names the slot, so it costs the recovery no
        CPU and the replacement can join the recovery generation itself (the run does not shrink), as a
        spare does. Returns their set-up calls' refs (the controller waits for them, bounded)."""
        refs = []
        for index in list(self.replacements_due):
            if self.group.standby_prebuilt(index):
                self.replacements_due.remove(index)
                refs.append(self.group.spawn(index).setup_ref)
        return refs

    def start_replacements(self) -> None:
        """Start the queued replacements of failed workers. The controller calls this once the survivors
        train again (or must wait for workers), not at detection: a starting worker (imports, model build,
        dataset) takes a whole core for seconds, and where it shares a node with the survivors it slowed the
        recovery it could not join anyway (it joins later by growing). Measured on 2 cores, fsdp on 4 ranks,
        one killed: the survivors' rebuild and load ran at half speed beside the starting replacement. (One
        the standby serves prebuilt started at detection: :meth:`start_prebuilt_replacements`.)"""
        due, self.replacements_due = self.replacements_due, []
        for index in due:
            self.group.spawn(index)

    def drain_runs(self, timeout: float) -> None:
        """Wait for every member's ``run`` to return and take their last records; a member that does not
        return is recorded as hung (handled by the next recovery iteration). The runs of a formation that
        failed (``stray_runs``: sent behind their joins) are waited for as long and taken, not judged: the
        joins' outcomes named the failure, and Ray logs a failed call never taken as an unhandled error."""
        if self.stray_runs:
            stray, self.stray_runs = list(self.stray_runs), ()
            get_each(self.rt, self.rt.wait(stray, num_returns=len(stray), timeout=timeout)[0])
        if not self.run_refs:
            return
        # only the calls not seen ending yet are waited for (usually none: a failed step ends them all,
        # and the run watch told them; at 10,000 ranks a wait on every call was ~7 ms of the decision), and
        # only they are looked at again: set operations, not a Python pass over every member's call
        missing = self.run_refs.keys() - self.runs_ended
        pending = [ref for ref in self.run_refs if ref in missing] if missing else []  # (in rank order)
        new, _ = self.rt.wait(pending, num_returns=len(pending), timeout=timeout) if pending else ([], [])
        if new:
            self.runs_ended = set(self.runs_ended) | set(new)
        self._check_runs(new)
        for ref in pending:
            slot = self.run_refs[ref]
            if ref not in self.runs_ended and slot.state is SlotState.MEMBER:
                self._add_failure(slot, FailureKind.HANG, f"did not leave the failed step within {timeout:g}s")
        # the decision waits on this: with rank 0 alive, its records say which steps completed (a
        # dead rank 0's steps are in the survivors' records: then every member is asked)
        alive = self.reporter is not None and self.reporter.state is SlotState.MEMBER
        self.poll_members_blocking(reporter_only=alive)
        self.run_refs = {}

