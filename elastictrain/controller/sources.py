"""Where the next generation's training state comes from: a pure, ranked choice of recovery sources.

Three kinds of source, in this order of preference at equal step:

* ``peer`` -- live survivors (replicas on the replicate dimension). Which part of the state a rank of the
  failed generation holds is its :meth:`MeshDims.holder_key`: its coordinate on the model axes (pp, tp)
  and the shard axes (dp_shard, and cp under fsdp/hsdp). Survivors at the newest step that cover every
  key hold everything (DDP: any survivor; HSDP: one survivor per shard coordinate; pure FSDP: all; a
  pipeline: that for each of its stages, so pp alone with one data rank needs every rank; tensor parallel:
  for each tp coordinate, so a lost rank of tp2 x dp2 is covered by the data-parallel replica of its
  coordinate; expert parallel: for each ep coordinate, so a lost rank of ep2 x dp2 is covered by its expert
  replica).
  Lost work: the step in flight only.
* ``memory`` -- the peer memory tier: the newest step whose per-rank snapshots, kept on other nodes,
  cover every element (see :func:`elastictrain.checkpoint.memory_dcp.coverage`). Lost work <= the
  snapshot interval.
* ``checkpoint`` -- the newest committed durable checkpoint.

If none is viable the run restarts from step 0 (``scratch``), which the caller must announce loudly.
The newest step wins; ties go to the earlier kind above (cheaper, no storage touched). No I/O, no clock:
unit-testable, and the decision's ``reason`` goes into the event log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastictrain.checkpoint.memory_dcp import SnapshotMeta, coverage
from elastictrain.parallel.dims import MeshDims

KINDS = ("peer", "memory", "checkpoint", "scratch")  # also the ``source`` of the ``recovered`` event


@dataclass(frozen=True)
class SourceCandidate:
    kind: str
    step: int
    ranks: tuple[int, ...]  # peer: the survivors to read from (one per (stage, shard coordinate)); else ()
    reason: str


@dataclass(frozen=True)
class SourceDecision:
    """The chosen source (``ranked[0]``), every viable one best first, and the lost completed steps."""

    chosen: SourceCandidate
    ranked: tuple[SourceCandidate, ...]
    lost_steps: int
    reason: str


_NAMED = {"pp": "pipeline stage", "tp": "tp coordinate", "dp_shard": "shard coordinate", "cp": "cp coordinate",
          "ep": "ep coordinate"}
_EVERY = {"pp": "every stage's", "tp": "every tp coordinate's", "cp": "every cp coordinate's",
          "ep": "every ep coordinate's"}


def _peer(dims: MeshDims, survivors: Mapping[int, int]) -> tuple[SourceCandidate | None, str]:
    world = dims.world_size
    inside = bool(survivors) and min(survivors) >= 0 and max(survivors) < world  # (the usual case: no copy)
    alive = survivors if inside else {r: s for r, s in survivors.items() if 0 <= r < world}
    if not alive:
        return None, "no survivor holds state"
    newest = max(alive.values())
    need = dims.holder_keys()
    # holder key (the coordinate on the model and shard axes) -> the lowest survivor holding it; the scan
    # stops once every key has one (a replicated layout: the first newest survivor)
    holders: dict[tuple[int, ...], int] = {}
    newest_ranks = [r for r, s in alive.items() if s == newest]
    if len(need) == 1:  # a replicated layout: the lowest newest survivor, no sort
        holders[need[0]] = min(newest_ranks)
    for r in sorted(newest_ranks) if len(need) > 1 else ():
        holders.setdefault(dims.holder_key(r), r)
        if len(holders) == len(need):
            break
    missing = [k for k in need if k not in holders]
    mesh = " x ".join(f"{n}={dims.size(n)}" for n in dims.axes
                      if n in ("dp_replicate", "dp_shard") or dims.size(n) > 1)
    mesh += f" (ep={dims.ep})" if dims.ep > 1 else ""
    if missing:  # named by the axes the layout has (the shard coordinate always)
        axes = [(i, n) for i, n in enumerate(dims.holder_axes()) if dims.size(n) > 1 or n == "dp_shard"]
        if len(axes) == 1:
            return None, (f"survivors at step {newest} lack shard coordinates {[k[axes[0][0]] for k in missing]} "
                          f"of {dims.dp_shard} (mesh {mesh})")
        lacking = [tuple(k[i] for i, _ in axes) for k in missing]
        return None, (f"survivors at step {newest} lack ({', '.join(_NAMED[n] for _, n in axes)}) {lacking} of "
                      f"{' x '.join(str(dims.size(n)) for _, n in axes)} (mesh {mesh})")
    ranks = tuple(holders[k] for k in need)
    every = " ".join([_EVERY[n] for n in dims.holder_axes() if n in _EVERY and dims.size(n) > 1] + ["every shard"])
    return SourceCandidate("peer", newest, ranks, f"survivors {list(ranks)} hold {every} at step {newest}"), ""


def rank_sources(
    *, dp_replicate: int, dp_shard: int, survivors: Mapping[int, int], memory: Mapping[int, bool],
    durable_step: int | None, last_step: int, storage_asked: bool = True, pp: int = 1, tp: int = 1, cp: int = 1,
    dims: MeshDims | None = None,
) -> SourceDecision:
    """Rank the recovery sources.

    ``survivors``: rank in the failed generation's mesh -> completed steps it holds. ``memory``: step ->
    whether the peer tier's snapshots of that step cover everything. ``durable_step``: newest committed
    checkpoint, or None. ``last_step``: the newest step the group completed (for ``lost_steps``).
    ``storage_asked`` False: storage was not listed (see :func:`storage_needed`), and the reason says so.
    ``pp``: the failed generation's pipeline stages (the outermost mesh axis); ``tp``: its tensor-parallel
    size (the innermost); ``cp`` its context-parallel size. ``dims``: the failed generation's
    :class:`MeshDims` itself (then the sizes above are ignored): a survivor covers the ranks of its
    :meth:`~MeshDims.holder_key` (same coordinate on every model and shard axis). Raises ``ValueError`` on
    mesh dims < 1.
    """
    if dims is None:
        if min(dp_replicate, dp_shard, pp, tp, cp) < 1:
            raise ValueError(f"mesh dims must be >= 1, got pp={pp} dp_replicate={dp_replicate} "
                             f"dp_shard={dp_shard} cp={cp} tp={tp}")
        plan = "ddp" if dp_shard == 1 else "fsdp" if dp_replicate == 1 else "hsdp"
        dims = MeshDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, plan=plan)
    found: list[SourceCandidate] = []
    notes: list[str] = []
    peer, why = _peer(dims, survivors)
    if peer is not None:
        found.append(peer)
    else:
        notes.append(why)
    complete = [s for s, ok in memory.items() if ok]
    if complete:
        step = max(complete)
        found.append(SourceCandidate("memory", step, (), f"the peer memory tier holds a complete snapshot of step {step}"))
    elif memory:
        notes.append(f"the peer memory tier's snapshots (steps {sorted(memory)}) are incomplete")
    else:
        notes.append("the peer memory tier holds no snapshot")
    if durable_step is not None:
        found.append(SourceCandidate("checkpoint", durable_step, (), f"committed checkpoint of step {durable_step}"))
    else:
        notes.append("no committed checkpoint" if storage_asked else "storage not asked")
    found.append(SourceCandidate("scratch", 0, (), "no source holds training state: restart from step 0"))
    ranked = tuple(sorted(found, key=lambda c: (-c.step, KINDS.index(c.kind))))
    chosen = ranked[0]
    lost = max(0, last_step - chosen.step)
    reason = f"{chosen.kind}: {chosen.reason}; lost {lost} completed step(s)"
    if notes and chosen.kind != "peer":
        reason += " (" + "; ".join(notes) + ")"
    return SourceDecision(chosen, ranked, lost, reason)


def storage_needed(decision: SourceDecision, committed_steps: Sequence[int]) -> bool:
    """Whether the durable checkpoint must be looked up, given the ranking without it: only when neither the
    survivors nor the peer memory tier cover the state, or when a checkpoint this run committed (known to
    the driver without I/O) is newer than what they hold. Asking costs a drain of queued commits and a
    listing, which a stalled store turns into seconds of recovery."""
    if decision.chosen.kind in ("peer", "memory"):
        return bool(committed_steps) and max(committed_steps) > decision.chosen.step
    return True


def check_served(metas: Sequence[SnapshotMeta], ranks: Sequence[int], step: int, generation: int) -> str:
    """Pure check of the snapshots live survivors served for a peer restore: ``metas[i]`` must be rank
    ``ranks[i]`` of ``generation`` (the layout the decision described them by) at ``step``, and together
    cover every element. Returns why not, or "" when they are what was asked. A survivor whose runner moved
    on in a failed rendezvous since would otherwise serve another layout's shards or another step."""
    if len(metas) != len(ranks):
        return f"{len(metas)} snapshots served for {len(ranks)} survivors"
    for rank, m in zip(ranks, metas):
        if (m.generation, m.rank, m.step) != (generation, rank, step):
            return (f"the survivor of rank {rank} served generation {m.generation} rank {m.rank} step {m.step}, "
                    f"not generation {generation} rank {rank} step {step}")
    cov = coverage(list(metas))
    return "" if cov.complete else f"the survivors' snapshots do not cover the state: {'; '.join(cov.missing[:3])}"
