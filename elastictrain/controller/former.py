"""Forming a membership generation: the rendezvous of the chosen workers, their state from its source,
and the start of their step loop.

The controller decides *who* forms the next generation and *where its state comes from*
(controller/gather.py); :class:`GenerationFormer` does the rounds of calls on the members and returns a
:class:`Formed` generation, or raises: :class:`FormationFailed` when a member failed on the way (recorded
as its failure with the monitor, charged to whoever's part failed) or
:class:`~elastictrain.controller.gather.CheckpointLoadFailed` (exit 3). It changes no controller state:
the controller applies what it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastictrain.config import JobConfig
from elastictrain.controller import policy
from elastictrain.controller.commits import Committer
from elastictrain.controller.gather import CheckpointLoadFailed, PeerRestore, SourceGatherer, slot_step
from elastictrain.controller.group import (MemberCallFailed, Slot, SlotState, WorkerGroup, call_members,
                                           call_outcomes, describe_remote_error)
from elastictrain.controller.ledger import Ledger
from elastictrain.controller.detect import CallOutcome
from elastictrain.controller.monitor import WorkerMonitor
from elastictrain.controller.recovery import Recovery
from elastictrain.controller.runtime import get_each
from elastictrain.events import EventLog
from elastictrain.parallel.placement import arrange
from elastictrain.parallel.layout import Layout

log = logging.getLogger("elastictrain.controller")


class FormationFailed(RuntimeError):
    """A member failed during the formation (recorded with the monitor as its failure)."""


@dataclass
class Formed:
    """A generation that stands: its members in rank order, its layout, the step it starts at, and the
    members' ``run`` calls already sent behind their joins (None: not sent; :meth:`GenerationFormer.start`)."""

    generation: int
    members: list[Slot]
    layout: Layout
    start_step: int
    source_rank: int | None
    runs: list[tuple[Slot, Any]] | None


