"""Parallel layouts: plan resolution (pure, :mod:`.plan`), one small ``parallelize_*`` function per layout
(:mod:`.parallelize`), the per-generation mesh (:mod:`.mesh`) and the layout-agnostic training state
(:mod:`.train_state`). The step loop asks the parallelized model, never the plan name."""

from elastictrain.parallel.plan import (
    CPU_DEFAULT_SHARD_SIZE,
    PLANS,
    Layout,
    MeshDims,
    PlanError,
    PlanSpec,
    effective_shard_size,
    is_valid,
    resolve,
    valid_world_sizes,
)

__all__ = [
    "CPU_DEFAULT_SHARD_SIZE",
    "PLANS",
    "Layout",
    "MeshDims",
    "PlanError",
    "PlanSpec",
    "effective_shard_size",
    "is_valid",
    "resolve",
    "valid_world_sizes",
]
