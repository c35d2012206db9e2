"""Expert parallelism: each rank of an ep group holds ``E / ep`` experts of every MoE layer and exchanges token
slots with the others by all-to-all.

Layout. An expert tensor ``[E, ...]`` becomes a DTensor ``Shard(0)`` over the 1-D ep mesh: rank ``r`` holds
experts ``[r E/ep, (r+1) E/ep)``. Why a DTensor rather than a plain local slice with its offset on the side:
the global shape and offset then travel with the tensor, so DCP saves it by name and a load under another ep
(ep1 included: a plain full tensor) reshards it; :func:`elastictrain.parallel.init.init_by_name` fills the
slice of the whole seeded value; ``full_tensor()`` gathers it for digests and exports. The forward uses the
local slice (``to_local``, differentiable), so the expert math runs on plain tensors.

Dispatch (per MoE layer, per forward): the token slots, grouped by expert, go to the rank owning the expert
(one ``all_to_all_single`` of the per-expert counts first, so both sides know the uneven split sizes; then a
differentiable ``all_to_all_single`` of the rows), the local experts run on their rows (a loop on CPU), and
the outputs come back by the reverse all-to-all, in slot order. Dropless: every slot is sent, so a token's
output does not depend on ep. Backward: the all-to-all's gradient is the reverse all-to-all.

Gradient rule (:func:`reduce_expert_grads`). Let D be the number of data ranks (every rank of the ep groups
and their replicas splits the batch: D = ep x R, R the expert replicas; under ep x tp the tp ranks of a data
rank split its tokens and join the ep groups, D x tp = ep x R, elastictrain/parallel/expert_tp.py) and the loss
``L = (1/D) sum_d L_d`` (each rank's mean over its samples, the step loop's contract). Dense parameters: as
today, the mean of the D gradients. An expert held by rank r: the backward through the all-to-all already
gives r the SUM over its ep group of ``dL_d/dW`` (each rank's slots that reached the expert), so the exact
gradient is ``(1/D) * sum over the R replicas holding the same slice`` -- an all_reduce(SUM) over the replica
group (the ranks with the same ep coordinate), then a scale by ``1/D``. (With R = 1 there is no replica
group, only the scale.) Under context parallel read D as the data x cp ranks (``D x cp = ep x R``): a cp
rank's gradient is ``cp`` times its partial (parallel/context.py), so the same sum over the replicas
scaled by ``1 / (D x cp)`` is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from elastictrain.models.moe import MoEFeedForward, moe_layers

__all__ = [
    "enable_expert_parallel",
    "expert_parameter_names",
    "expert_replica_mesh",
    "full_state_dict",
    "load_full_state_dict",
    "reduce_expert_grads",
    "step_token_counts",
]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits along dim 0; its gradient is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _Dispatch:
    """The ep dispatcher a :class:`MoEFeedForward` calls with its token slots (see the module docstring).
    ``replica_mesh``: the ranks holding the same experts (the ``edp`` axis of the ``(edp, ep)`` mesh; under
    hsdp the 2-D ``(dp_replicate, efsdp)`` part of ``(dp_replicate, efsdp, ep)``), which an FSDP (HSDP) of
    the experts shards over (:func:`expert_replica_mesh`); None when not given."""

    def __init__(self, group: ProcessGroup, ep: int, replica_mesh: DeviceMesh | None = None) -> None:
        self.group, self.ep, self.replica_mesh = group, ep, replica_mesh

    def __call__(self, layer: MoEFeedForward, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, layer.local_experts
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, so by owner rank
        counts = torch.bincount(slots, minlength=layer.cfg.experts)
        # recv[s, j]: rows rank s sends for my local expert j (the counts split evenly: E/ep per rank)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(ep, local)
        send_splits = counts.view(ep, local).sum(dim=1).tolist()
        recv_splits = recv.sum(dim=1).tolist()
        rows = _AllToAll.apply(tokens[order], recv_splits, send_splits, self.group)
        # the rows arrive by source rank, each source's by local expert: regroup by local expert (stable)
        expert_of_row = torch.arange(local, device=slots.device).repeat(ep).repeat_interleave(recv.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        out = layer.run_experts(rows[regroup], recv.sum(dim=0).tolist())
        out = torch.empty_like(out).index_copy(0, regroup, out)
        back = _AllToAll.apply(out, send_splits, recv_splits, self.group)
        return torch.empty_like(back).index_copy(0, order, back)


def enable_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, replica_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE layer of ``model`` over the 1-D ``ep_mesh`` in place: each rank keeps its
    ``E / ep`` experts as DTensor ``Shard(0)`` parameters (the slice of the values it holds now: a seeded
    whole model, or meta tensors to be filled by name) and dispatches token slots by all-to-all.
    ``replica_mesh`` (the ``edp`` sibling of ``ep_mesh`` in one ``(edp, ep)`` mesh) is kept for an FSDP of
    the experts (:func:`elastictrain.parallel.parallelize.parallelize_fsdp` shards them over it).

    Call before building the optimizer (the expert parameters are replaced). Raises ValueError when
    ``ep_mesh`` is not 1-D, when a layer's expert count is not divisible by the ep degree (naming the valid
    degrees), or when the model is already expert-parallel."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"enable_expert_parallel needs the 1-D ep mesh (mesh['ep']), got {ep_mesh.ndim} dims")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    dispatch = _Dispatch(ep_mesh.get_group(), ep, replica_mesh)
    for name, layer in moe_layers(model).items():
        e = layer.cfg.experts
        if e % ep:
            valid = [d for d in range(1, e + 1) if e % d == 0]
            raise ValueError(f"{name}: {e} experts do not split over parallel.ep={ep} ranks; set parallel.ep to "
                             f"one of {valid} (a divisor of task.model.moe.experts)")
        if layer.dispatch is not None:
            raise ValueError(f"{name} is already expert-parallel (enable_expert_parallel called twice)")
        local = e // ep
        for pname in layer.expert_names:
            whole = getattr(layer, pname)
            part = whole.detach()[rank * local:(rank + 1) * local].clone()
            sharded = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False,
                                         shape=whole.shape, stride=whole.stride())
            setattr(layer, pname, nn.Parameter(sharded, requires_grad=whole.requires_grad))
        layer.expert_offset, layer.local_experts, layer.dispatch = rank * local, local, dispatch


def expert_replica_mesh(layer: MoEFeedForward) -> DeviceMesh | None:
    """The mesh of the ranks holding ``layer``'s experts (its ``edp`` axis), None when ``layer`` is not
    expert-parallel or was made so without one."""
    return getattr(layer.dispatch, "replica_mesh", None)


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Qualified names of the expert parameters (what a DDP over all data ranks must ignore:
    ``DDP._set_params_and_buffers_to_ignore_for_model``; :func:`reduce_expert_grads` reduces them)."""
    return [f"{name}.{p}" if name else p for name, layer in moe_layers(model).items() for p in layer.expert_names]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, replica_group: ProcessGroup | None, scale: float) -> None:
    """Turn each expert gradient into the gradient of the mean loss over the data ranks, in place.

    Call after backward, where the dense gradients are averaged over all data ranks. ``replica_group``: the
    ranks holding the same experts (same ep coordinate, one per ep group), None when there is one ep group;
    ``scale``: ``1 / D``, D the number of data ranks (ep x replicas; the expert ranks data x cp x tp under
    cp or ep x tp). Does all_reduce(SUM) over ``replica_group`` then multiplies by ``scale`` (see the module
    docstring for why this is exact)."""
    for layer in moe_layers(model).values():
        for pname in layer.expert_names:
            grad = getattr(layer, pname).grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if replica_group is not None and dist.get_world_size(replica_group) > 1:
                dist.all_reduce(local, op=dist.ReduceOp.SUM, group=replica_group)
            local.mul_(scale)


