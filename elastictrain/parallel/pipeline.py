"""Pipeline parallelism: this rank's stages, torch's schedule, and the step's micro-batches through it.

:func:`build_pipeline` turns a copy of the whole (meta) model into this pp rank's virtual stages
(``Task.pipeline.stage_fn``; stage ``v`` of ``S = pp * stages_per_rank`` on the rank
:func:`elastictrain.parallel.stages.stage_owner` names, torch's own convention), applies the data-parallel
layout to each stage module on the mesh of that stage's data-parallel ranks (``parallelize_fn``: DDP, or
FSDP2 with ``reshard_after_forward=False`` -- pytorch#164756, torchtitan does the same under pp), wraps
each in a ``PipelineStage`` on the pp group and builds the schedule (``scale_grads=False``).

Data parallelism of plan ``ddp`` inside a stage is not DistributedDataParallel: on torch 2.13, DDP stage
modules under a schedule do not reduce their gradients (measured: pp2 x dp2, the two replicas of a stage
diverge after the first step; ``PipelineStage`` runs every forward under ``no_sync`` and calls the reducer's
``prepare_for_backward`` itself before the last backward). The stage's gradients are instead averaged over
its data-parallel group in one flat all-reduce after ``schedule.step`` (what DDP computes: divide by ``D``,
then sum; :func:`elastictrain.parallel.tensor.average_grads`, on the local shards of DTensor gradients). A ``parallelize_fn`` that returns a DDP module is unwrapped the same way. FSDP2/HSDP stages
reduce-scatter inside the schedule as torch intends (``set_requires_gradient_sync`` per last backward).

:class:`PipelineModel` is a :class:`~elastictrain.parallel.parallelize.ParallelModel`: the step loop calls
the same :meth:`~PipelineModel.run_micro_batches`. The contract:

* the step's accumulation micro-batches ARE the pipeline's micro-batches: every stage of one pipeline
  loads the same samples (same data-parallel rank), the first stage feeds ``inputs_fn(batch)``;
* the per-sample seeds go to EVERY stage as the ``seeds`` keyword (torch passes a schedule's keyword
  arguments to every local stage), so dropout masks depend on (seed, step, sample id, position) only;
* the last stage computes ``loss_fn(output, batch)`` per sample; each micro-batch loss is
  ``sum(per_sample) * D / G``; torch's own grad scaling is off; ranks without the last stage add 0 to the
  (loss, stop) word, which is all-reduced over the whole world;
* phases: a stage's forward/backward computation is ``compute``, everything else (p2p waits) ``collective``,
  so a hung stage rank is the one stuck in ``compute``;
* :class:`StageSet` holds this rank's stage modules under the whole model's names: the optimizer, the
  training state (DCP) and recovery see one module whose keys are a subset of the whole model's;
* under ``parallel.tp > 1`` each stage module is made tensor-parallel on the ``tp`` axis first
  (``parallelize_fn`` gets the stage's submesh, every axis but ``pp``); the pp group links equal tp
  coordinates, so each tp rank sends its local activations to its peer of the next stage; the schedule
  runs inside ``loss_parallel``, gradients are settled to their parameters' placements after it
  (:func:`elastictrain.parallel.tensor.settle_grads`), and only tp coordinate 0 counts samples and losses;
* a tied weight whose uses fall on different stages (an embedding and its tied output head) is one tensor
  held by each stage rank that uses it, under all its names, with its gradient summed over those ranks after
  the schedule and counted once in the clipping norm (:mod:`elastictrain.parallel.tied`: Megatron's
  embedding group);
* under ``parallel.cp > 1`` each stage's attention gathers keys and values over the ``cp`` axis group (the
  cp ranks of the same pp coordinate: each stage talks to its own cp peers), the micro-batches are this
  rank's positions of each sample and the positions go to every stage as the ``positions`` keyword (one
  row per sample: nothing crosses a stage boundary, :mod:`elastictrain.parallel.context` says why), the
  last stage's loss is called with ``cp_group=`` (the whole sample's loss, summed over cp), the stages'
  gradients are averaged over ``dp x cp`` (the flattened group), and only cp coordinate 0 counts samples
  and losses.
* a stage with mixture-of-experts layers runs inside :class:`~elastictrain.parallel.expert_pipeline.MoEStage`:
  its load-balancing losses join its backward and the rank's loss sum, its token counts the step's tally;
  under ``parallel.ep > 1`` each stage's experts are sharded over its own expert ranks (``ep_mesh``) and left
  out of the stage's gradient average (:mod:`elastictrain.parallel.expert_pipeline`);
* ``parallel.mixed_precision: bf16`` on stages without FSDP: each stage's forward runs under
  ``torch.autocast`` and hands on fp32 outputs, so activations cross stages and reach the loss in fp32
  (:class:`elastictrain.parallel.precision.AutocastStage`); FSDP2 stages cast by their own policy.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.nn.parallel import DistributedDataParallel

from elastictrain.parallel.parallelize import (
    LossFn,
    MicroBatch,
    MicroStepResult,
    ParallelModel,
    StepHooks,
    dp_submesh,
    stage_submesh,
)
from elastictrain.models.moe import moe_layers
from elastictrain.parallel.expert import enable_expert_parallel
from elastictrain.parallel.expert_pipeline import MoEStage, StageTokenTally, expert_parameters
from elastictrain.parallel.expert_wiring import expert_replica_submesh
from elastictrain.parallel.layout import Layout
from elastictrain.parallel.precision import AutocastStage, autocast_dtype
from elastictrain.parallel.stages import local_stages
from elastictrain.parallel.tensor import average_grads, local_loss, parallelize_tp, settle_grads, tp_submesh
from elastictrain.parallel.tied import TiedWeights, alias_sources, find_splits

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
_SINGLE = ("gpipe", "1f1b")


class PipelineError(ValueError):
    """A model or hook that cannot run as a pipeline; the message names the problem and the fix."""


class StageSet(nn.Module):
    """This rank's stage modules as one module whose parameters keep the whole model's names.

    Each stage's children are registered here under their own names. A name only one stage has is that
    stage's module itself; a name several stages share (GPT's ``blocks`` ModuleDict, a Hugging Face model's
    ``model`` container holding each stage's slice of ``layers``) becomes a fresh container (``nn.ModuleDict``
    or ``nn.Module``) merged from theirs, level by level, so no stage's own module is changed. A shared name
    whose modules hold no parameters at all (a rotary-embedding helper every stage keeps) is kept once. A
    parameter two stages both hold is an error (every parameter belongs to one stage). Not called: the
    schedule runs the stages. ``before``/``after``: parameter-only trees merged before and after the stages
    (the names a split tied weight lacks on this rank, :func:`elastictrain.parallel.tied.alias_sources`)."""

    def __init__(self, stages: list[nn.Module], before: nn.Module | None = None,
                 after: nn.Module | None = None) -> None:
        super().__init__()
        for stage in stages:  # parameters registered on a stage itself (not on a child) have no name here
            if any(True for _ in stage.parameters(recurse=False)):
                raise PipelineError(f"a stage module ({type(stage).__name__}) holds parameters of its own; keep "
                                    "them on child modules named as in the whole model (Task.pipeline.stage_fn)")
        _merge_children(self, [m for m in (before, *stages, after) if m is not None], "")
        #: state names whose values another rank counts (a split tied weight's copy): left out of the digest
        self.uncounted_names: frozenset[str] = frozenset()


def _merge_children(into: nn.Module, sources: list[nn.Module], path: str) -> None:
    names: dict[str, None] = {}
    for src in sources:
        names.update(dict.fromkeys(src._modules))
    for name in names:
        kids = [src._modules[name] for src in sources if src._modules.get(name) is not None]
        kids = list({id(k): k for k in kids}.values())
        if len(kids) == 1 or not any(True for k in kids for _ in k.parameters()):
            into.add_module(name, kids[0])
            continue
        where = f"{path}{name}"
        if any(True for k in kids for _ in k.parameters(recurse=False)):
            raise PipelineError(f"two pipeline stages both hold the parameters of {where!r}: each parameter must "
                                "belong to one stage (check Task.pipeline.stage_fn)")
        merged = nn.ModuleDict() if isinstance(kids[0], nn.ModuleDict) else nn.Module()
        into.add_module(name, merged)
        _merge_children(merged, kids, where + ".")


class _Clock:
    """Counts this rank's compute time inside ``schedule.step`` and reports the phase to the watchdog."""

    def __init__(self) -> None:
        self.compute_s = 0.0
        self.hooks: StepHooks | None = None
        self.inferring = False  # inside torch's first-step metadata inference (a loss that is not the step's)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.hooks is not None:
            self.hooks.phase("compute")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.compute_s += time.perf_counter() - t0
            if self.hooks is not None:
                self.hooks.phase("collective")


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` whose forward/backward computations are timed and reported as ``compute``."""

    clock: _Clock

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.compute():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.compute():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.clock.compute():
            return super().backward_weight_one_chunk(*args, **kwargs)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # the same first-step inference runs each stage's forward once more: its MoE auxiliary losses and
        # token counts are not the step's either (parallel/expert_pipeline.py)
        self.clock.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.clock.inferring = False

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # torch 2.13 infers the backward's shapes at a schedule's first step by calling loss_fn once on
        # micro-batch 0's output (under fork_rng, no gradient accumulated): that call is not a loss of the
        # step, so the loss sum must not count it (private hook; a torch without it never calls this)
        self.clock.inferring = True
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.clock.inferring = False


class _StageLoss:
    """The schedule's ``loss_fn(output, target)``: ``target`` is a micro-batch's row indices into this step's
    local batch, so the user's ``loss_fn(output, batch)`` sees the micro-batch as collated. Adds each
    micro-batch's per-sample loss sum to the step's total."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor], clock: _Clock) -> None:
        self.loss_fn = loss_fn
        self.clock = clock
        self.batch: dict[str, torch.Tensor] = {}
        self.scale = 1.0
        self.loss_sum: torch.Tensor | None = None
        self.remaining = 0
        self.hooks: StepHooks | None = None
        self.cp_group: Any = None  # context parallel: the loss sums each sample over this group

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        part = {k: v[rows] for k, v in self.batch.items()}
        extra = {} if self.cp_group is None else {"cp_group": self.cp_group}
        with self.clock.compute():  # the last stage's forward includes its loss (the bubble timeline's F)
            per_sample = local_loss(self.loss_fn(output, part, **extra))  # loss_parallel's are DTensors under tp
        if per_sample.shape != rows.shape:
            raise PipelineError(f"Task.pipeline.loss_fn returned shape {tuple(per_sample.shape)} for a micro-batch "
                                f"of {rows.numel()} samples: return the per-sample losses, shape [B]")
        if self.clock.inferring:
            return per_sample.sum() * self.scale
        self.loss_sum += per_sample.detach().sum().double()
        loss = per_sample.sum() * self.scale
        self.remaining -= 1
        if self.remaining == 0 and self.hooks is not None:
            self.hooks.last_loss(loss)
        return loss


class PipelineModel(ParallelModel):
    """This rank's pipeline stages and their schedule, as the step loop sees a parallelized model."""

    def __init__(self, set_: StageSet, modules: list[nn.Module], stages: list[_TimedStage], schedule: Any,
                 loss: _StageLoss, clock: _Clock, mesh: DeviceMesh, layout: Layout,
                 inputs_fn: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 grad_group: Any = None, tied: TiedWeights | None = None,
                 token_tally: StageTokenTally | None = None) -> None:
        super().__init__(set_, mesh)
        self.token_tally = token_tally
        # ep x pp: the experts are not replicated over the stage's dp group (ExpertParallel.reduce_grads)
        experts = expert_parameters(set_) if layout.dims.ep > 1 else set()
        self._averaged = [p for p in set_.parameters() if id(p) not in experts]
        self.tied = tied or TiedWeights([])
        self.clip_uncounted = self.tied.uncounted
        self.grad_group = grad_group  # replicated stages: their gradients are averaged over it after a step
        self.model = set_
        self.modules = modules
        self.stages = stages
        self.schedule = schedule
        self.layout = layout
        self._loss, self._clock, self._inputs_fn = loss, clock, inputs_fn
        self.clip_group = mesh.get_group("pp")
        self.tp_mesh = tp_submesh(mesh)
        tp_first = self.tp_mesh is None or self.tp_mesh.get_local_rank() == 0  # tp peers: same samples, losses
        cp_first = "cp" not in (mesh.mesh_dim_names or ()) or mesh["cp"].get_local_rank() == 0  # cp peers: too
        self.feeds_samples = tp_first and cp_first and any(s.is_first for s in stages)
        self.counts_loss = tp_first and cp_first

    @property
    def grads_in_buckets(self) -> bool:
        return False

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        yield  # the stages defer their own reductions to the last backward (torch's PipelineStage)

    def run_micro_batches(self, n: int, loss_fn: LossFn, scale: float, hooks: StepHooks) -> MicroStepResult:
        """One ``schedule.step`` over this rank's ``n`` micro-batches (the schedule's ``n_microbatches``).
        ``loss_fn`` (the whole model's) is not used: the last stage applies ``Task.pipeline.loss_fn``."""
        if n != self.layout.accum:
            raise RuntimeError(f"{n} micro-batches for a schedule built for {self.layout.accum}")
        hooks.phase("compute")
        mbs = [hooks.load(k) for k in range(n)]
        args, kwargs = self._feed(mbs, scale, hooks)
        if self.token_tally is not None:
            self.token_tally.reset()
        self._clock.compute_s, self._clock.hooks = 0.0, hooks
        hooks.seed(0)  # the global RNG per step (stage forwards run in the schedule's order, not per sample)
        hooks.forwarded(0)
        s0 = time.perf_counter()
        try:
            with loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext():
                self.schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            wall = time.perf_counter() - s0
            self._clock.hooks = self._loss.hooks = None
            self._loss.batch = {}
        hooks.phase("collective")
        loss_sum = self._loss.loss_sum if self.counts_loss else torch.zeros_like(self._loss.loss_sum)
        word = hooks.send(loss_sum)  # async: overlaps the gradient reduction
        if self.tp_mesh is not None:
            settle_grads(list(self.model.parameters()))
        if self.grad_group is not None:
            average_grads(self._averaged, self.grad_group)
        self.tied.sync_grads()  # a tied weight split over stages: the embedding's and the head's gradients summed
        # compute_s counts the stages' forward/backward only, wall_s the schedule.step: their gap is the bubble
        return MicroStepResult(word, self._clock.compute_s, wall, schedule=self.layout.pp_schedule,
                               n_microbatches=n, stages_per_rank=self.layout.stages_per_rank)

    def _feed(self, mbs: list[MicroBatch], scale: float,
              hooks: StepHooks | None) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """The schedule's inputs for ``mbs`` (the first stage's args; ``target``, ``seeds`` and cp's
        ``positions`` as keywords), with the loss set to count them from zero."""
        # cp: every micro-batch holds the same positions (this rank's, [t]); the samples' tensors are [b, ...]
        batch = {k: torch.cat([mb.batch[k] for mb in mbs]) for k in mbs[0].batch if k != "positions"}
        seeds = torch.cat([mb.seeds for mb in mbs]).to(_device(self.model))
        kwargs: dict[str, Any] = {"seeds": seeds}
        if "positions" in mbs[0].batch:  # one row per sample: torch cuts every tensor keyword on dim 0
            kwargs["positions"] = mbs[0].batch["positions"].to(seeds.device).expand(seeds.numel(), -1)
        self._loss.batch, self._loss.scale, self._loss.hooks = batch, scale, hooks
        self._loss.loss_sum = torch.zeros((), dtype=torch.float64, device=seeds.device)
        self._loss.remaining = len(mbs)
        last = any(s.is_last for s in self.stages)
        kwargs["target"] = torch.arange(seeds.numel(), device=seeds.device) if last else None
        args = tuple(self._inputs_fn(batch)) if any(s.is_first for s in self.stages) else ()
        return args, kwargs

    def eval_loss_sum(self, mbs: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        """One forward-only pass of the schedule (torch's ``schedule.eval``: no backward, the stages' p2p
        sends the activations as in training) over ``mbs``, as many as the schedule's ``n_microbatches``
        (the held-out batch splits over the ranks as a step's does). The last stage applies
        ``Task.pipeline.loss_fn`` (``loss_fn``, the whole model's, is not used); its per-sample loss sum, zero
        on other stages and on tp/cp coordinates > 0. Raises :class:`PipelineError` under the zbv schedule,
        which has no forward-only pass in torch 2.13. The schedule re-infers its stages' buffers when it
        switches between eval and training (torch's mode-switch check), a forward's cost each way."""
        if len(mbs) != self.layout.accum:
            raise RuntimeError(f"{len(mbs)} micro-batches for a schedule built for {self.layout.accum}")
        if self.layout.pp_schedule == "zbv":  # (a planned layout: the config refuses an explicit one)
            from elastictrain.config import zbv_eval_refusal

            raise PipelineError(zbv_eval_refusal())
        args, kwargs = self._feed(mbs, 1.0, None)
        try:
            with loss_parallel() if self.tp_mesh is not None else contextlib.nullcontext():
                self.schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            self._loss.batch = {}
        return self._loss.loss_sum if self.counts_loss else torch.zeros_like(self._loss.loss_sum)


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def build_pipeline(model: nn.Module, mesh: DeviceMesh, layout: Layout, rank: int, hooks: Any,
                   parallelize_fn: Callable[[nn.Module, DeviceMesh, Any], nn.Module] | None, plan: Any,
                   device: torch.device,
                   materialize_fn: Callable[[nn.Module, torch.device], None] | None = None,
                   ep_mesh: DeviceMesh | None = None) -> PipelineModel:
    """This rank's stages of ``model`` (a meta or real copy of the whole model that the stages may take
    modules from), parallelized, wrapped in ``PipelineStage`` s on ``mesh["pp"]`` and scheduled.
    ``hooks``: the task's :class:`~elastictrain.task.PipelineHooks`. ``materialize_fn(module, device)``
    gives meta parameters memory after parallelizing (values come from a restore or the seeded init).
    ``parallelize_fn`` None: the default layout (parallel/parallelize.py) without the DDP wrapper (see the
    module doc). ``ep_mesh``: under ``parallel.ep > 1`` the ``(stage, edp, ep)`` mesh (hsdp: ``(stage,
    dp_replicate, efsdp, ep)``; :func:`elastictrain.parallel.expert_pipeline.ep_stage_mesh`) each stage's
    experts are sharded over (``ep``, kept with their replica submesh) before parallelizing. Raises
    :class:`PipelineError` for a task without pipeline hooks, under ``parallel.cp > 1`` for hooks or stage
    modules without the context-parallel hook, and for experts that do not split over ``ep``."""
    from elastictrain.parallel.context import enable_context_parallel, pipeline_cp_refusal
    from elastictrain.parallel.parallelize import parallelize
    from elastictrain.parallel.speed import apply_block_transforms

    if hooks is None:
        raise PipelineError("parallel.pp > 1 needs Task.pipeline (PipelineHooks: how the model splits into "
                            "stages); add it to the task or set parallel.pp=1")
    cp_group = mesh["cp"].get_group() if layout.dims.cp > 1 else None
    if cp_group is not None and (why := pipeline_cp_refusal(hooks)):
        raise PipelineError(why)
    replicas = layout.dims.dp * layout.dims.cp  # the ranks a stage's gradients are averaged over (dp x cp)
    pp, v = layout.dims.pp, layout.stages_per_rank
    n_stages = pp * v
    pp_rank = layout.dims.coord(rank)["pp"]
    pp_group = mesh.get_group("pp")
    dp_mesh = dp_submesh(mesh)
    tp_mesh = tp_submesh(mesh)
    if plan.plan != "ddp" and plan.reshard_after_forward:
        plan = plan.model_copy(update={"reshard_after_forward": False})  # pytorch#164756 (torchtitan: same)
    clock = _Clock()
    loss = _StageLoss(hooks.loss_fn, clock)
    loss.cp_group = cp_group
    # every MoE layer of the whole model (a stage's token counts are padded to them: parallel/expert_pipeline.py)
    moe = {name: layer.cfg.experts for name, layer in moe_layers(model).items()}
    tally = StageTokenTally(moe) if moe else None
    grad_group = None
    modules, stage_modules, stages = [], [], []
    ties = tied_parameters(model)  # before stage_fn: a stage may take the whole model's modules
    for index in local_stages(layout.pp_schedule, pp, n_stages, pp_rank):
        whole = copy.deepcopy(model) if v > 1 else model
        stage_module = hooks.stage_fn(whole, index, n_stages)
        if ep_mesh is not None:  # this stage's experts over its own expert ranks, before any data-parallel wrapper
            try:
                enable_expert_parallel(stage_module, ep_mesh["ep"], expert_replica_submesh(ep_mesh))
            except ValueError as e:
                raise PipelineError(f"{e} (pipeline stage {index})") from None
        if parallelize_fn is None and plan.plan == "ddp":
            if tp_mesh is not None:
                parallelize_tp(stage_module, tp_mesh, plan)
            apply_block_transforms(stage_module, plan)  # float8, checkpointing, compile (parallel/speed.py)
            module = stage_module
            grad_group = dp_mesh.get_group() if replicas > 1 else None
        else:
            module = (parallelize_fn or parallelize)(stage_module, stage_submesh(mesh), plan)
            if tp_mesh is not None and plan.plan == "ddp" and replicas > 1:  # a tp module: no DDP
                grad_group = dp_mesh.get_group()
        if isinstance(module, DistributedDataParallel):  # see the module doc: its reducer does not run here
            grad_group = module.process_group if replicas > 1 else None
            module = module.module
        if materialize_fn is not None:
            materialize_fn(module, device)
        if cp_group is not None:  # this stage's attention gathers K/V over its own pp coordinate's cp ranks
            try:
                enable_context_parallel(module, cp_group)
            except ValueError as e:
                raise PipelineError(f"{e} (pipeline stage {index}: Task.pipeline.stage_fn)") from None
        inner = module
        dtype = autocast_dtype(plan.mixed_precision, module)  # bf16 without FSDP: autocast (parallel/precision.py)
        run = module if dtype is None else AutocastStage(module, dtype, device)
        if tally is not None and moe_layers(module):  # the stage's load-balancing losses join the backward
            run = MoEStage(run, module, loss, clock, tally, last=index == n_stages - 1)
        stage = _TimedStage(run, index, n_stages, device, group=pp_group)
        stage.clock = clock
        modules.append(module)
        stage_modules.append(inner)
        stages.append(stage)
    tied = find_splits(ties, stage_modules, pp_group)
    set_ = StageSet(stage_modules, *alias_sources(tied, stage_modules, model))
    set_.uncounted_names = tied.uncounted_names
    cls = SCHEDULES[layout.pp_schedule]
    if layout.pp_schedule in _SINGLE:
        schedule = cls(stages[0], n_microbatches=layout.accum, loss_fn=loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=layout.accum, loss_fn=loss, scale_grads=False)
    return PipelineModel(set_, modules, stages, schedule, loss, clock, mesh, layout, hooks.inputs_fn, grad_group,
                         tied, tally)


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each tensor the model holds under more than one name (tied weights: an output head that
    is the token embedding)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def gather_full_state(set_: StageSet, rank: int) -> dict[str, torch.Tensor]:
    """The whole model as full CPU tensors on rank 0 (empty elsewhere), gathered from every stage: each
    rank takes its stages' full tensors (all-gathered over its data-parallel ranks under fsdp), then rank 0
    collects every rank's. Collective over the world."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mine = get_model_state_dict(set_, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    mine = {k: v.detach().cpu() for k, v in mine.items()}
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return {}
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, t in part.items():
            full.setdefault(k, t)
    return full


def load_stage_seeded_init(set_: StageSet, build: Callable[[], nn.Module]) -> None:
    """Give this rank's stages the seeded initial values (step 0): ``build()`` (seeded, on the CPU) makes
    the whole model and each stage keeps its own keys, so every stage holds exactly what a non-pipelined
    build would. No collective (stage ranks hold disjoint keys, so rank 0's broadcast of its own keys would
    not cover them); under fsdp each rank cuts its shards from the full values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    wanted = set(get_model_state_dict(set_, options=StateDictOptions(full_state_dict=False)).keys())
    full = {k: v for k, v in build().state_dict().items() if k in wanted}
    missing = wanted - set(full)
    if missing:
        raise PipelineError(f"the stages hold {sorted(missing)[:3]}..., which the whole model does not: a stage "
                            "must keep the whole model's parameter names (Task.pipeline.stage_fn)")
    set_model_state_dict(set_, full, options=StateDictOptions(full_state_dict=True, strict=True))
