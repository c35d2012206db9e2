"""Expert parallel composed with tensor parallel (ep x tp), torchtitan's expert tensor parallel degree 1.

The dense part of the model (attention, norms, the MoE router) is tensor-parallel as without experts
(:mod:`elastictrain.parallel.tensor`). The experts are NOT split over tp: the expert group borrows the tp
ranks (``dp x tp = edp x ep``, :class:`~elastictrain.parallel.dims.MeshDims`), so before dispatch the MoE
layer's tokens must be disjoint across the tp group -- otherwise every tp rank would send the same tokens to
the experts and each expert would see them tp times. :class:`MoETokenSplit` is the MoE layer's
tensor-parallel style:

* its input is this rank's slice of every sample's positions: under sequence parallel the block's norm
  before it already hands it its sequence shard (``SequenceParallel``, a local tensor); without it the
  replicated ``[B, T, d]`` input is cut here to the rank's ``Shard(1)`` slice (a ``Replicate -> Shard``
  redistribute: no communication forward, an all-gather of the input gradient backward);
* its output, ``[B, T / tp, d]``, stays the sequence shard under sequence parallel (what the dropout region
  after it takes) and is otherwise all-gathered to the replicated ``[B, T, d]`` the residual expects (a
  ``Shard -> Replicate`` redistribute: the backward keeps the rank's slice of the replicated gradient);
* the router is replicated over tp (a DTensor ``Replicate``): each rank routes its own tokens, so its
  weight gradient is a partial sum, summed over tp in backward (:class:`_SplitRouter`), and the layer's
  ``token_group`` sums the load-balancing statistics over tp (and then over cp under cp x tp)
  (:class:`~elastictrain.models.moe.MoEFeedForward`), so the aux loss and the token counts are one process's.

Gradients: the experts as without tp (:func:`elastictrain.parallel.expert.reduce_expert_grads`: summed over
the replicas, scaled by ``1 / dp`` -- the tp ranks of a data rank split one loss's tokens, so their
contributions add); the dense part as tensor parallelism does it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from elastictrain.models.moe import MoEFeedForward

__all__ = ["MoETokenSplit"]

_SEQ = Shard(1)


class MoETokenSplit(ParallelStyle):
    """The tensor-parallel style of a :class:`~elastictrain.models.moe.MoEFeedForward` under ep x tp (see the
    module doc). ``sequence_parallel``: whether the plan shards the sequence around it (then the input and
    output are already this rank's positions; else the style cuts and gathers them)."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MoEFeedForward):
            raise TypeError(f"MoETokenSplit applies to a MoEFeedForward, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"MoETokenSplit needs the 1-D tp mesh, got {device_mesh.ndim} dims")
        router = module.router
        if type(router) is not nn.Linear or router.bias is not None:
            raise TypeError(f"MoETokenSplit expects the MoE router to be a bias-free nn.Linear, got {router}")
        w = router.weight  # (src_data_rank=None: every rank holds the same seeded copy)
        rep = DTensor.from_local(w.detach(), device_mesh, [Replicate()], run_check=False)
        router.weight = nn.Parameter(rep, requires_grad=w.requires_grad)
        # still called as a module (an FSDP unit's hooks gather its weight), on this rank's tokens
        router.__class__ = _SplitRouter
        router.token_group = module.token_group = device_mesh.get_group()
        if not self.sequence_parallel:
            whole: list[torch.Size] = []  # the replicated input's shape, for the gather of the output

            def split(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                x, *rest = args
                whole[:] = [x.shape]
                part = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return (part.redistribute(device_mesh, [_SEQ]).to_local(), *rest)

            def gather(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
                shape = whole[0]
                stride = (shape[1] * shape[2], shape[2], 1)
                part = DTensor.from_local(out, device_mesh, [_SEQ], run_check=False, shape=shape, stride=stride)
                return part.redistribute(device_mesh, [Replicate()]).to_local()

            module.register_forward_pre_hook(split)
            module.register_forward_hook(gather)
        return module


class _SplitRouter(nn.Linear):
    """The MoE router under ep x tp: a weight replicated over the tp ranks (a DTensor), applied to this rank's
    tokens. Each rank's weight gradient is a partial sum over its own tokens: summed over ``token_group`` in
    backward, so the parameter's gradient is the whole one, ``Replicate`` as FSDP2 and the tensor-parallel
    step expect of a replicated weight."""

    token_group: ProcessGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        return F.linear(x, _SumGradOverGroup.apply(local, self.token_group))


class _SumGradOverGroup(torch.autograd.Function):
    """The identity whose backward is all_reduce(SUM) over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None
