"""Plan resolution: (parallel config, batch sizes, world size) -> mesh dims and gradient accumulation.

Pure functions only (no torch.distributed, no Ray): the ONE place that answers "is world size W valid for
this plan, with which mesh and which accumulation, and which world sizes are valid at all". The config
validator, the controller's membership policy and the worker's step loop all ask it.

Rules, checked together:

* the mesh is ``dp_replicate x dp_shard x tp x pp`` with ``tp = pp = 1`` today (the slots exist so that
  tensor and pipeline parallelism add a factor here and nowhere else);
* ``ddp``: ``dp_replicate = W``; ``fsdp``: ``dp_shard = W``; ``hsdp``: ``dp_shard = shard_size`` and
  ``dp_replicate = W / shard_size`` (``W`` must be a positive multiple of ``shard_size``);
* the data rule on the data-parallel size ``D = dp_replicate * dp_shard`` (see data/cursor.py):
  ``global_batch % (D * micro_batch) == 0``; then ``accum = global_batch // (D * micro_batch)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastictrain.data.cursor import CursorError, check_layout

PlanName = Literal["ddp", "fsdp", "hsdp"]
PLANS: tuple[str, ...] = ("ddp", "fsdp", "hsdp")

# hsdp's shard group size when parallel.shard_size is unset and workers have no GPUs (CPU tests, laptops):
# two processes per shard group, so that 4 workers give a real 2 x 2 mesh.
CPU_DEFAULT_SHARD_SIZE = 2
# How many world sizes an error lists (the same bound as the data cursor's messages).
_LISTED = 64


class PlanError(ValueError):
    """A world size (or config) that a plan cannot use; the message lists the usable world sizes."""


@dataclass(frozen=True)
class PlanSpec:
    """What resolution needs from the config: the plan, hsdp's shard group size and the batch sizes."""

    plan: str
    global_batch: int
    micro_batch: int
    shard_size: int = CPU_DEFAULT_SHARD_SIZE


@dataclass(frozen=True)
class MeshDims:
    """Sizes of the mesh axes. ``names``/``shape`` give the DeviceMesh to build (axes of a plan only)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    plan: str = "ddp"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ranks see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def names(self) -> tuple[str, ...]:
        return {"ddp": ("dp_replicate",), "fsdp": ("dp_shard",)}.get(self.plan, ("dp_replicate", "dp_shard"))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.names)


@dataclass(frozen=True)
class Layout:
    """A resolved plan for one generation: mesh dims, gradient accumulation, and why."""

    dims: MeshDims
    accum: int
    reason: str

    @property
    def plan(self) -> str:
        return self.dims.plan

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole training state (no shard axis): any survivor can restore a joiner."""
        return self.dims.dp_shard == 1


def effective_shard_size(shard_size: int | None, use_gpu: bool, gpus_per_node: int | None = None) -> int:
    """hsdp's shard group size: the configured one, else the GPUs of a node, else the CPU default."""
    if shard_size is not None:
        return shard_size
    if use_gpu and gpus_per_node:
        return gpus_per_node
    return CPU_DEFAULT_SHARD_SIZE


def _dims(spec: PlanSpec, world_size: int) -> MeshDims | str:
    """Mesh dims for ``world_size``, or the reason the plan cannot use it."""
    if spec.plan == "ddp":
        return MeshDims(dp_replicate=world_size, plan="ddp")
    if spec.plan == "fsdp":
        return MeshDims(dp_shard=world_size, plan="fsdp")
    if spec.plan == "hsdp":
        s = spec.shard_size
        if world_size % s:
            return f"hsdp needs a multiple of parallel.shard_size={s} workers, got {world_size}"
        return MeshDims(dp_replicate=world_size // s, dp_shard=s, plan="hsdp")
    return f"parallel.plan={spec.plan!r} is not one of {list(PLANS)}"


def _try(spec: PlanSpec, world_size: int) -> Layout | str:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return f"world size must be a positive int, got {world_size!r}"
    dims = _dims(spec, world_size)
    if isinstance(dims, str):
        return dims
    try:
        accum = check_layout(spec.global_batch, spec.micro_batch, dims.dp)
    except CursorError:
        return (f"train.global_batch={spec.global_batch} is not a multiple of data-parallel size {dims.dp} x "
                f"train.micro_batch={spec.micro_batch}")
    shape = " x ".join(f"{n}={v}" for n, v in zip(dims.names, dims.shape))
    return Layout(dims, accum, f"{spec.plan} on {world_size} workers: mesh {shape}, accum {accum}")


def valid_world_sizes(spec: PlanSpec, max_world: int) -> list[int]:
    """Every world size in ``1..max_world`` that ``spec`` can run at, ascending."""
    return [w for w in range(1, max_world + 1) if isinstance(_try(spec, w), Layout)]


def is_valid(spec: PlanSpec, world_size: int) -> tuple[bool, str]:
    """Whether ``spec`` can run at ``world_size``, with the reason (the layout, or the rule broken)."""
    got = _try(spec, world_size)
    return (True, got.reason) if isinstance(got, Layout) else (False, got)


def resolve(spec: PlanSpec, world_size: int) -> Layout:
    """The layout of ``spec`` at ``world_size``. Raises :class:`PlanError` naming the rule broken and
    the usable world sizes."""
    got = _try(spec, world_size)
    if isinstance(got, Layout):
        return got
    usable = valid_world_sizes(spec, _LISTED)
    raise PlanError(f"{got}; usable world sizes (1..{_LISTED}) for parallel.plan={spec.plan}: "
                    f"{usable or 'none'}; change the worker count, the batch sizes or the plan")


def spec_from_config(config: object, gpus_per_node: int | None = None) -> PlanSpec:
    """The :class:`PlanSpec` of a ``JobConfig`` (duck-typed to keep this module free of the config)."""
    p, t, w = config.parallel, config.train, config.workers  # type: ignore[attr-defined]
    return PlanSpec(p.plan, t.global_batch, t.micro_batch,
                    effective_shard_size(p.shard_size, w.use_gpu, gpus_per_node))
