"""Plan resolution: (parallel config, batch sizes, world size) -> mesh dims and gradient accumulation.

Pure functions only (no torch.distributed, no Ray): the ONE place that answers "is world size W valid for
this plan, with which mesh and which accumulation, and which world sizes are valid at all". The config
validator, the controller's membership policy and the worker's step loop all ask it.

Rules, checked together:

* the mesh is ``pp x dp_replicate x dp_shard x cp x tp`` (:class:`~elastictrain.parallel.dims.MeshDims`,
  outermost first). ``W = pp * D * cp * tp`` with ``D = dp_replicate * dp_shard`` the data-parallel size of
  each (pipeline stage, cp, tp coordinate): ``W`` must be a multiple of ``pp * cp * tp`` (a shrink or grow
  moves whole blocks of them); ``parallel.ep`` must divide ``D x cp x tp`` (the expert ranks; a multiple of
  tp under tp; under hsdp dividing ``shard_size x cp x tp``: :func:`ep_rule` for what it composes with);
* ``parallel.plan`` lays out the ``D`` ranks of each stage: ``ddp``: ``dp_replicate = D``; ``fsdp``:
  ``dp_shard = D``; ``hsdp``: ``dp_shard = shard_size`` and ``dp_replicate = D / shard_size`` (``D`` must
  be a positive multiple of ``shard_size``);
* the data rule on ``D`` (see data/cursor.py): ``global_batch % (D * micro_batch) == 0``; then ``accum =
  global_batch // (D * micro_batch)``, which under ``pp > 1`` is the pipeline's ``n_microbatches``;
* under ``pp > 1`` the schedule's own rules on ``n_microbatches`` (torch 2.13,
  ``torch.distributed.pipelining.schedules``): ``1f1b`` needs ``n_microbatches >= pp``; ``interleaved_1f1b``
  and ``zero_bubble`` need ``n_microbatches`` to be a multiple of their round count ``max(1, n // pp)``;
  ``gpipe`` and ``zbv`` take any count (:func:`schedule_rule`).

Rank order is row-major over the axes (tp innermost); which rank holds what is :class:`MeshDims`'s answer
(``coord``, ``rank``, ``group_ranks``, the role queries), asked everywhere, never written out. The sequence
rule of ``cp`` is :func:`cp_rule`; the model's own divisibility rules under ``tp`` (heads, hidden sizes) are
the model's: :func:`tp_rule` for the built-in GPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastictrain.data.cursor import CursorError, check_layout
from elastictrain.parallel.dims import MeshDims  # (re-exported: plan.MeshDims, used by every caller)

PlanName = Literal["ddp", "fsdp", "hsdp"]
PLANS: tuple[str, ...] = ("ddp", "fsdp", "hsdp")
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
# Virtual stages per pp rank that each schedule runs with (torch 2.13): the single-stage schedules exactly 1,
# ZBV exactly 2 (its V shape), the looped ones any count >= 2 (default 2).
_STAGES_DEFAULT = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}

# hsdp's shard group size when parallel.shard_size is unset and workers have no GPUs (CPU tests, laptops):
# two processes per shard group, so that 4 workers give a real 2 x 2 mesh.
CPU_DEFAULT_SHARD_SIZE = 2
# How many world sizes an error lists (the same bound as the data cursor's messages).
_LISTED = 64


class LayoutError(ValueError):
    """A world size (or config) that a plan cannot use; the message lists the usable world sizes."""


@dataclass(frozen=True)
class LayoutSpec:
    """What resolution needs from the config: the plan, hsdp's shard group size and the batch sizes."""

    plan: str
    global_batch: int
    micro_batch: int
    shard_size: int = CPU_DEFAULT_SHARD_SIZE
    pp: int = 1
    pp_schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: what the schedule needs (default_stages_per_rank)
    tp: int = 1
    sequence_parallel: bool | None = None  # None: on when tp > 1
    cp: int = 1
    ep: int = 1


