"""Apply a layout to a model: one small function per layout, in torchtitan's shape.

``parallelize(model, mesh, parallel)`` is :class:`~elastictrain.task.Task`'s default ``parallelize_fn``:
under ``parallel.tp > 1`` the model's tensor-parallel plan on the ``tp`` axis first
(:mod:`elastictrain.parallel.tensor`), then float8 linears, activation checkpointing (full or selective)
and ``torch.compile`` on each repeated block as asked (:mod:`elastictrain.parallel.speed`), then DDP, or FSDP2 (``fully_shard`` each repeated block, then the root) on a 1-D (``fsdp``) or 2-D
replicate x shard (``hsdp``) data-parallel mesh (:func:`parallelize_dp`). Under tensor parallelism ``ddp``
is no DDP wrapper: :class:`~elastictrain.parallel.tensor.TensorParallelModel` averages the gradients over
the data-parallel group.

The step loop never asks for the plan name: :func:`wrap` turns whatever a ``parallelize_fn`` returned into
a :class:`ParallelModel`, whose :meth:`~ParallelModel.run_micro_batches` runs one step's micro-batches
(forward, per-sample loss, backward) and whose :meth:`~ParallelModel.accumulating` context defers gradient
reduction for every micro-batch but the last (``no_sync`` for DDP; for FSDP2
``set_requires_all_reduce(False)``: the reduce-scatter still runs so gradients stay sharded, HSDP's replica
all-reduce waits; nothing for a plain module). Under pipeline parallelism
(:class:`elastictrain.parallel.pipeline.PipelineModel`) the same method runs a torch pipeline schedule.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from elastictrain.config import ParallelConfig
from elastictrain.parallel.bubble import measured_idle
from elastictrain.parallel.precision import autocast
from elastictrain.worker.errors import framework_collective


def _is_block_list(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` (or, a pipeline stage's slice of one, an ``nn.ModuleDict``) of children of one class."""
    return (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0
            and len({type(child) for child in module.children()}) == 1)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of every ``nn.ModuleList`` whose children all have one
    class (GPT's ``blocks``, Hugging Face GPT-2's ``transformer.h``), or of an ``nn.ModuleDict`` of one
    class (a pipeline stage's blocks, keyed by their index in the whole model). Outermost lists only."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not _is_block_list(module):
            continue
        found.extend(module.children())
        inside.update(id(m) for child in module.children() for m in child.modules())
    return found


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> None:
    """Recompute each repeated block in backward (:func:`elastictrain.parallel.speed.apply_activation_checkpointing`)."""
    from elastictrain.parallel.speed import apply_activation_checkpointing as apply

    apply(model, mode)


def parallelize_ddp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig) -> nn.Module:
    """Replicate: DistributedDataParallel over the mesh's (only) group. State is assumed equal on every rank
    already (set by the restore step), so DDP's init broadcast is skipped. Gradients are views of DDP's
    reduction buckets (``gradient_as_bucket_view``): no second copy of every gradient
    (docs/perf/2026-11-23-code-figures.md). The step
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


def parallelize_fsdp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig) -> nn.Module:
    """FSDP2: shard each repeated block, then the root (which takes the remaining parameters). A 2-D mesh
    (replicate x shard) gives HSDP. An expert-parallel model's experts first, over their own replicas
    (:func:`shard_experts`). bf16: bf16 parameters in forward/backward, fp32 gradient reduction and
    fp32 master parameters / optimizer state.

    ``parallel.reshard_after_forward`` (ZeRO-3) frees every block's gathered parameters after its forward except
    the last block's and the root's: backward starts with them, so freeing them would only gather them again
    at once (torchtitan's default; FSDP2's own rule for the root). Two all-gathers fewer per micro-batch, for
    one block's parameters held through the loss."""
    mp = MixedPrecisionPolicy()
    if parallel.mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_experts(model, mesh, mp, reshard=parallel.reshard_after_forward)
    blocks = repeated_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward and i < len(blocks) - 1,
                    mp_policy=mp)
    # None: FSDP2 keeps the root's parameters gathered from forward to backward (an explicit True would not)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if parallel.reshard_after_forward else False, mp_policy=mp)
    return model


