"""Tensor (and sequence) parallelism: the model's plan on the mesh's ``tp`` axis, and the step under it.

:func:`parallelize_tp` applies a model's tensor-parallel plan (``model.tp_plan(sequence_parallel)``, a
``parallelize_module`` plan: the built-in GPT's is :mod:`elastictrain.models.gpt_tp`) on the ``tp`` submesh;
the default ``parallelize_fn`` (:func:`elastictrain.parallel.parallelize.parallelize`) calls it first, then
lays out the data-parallel axes (torchtitan's order: TP, activation checkpointing, FSDP). A user's model
without ``tp_plan`` brings its own through ``Task.parallelize_fn``.

:class:`TensorParallelModel` is the :class:`~elastictrain.parallel.parallelize.ParallelModel` of a mesh with
a ``tp`` axis. Its step runs inside ``loss_parallel`` (the head's logits are sharded on the vocabulary and
the cross-entropy is computed on the shards: torch 2.13's ``loss_parallel`` supports ``reduction="none"``,
the per-sample losses come back replicated over ``tp``). The contract with the step loop:

* every tp rank of one data-parallel rank loads the same samples and computes the same per-sample losses;
  only tp coordinate 0 adds them to the (loss, stop) word (``counts_loss``) and to the audit
  (``feeds_samples``), so each sample counts once;
* under ``parallel.plan=ddp`` there is no DistributedDataParallel (it does not take DTensor parameters):
  the gradients are averaged over the data-parallel group in one flat all-reduce of the local shards after
  the last backward (DDP's math), as pipeline stages do; fsdp/hsdp shard on the data-parallel submesh
  (FSDP2 + TP, 2-D parameters) and reduce inside backward. An expert-parallel model's experts (ep x tp,
  :mod:`elastictrain.parallel.expert_tp`) are left out of that average: they are not replicated over the
  data-parallel ranks, and the step loop reduces them over their replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from elastictrain.parallel.parallelize import (
    LossFn,
    MicroBatch,
    MicroStepResult,
    ParallelModel,
    StepHooks,
    dp_submesh,
)


class TensorParallelError(ValueError):
    """A model that cannot run tensor-parallel; the message names the fix."""


def tp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``tp`` axis of ``mesh`` (None without tensor parallelism)."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"]


def sequence_parallel_on(plan: Any) -> bool:
    """``parallel.sequence_parallel`` as resolved: None means on (it is read only where ``tp > 1``)."""
    return getattr(plan, "sequence_parallel", None) is not False


def parallelize_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Any) -> nn.Module:
    """Apply ``model.tp_plan(sequence_parallel)`` on ``tp_mesh`` (in place; parameters become DTensors
    sharded or replicated on ``tp``), then ``model.tie_weights()`` where the model has one (a tied weight's
styles must give it one placement). Raises :class:`TensorParallelError` for a model without a plan."""
    make = getattr(model, "tp_plan", None)
    if not callable(make):
        raise TensorParallelError(
            f"parallel.tp > 1 needs a tensor-parallel plan for {type(model).__name__}: give the model a "
            "tp_plan(sequence_parallel) method returning a parallelize_module plan, or apply one in "
            "Task.parallelize_fn (see examples/tp_llama.py); or set parallel.tp=1")
    # src_data_rank=None: each rank splits its own copy, no scatter. Every rank's model is the same seeded
    # init (or a meta rebuild a restore fills), and a collective here would pair a fresh joiner's real
    # tensors with a survivor's meta rebuild, which sends nothing: the joiner waits out the timeout
    module = parallelize_module(model, tp_mesh, make(sequence_parallel_on(plan)), src_data_rank=None)
    # each style distributes its module's weight on its own: a tied head (the built-in Llama's) got a copy
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return module


def local_loss(per_sample: torch.Tensor) -> torch.Tensor:
    """Per-sample losses as a plain tensor: ``loss_parallel``'s are replicated DTensors over ``tp``
    (``to_local`` keeps the autograd graph)."""
    return per_sample.to_local() if isinstance(per_sample, DTensor) else per_sample


@torch.no_grad()
def settle_grads(params: list[torch.Tensor]) -> None:
    """Give every DTensor gradient its parameter's placements, as FSDP2 does before its reduce-scatter.

    Autograd leaves a gradient with the placements its last op produced: ``Partial`` for a parameter
    replicated over ``tp`` whose input was sharded (a sequence-parallel norm: each rank's positions give a
    partial sum), ``Replicate`` for the vocabulary-parallel embedding's table. The optimizer and the
    data-parallel average run on local tensors, so the pending sums are done here: every ``Partial -> Replicate``
    gradient of one mesh in one flat all-reduce over its ``tp`` group, the rest (local slices) by
    ``redistribute``."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    pending: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if not isinstance(p, DTensor) or not isinstance(g, DTensor) or g.placements == p.placements:
            continue
        if g.device_mesh.ndim == 1 and g.placements[0].is_partial("sum") and p.placements[0].is_replicate():
            pending.setdefault(g.device_mesh, []).append(p)
        else:
            p.grad = g.redistribute(p.device_mesh, p.placements)
    for mesh, group in pending.items():
        locals_ = [p.grad.to_local() for p in group]
        flat = _flatten_dense_tensors(locals_)
        dist.all_reduce(flat, group=mesh.get_group())
        for p, reduced in zip(group, _unflatten_dense_tensors(flat, locals_)):
            p.grad = DTensor.from_local(reduced, mesh, p.placements, run_check=False)


