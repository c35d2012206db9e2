"""Apply a layout to a model: one small function per layout, in torchtitan's shape.

``parallelize(model, mesh, plan)`` is :class:`~elastictrain.task.Task`'s default ``parallelize_fn``:
activation checkpointing (if asked) on each repeated block, then DDP, or FSDP2 (``fully_shard`` each
repeated block, then the root) on a 1-D (``fsdp``) or 2-D replicate x shard (``hsdp``) mesh.

The step loop never asks for the plan name: :func:`wrap` turns whatever a ``parallelize_fn`` returned into
a :class:`ParallelModel`, whose :meth:`~ParallelModel.accumulating` context defers gradient reduction for
every micro-batch but the last (``no_sync`` for DDP; for FSDP2 ``set_requires_all_reduce(False)``: the
reduce-scatter still runs so gradients stay sharded, HSDP's replica all-reduce waits; nothing for a plain
module).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from elastictrain.config import ParallelConfig


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of every ``nn.ModuleList`` whose children all have one
    class (GPT's ``blocks``, Hugging Face GPT-2's ``transformer.h``). Outermost lists only."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) == 1:
            found.extend(module)
            inside.update(id(m) for child in module for m in child.modules())
    return found


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each repeated block in backward (the block's forward must be deterministic: the built-in
    GPT's dropout draws from per-sample seeded generators, so it is). State-dict names are unchanged
    through torch.distributed.checkpoint.state_dict, which strips the wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    for parent in list(model.modules()):
        if isinstance(parent, nn.ModuleList) and len(parent) and len({type(c) for c in parent}) == 1:
            for i, block in enumerate(list(parent)):
                if not isinstance(block, CheckpointWrapper):  # a kept (DDP) model is re-parallelized
                    parent[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def parallelize_ddp(model: nn.Module, mesh: DeviceMesh, plan: ParallelConfig) -> nn.Module:
    """Replicate: DistributedDataParallel over the mesh's (only) group. State is assumed equal on every rank
    already (set by the restore step), so DDP's init broadcast is skipped. Gradients are views of DDP's
    reduction buckets (``gradient_as_bucket_view``): no second copy of every gradient (measured on the
    25M-parameter GPT of ``benchmarks/parallel.py``: peak 793 MiB per process instead of 890). The step
    loop zeroes them in place rather than dropping them (:attr:`ParallelModel.grads_in_buckets`), or each
    step's first backward would allocate them afresh beside the buckets."""
    device = next(model.parameters()).device
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=mesh.get_group(), init_sync=False,
                                   gradient_as_bucket_view=True, **_NO_FORWARD_BUFFER_SYNC)


# No buffer broadcast before each forward: torch 2.13 names it forward_sync_buffers (broadcast_buffers is
# deprecated there); earlier releases (2.6 - 2.12, e.g. 2.11 on the GPU machine) know only broadcast_buffers.
_NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                           else {"broadcast_buffers": False})


def parallelize_fsdp(model: nn.Module, mesh: DeviceMesh, plan: ParallelConfig) -> nn.Module:
    """FSDP2: shard each repeated block, then the root (which takes the remaining parameters). A 2-D mesh
    (replicate x shard) gives HSDP. bf16: bf16 parameters in forward/backward, fp32 gradient reduction and
    fp32 master parameters / optimizer state.

    ``plan.reshard_after_forward`` (ZeRO-3) frees every block's gathered parameters after its forward except
    the last block's and the root's: backward starts with them, so freeing them would only gather them again
    at once (torchtitan's default; FSDP2's own rule for the root). Two all-gathers fewer per micro-batch, for
    one block's parameters held through the loss."""
    mp = MixedPrecisionPolicy()
    if plan.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = repeated_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=plan.reshard_after_forward and i < len(blocks) - 1,
                    mp_policy=mp)
    # None: FSDP2 keeps the root's parameters gathered from forward to backward (an explicit True would not)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if plan.reshard_after_forward else False, mp_policy=mp)
    return model


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ParallelConfig) -> nn.Module:
    """The default ``Task.parallelize_fn``: activation checkpointing, then DDP or FSDP2/HSDP by the mesh."""
    if plan.activation_checkpointing:
        apply_activation_checkpointing(model)
    if plan.plan == "ddp":
        return parallelize_ddp(model, mesh, plan)
    return parallelize_fsdp(model, mesh, plan)


class ParallelModel:
    """A parallelized model as the step loop sees it: call :attr:`module`, enter :meth:`accumulating` for
    micro-batches whose gradients must stay local, read state through :attr:`model` (never the wrapper)."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh | None) -> None:
        self.module = module
        self.mesh = mesh
        self.model = module.module if isinstance(module, DistributedDataParallel) else module

    @property
    def grads_in_buckets(self) -> bool:
        """Gradients live in the wrapper's reduction buckets (DDP's ``gradient_as_bucket_view``): zero them in
        place after a step (``zero_grad(set_to_none=False)``); setting them to None would free the views
        and make the next backward allocate every gradient again beside the buckets."""
        return isinstance(self.module, DistributedDataParallel) and bool(getattr(self.module, "gradient_as_bucket_view", False))

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole state (not sharded): a peer's copy is anyone's copy."""
        return not isinstance(self.model, FSDPModule) and not _has_dtensor(self.model)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradients of the backward passes inside stay on this rank (reduced by the next synced one)."""
        if isinstance(self.module, DistributedDataParallel):
            with self.module.no_sync():
                yield
        elif isinstance(self.model, FSDPModule):
            # FSDP2 still reduce-scatters every micro-batch so gradients stay sharded: skipping it
            # (set_requires_gradient_sync(False)) would hold the whole model's unsharded gradients across
            # micro-batches, more than DDP's memory. What is deferred is HSDP's all-reduce across replicas.
            self.model.set_requires_all_reduce(False)
            try:
                yield
            finally:
                self.model.set_requires_all_reduce(True)
        else:
            yield


def _has_dtensor(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def wrap(module: Any, mesh: DeviceMesh | None) -> ParallelModel:
    """A :class:`ParallelModel` around what a ``parallelize_fn`` returned."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
    return ParallelModel(module, mesh)
