"""Re-planning when the world changes size: keep the running layout at the new size, or move to another.
Pure: a decision with its reason, from the planner's estimates (issue 24, "Re-planning a live run").

The rule: a layout that does not fit the new world is never chosen; the running layout's family (its
data-parallel layout and pipeline degree, resolved at the new size: today's whole-group rule) is kept unless
another runnable layout is faster by more than the move costs over the rest of the run. The move is priced
as every device reading its share of the new layout's weights and optimizer state by parameter name
(gradients are not moved) over the slowest link it may cross, plus ``rebuild_s`` (a generation's rebuild:
process groups, the model wrapped again). When the running family cannot run or fit at the new size, the
move is required and the best layout that fits is taken whatever it costs.

The controller asks it through :mod:`.live` (a run under ``parallel.plan: auto``, at every generation
formed at another world size) and emits ``replanned`` with :meth:`Replan.as_event`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from elastictrain.planner.inputs import (OPTIMIZER_BYTES, PRECISIONS, Candidate, Cluster, ModelShape, PlannerInputError,
                                         Training)
from elastictrain.planner.memory import state_params
from elastictrain.planner.search import Estimate, evaluate, rank_layouts, why_invalid


@dataclass(frozen=True)
class Replan:
    """What to run at the new world size and why. ``action``: ``keep`` (the running family at the new size),
    ``switch`` (another layout pays for its move) or ``required`` (the running family cannot run or fit)."""

    action: str
    world_size: int
    old: Candidate
    new: Estimate
    kept: Estimate | None
    move_s: float
    saved_s: float
    reason: str

    @property
    def pays_for_itself(self) -> bool:
        return self.saved_s > self.move_s

    def as_event(self) -> dict[str, Any]:
        """The fields of a ``replanned`` event."""
        return {"action": self.action, "world_size": self.world_size, "old_layout": self.old.describe(),
                "new_layout": self.new.candidate.describe(), "predicted_step_s": self.new.time.total_s,
                "predicted_memory_bytes": int(self.new.memory.total),
                "kept_step_s": self.kept.time.total_s if self.kept else None,
                "kept_memory_bytes": int(self.kept.memory.total) if self.kept else None, "move_s": self.move_s,
                "saved_s": None if math.isinf(self.saved_s) else self.saved_s,  # required: not a saving
                "pays_for_itself": self.pays_for_itself, "reason": self.reason}


def same_family(old: Candidate, world: int, train: Training) -> Candidate | None:
    """The running layout at ``world``: the same pipeline, cp, tp and ep degrees and schedule; all data ranks
    sharded (fsdp), none (ddp), or the same shard size (hsdp). None when ``world`` cannot hold it: not whole
    ``pp x cp x tp`` groups, or an ep that does not divide the new expert ranks (``MeshDims``' rule: ep4 on
    2 ranks is another layout, which the planner must choose, not this family)."""
    per = old.pp * old.cp * old.tp
    if world % per:
        return None
    d = world // per
    shard = {"ddp": 1, "fsdp": d}.get(old.layout_name, old.dp_shard)
    if old.dp == 1:
        shard = 1 if old.dp_shard == 1 else d
    if d % shard:
        return None
    try:
        return old.with_dims(dp_replicate=d // shard, dp_shard=shard)
    except PlannerInputError:  # the mesh's own rule refuses it (ep)
        return None


def move_seconds(model: ModelShape, train: Training, cluster: Cluster, new: Candidate, rebuild_s: float) -> float:
    """Every device reads its share of the new layout's weights and optimizer state (module docstring): the
    state one rank keeps (:func:`.memory.state_params`: its stage over tp, the experts over ep, the whole over
    the FSDP shard group of ``dp_shard x cp``)."""
    w, _, master = PRECISIONS[train.precision]
    state = state_params(model, new) * (w + master + OPTIMIZER_BYTES[train.optimizer])
    bw = cluster.inter_node_bw if cluster.nodes > 1 else cluster.intra_node_bw
    return state / bw + rebuild_s


def decide(model: ModelShape, train: Training, cluster: Cluster, old: Candidate, world: int, steps_left: int,
           *, rebuild_s: float = 2.0, allowed: Callable[[Candidate], bool] | None = None,
           **search: Any) -> Replan | None:
    """The layout for ``world`` devices after a resize (module docstring), or None when nothing runnable
    fits there. ``allowed``: which candidates the job can run at all (e.g. sharded ones only; the running
    family is kept only if allowed too). ``search`` goes to :func:`.search.rank_layouts` (e.g. ``micro_batches``)."""
    ok = allowed or (lambda c: True)
    ranked = [e for e in rank_layouts(model, train, cluster, world, **search) if e.fits and ok(e.candidate)]
    if not ranked:
        return None
    best = ranked[0]
    fam = same_family(old, world, train)
    kept = None
    if fam is not None and ok(fam) and why_invalid(model, train, cluster, fam) is None:
        kept = evaluate(model, train, cluster, fam)
    if kept is None or not kept.fits:
        why = ("cannot run at this size" if kept is None else
               f"does not fit ({kept.memory.total / 2**30:.2f} GiB per device)")
        move = move_seconds(model, train, cluster, best.candidate, rebuild_s)
        return Replan("required", world, old, best, kept, move, math.inf,
                      f"{old.describe()} {why} at world size {world}: {best.candidate.describe()} is the best that "
                      f"fits ({best.time.total_s:.3g} s per step)")
    if best.candidate == kept.candidate or best.time.total_s >= kept.time.total_s:
        return Replan("keep", world, old, kept, kept, 0.0, 0.0,
                      f"{kept.candidate.describe()} is still the best layout at world size {world}")
    move = move_seconds(model, train, cluster, best.candidate, rebuild_s)
    saved = (kept.time.total_s - best.time.total_s) * steps_left
    if saved > move:
        return Replan("switch", world, old, best, kept, move, saved,
                      f"{best.candidate.describe()} saves {saved:.3g} s over the {steps_left} steps left against "
                      f"{kept.candidate.describe()}, more than its move costs ({move:.3g} s)")
    return Replan("keep", world, old, kept, kept, move, saved,
                  f"{best.candidate.describe()} would save {saved:.3g} s over the {steps_left} steps left, less "
                  f"than its move costs ({move:.3g} s): {kept.candidate.describe()} is kept")
