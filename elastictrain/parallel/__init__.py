"""Parallel layouts: the mesh as data (pure, :mod:`.dims`), layout resolution (pure, :mod:`.layout`), one small
``parallelize_*`` function per layout (:mod:`.parallelize`), the per-generation mesh (:mod:`.mesh`) and the
layout-agnostic training state (:mod:`.train_state`). The step loop asks the parallelized model, never the
plan name.

The names below are imported on first use: :mod:`.dims` is pure and torch-free, and the planner imports it
without importing torch (plan resolution does, through the data cursor)."""

from typing import Any

__all__ = [
    "CPU_DEFAULT_SHARD_SIZE",
    "PLANS",
    "Layout",
    "MeshDims",
    "LayoutError",
    "LayoutSpec",
    "effective_shard_size",
    "is_valid",
    "resolve",
    "valid_world_sizes",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elastictrain.parallel import layout

        return getattr(layout, name)
    raise AttributeError(f"module 'elastictrain.parallel' has no attribute {name!r}")
