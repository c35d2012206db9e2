"""Expert parallelism in the step loop: the ep mesh of a generation, the model made expert-parallel before
its data-parallel wrapper, the expert gradients reduced after the backward, and the router's token counts.

The ep math is :mod:`elastictrain.parallel.expert`; this module only wires it, one function per concern:

* :func:`attach_expert_parallel` (in ``StepRunner.attach``, before ``parallelize_fn``): the data x cp ranks
  factored as ``(edp, ep)``, ep innermost (:meth:`MeshDims.ep_group_ranks` gives the rows; under ``hsdp``
  the edp part split again as ``(dp_replicate, efsdp)``), built per generation over the current default
  group like the other axes (parallel/mesh.py); the model's experts sharded over ``mesh["ep"]`` (a meta
  model's stay meta: ``StepRunner.attach`` then gives the dense part and this rank's experts memory before
  DDP wraps it); DDP told to ignore them (they are not replicated: their gradients are reduced by
  :meth:`ExpertParallel.reduce_grads`, over ``mesh["edp"]``).
* :meth:`ExpertParallel.reduce_grads` (after the last backward, before the clip, inside the framework's
  collective phase): under ``ddp``. Under ``fsdp`` (ep x fsdp, torchtitan's composition) the plan's
  ``fully_shard`` shards the experts over ``mesh["edp"]`` and the dense part over every data rank
  (:func:`elastictrain.parallel.parallelize.shard_experts`); under ``hsdp`` over the 2-D
  ``(dp_replicate, efsdp)`` replica mesh (HSDP for the experts too); FSDP's reduce-scatter (and HSDP's
  all-reduce) reduces the expert gradients: ``reduce_grads`` does nothing.
* :class:`TokenTally` (after each micro-batch's forward) and :meth:`TokenTally.total` (once a step): the
  per-expert token slots of every MoE layer over the data ranks, for the ``step`` event.

Supported: ``parallel.plan`` ``ddp``, ``fsdp`` or ``hsdp``, any ``cp`` and ``pp``, and ``tp`` dividing ``ep``
(ep x tp: the expert group borrows the tp ranks, :mod:`elastictrain.parallel.expert_tp`), in any combination
(5D included; :func:`elastictrain.parallel.layout.ep_rule` refuses the rest at config time). Without pp the
expert ranks (``dp x cp x tp``) are the world; under pp each stage's expert ranks are factored the same way
(:func:`ep_mesh_layout` with a leading ``stage`` dimension) and the pipeline wires them
(:func:`elastictrain.parallel.expert_pipeline.stage_expert_parallel`).
Under cp an ep group may span cp ranks: they hold other tokens of the same samples, and a token's expert
output depends on the token alone; the gradient scale is ``1 / (D x cp)``, the mean over the ranks the
dense gradients are averaged over (cp ranks' gradients are ``cp`` x partial, parallel/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from elastictrain.models.moe import moe_layers, moe_token_counts
from elastictrain.parallel.dims import MeshDims
from elastictrain.parallel.expert import (
    enable_expert_parallel,
    expert_parameter_names,
    reduce_expert_grads,
    step_token_counts,
)

__all__ = ["ExpertParallel", "TokenTally", "attach_expert_parallel", "ep_mesh_layout", "ep_mesh_rows",
           "expert_replica_submesh"]


def ep_mesh_rows(dims: MeshDims) -> list[list[int]]:
    """The ``(edp, ep)`` mesh as rows of ranks: one row per ep group (the ranks that exchange tokens),
    ordered by their first rank; column ``j`` holds the ranks of ep coordinate ``j`` (expert replicas)."""
    firsts = sorted({dims.ep_group_ranks(r)[0] for r in range(dims.world_size)})
    return [dims.ep_group_ranks(r) for r in firsts]


def ep_mesh_layout(dims: MeshDims) -> tuple[list, tuple[str, ...]]:
    """The expert mesh of ``dims`` as nested rank lists and its axis names: ``(edp, ep)`` (ddp, fsdp), or
    under ``hsdp`` ``(dp_replicate, efsdp, ep)``: the rows of :func:`ep_mesh_rows` grouped by replica
    (an ep group never leaves one, ``MeshDims``' rule), ``efsdp = dp_shard x cp x tp / ep``. Under
    ``pp > 1`` a leading ``stage`` dimension: one block per pipeline coordinate (an ep group never leaves
    one either), the same factoring over each stage's ranks."""
    rows, names = ep_mesh_rows(dims), ("edp", "ep")
    if dims.plan == "hsdp":  # (rows in rank order: pp, then dp_replicate, outermost)
        rows, names = _chunks(rows, dims.pp * dims.dp_replicate), ("dp_replicate", "efsdp", "ep")
    if dims.pp > 1:
        rows, names = _chunks(rows, dims.pp), ("stage", *names)
    return rows, names


def _chunks(items: list, n: int) -> list[list]:
    """``items`` cut into ``n`` consecutive parts of equal length."""
    per = len(items) // n
    return [items[i * per:(i + 1) * per] for i in range(n)]


def expert_replica_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding the same experts in an expert mesh of :func:`ep_mesh_layout`: ``edp``, or under
    hsdp the 2-D ``(dp_replicate, efsdp)`` (what an FSDP/HSDP of the experts shards over)."""
    names = mesh.mesh_dim_names or ()
    return mesh[("dp_replicate", "efsdp")] if "efsdp" in names else mesh["edp"]


@dataclass
class ExpertParallel:
    """A generation's expert-parallel wiring: its expert mesh (:func:`ep_mesh_layout`), the gradient scale
    ``1 / (D x cp)`` and whether FSDP reduces the expert gradients (ep x fsdp/hsdp) or :meth:`reduce_grads`
    does (ddp)."""

    mesh: DeviceMesh
    scale: float
    fsdp: bool = False

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh["ep"]

    @property
    def replica_mesh(self) -> DeviceMesh:
        """The ranks holding the same experts: ``edp``, or under hsdp the 2-D ``(dp_replicate, efsdp)``."""
        return expert_replica_submesh(self.mesh)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts (None with one ep group: nothing to reduce over). ddp's 1-D
        ``edp`` (under hsdp the 2-D replica mesh is FSDP's: nothing reduces through this)."""
        if "edp" not in (self.mesh.mesh_dim_names or ()):
            return None
        edp = self.mesh["edp"]  # (the ``(edp, ep)`` mesh, or ep x pp's ``(stage, edp, ep)``: this stage's)
        return edp.get_group() if edp.size() > 1 else None

    def reduce_grads(self, model: nn.Module) -> None:
        """Expert gradients -> those of the mean loss over the data ranks (collective over the replicas):
        :func:`elastictrain.parallel.expert.reduce_expert_grads`. Call after the last backward. Nothing
        under ep x fsdp: FSDP's reduce-scatter over ``edp`` already did it (divided by D)."""
        if not self.fsdp:
            reduce_expert_grads(model, self.replica_group, self.scale)


def attach_expert_parallel(model: nn.Module, dims: MeshDims, device: torch.device) -> ExpertParallel | None:
    """Make ``model`` (plain, not yet wrapped) expert-parallel for ``dims``; None when ``dims.ep == 1``.

    Collective over the default group (builds the expert mesh of :func:`ep_mesh_layout`: every rank calls
    it, in the same order relative to other group creations). Shards every MoE layer's experts over
    ``mesh["ep"]`` (the slice of the values the model holds now), keeps the replica mesh
    (:attr:`ExpertParallel.replica_mesh`) on each layer for an FSDP/HSDP plan to shard the experts over,
    and, under ddp, marks them for a DistributedDataParallel to ignore. Raises
    ValueError when the model has no MoE layer or its expert count does not divide by ``ep``."""
    if dims.ep == 1:
        return None
    if not moe_layers(model):
        raise ValueError(f"parallel.ep={dims.ep} needs a mixture-of-experts model (no MoEFeedForward layer "
                         "found); set task.model.moe or parallel.ep=1")
    ranks, names = ep_mesh_layout(dims)
    mesh = DeviceMesh(device.type, torch.tensor(ranks, dtype=torch.int), mesh_dim_names=names)
    wiring = ExpertParallel(mesh, 1.0 / (dims.dp * dims.cp), dims.plan in ("fsdp", "hsdp"))
    enable_expert_parallel(model, mesh["ep"], wiring.replica_mesh)
    if not wiring.fsdp:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))
    return wiring


@dataclass
class TokenTally:
    """One step's per-expert token counts of this rank, taken after each micro-batch's forward."""

    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def add(self, model: nn.Module) -> None:
        counts = moe_token_counts(model)
        if counts:
            self.parts.append(dict(counts))

    def total(self, group: dist.ProcessGroup | None, copies: int = 1) -> dict[str, list[int]] | None:
        """``{layer: [slots per expert]}`` summed over ``group`` (the data ranks; one all-reduce, every
        rank of it calls this), None without MoE layers. ``copies``: how many ranks of ``group`` hold
        each data rank's counts (ep x tp: its tp ranks, whose layers sum the counts over tp), divided out."""
        got = step_token_counts(self.parts, group) or None
        return got if got is None or copies == 1 else {n: [c // copies for c in v] for n, v in got.items()}
