"""Gathering the recovery sources of a new generation: where its training state comes from, asked for.

The controller's state machine decides *when* a generation forms; this module finds *where its state
comes from*, asking each source only when the ones before it do not cover the state (the ranking itself is
the pure :func:`elastictrain.controller.sources.rank_sources`):

1. live survivors of the previous generation -- under a sharded layout they snapshot and serve their
   shards (``hold_snapshot``), asked for exactly the (generation, rank, step) the decision counted on;
2. the peer memory tier -- the per-node :class:`~elastictrain.checkpoint.ShardKeeper` catalogues (asked as
   soon as a death is detected, :meth:`SourceGatherer.ask_peer_tier`) and survivors' own copies;
3. the durable checkpoint of the run's lineage, or the checkpoint the run branched from until it commits
   one of its own; storage is listed only when 1 and 2 do not cover the state (or this run committed a
   newer step than they hold).

The gatherer owns the keepers (one per alive node). It changes no controller state: :meth:`gather`
returns a :class:`Gathered` that the controller applies.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


from elastictrain.config import JobConfig
from elastictrain.controller import sources
from elastictrain.controller.detect import blame
from elastictrain.controller.group import MemberCallFailed, Slot, call_members, describe_remote_error
from elastictrain.controller.runtime import RAY, Runtime
from elastictrain.events import EventLog
from elastictrain.parallel.layout import Layout, MeshDims

log = logging.getLogger("elastictrain.controller")


class SurvivorLost(RuntimeError):
    """A survivor chosen as a recovery source died before serving its state (``outcomes``: whose part
    failed, for :meth:`WorkerMonitor.detect_dead`)."""

    def __init__(self, reason: str, holders: list[Slot], outcomes: list[Any]) -> None:
        super().__init__(reason)
        self.holders, self.outcomes = holders, outcomes


class SurvivorsStale(RuntimeError):
    """Live survivors cannot serve the state the source decision counted on (their runners moved on in a
    failed rendezvous, or released it): not their failure; another source is picked."""


class CheckpointLoadFailed(RuntimeError):
    """No checkpoint could be loaded into the members: a checkpoint error (exit 3), not a worker failure."""


@dataclass(frozen=True)
class PeerRestore:
    """Every member loads (resharding) from snapshots of one step that cover the state: ``KeeperSource``s
    of the peer memory tier (``kind="memory"``) or of live survivors (``kind="peer"``)."""

    step: int
    sources: list[Any]
    kind: str
    # the peer tier's: step records its snapshots carried (the reporting rank's newest, worker/loop.py
    # StepRecord), for the steps the controller may never have seen (Ledger.replay)
    records: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Previous:
    """The generation a recovery starts from: its number, its members' ranks (slot index -> rank), its
    world size (0: none formed yet) and its layout (None: the plan's at ``world``)."""

    generation: int
    ranks: dict[int, int]
    world: int
    layout: Layout | None = None


@dataclass(frozen=True)
class Gathered:
    """Where the next generation's state comes from. ``resume``: None (live survivors broadcast it, or
    step 0 for ``kind == "scratch"``), a :class:`PeerRestore`, or a checkpoint manifest. ``last_step``:
    the newest completed step anyone knew of, against which the recovery counts lost steps."""

    resume: Any
    kind: str
    reason: str
    last_step: int


def slot_step(slot: Slot) -> int:
    """The newest completed step a worker reported."""
    return int(slot.info.get("step", 0))


def snapshot_pushers(layout: Layout) -> set[int]:
    """PURE: the ranks that send peer-tier snapshots: the lowest rank of each :meth:`MeshDims.holder_key`
    (one copy of every part of the state; a replica's would repeat it). Under DDP that is rank 0 alone."""
    first: dict[tuple[int, ...], int] = {}
    for r in range(layout.dims.world_size):
        first.setdefault(layout.dims.holder_key(r), r)
    return set(first.values())


def dense_parts(layout: Layout) -> int:
    """PURE: how many distinct parts the state's non-expert (dense) tensors fall into: one per
    :meth:`MeshDims.holder_key` with its ep coordinate left out. Under ep every expert coordinate pushes a
    snapshot, and each carries its dense part whole (replicated over the ep group), so a snapshot is at most
    ``state / dense_parts`` bytes, not ``state / pushers``; without ep the two counts are equal."""
    dims = layout.dims
    return len({dims.holder_key(r)[:-1] if dims.ep > 1 else dims.holder_key(r) for r in range(dims.world_size)})


def every_part_replicated(layout: Layout) -> bool:
    """PURE: whether every part of the training state (each :meth:`MeshDims.holder_key`) is held by at least
    two ranks, so that losing any one rank leaves a replica to restore it from. ``dp_replicate > 1`` is not
    enough: under ep the holder key carries the ep coordinate, and the experts of an ep coordinate have a
    replica only when the expert ranks span more than one ep group (``expert_replica_ranks``); ddp x ep2 on
    2 ranks has ``dp_replicate`` 2 and no replica of either rank's experts."""
    dims = layout.dims
    held: dict[tuple[int, ...], int] = {}
    for r in range(dims.world_size):
        key = dims.holder_key(r)
        held[key] = held.get(key, 0) + 1
    return min(held.values()) >= 2


def _memory_restore(step: int, srcs: list[Any]) -> PeerRestore:
    """A restore from the peer tier's snapshots ``srcs`` of ``step``, with the step records they carry taken
    off their metas (they stay with the controller: the loading ranks need none of them)."""
    records: dict[int, Any] = {}
    for src in srcs:
        meta = getattr(src, "meta", None)  # (a source that names no SnapshotMeta carries no records)
        if meta is not None and meta.records:
            records.update((r.step, r) for r in meta.records if r.step <= step)
            src.meta = dataclasses.replace(meta, records=())
    return PeerRestore(step, srcs, "memory", tuple(records[s] for s in sorted(records)))


def _split(layout: Layout) -> bool:
    """No rank of ``layout`` holds the whole state as a DDP replica (sharded, staged or tensor-parallel)."""
    return not layout.dims.holds_whole_state


class SourceGatherer:
    """Finds a generation's recovery source (:meth:`gather`) and keeps the peer memory tier's keepers."""

    def __init__(self, config: JobConfig, events: EventLog, store: Any, committer: Any, lineage: str | None,
                 branch_point: Any, layout: Callable[[int], Layout], rt: Runtime = RAY) -> None:
        """``branch_point``: the manifest the run started from (a recovery source until the run commits one
        of its own), or None. ``layout``: world size -> the plan's :class:`Layout`. ``rt``: what starts
        the keepers and takes their answers (the worker group's runtime)."""
        self.config, self.events, self.store, self.committer, self.rt = config, events, store, committer, rt
        self.lineage, self.branch_point, self.layout = lineage, branch_point, layout
        self.keepers: dict[str, Any] = {}
        # this run's lease on its keepers: a keeper takes only puts sent under it (KeeperState.lease), so a
        # pooled keeper (workers.reuse) never keeps a late snapshot of the run that had it before
        self.lease = uuid.uuid4().hex
        self._budget: int | None = None  # sized from the job at the first generation (size_keepers)
        self._short_said = False
        # (generation, node -> catalog ref) asked at failure detection (ask_peer_tier), taken by peer_tier
        self._early_catalogs: tuple[int | None, dict[str, Any]] = (None, {})

    # ------------------------------------------------------------------ the peer memory tier
    def start_keepers(self) -> None:
        """One ShardKeeper per alive node (bound to it: it dies with its node); keepers of nodes that left
        are forgotten. Idempotent: called at start and for each generation."""
        if not self.config.checkpoint.memory_every_steps:
            return
        alive = self.rt.alive_nodes()
        for node in [n for n in self.keepers if n not in alive]:
            del self.keepers[node]
        budget = self._budget or max(1, int((self.config.checkpoint.memory_budget_gib or 4.0) * (1 << 30)))
        reuse, t = self.config.workers.reuse, self.config.timeouts.poll_s
        for node in sorted(alive - set(self.keepers)):  # workers.reuse: a pooled one (controller/keeper_pool.py)
            self.keepers[node] = self.rt.start_keeper(node, budget, reuse=reuse, timeout=t, lease=self.lease)

    def size_keepers(self, chosen: list[Slot], layout: Layout) -> None:
        """Size every keeper's budget from the job (checkpoint/tier_budget.py): the state bytes the workers
        reported at setup, the ranks per node, the smallest node's free memory (Ray's ``memory`` resource).
        The first time the tier cannot keep a lost rank of a layout without replica or periodic checkpoint,
        a ``peer_tier_short`` event (one console line) names the fix. Waits for the keepers to take it."""
        if not self.keepers or not chosen:
            return
        from elastictrain.checkpoint.tier_budget import size_budget, tier_shortfall

        state = max(int(s.info.get("state_bytes") or 0) for s in chosen)
        pushers = snapshot_pushers(layout)  # the ranks that push: one per part of the state (holder key)
        per_node: dict[str, int] = {}
        for r, s in enumerate(chosen):
            node = str(s.info.get("node_id"))
            per_node[node] = per_node.get(node, 0) + (r in pushers)
        free = self.rt.free_memory(set(per_node))
        # a snapshot's bytes are bounded by state / dense parts (under ep each carries its dense part whole)
        ranks, world = max(1, max(per_node.values())), dense_parts(layout)
        ck = self.config.checkpoint
        tier = size_budget(state, world, ranks, min(free) if free else None, ck.memory_budget_gib)
        self._budget = tier.budget
        self.rt.get([k.set_budget.remote(tier.budget) for k in self.keepers.values()], timeout=self.config.timeouts.poll_s)
        why = tier_shortfall(tier, -(-state // world), ranks, has_replica=every_part_replicated(layout),
                             periodic_checkpoint=ck.uri is not None and ck.every_steps > 0)
        if why and not self._short_said:
            self._short_said = True
            self.events.emit("peer_tier_short", budget_bytes=tier.budget, need_bytes=tier.need, reason=why)

    def close(self) -> None:
        """End the keepers this run started or took (the run is over: its snapshots have no reader left):
        killed, or with ``workers.reuse`` emptied and given to the driver's pool when alive on an alive node
        (controller/keeper_pool.py). The controller calls it on every path out of its run. Until then each
        keeper holds up to ``checkpoint.memory_budget_gib`` of snapshots, and a driver that keeps the
        Trainer (a notebook, a benchmark running one job after another) would otherwise keep them all alive."""
        keepers, self.keepers = dict(self.keepers), {}
        self._early_catalogs = (None, {})
        reuse = self.config.workers.reuse and bool(keepers)
        try:
            alive = self.rt.alive_nodes() if reuse else set()
        except Exception:  # noqa: BLE001 - Ray going away: kill them
            alive = set()
        for node, keeper in keepers.items():
            try:
                self.rt.stop_keeper(keeper, node=node, reuse=node in alive, timeout=self.config.timeouts.poll_s)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass

    def keepers_for(self, chosen: list[Slot], layout: Layout) -> list[tuple[Any, bool]]:
        """Each member's keeper -- on the next node in the ring, never its own unless it is alone -- and
        whether it is on another node (then the member keeps its own newest snapshots too: they outlive
        that keeper's node; on its own node they would die with it, and add nothing). ``chosen`` in rank
        order. Only the lowest rank of each part of the state (:func:`snapshot_pushers`) gets a keeper: a
        replica's snapshot is the same bytes, and the budget is sized for one copy of each part."""
        if not self.keepers:
            return [(None, False)] * len(chosen)
        from elastictrain.checkpoint import keeper_ring

        own = [str(s.info.get("node_id")) for s in chosen]
        nodes = keeper_ring(own, list(self.keepers))
        pushers = snapshot_pushers(layout)
        return [(self.keepers.get(n) if n and r in pushers else None, n is not None and n != o and r in pushers)
                for r, (n, o) in enumerate(zip(nodes, own))]

    def ask_peer_tier(self, generation: int) -> None:
        """Ask every keeper for its catalog now, so the answers arrive while the survivors leave the failed
        step (:meth:`peer_tier` takes them; a keeper receiving the last snapshots answers after them). Asked
        later it would add its wait to the recovery: measured 0.2 s of a 1.5 s fsdp recovery on 4 CPU ranks."""
        self._early_catalogs = (generation, {node: k.catalog.remote() for node, k in self.keepers.items()})

    def peer_tier(self, holders: Sequence[Slot], generation: int) -> dict[int, tuple[bool, list[Any]]]:
        """step -> (complete, KeeperSources of the newest generation that covers it, or of the newest).
        The keepers' snapshots first, then ``holders``' own copies of theirs (live members of the failed
        generation, ``Worker.own_snapshots``): a node lost with its keeper takes the snapshots it kept for
        the ranks of another node, which still hold them."""
        from elastictrain.checkpoint import KeeperSource
        from elastictrain.checkpoint.memory_dcp import coverage

        t = self.config.timeouts
        groups: dict[tuple[int, int], list[Any]] = {}
        own = [(s, s.actor.own_snapshots.remote()) for s in holders if s.actor is not None]
        gen, asked = self._early_catalogs
        self._early_catalogs = (None, {})
        if gen != generation:  # asked for an earlier generation's recovery: stale
            asked = {}
        for node, keeper in sorted(self.keepers.items()):
            try:
                metas = self.rt.get(asked.get(node) or keeper.catalog.remote(), timeout=t.poll_s)
            except Exception as e:  # noqa: BLE001 - a keeper lost with its node: its snapshots are gone
                log.warning("peer memory tier: keeper on node %s unavailable: %s", node, e)
                continue
            for m in metas:
                groups.setdefault((m.step, m.generation), []).append(
                    KeeperSource(keeper, m, timeout_s=t.restart_grace_s, batched=True))
        for slot, ref in own:
            try:
                metas = self.rt.get(ref, timeout=t.poll_s)
            except Exception as e:  # noqa: BLE001 - a survivor that died since: the next recovery finds it
                log.warning("peer memory tier: slot %s's own snapshots unavailable: %s", slot.index, e)
                continue
            for m in metas:
                groups.setdefault((m.step, m.generation), []).append(
                    KeeperSource(slot.actor, m, timeout_s=t.restart_grace_s))
        out: dict[int, tuple[bool, list[Any]]] = {}
        for (step, _gen), srcs in sorted(groups.items(), reverse=True):
            complete = coverage([x.meta for x in srcs]).complete
            if step not in out or (complete and not out[step][0]):
                out[step] = (complete, srcs)
        return out

    # ------------------------------------------------------------------ the choice
    def gather(self, chosen: list[Slot], alive: Sequence[Slot], prev: Previous, generation: int,
               known_steps: Sequence[int], next_layout: Layout | None = None) -> Gathered:
        """Pick where the next generation's state comes from (:func:`sources.rank_sources`), asking
        survivors, then the tier, then storage, each only when the ones before do not cover the state.
        ``alive``: every live member of the previous generation, chosen or not -- a survivor left out of a
        folded mesh still serves its shards. ``known_steps``: completed steps the controller knows of
        (ledger, records, the open failure). Raises :class:`SurvivorLost` (a serving survivor died) or
        :class:`CheckpointLoadFailed` (storage failed and nothing else holds the state). ``next_layout``: the
        next generation's, when it may differ from the previous one's family (``parallel.plan: auto``)."""
        old = (prev.layout or self.layout(prev.world)) if prev.world else None
        dims = old.dims if old is not None else None
        mesh = dims or MeshDims()
        # a sharded layout's survivors always serve snapshots (even at dp_shard 1: their parameters are
        # DTensors, which the replicated broadcast path does not move); so do a pipeline's, whose ranks
        # each hold one stage, and a tensor-parallel one's, whose ranks each hold one tp shard: loaded by
        # name whatever the next generation's layout is. A replicated generation followed by a sharded one
        # (a re-plan) serves snapshots too: the next one's rebuilt shards are loaded from them by name.
        sharded = old is not None and (_split(old) or (next_layout is not None and _split(next_layout)))
        # (a slot respawned since has rank None: a replacement in the same slot is not a survivor)
        taken = {s.index for s in chosen}  # by slot index: `in` on a list of Slots is O(N^2) at 10,000
        pool = list(chosen) + [s for s in alive if s.index not in taken]
        # members of the previous generation, by their rank in its mesh (a sharded survivor's has_state was
        # cleared: its shard alone is not a whole state, but it is a source for the policy). Growing after
        # a clean stop takes the same path: all shards survive, the covering ranks serve them. (One pass:
        # at 10,000 ranks each pass over the pool is ~1 ms of the decision.)
        ranks, members, survivors = prev.ranks, [], {}
        for s in pool:
            r = ranks.get(s.index)
            if r is not None and s.rank is not None:
                members.append(s)
                survivors[r] = int(s.info.get("step", 0))  # (slot_step, inlined: 10,000 calls)
        if not survivors and not sharded and any(s.has_state for s in chosen):  # state, no rank: replica 0
            survivors = {0: max(slot_step(s) for s in chosen if s.has_state)}
            mesh = MeshDims(dp_replicate=max(1, prev.world))  # (not sharded: a whole-state layout)
        # the newest completed step anyone knows of (records and survivors run ahead of the polls): the
        # same count the ``recovered`` event reports as ``lost_steps``
        last_step = max([*known_steps, *survivors.values()])
        args = dict(dp_replicate=1, dp_shard=1, dims=mesh, survivors=survivors, last_step=last_step)
        decision = sources.rank_sources(memory={}, durable_step=None, **args)
        if decision.chosen.kind == "peer" and sharded:  # the covering survivors serve their shards to everyone
            try:
                restore = self.survivor_restore(pool, decision.chosen, prev, generation)
                return Gathered(restore, "peer", decision.reason, last_step)
            except SurvivorsStale as e:  # not their failure: their state is not what was counted on
                self.events.emit("warning", source="recovery", reason=f"survivors cannot serve step "
                                 f"{decision.chosen.step}: {e}; picking another source")
                args["survivors"] = {}
                decision = sources.rank_sources(memory={}, durable_step=None, **args)
        resume = None
        if decision.chosen.kind != "peer":
            tier = self.peer_tier(members, generation)
            memory = {k: v[0] for k, v in tier.items()}
            decision = sources.rank_sources(memory=memory, durable_step=None, storage_asked=False, **args)
            # storage only when survivors and the tier do not cover the state (a stalled store would delay
            # the recovery by a drain and a listing), or this run committed a newer step than the tier holds
            if self.store is not None and sources.storage_needed(decision, self.committer.committed_steps):
                manifest, storage_error = self.durable_source()
                decision = sources.rank_sources(memory=memory,
                                                durable_step=None if manifest is None else int(manifest.step), **args)
                if storage_error and decision.chosen.kind == "scratch":
                    # storage did not answer: whether a committed checkpoint exists is unknown, so never
                    # restart from step 0 (and commit over it); the committed checkpoints are left as they are
                    raise CheckpointLoadFailed(
                        f"storage failed during recovery ({storage_error}) and no survivor or peer-tier snapshot "
                        "holds the state: not restarting from step 0 over committed checkpoints, which are "
                        "untouched; run the job again once storage answers (checkpoint.resume: auto resumes)")
                resume = manifest if decision.chosen.kind == "checkpoint" else None
            if decision.chosen.kind == "memory":
                resume = _memory_restore(decision.chosen.step, tier[decision.chosen.step][1])
        return Gathered(resume, decision.chosen.kind, decision.reason, last_step)

    def survivor_restore(self, pool: list[Slot], cand: sources.SourceCandidate, prev: Previous,
                         generation: int) -> PeerRestore:
        """Survivors ``cand.ranks`` (found in ``pool``, members of the next generation or not) snapshot their
        live shards (collective-free) and serve them; every member of the next generation then reads its
        new shards from them (no storage, no keeper). Raises :class:`SurvivorLost` when a holder died or
        hangs, :class:`SurvivorsStale` when live holders refuse or serve something else."""
        from elastictrain.checkpoint import KeeperSource

        by_rank = {prev.ranks[s.index]: s for s in pool if s.index in prev.ranks and s.rank is not None}
        holders = [by_rank[r] for r in cand.ranks]
        gen = prev.generation  # the generation the decision describes them by (not a failed one since)
        try:
            metas = call_members([(s, s.actor.hold_snapshot.remote((gen, r, cand.step)))
                                  for s, r in zip(holders, cand.ranks)], self.config.timeouts.poll_s, "hold_snapshot", self.rt)
        except MemberCallFailed as e:
            # a holder died or hangs: its failure; live holders that refused (their state moved on) are not.
            # (ray.get fails fast: a refusal can come back while another holder's call is still pending)
            if any(o.status != "own" for o in blame(e.outcomes)):
                raise SurvivorLost(f"failed while snapshotting its state for generation {generation + 1}",
                                   holders, e.outcomes) from e
            raise SurvivorsStale(str(e)) from e  # live holders refused: their state moved on
        why = sources.check_served(metas, cand.ranks, cand.step, gen)
        if why:
            raise SurvivorsStale(why)
        return PeerRestore(cand.step, [KeeperSource(s.actor, m, timeout_s=self.config.timeouts.restart_grace_s)
                                       for s, m in zip(holders, metas)], "peer")

    def durable_source(self) -> tuple[Any, str | None]:
        """(the newest committed checkpoint of this run's lineage -- or its branch point -- or None, the
        storage error that kept it from being found, or None). Never raises."""
        if self.store is None:
            return None, None
        try:
            # commits run on their own thread: let queued ones land before asking storage (bounded)
            self.committer.drain(timeout=self.config.timeouts.poll_s)
            # sizes only (ranks check what they read); only this run's own trajectory, never another's
            manifest, skipped = self.store.latest_valid(checksums=False, lineage=self.lineage)
        except Exception as e:  # noqa: BLE001 - storage unreachable or failing: the caller decides
            why = describe_remote_error(e)
            self.events.emit("checkpoint_failed", step=None, reason=f"storage error during recovery: {why}")
            return None, why
        for why in skipped:
            self.events.emit("checkpoint_failed", step=None, reason=f"skipped on recovery: {why}")
        # a run branched from an explicit checkpoint URI (a new lineage, maybe another root) finds nothing of
        # its own on storage before its first commit, and must not restart from step 0 over the branch
        return manifest or self.branch_point, None