class GenerationFormer:
    def __init__(self, config: JobConfig, group: WorkerGroup, ledger: Ledger, committer: Committer,
                 events: EventLog, monitor: WorkerMonitor, sources: SourceGatherer, store: Any,
                 lineage: str | None, layout: Callable[[int], Layout]) -> None:
        """``layout``: world size -> the layout a generation of that size runs (the controller's, which
        a re-plan changes)."""
        self.config, self.group, self.rt = config, group, group.rt
        self.ledger, self.committer, self.events = ledger, committer, events
        self.monitor, self.sources, self.store, self.lineage = monitor, sources, store, lineage
        self.ckpt_root = getattr(store, "root_uri", None)
        self.layout = layout
        # the state-thread calls (join, load, sync) of the formation in progress, as (slot, actor, ref,
        # generation); those of a formation that failed stay here until taken (_await_stray)
        self._calls: list[tuple[Slot, Any, Any, int]] = []

    def form(self, chosen: list[Slot], generation: int, reason: str, recovery: Recovery, resume: Any = None,
             start: bool = True) -> Formed:
        """Rendezvous ``chosen`` (in rank order) as generation ``generation`` and sync state from its source
        (``resume``: None -- the survivors hold it, or step 0 --, a :class:`PeerRestore` or a manifest);
        records in ``recovery`` where the state came from. Under tp or pp the ranks are first given by
        topology (:meth:`_place`).

        Rounds of calls on the members: ``open_store`` on rank 0, then ``join`` -- which also syncs the
        state from its source when that is known before the rendezvous (the survivors hold it, or step 0)
        -- with each member's ``run`` sent right behind its ``join``, before any answer (:meth:`_run_after`):
        one round, not two; the last polls of the previous members that need one
        (``monitor.last_poll_targets``, usually none) are sent first and taken while the members join. A
        restore (the peer tier, a checkpoint) runs between ``join`` and ``sync``: the source is known once
        it is loaded, so ``sync`` is a round of its own and ``run`` follows it (:meth:`start`); with the peer
        memory tier on, ``run`` follows the keepers' attachment (``attach_keeper`` reads the joined rank)."""
        chosen = self._place(chosen)
        gen, world = generation, len(chosen)
        self._await_stray(chosen, gen)
        asked = self.monitor.ask_members(self.monitor.last_poll_targets())  # taken while the members join
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
            joins = self._sent([(s, s.actor.join.remote(gen, r, world, host, port, layout, peer, sync_src=src))
                                for r, s in enumerate(chosen)], gen)
            asked = self._take_last_polls(asked)  # (before any run goes out: their records are the old generation's)
            # the state source known and no peer tier to attach in between: each member's `run` goes right
            # behind its `join` (one round of calls, not two), the join's answer its argument (_run_after)
            pipelined = src is not None and start and not self.config.checkpoint.memory_every_steps
            runs = self._run_after(joins) if pipelined else None
            got = call_members(joins, t.restart_grace_s, "join", self.rt)
            if src is not None:  # joined and synced in one round
                steps = got
                if not any(s.has_state for s in chosen):  # nobody held state: from step 0, every step redone
                    self.ledger.rewind(0)  # (after the last polls: an old record is never taken for a redo)
            elif isinstance(resume, PeerRestore):
                for s, step in zip(chosen, got):
                    s.has_state, s.info["step"] = True, step
                recovery.source = resume.kind
                self.ledger.replay(resume.records, resume.step)  # the tier's: steps whose records died
                if resume.kind == "peer":  # live survivors: the newest state, nothing is redone
                    self.ledger.last_step = max(self.ledger.last_step, resume.step)
                else:  # the tier's snapshot may be older than the last step reported: those are redone
                    self.ledger.rewind(resume.step)
            else:
                resume = self._load_checkpoint(chosen, gen, resume, explicit=reason == "start" and
                                               self.config.checkpoint.resume not in ("auto", "never"))
                for s in chosen:
                    s.has_state = True
                recovery.source = "checkpoint"
                self._replay_checkpoint(resume)
                self.ledger.rewind(int(resume.step))
                self.events.emit("resumed", step=int(resume.step), world_size=world,
                                 from_world_size=getattr(resume, "world_size", None), uri=self.ckpt_root)
            if src is None:
                src = self._sync_source(chosen)
                steps = call_members(self._sent([(s, s.actor.sync.remote(src)) for s in chosen], gen),
                                     t.restart_grace_s, "state sync", self.rt)
        except CheckpointLoadFailed:  # the checkpoint's fault, not the workers': exit 3, no crash loop
            self._take_last_polls(asked)
            raise
        except Exception as e:  # noqa: BLE001 - any member failing here is a failure like any other
            self.monitor.stray_runs = [ref for _, ref in runs or ()]  # drained by the recovery, not judged
            self._take_last_polls(asked)  # before detect_dead polls again: a slot's records stay in order
            # charged to the member whose part failed (its own error quoted), not to whoever comes first
            if isinstance(e, MemberCallFailed):
                self.monitor.detect_dead(chosen, f"failed during rendezvous of generation {gen} ({e.what})",
                                         e.outcomes)
            else:
                self.monitor.detect_dead(chosen, f"failed during rendezvous of generation {gen}: {e}")
            raise FormationFailed(f"a member failed during the rendezvous of generation {gen}") from e
        self._calls = [c for c in self._calls if c[3] != gen]  # this formation's calls all returned
        for r, s in enumerate(chosen):
            first_time = s.rank is None and not s.has_state
            s.state, s.rank, s.has_state = SlotState.MEMBER, r, True
            s.info.setdefault("joined_step", steps[0])  # progress of this incarnation counts from here
            if first_time or reason == "start":
                self.events.emit("worker_started", rank=r, slot=s.index, pid=s.info.get("pid"),
                                 node_id=s.info.get("node_id"), generation=gen, setup_s=s.info.get("setup_s"),
                                 device=s.info.get("device"), standby=s.info.get("standby", False),
                                 reused=s.info.get("reused", False))
        self.monitor.new_generation(gen, world, time.time(), steps[0])
        self.ledger.new_generation(gen, world, layout.accum)
        self.ledger.last_step = max(self.ledger.last_step, steps[0])
        self.events.emit("generation_started", generation=gen, world_size=world, accum=layout.accum,
                         step=steps[0], source_rank=src, reason=reason)
        return Formed(gen, chosen, layout, steps[0], src, runs)

    def start(self, formed: Formed) -> None:
        """Start the formed generation's step loop: attach the peer tier's keepers (when on), send each
        member's ``run`` (unless it went behind its join) and hand the calls to the monitor."""
        chosen, gen, layout = formed.members, formed.generation, formed.layout
        if self.config.checkpoint.memory_every_steps:
            self.sources.start_keepers()
            self.sources.size_keepers(chosen, layout)
            keepers = self.sources.keepers_for(chosen, layout)
            try:
                self.rt.get([s.actor.attach_keeper.remote(k, elsewhere, self.sources.lease)
                             for s, (k, elsewhere) in zip(chosen, keepers)],
                            timeout=self.config.timeouts.poll_s)
            except Exception as e:  # noqa: BLE001 - a member that died just now is found by its run ref below
                self.events.emit("warning", source="peer_tier", reason=f"attaching the peer memory tier in "
                                 f"generation {gen} failed: {describe_remote_error(e)}")
        runs = formed.runs
        if runs is None:
            runs = [(s, s.actor.run.remote(self.config.train.steps)) for s in chosen]
        self.monitor.watch_runs(runs, aggregate=layout.dims.pp == 1)

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

    def _sent(self, calls: list[tuple[Slot, Any]], gen: int) -> list[tuple[Slot, Any]]:
        """Record ``calls`` (state-thread calls of generation ``gen``'s formation, ``(slot, ref)``); returns them."""
        self._calls.extend((s, s.actor, ref, gen) for s, ref in calls)
        return calls

    def _await_stray(self, chosen: list[Slot], gen: int) -> None:
        """Before the members of generation ``gen`` are sent its calls: wait until their calls of a formation
        that failed have returned, and take them. Such a call holds the member's one state thread (a join
        whose peer died before connecting waits in the rendezvous until ``timeouts.collective_s``), so the
        new join would start only after it while its peers' rendezvous clock already ran: under load they
        timed out first and the run charged a second failure to a healthy member. Bounded by
        ``timeouts.restart_grace_s`` (a formation call's own bound); a member whose call is still running
        then is charged as hung and :class:`FormationFailed` raised. Calls of killed members are dropped; those
        of members not chosen wait for a later formation."""
        live = [c for c in self._calls if c[0].actor is c[1] and c[1] is not None]
        ours = {s.index for s in chosen}
        waiting = [c for c in live if c[0].index in ours]
        self._calls = [c for c in live if c[0].index not in ours]
        if not waiting:
            return
        refs = [ref for _, _, ref, _ in waiting]
        done, _ = self.rt.wait(refs, num_returns=len(refs), timeout=self.config.timeouts.restart_grace_s)
        get_each(self.rt, done)  # their errors were the failed formation's: taken, not judged again
        returned = set(done)
        stuck = {s.index: g for s, _, ref, g in waiting if ref not in returned}
        if stuck:  # charged as hangs (detect.blame: those that did not return while the others did)
            grace = self.config.timeouts.restart_grace_s
            outcomes = [CallOutcome(s.index, "pending", f"still in the failed formation of generation "
                                    f"{stuck[s.index]} after timeouts.restart_grace_s={grace:g}")
                        if s.index in stuck else CallOutcome(s.index, "ok") for s in chosen]
            self.monitor.detect_dead(chosen, f"could not form generation {gen}", outcomes)
            raise FormationFailed(f"a member of generation {gen} was still in an earlier formation")

    def _take_last_polls(self, asked: list[tuple[Slot, Any]]) -> list[tuple[Slot, Any]]:
        """Take the previous members' last polls (``monitor.ask_members``) and keep the steps only some
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

    def _replay_checkpoint(self, manifest: Any) -> None:
        """Report the steps the loaded checkpoint holds whose events were never written, from the records
        it carries (checkpoint/carried.py; only one this run committed). Records that are not what a save
        writes are a ``warning``, and nothing is reported from them."""
        from elastictrain.checkpoint.carried import to_replay
        from elastictrain.checkpoint.manifest import ManifestError

        try:
            records = to_replay(manifest, self.committer.committed_steps)
        except ManifestError as e:
            self.events.emit("warning", source="recovery", reason=f"step records not replayed: {e}")
            return
        self.ledger.replay(records, int(manifest.step))

    def _load_checkpoint(self, chosen: list[Slot], gen: int, manifest: Any, explicit: bool) -> Any:
        """Load ``manifest`` on every member (collective). A load error is the checkpoint's (corrupt bytes
        found by a rank's SHA-256 check, a layout that does not fit): unless the checkpoint was named
        explicitly, fall back to the next older checkpoint of this run's lineage. Returns the manifest
        loaded; raises CheckpointLoadFailed when none loads."""
        from elastictrain.checkpoint import CheckpointError

        while True:
            calls = self._sent([(s, s.actor.load.remote(manifest, self.ckpt_root)) for s in chosen], gen)
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