def step_token_counts(micro_batches: list[dict[str, torch.Tensor]], group: ProcessGroup | None
                      ) -> dict[str, list[int]]:
    """The step's token slots per expert of each MoE layer, over every data rank: ``micro_batches`` holds
    :func:`elastictrain.models.moe.moe_token_counts` taken after each micro-batch's forward on this rank
    (a recompute under activation checkpointing rewrites the same values), ``group`` the data ranks (None:
    this rank alone). One all_reduce(SUM) of the stacked counts; every rank of ``group`` must call it with
    the same layer names. Returns ``{layer name: [E counts]}`` (what the step event carries)."""
    if not micro_batches:
        return {}
    names = sorted(micro_batches[0])
    total = torch.stack([torch.stack([mb[n] for n in names]) for mb in micro_batches]).sum(dim=0)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return {n: row.tolist() for n, row in zip(names, total, strict=True)}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every expert DTensor gathered whole (a collective over the ep group: every
    ep rank calls it): the state of the one-process model, for digests, exports and comparisons."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a whole-model state (of any ep, e.g. a checkpoint of ep1) into ``model``: each expert DTensor
    takes its rank's rows by global expert index, the rest is copied whole. No collective. Raises KeyError
    naming a missing key."""
    for key, value in model.state_dict().items():
        if key not in state:
            raise KeyError(f"{key} is missing from the state to load")
        if isinstance(value, DTensor):
            local = value.to_local()
            local.copy_(state[key][_local_slices(value)])
        else:
            value.copy_(state[key])


def _local_slices(t: DTensor) -> tuple[slice, ...]:
    """This rank's part of ``t`` as slices of the whole tensor (ep's Shard(0), and FSDP's shard of it
    over the expert replicas under ep x fsdp)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