def shard_experts(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """ep x fsdp/hsdp (torchtitan's rule): each expert-parallel MoE layer's experts FSDP-sharded over the ranks
    that hold the same experts (its ``edp`` mesh; under hsdp the 2-D ``(dp_replicate, efsdp)`` mesh: HSDP,
    replicated over the replicas, sharded over the rest of the shard ranks), its router over ``mesh`` (all
    data ranks, as the rest of the model). Nothing for a model without expert-parallel layers. Call before
    the blocks' ``fully_shard``.

    Shard dim 1 of the stacked ``[E, ...]`` experts (torchtitan's choice when ``edp x ep`` may exceed E):
    dim 0 is already ep's, so each rank holds ``1 / (ep x edp)`` of every expert tensor as plain
    ``Shard`` placements (no ``_StridedShard`` for DCP to map). Gradients: a rank's expert gradient already
    sums its ep group's tokens (the all-to-all's backward), so the edp reduce-scatter SUMS and divides by
    the number of data ranks ``D = mesh.size()`` (x cp under cp: the ranks the dense gradients are averaged
    over), not by ``edp`` (``set_gradient_divide_factor``; under hsdp the factor covers the reduce-scatter
    over ``efsdp`` and the SUM all-reduce over ``dp_replicate`` together): the gradient of the mean loss, as
    ddp's :func:`~elastictrain.parallel.expert.reduce_expert_grads`. gloo has no PREMUL_SUM, so there the
    divide is a separate op after a SUM (not when the shard dim is one rank: torch 2.13's FSDP2 then divides
    the copied gradient by the factor AND post-divides it again). Raises ValueError when a layer is
    expert-parallel without a replica mesh (made so by hand, not by
    :func:`~elastictrain.parallel.expert_wiring.attach_expert_parallel`)."""
    from torch.distributed.tensor import Shard

    from elastictrain.models.moe import moe_layers
    from elastictrain.parallel.expert import expert_replica_mesh

    for name, layer in moe_layers(model).items():
        if layer.dispatch is None:
            continue
        edp = expert_replica_mesh(layer)
        if edp is None:
            raise ValueError(f"{name} is expert-parallel without a replica (edp) mesh: make the model expert-"
                             "parallel with elastictrain.parallel.expert_wiring.attach_expert_parallel before "
                             "an FSDP plan shards it")
        fully_shard(layer.router, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(layer, mesh=edp, reshard_after_forward=reshard, mp_policy=mp,
                    shard_placement_fn=lambda _p: Shard(1))
        layer.set_gradient_divide_factor(float(mesh.size()))
        if mesh.device_type == "cpu" and edp.size(edp.ndim - 1) > 1:  # (over one rank torch 2.13 divides twice)
            layer.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig) -> nn.Module:
    """The default ``Task.parallelize_fn``: tensor parallelism (a mesh with a ``tp`` axis: the model's
    ``tp_plan``), then :func:`parallelize_dp`."""
    from elastictrain.parallel.tensor import parallelize_tp, tp_submesh

    tp_mesh = tp_submesh(mesh)
    if tp_mesh is not None:
        parallelize_tp(model, tp_mesh, parallel)
    return parallelize_dp(model, mesh, parallel)


def parallelize_dp(model: nn.Module, mesh: DeviceMesh, parallel: ParallelConfig) -> nn.Module:
    """float8, activation checkpointing and compile on each repeated block
    (:func:`elastictrain.parallel.speed.apply_block_transforms`), then DDP or FSDP2/HSDP on the data-parallel
    axes of ``mesh``. A mesh with a
    ``tp`` axis (the model already tensor-parallel): fsdp/hsdp shard on the data-parallel submesh (FSDP2 +
    TP), and ddp returns the module unwrapped (DDP does not take DTensor parameters;
    :class:`~elastictrain.parallel.tensor.TensorParallelModel` averages its gradients). For a
    ``parallelize_fn`` that applies its own tensor-parallel plan and then the usual data-parallel layout."""
    from elastictrain.parallel.speed import apply_block_transforms

    tensor_parallel = "tp" in (mesh.mesh_dim_names or ())
    mesh = dp_submesh(mesh)
    apply_block_transforms(model, parallel)  # float8, activation checkpointing, compile (parallel/speed.py)
    if parallel.plan == "ddp":
        return model if tensor_parallel else parallelize_ddp(model, mesh, parallel)
    return parallelize_fsdp(model, mesh, parallel)


@dataclass
class MicroBatch:
    """One collated micro-batch of this rank, with the per-sample seeds of its samples."""

    ids: list[int]
    batch: dict[str, torch.Tensor]
    seeds: torch.Tensor


class StepHooks(Protocol):
    """What the step loop lends :meth:`ParallelModel.run_micro_batches`: the data, and the points where it
    tracks phases (for the watchdog), reseeds the global RNG, injects faults and sends the (loss, stop)
    word. Observers of the step, except :meth:`send`, which starts the step's one reduction."""

    def load(self, k: int) -> MicroBatch: ...
    def phase(self, name: str) -> None: ...  # "compute" | "collective"
    def seed(self, k: int) -> None: ...  # global RNG for micro-batch k, right before its forward
    def forwarded(self, k: int) -> None: ...  # after micro-batch k's forward: delays, the mid_step fault
    def last_loss(self, loss: torch.Tensor) -> None: ...  # the last backward's loss (the backward fault)
    def send(self, loss_sum: torch.Tensor) -> Any: ...  # the (loss, stop) word; returns a handle with wait()


@dataclass
class MicroStepResult:
    """What :meth:`ParallelModel.run_micro_batches` did: the (loss, stop) word's handle (``wait()`` returns
    it summed over the world) and this rank's compute time; ``wall_s`` is the whole call (a pipeline's:
    its ``schedule.step``, so that ``idle_share`` is the rank's measured bubble). Pipeline fields
    (``schedule``, ``n_microbatches``) are None without pipelining."""

    word: Any
    compute_s: float
    wall_s: float
    schedule: str | None = None
    n_microbatches: int | None = None
    stages_per_rank: int | None = None

    @property
    def idle_share(self) -> float:
        """This rank's share of the call not spent computing: under a pipeline, its measured bubble
        (:func:`elastictrain.parallel.bubble.measured_idle`, as every report of it)."""
        return measured_idle(self.compute_s, self.wall_s)


LossFn = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


class ParallelModel:
    """A parallelized model as the step loop sees it: :meth:`run_micro_batches` runs a step's micro-batches
    (or call :attr:`module` and enter :meth:`accumulating` for micro-batches whose gradients must stay
    local); read state through :attr:`model` (never the wrapper)."""

    #: the process group over which the gradient norm of :attr:`model`'s parameters is summed on top of the
    #: mesh's own sharded dims (pipeline stages: the pp group); None: the parameters are the whole model
    clip_group: Any = None
    #: parameters whose gradient the norm leaves out here because another rank counts it (a tied weight's
    #: copy on a later pipeline stage, parallel/tied.py); still clipped
    clip_uncounted: tuple[torch.Tensor, ...] = ()
    #: whether this rank feeds samples of its own to the step (False on a pipeline's later stages, whose
    #: samples the first stage's rank already counts, and on tp coordinates > 0): the sample-id audit
    #: counts each sample once
    feeds_samples: bool = True
    #: whether this rank's per-sample losses go into the (loss, stop) word (False on tp coordinates > 0,
    #: which compute the same losses as coordinate 0): the word counts each sample's loss once
    counts_loss: bool = True
    #: the dtype the step's forward and loss run under ``torch.autocast`` in (bf16 without FSDP,
    #: :mod:`elastictrain.parallel.precision`); None: as the parameters are
    autocast_dtype: torch.dtype | None = None
    #: a pipeline's MoE token counts, taken inside its schedule (parallel/expert_pipeline.py); None: the step
    #: loop takes them after each micro-batch's forward
    token_tally: Any = None

    def __init__(self, module: nn.Module, mesh: DeviceMesh | None) -> None:
        self.module = module
        self.mesh = mesh
        self.model = module.module if isinstance(module, DistributedDataParallel) else module

    def run_micro_batches(self, n: int, loss_fn: LossFn, scale: float, hooks: StepHooks) -> MicroStepResult:
        """Forward and backward ``n`` micro-batches (``hooks.load(k)``); each micro-batch's loss is
        ``sum(loss_fn(module, batch, seeds)) * scale``. Gradients are reduced over the data-parallel ranks
        with the last backward, which overlaps the (loss, stop) word's reduction (sent with this rank's
        per-sample loss sum, float64). With :attr:`autocast_dtype` set, ``loss_fn`` runs under
        ``torch.autocast`` and its per-sample losses are taken in fp32 (parallel/precision.py)."""
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=_device_of(self.model))
        compute_s, word = 0.0, None
        for k in range(n):
            hooks.phase("compute")
            c0 = time.perf_counter()
            mb = hooks.load(k)
            last = k == n - 1
            with contextlib.nullcontext() if last else self.accumulating():
                hooks.seed(k)
                with autocast(self.autocast_dtype, loss_sum.device):
                    per_sample = loss_fn(self.module, mb.batch, mb.seeds)
                if self.autocast_dtype is not None and per_sample.dtype.itemsize < 4:  # bf16 losses count in fp32
                    per_sample = per_sample.float()
                loss_sum += per_sample.detach().sum().double()
                hooks.forwarded(k)
                if last:  # the last backward overlaps DDP's all-reduce: not purely local work
                    compute_s += time.perf_counter() - c0
                    hooks.phase("collective")
                    # Loss and stop flag travel together: inside DDP's last gradient bucket (step_stats.py), or
                    # an async all-reduce overlapped with the last backward under other layouts.
                    word = hooks.send(loss_sum if self.counts_loss else torch.zeros_like(loss_sum))
                loss = per_sample.sum() * scale
                if last:
                    hooks.last_loss(loss)
                    with framework_collective():  # DDP's all-reduce fails out of this backward's C++
                        loss.backward()
                else:
                    loss.backward()
            if not last:
                compute_s += time.perf_counter() - c0
        return MicroStepResult(word, compute_s, time.perf_counter() - t0)

    def eval_loss_sum(self, mbs: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        """Forward only (the caller holds ``torch.no_grad`` and ``eval()`` mode): the float64 sum of
        ``loss_fn``'s per-sample losses over ``mbs`` (this rank's micro-batches of one held-out global batch),
        under :attr:`autocast_dtype` as in training; zero on a rank that does not count losses
        (:attr:`counts_loss`: tp or cp coordinates > 0, whose losses coordinate 0 already counts), so one sum
        over the world counts every sample once. Collective where the forward is (tp, cp, fsdp)."""
        total = torch.zeros((), dtype=torch.float64, device=_device_of(self.model))
        for mb in mbs:
            with autocast(self.autocast_dtype, total.device):
                total += loss_fn(self.module, mb.batch, mb.seeds).double().sum()
        return total if self.counts_loss else torch.zeros_like(total)

    @property
    def grads_in_buckets(self) -> bool:
        """Gradients live in the wrapper's reduction buckets (DDP's ``gradient_as_bucket_view``): zero them in
        place after a step (``zero_grad(set_to_none=False)``); setting them to None would free the views
        and make the next backward allocate every gradient again beside the buckets."""
        return isinstance(self.module, DistributedDataParallel) and bool(getattr(self.module, "gradient_as_bucket_view", False))

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


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def dp_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh`` (every axis but ``pp`` and ``tp``): what gradients are averaged
    and FSDP shards over. Under cp, the data axis and ``cp`` flattened into one
    (:func:`elastictrain.parallel.context_wiring.dp_cp_submesh`: the cp ranks of a data rank join its group)."""
    from elastictrain.parallel.context_wiring import dp_cp_submesh

    flat = dp_cp_submesh(mesh)
    return _submesh(mesh, ("pp", "tp")) if flat is None else flat


def stage_submesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every axis of ``mesh`` but ``pp``: what ``parallelize_fn`` gets per pipeline stage module."""
    return _submesh(mesh, ("pp",))


def _submesh(mesh: DeviceMesh, drop: tuple[str, ...]) -> DeviceMesh:
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n not in drop)
    return mesh[names] if names != tuple(mesh.mesh_dim_names or ()) else mesh


def _has_dtensor(model: nn.Module) -> bool:  # (the step loop checks a whole-state layout with it)
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def wrap(module: Any, mesh: DeviceMesh | None) -> ParallelModel:
    """A :class:`ParallelModel` around what a ``parallelize_fn`` returned."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        from elastictrain.parallel.tensor import TensorParallelModel

        return TensorParallelModel(module, mesh)
    return ParallelModel(module, mesh)