@dataclass(frozen=True)
class Layout:
    """A resolved plan for one generation: mesh dims, gradient accumulation, and why."""

    dims: MeshDims
    accum: int
    reason: str
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1
    sp: bool = False  # parallel.sequence_parallel as resolved (read it through sequence_parallel)

    @property
    def plan(self) -> str:
        return self.dims.plan

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole training state: :attr:`MeshDims.holds_whole_state` (the one
        predicate; any survivor can restore a joiner)."""
        return self.dims.holds_whole_state

    @property
    def n_stages(self) -> int:
        """Virtual pipeline stages in all: ``pp * stages_per_rank`` (1 without pipelining)."""
        return self.dims.pp * self.stages_per_rank if self.dims.pp > 1 else 1

    @property
    def sequence_parallel(self) -> bool:
        """Whether the tensor-parallel plan shards norm and dropout regions on the sequence."""
        return self.dims.tp > 1 and self.sp


def default_stages_per_rank(schedule: str) -> int:
    """The virtual stages per rank a schedule needs when ``parallel.stages_per_rank`` is unset."""
    return _STAGES_DEFAULT.get(schedule, 1)


def stages_rule(schedule: str, stages_per_rank: int | None) -> str | None:
    """Why ``stages_per_rank`` cannot run ``schedule`` (None when it can)."""
    if schedule not in PP_SCHEDULES:
        return f"parallel.pp_schedule={schedule!r} is not one of {list(PP_SCHEDULES)}"
    if stages_per_rank is None:
        return None
    if schedule in ("gpipe", "1f1b") and stages_per_rank != 1:
        return (f"parallel.pp_schedule={schedule} runs exactly 1 stage per rank, got parallel.stages_per_rank="
                f"{stages_per_rank}; unset it, or pick interleaved_1f1b/zero_bubble for more")
    if schedule == "zbv" and stages_per_rank != 2:
        return (f"parallel.pp_schedule=zbv runs exactly 2 stages per rank (its V shape), got "
                f"parallel.stages_per_rank={stages_per_rank}; unset it or set it to 2")
    if schedule in ("interleaved_1f1b", "zero_bubble") and stages_per_rank < 2:
        return (f"parallel.pp_schedule={schedule} is a looped schedule of >= 2 stages per rank, got "
                f"parallel.stages_per_rank={stages_per_rank}; unset it (2) or use pp_schedule=1f1b")
    return None


def schedule_rule(schedule: str, pp: int, n_microbatches: int) -> str | None:
    """Why torch 2.13's ``schedule`` cannot run ``n_microbatches`` micro-batches on ``pp`` ranks (None when
    it can): the checks its constructors make, as a pure function, so that unusable world sizes are listed
    before any worker starts."""
    if pp <= 1:
        return None
    if schedule == "1f1b" and n_microbatches < pp:
        return (f"pp_schedule=1f1b needs at least pp={pp} micro-batches per step, got {n_microbatches} "
                "(global_batch / (data-parallel size x micro_batch))")
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            return (f"pp_schedule={schedule} needs the micro-batches per step ({n_microbatches}) to be a "
                    f"multiple of its rounds max(1, {n_microbatches} // pp={pp}) = {rounds}")
    return None


def effective_shard_size(shard_size: int | None, use_gpu: bool, gpus_per_node: int | None = None) -> int:
    """hsdp's shard group size: the configured one, else the GPUs of a node, else the CPU default."""
    if shard_size is not None:
        return shard_size
    if use_gpu and gpus_per_node:
        return gpus_per_node
    return CPU_DEFAULT_SHARD_SIZE


