"""PURE: the peer memory tier's per-node keeper budget, sized from the job, and whether it covers a layout.

A keeper holds the snapshots of the ranks of one other node (the keeper ring), ``KEEP_PER_RANK`` steps of
each: one complete step survives while the next step's pushes are in flight. A rank's snapshot is its share
of the training state, so a keeper needs about ``KEEP_PER_RANK * state_bytes * ranks_per_node / world``
(``state_bytes``: the whole training state, what the workers report at setup; ``world``: the parts it is
split into, which under ep are its dense parts, since each expert coordinate's snapshot carries its dense
part whole: ``controller/gather.py``'s ``dense_parts``). Unset,
``checkpoint.memory_budget_gib`` is that need, capped at half the smallest node's free host memory; set, it
is taken as given. When the budget cannot hold one snapshot of every served rank and the layout has no
replica (a lost shard, stage, tp coordinate or, under ep, expert coordinate exists nowhere else:
``controller/gather.py``'s ``every_part_replicated``) and no periodic checkpoint, a loss
restarts from step 0: :func:`tier_shortfall` says so, naming the fix, before the first failure does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastictrain.checkpoint.memory import KEEP_PER_RANK

_GIB = 1 << 30
_MARGIN = 1.1  # progress entries, DCP metadata and uneven shards ride on top of the state's bytes


@dataclass(frozen=True)
class TierBudget:
    """A keeper's budget in bytes, what the job needs, and how the budget was chosen."""

    budget: int
    need: int
    reason: str


def size_budget(state_bytes: int, world: int, ranks_per_node: int, node_free_bytes: int | None,
                configured_gib: float | None) -> TierBudget:
    """The budget of each node's keeper. ``ranks_per_node``: the most ranks on one node;
    ``node_free_bytes``: the smallest node's free host memory (None: unknown)."""
    per_rank = math.ceil(state_bytes / max(1, world))
    need = math.ceil(KEEP_PER_RANK * per_rank * max(1, ranks_per_node) * _MARGIN)
    if configured_gib is not None:
        return TierBudget(max(1, int(configured_gib * _GIB)), need, "checkpoint.memory_budget_gib")
    if node_free_bytes is not None and need > node_free_bytes // 2:
        return TierBudget(max(1, node_free_bytes // 2), need, "half the smallest node's free host memory")
    return TierBudget(max(1, need), need, f"{KEEP_PER_RANK} snapshots of {ranks_per_node} rank(s) of "
                                          f"{per_rank} bytes")


def tier_shortfall(tier: TierBudget, per_rank_bytes: int, ranks_per_node: int, has_replica: bool,
                   periodic_checkpoint: bool) -> str | None:
    """Why the peer tier cannot keep a lost rank's state, with the fix; None when it can, or when a replica
    or a periodic checkpoint covers the loss anyway."""
    if has_replica or periodic_checkpoint:
        return None
    one_step = per_rank_bytes * max(1, ranks_per_node)
    if tier.budget >= one_step:
        return None
    return (f"the peer memory tier keeps {tier.budget} bytes per node ({tier.reason}) but one step of the ranks "
            f"a keeper serves is {one_step} bytes, the layout has no replica and no periodic checkpoint is "
            "configured: losing a rank restarts from step 0; raise checkpoint.memory_budget_gib to "
            f"{math.ceil(KEEP_PER_RANK * one_step * _MARGIN / _GIB * 100) / 100} or more, or set checkpoint.uri "
            "with checkpoint.every_steps > 0")