def average_grads(params: list[torch.Tensor], group: Any) -> None:
    """Average the gradients of ``params`` over ``group`` in one flat all-reduce of their local tensors
    (DDP's math: each rank divides by the group size, then the sum). DTensor gradients are averaged on
    their local shards: the ranks of ``group`` hold the same shard of each."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads).div_(dist.get_world_size(group))
    dist.all_reduce(flat, group=group)
    for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(reduced)


class TensorParallelModel(ParallelModel):
    """A model parallelized over a mesh with a ``tp`` axis, as the step loop sees it (see the module doc)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__(module, mesh)
        self.tp_mesh = tp_submesh(mesh)
        self.feeds_samples = self.counts_loss = self.tp_mesh.get_local_rank() == 0
        dp_mesh = dp_submesh(mesh)
        # fsdp/hsdp reduce in backward; a plain (ddp-plan) module's gradients are averaged after the step's
        # last backward over the data-parallel ranks holding the same tp shard
        replicated_dp = not isinstance(self.model, FSDPModule) and not isinstance(module, DistributedDataParallel)
        self.grad_group = dp_mesh.get_group() if replicated_dp and dp_mesh.size() > 1 else None
        # ep x tp: the experts are not replicated over dp; ExpertParallel.reduce_grads reduces them
        from elastictrain.parallel.expert import expert_parameter_names

        experts = set(expert_parameter_names(self.model))
        self.dense = [p for n, p in self.model.named_parameters() if n not in experts]
        if isinstance(module, DistributedDataParallel):
            raise TensorParallelError("parallel.tp > 1: parallelize_fn returned DistributedDataParallel, which does "
                                      "not take DTensor parameters; return the tensor-parallel module itself "
                                      "(its gradients are averaged over the data-parallel ranks) or use fsdp")

    def run_micro_batches(self, n: int, loss_fn: LossFn, scale: float, hooks: StepHooks) -> MicroStepResult:
        """The base step inside ``loss_parallel``, with the per-sample losses made local; then the
        data-parallel gradient average (plan ddp)."""
        with loss_parallel():
            done = super().run_micro_batches(n, _local(loss_fn), scale, hooks)
        settle_grads(list(self.model.parameters()))
        if self.grad_group is not None:
            average_grads(self.dense, self.grad_group)
        return done

    def eval_loss_sum(self, mbs: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        """The base forward-only sum inside ``loss_parallel``: every tp rank runs the forward together (its
        collectives), tp coordinate 0 counts the (replicated) per-sample losses."""
        with loss_parallel():
            return super().eval_loss_sum(mbs, _local(loss_fn))


def _local(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with its per-sample losses made plain tensors (:func:`local_loss`)."""

    def tp_loss(module: nn.Module, batch: dict[str, torch.Tensor], seeds: torch.Tensor) -> torch.Tensor:
        return local_loss(loss_fn(module, batch, seeds))

    return tp_loss