def _dims(spec: LayoutSpec, world_size: int) -> MeshDims | str:
    """Mesh dims for ``world_size``, or the reason the plan cannot use it."""
    block = {"pp": spec.pp, "cp": spec.cp, "tp": spec.tp}  # the axes a shrink or grow moves whole
    for name, v in (*block.items(), ("ep", spec.ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"parallel.{name} must be a positive int, got {v!r}"
    n = spec.pp * spec.cp * spec.tp
    if world_size % n:
        what = " x ".join(f"{k}={v}" for k, v in block.items() if v > 1)
        groups = [w for k, w in (("pp", "pipelines"), ("cp", "CP groups"), ("tp", "TP groups")) if block[k] > 1]
        whole = "whole " + " of whole ".join(groups)
        return f"{what} needs a multiple of {n} workers ({whole}), got {world_size}"
    d = world_size // n
    if (d * spec.cp * spec.tp) % spec.ep:  # the expert ranks: dp x cp x tp (ep borrows the cp and tp ranks)
        valid = valid_ep(d, spec.tp, spec.cp)
        if spec.tp == 1:
            where = f"the data-parallel size {d}" + (f" x cp={spec.cp}" if spec.cp > 1 else "")
        else:
            where = f"dp x cp x tp = {d} x {spec.cp} x {spec.tp}" if spec.cp > 1 else f"dp x tp = {d} x {spec.tp}"
        return (f"parallel.ep={spec.ep} does not divide {where} (world {world_size} / "
                f"{n}); valid parallel.ep values there: {valid}")
    axes = dict(tp=spec.tp, pp=spec.pp, cp=spec.cp, ep=spec.ep)
    if spec.plan == "ddp":
        return MeshDims(dp_replicate=d, plan="ddp", **axes)
    if spec.plan == "fsdp":
        return MeshDims(dp_shard=d, plan="fsdp", **axes)
    if spec.plan == "hsdp":
        s = spec.shard_size
        if d % s:
            per = (f" data-parallel ranks (world {world_size} / {' / '.join(f'{k}={v}' for k, v in block.items() if v > 1)})"
                   if n > 1 else " workers")
            return f"hsdp needs a multiple of parallel.shard_size={s}{per}, got {d}"
        if s * spec.cp * spec.tp % spec.ep:  # an ep group stays inside one replica: the experts are HSDP too
            valid = valid_ep(s, spec.tp, spec.cp)
            cp = (f" x cp={spec.cp}" if spec.cp > 1 else "") + (f" x tp={spec.tp}" if spec.tp > 1 else "")
            return (f"parallel.ep={spec.ep} under hsdp must divide parallel.shard_size={s}{cp} (an expert-parallel "
                    f"group inside one replica); valid parallel.ep values there: {valid}")
        return MeshDims(dp_replicate=d // s, dp_shard=s, plan="hsdp", **axes)
    return f"parallel.plan={spec.plan!r} is not one of {list(PLANS)}"


def _try(spec: LayoutSpec, world_size: int) -> Layout | str:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return f"world size must be a positive int, got {world_size!r}"
    dims = _dims(spec, world_size)
    if isinstance(dims, str):
        return dims
    not_multiple = (f"train.global_batch={spec.global_batch} is not a multiple of data-parallel size {dims.dp} x "
                    f"train.micro_batch={spec.micro_batch}")
    if isinstance(spec.global_batch, int) and isinstance(spec.micro_batch, int) and spec.micro_batch > 0 \
            and spec.global_batch % (dims.dp * spec.micro_batch):
        # (the rule before check_layout: its error lists every valid size, O(workers.max) for each size the
        # membership decision tries downwards from what is available: ~4 ms of a decision at 10,000 ranks)
        return not_multiple
    try:
        accum = check_layout(spec.global_batch, spec.micro_batch, dims.dp)
    except CursorError:
        return not_multiple
    shape = " x ".join(f"{n}={v}" for n, v in zip(dims.names, dims.shape))
    sp = dims.tp > 1 and spec.sequence_parallel is not False
    tp = f" x tp{' + sp' if sp else ''}" if dims.tp > 1 else ""
    if dims.pp == 1:
        return Layout(dims, accum, f"{spec.plan}{tp} on {world_size} workers: mesh {shape}, accum {accum}", sp=sp)
    bad = stages_rule(spec.pp_schedule, spec.stages_per_rank) or schedule_rule(spec.pp_schedule, dims.pp, accum)
    if bad:
        return bad
    v = spec.stages_per_rank or default_stages_per_rank(spec.pp_schedule)
    return Layout(dims, accum, f"{spec.plan}{tp} x pp on {world_size} workers: mesh {shape}, {spec.pp_schedule} "
                               f"with {dims.pp * v} stages ({v} per rank), {accum} micro-batches",
                  pp_schedule=spec.pp_schedule, stages_per_rank=v, sp=sp)


def valid_world_sizes(spec: LayoutSpec, max_world: int) -> list[int]:
    """Every world size in ``1..max_world`` that ``spec`` can run at, ascending."""
    return [w for w in range(1, max_world + 1) if isinstance(_try(spec, w), Layout)]


def is_valid(spec: LayoutSpec, world_size: int) -> tuple[bool, str]:
    """Whether ``spec`` can run at ``world_size``, with the reason (the layout, or the rule broken)."""
    got = _try(spec, world_size)
    return (True, got.reason) if isinstance(got, Layout) else (False, got)


def resolve(spec: LayoutSpec, world_size: int) -> Layout:
    """The layout of ``spec`` at ``world_size``. Raises :class:`LayoutError` naming the rule broken and
    the usable world sizes."""
    got = _try(spec, world_size)
    if isinstance(got, Layout):
        return got
    usable = valid_world_sizes(spec, _LISTED)
    what = (f"parallel.plan={spec.plan}" + (f", pp={spec.pp} ({spec.pp_schedule})" if spec.pp > 1 else "")
            + "".join(f", {k}={getattr(spec, k)}" for k in ("cp", "tp", "ep") if getattr(spec, k) > 1))
    raise LayoutError(f"{got}; usable world sizes (1..{_LISTED}) for {what}: "
                    f"{usable or 'none'}; change the worker count, the batch sizes or the plan")


def spec_from_config(config: object, gpus_per_node: int | None = None) -> LayoutSpec:
    """The :class:`LayoutSpec` of a ``JobConfig`` (duck-typed to keep this module free of the config)."""
    p, t, w = config.parallel, config.train, config.workers  # type: ignore[attr-defined]
    return LayoutSpec(p.plan, t.global_batch, t.micro_batch,
                    effective_shard_size(p.shard_size, w.use_gpu, gpus_per_node),
                    pp=p.pp, pp_schedule=p.pp_schedule, stages_per_rank=p.stages_per_rank, tp=p.tp,
                    sequence_parallel=p.sequence_parallel, cp=p.cp, ep=p.ep)


def cp_rule(cp: int, seq_len: int) -> str | None:
    """Why ``seq_len`` cannot be split over ``cp`` context-parallel ranks (None when it can): causal load
    balance cuts each sample into ``2 * cp`` chunks (head-tail), so ``seq_len % (2 * cp)`` must be 0. The
    message names the valid ``cp`` values."""
    if cp == 1 or seq_len % (2 * cp) == 0:  # (cp 1 splits nothing: any length)
        return None
    from elastictrain.parallel.context import valid_cp  # the one list of valid degrees (the attention's)

    valid = valid_cp(seq_len)
    return (f"parallel.cp={cp} needs the sequence length to be a multiple of 2 x cp = {2 * cp} (head-tail "
            f"chunks), got seq_len={seq_len}; valid parallel.cp values for it: {valid}")


def valid_ep(dp: int, tp: int, cp: int = 1) -> list[int]:
    """The expert-parallel degrees that run on ``dp`` data ranks of ``cp`` context-parallel ranks of ``tp``
    tensor-parallel ranks each: the divisors of the expert ranks ``dp x cp x tp`` that are multiples of
    ``tp`` (1 included: no ep)."""
    n = dp * cp * tp
    return [1] + [e for e in range(max(2, tp), n + 1) if e % tp == 0 and n % e == 0]


def ep_rule(cp: int, tp: int, ep: int, plan: str = "ddp", pp: int = 1) -> str | None:
    """Why ``ep`` cannot compose with the other axes (None when it can): expert parallel factors the expert
    ranks of each pipeline stage ``dp x cp x tp = edp x ep`` (torchtitan's ``dp_shard x cp x tp = efsdp x
    ep`` with expert tensor parallel degree 1: the experts are not split over tp, the expert group borrows
    the cp ranks (other tokens of the same samples) and the tp ranks, so ``ep`` is a multiple of ``tp``).
    Under ``ddp`` the experts' gradients are summed over their ``edp`` replicas, under ``fsdp`` they are
    FSDP-sharded over them, under ``hsdp`` (``ep`` dividing ``shard_size x cp x tp``) HSDP over
    (``dp_replicate``, ``efsdp``). Under ``pp`` (any schedule) each stage's expert ranks are factored so: a
    stage's experts are sharded over its own ranks (parallel/expert_pipeline.py). Every combination of
    pp, dp (ddp, fsdp, hsdp), cp and tp runs with ep (5D included); what is refused here is an ``ep`` that
    is not a multiple of ``tp`` and a plan other than those three (that ``ep`` divides the expert ranks is
    the resolver's rule, :func:`valid_ep`)."""
    if ep == 1:
        return None
    if tp > 1 and ep % tp:
        valid = [e for e in range(tp, 8 * tp + 1, tp)]
        return (f"parallel.ep={ep} with parallel.tp={tp}: the expert group borrows the tensor-parallel ranks (the "
                f"experts are not split over tp), so ep must be a multiple of tp; valid parallel.ep values with "
                f"tp={tp}: 1 or a multiple of {tp} dividing dp x cp x tp (e.g. {valid}); set parallel.ep to one of "
                "them")
    if plan not in ("ddp", "fsdp", "hsdp"):
        return (f"parallel.ep={ep} with parallel.plan={plan}: expert parallel runs under plan ddp, fsdp or hsdp "
                "(valid with ep > 1: plan ddp, fsdp, hsdp); set parallel.plan=fsdp, or parallel.ep=1")
    return None


def tp_rule(tp: int, sizes: dict[str, int]) -> str | None:
    """Why a model whose ``sizes`` (name -> size of a dimension tensor parallelism splits: attention heads,
    the MLP's hidden size, the vocabulary) cannot be split ``tp`` ways (None when it can); the message
    names the valid ``tp`` values (the common divisors, up to the smallest size)."""
    bad = {n: v for n, v in sizes.items() if v % tp}
    if not bad:
        return None
    valid = [t for t in range(1, min(sizes.values()) + 1) if all(v % t == 0 for v in sizes.values())]
    what = ", ".join(f"{n}={v}" for n, v in bad.items())
    return f"parallel.tp={tp} does not divide {what}; valid parallel.tp values for this model: {valid}"
