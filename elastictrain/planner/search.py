"""Candidate layouts for a world size, each priced by the cost model, ranked best first. Pure.

**What is priced** covers every factor of the cost model (dp_replicate, dp_shard, tp, cp, pp, schedule,
micro-batch size, activation checkpointing; for a mixture-of-experts model every expert-parallel degree
that divides the data-parallel size and the experts). **What may be chosen** to run is the subset the code base
runs: :func:`runnable_axes` (one place; tensor parallel joins when ``parallel.tp`` exists in the job config,
and a new axis is one more name there) and, within them, the combinations :func:`is_runnable` passes (ep's
rules). ``rank_layouts(..., runnable_only=False)`` ranks everything, marking each candidate ``runnable``; it
is also the only search of the runnable axes in :data:`ASKED_AXES` (context parallel: ``elastictrain plan
--all-axes``).

**Pruning** keeps the search to thousands of candidates for 10,000 devices: TP groups stay inside a node
and divide the heads; the pipeline has at most one block per stage and, past that, a degree that divides
the world; among FSDP shard sizes only those that can matter are priced: none (DDP), the smallest that
fits, a node's worth, and all ranks (any other shard size moves as many bytes and fits no better than the
smallest fitting one); micro-batch sizes are the job's (or the divisors given); the zero-bubble schedules
are priced where their closed form holds or the timeline is small (:mod:`.pipeline`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from elastictrain.planner.inputs import Candidate, Cluster, ModelShape, Training
from elastictrain.planner.memory import Memory, memory
from elastictrain.planner.pipeline import SCHEDULES
from elastictrain.planner.steptime import StepTime, microbatches, step_time

# Virtual stages per rank that each schedule is priced with (what elastictrain runs by default).
_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}
_TIMELINE_LIMIT = 64  # pp * micro-batches above which a zero-bubble schedule without closed form is skipped


def runnable_axes() -> frozenset[str]:
    """The mesh axes elastictrain can run today: data parallel (ddp/fsdp/hsdp), pipeline, tensor parallel
    and context parallel (``cp``, with or without pipeline stages). Extend here when an axis
    lands."""
    from elastictrain.config import ParallelConfig

    axes = {"dp_replicate", "dp_shard", "pp"}
    axes.update(a for a in ("tp", "cp") if a in ParallelConfig.model_fields)
    axes.add("ep")  # (under ddp, fsdp or hsdp, a multiple of tp, with any pp, cp and tp: layout.ep_rule)
    return frozenset(axes)


# Axes that are runnable but searched only when every axis is (``elastictrain plan --all-axes``): context
# parallel's K/V traffic is priced, not calibrated yet, and it pays off at sequence lengths whose
# activations do not fit otherwise; ``parallel.plan: auto`` keeps to the other axes until it is.
ASKED_AXES = frozenset({"cp"})


def is_runnable(c: Candidate, axes: frozenset[str], experts: bool = False) -> bool:
    """Whether elastictrain runs ``c`` (``experts``: a mixture-of-experts model, whose tp needs an ep that
    borrows the tp ranks: ``task._check_moe_layout``)."""
    from elastictrain.parallel.layout import ep_rule

    if experts and c.tp > 1 and c.ep == 1:
        return False
    ep_ok = c.ep == 1 or ("ep" in axes and ep_rule(c.cp, c.tp, c.ep, c.layout_name, c.pp) is None)
    return ep_ok and all(getattr(c, axis) == 1 or axis in axes
                         for axis in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))


@dataclass(frozen=True)
class Estimate:
    """One candidate priced: its memory and step time, whether elastictrain runs it, and why not if not."""

    candidate: Candidate
    memory: Memory
    time: StepTime
    n_microbatches: int = 1
    runnable: bool = True

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def as_dict(self) -> dict:
        c, mem, t = self.candidate, self.memory, self.time
        return {
            "layout": c.layout_name, "dp_replicate": c.dp_replicate, "dp_shard": c.dp_shard, "tp": c.tp,
            "ep": c.ep, "cp": c.cp, "pp": c.pp, "schedule": c.schedule if c.pp > 1 else None,
            "stages_per_rank": c.stages_per_rank if c.pp > 1 else None, "micro_batch": c.micro_batch,
            "n_microbatches": self.n_microbatches, "activation_checkpointing": c.activation_checkpointing,
            "memory_per_gpu_bytes": int(mem.total), "fits": mem.fits, "shortfall_bytes": int(mem.shortfall),
            "memory": {k: int(getattr(mem, k)) for k in
                       ("params", "grads", "optimizer", "gathered", "activations", "runtime", "fragmentation")},
            "step_time_s": t.total_s, "compute_s": t.compute_s, "bubble": t.bubble, "tp_comm_s": t.tp_s,
            "ep_comm_s": t.ep_s, "cp_comm_s": t.cp_s, "pp_comm_s": t.pp_s, "dp_comm_s": t.dp_s, "dp_exposed_s": t.dp_exposed_s,
            "optimizer_s": t.optimizer_s,
            "collective_calls": t.calls, "calls_s": t.calls_s, "dispatch_s": t.dispatch_s,
            "dispatch_exposed_s": t.dispatch_exposed_s, "fsdp_host_s": t.fsdp_host_s,
            "fsdp_host_exposed_s": t.fsdp_host_exposed_s, "comm_cpu_s": t.comm_cpu_s, "core_share": t.share,
            "runnable": self.runnable,
        }


def evaluate(model: ModelShape, train: Training, cluster: Cluster, c: Candidate,
             axes: frozenset[str] | None = None) -> Estimate:
    """Price one candidate (no validity check: see :func:`why_invalid`)."""
    axes = runnable_axes() if axes is None else axes
    return Estimate(c, memory(model, train, cluster, c), step_time(model, train, cluster, c),
                    microbatches(train, c), is_runnable(c, axes, bool(model.experts)))


def why_invalid(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> str | None:
    """The rule ``c`` breaks (None when it can run at all): the data rule on the data-parallel size, TP
    dividing the heads, one block per virtual stage at least, the schedule's own micro-batch rule."""
    from elastictrain.parallel.layout import schedule_rule

    if train.global_batch % (c.dp * c.micro_batch):
        return (f"global_batch={train.global_batch} is not a multiple of data-parallel size {c.dp} x "
                f"micro_batch={c.micro_batch}")
    if model.heads % c.tp or model.hidden % c.tp or (model.kv_heads or model.heads) % c.tp:
        return (f"tp={c.tp} does not divide the {model.heads} heads"
                + (f" ({model.kv_heads} kv heads)" if model.kv_heads else "") + f" and hidden size {model.hidden}")
    if c.cp > 1 and model.seq_len % (2 * c.cp):
        return f"cp={c.cp} does not split seq_len={model.seq_len} into 2 x cp head-tail chunks"
    if c.pp > 1 and c.schedule == "zbv" and model.tied_embeddings:
        return "zbv puts the first and the last stage on one rank: tied embeddings there are refused"
    if c.pp > 1 and model.layers < c.pp * c.stages_per_rank:
        return f"{model.layers} blocks cannot fill pp={c.pp} x {c.stages_per_rank} stages"
    if c.pp > 1:
        return schedule_rule(c.schedule, c.pp, microbatches(train, c))
    return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _shard_choices(model: ModelShape, train: Training, cluster: Cluster, base: Candidate) -> list[int]:
    d = base.dp
    divs = _divisors(d)
    fitting = next((s for s in divs if memory(model, train, cluster, _with(base, s)).fits), None)
    per_node = cluster.devices_per_node // base.tp
    picks = {1, d} | ({fitting} if fitting else set()) | ({per_node} if per_node > 1 and d % per_node == 0 else set())
    return sorted(picks)


def _with(c: Candidate, shard: int) -> Candidate:
    """``c`` with its data-parallel ranks laid out as ``dp / shard`` replicas of ``shard``-rank shards."""
    return c.with_dims(dp_replicate=c.dp // shard, dp_shard=shard)


def candidates(model: ModelShape, train: Training, cluster: Cluster, world: int, *,
               micro_batches: Iterable[int] | None = None, schedules: Iterable[str] = SCHEDULES,
               checkpointing: Iterable[bool] = (False, True), axes: frozenset[str] | None = None,
               sequence_parallel: bool = True, reshard_after_forward: bool = True) -> Iterator[Candidate]:
    """Every valid, pruned candidate for ``world`` devices (module docstring). ``axes`` limits the mesh axes
    that may exceed 1 (None: all of them); ``cp`` takes the degrees that split ``seq_len`` in head-tail
    chunks (a mixture-of-experts model's too: its load-balance statistics are summed over cp)."""
    allowed = frozenset(("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")) if axes is None else axes
    for cp in _divisors(world):
        if cp == 1 or ("cp" in allowed and model.seq_len % (2 * cp) == 0):
            yield from _candidates_at_cp(model, train, cluster, world, cp, micro_batches, schedules,
                                         checkpointing, allowed, sequence_parallel, reshard_after_forward)


def _candidates_at_cp(model: ModelShape, train: Training, cluster: Cluster, world: int, cp: int,
                      micro_batches: Iterable[int] | None, schedules: Iterable[str], checkpointing: Iterable[bool],
                      allowed: frozenset[str], sequence_parallel: bool,
                      reshard_after_forward: bool) -> Iterator[Candidate]:
    mbs = sorted(set(micro_batches or [train.micro_batch]))
    for tp in _divisors(world // cp):
        if tp > 1 and ("tp" not in allowed or tp > cluster.devices_per_node or cluster.devices_per_node % tp
                       or model.heads % tp or model.hidden % tp or (model.kv_heads or model.heads) % tp):
            continue
        for pp in _divisors(world // (cp * tp)):
            if pp > 1 and ("pp" not in allowed or pp > model.layers):
                continue
            d = world // (cp * tp * pp)
            for mb in mbs:
                if train.global_batch % (d * mb):
                    continue
                m = train.global_batch // (d * mb)
                for schedule in (schedules if pp > 1 else ("1f1b",)):
                    v = _STAGES[schedule] if pp > 1 else 1
                    if not _schedule_priced(schedule, pp, m, v):
                        continue
                    for ac in checkpointing:
                        base = Candidate(dp_replicate=d, tp=tp, pp=pp, cp=cp, schedule=schedule, stages_per_rank=v,
                                         micro_batch=mb, activation_checkpointing=ac,
                                         sequence_parallel=sequence_parallel,
                                         reshard_after_forward=reshard_after_forward)
                        if why_invalid(model, train, cluster, base):
                            continue
                        for s in _shard_choices(model, train, cluster, base):
                            c = _with(base, s)
                            if (s > 1 and "dp_shard" not in allowed) or (c.dp_replicate > 1
                                                                         and "dp_replicate" not in allowed):
                                continue
                            yield c
                            yield from _with_ep(model, c, allowed)


def _with_ep(model: ModelShape, c: Candidate, allowed: frozenset[str]) -> Iterator[Candidate]:
    """``c`` with each expert-parallel degree > 1 that divides both its expert ranks (data-parallel x cp x
    tp: ep borrows the cp and tp ranks; hsdp: its shard x cp x tp ranks, an ep group inside one replica:
    ``MeshDims``' rule) and the experts."""
    if not model.experts or "ep" not in allowed:
        return
    for ep in _divisors((c.dp_shard if c.layout_name == "hsdp" else c.dp) * c.cp * c.tp):
        if ep > 1 and model.experts % ep == 0:
            yield c.with_dims(ep=ep)


def _schedule_priced(schedule: str, pp: int, m: int, v: int) -> bool:
    if schedule == "zero_bubble" and m < pp or schedule == "zbv" and m < 2 * pp:
        return pp * m <= _TIMELINE_LIMIT
    return True


def rank(estimates: Iterable[Estimate]) -> list[Estimate]:
    """Best first: layouts that fit by step time (ties: less communication, then less memory); then those
    that do not, by shortfall."""
    return sorted(estimates, key=lambda e: (not e.fits, e.time.total_s if e.fits else e.memory.shortfall,
                                            e.time.comm_s, e.memory.total))


def rank_layouts(model: ModelShape, train: Training, cluster: Cluster, world: int | None = None, *,
         runnable_only: bool = True, **options) -> list[Estimate]:
    """Every pruned candidate for ``world`` devices (default: the whole cluster), priced and ranked best
    first. ``runnable_only`` keeps to :func:`runnable_axes` (less :data:`ASKED_AXES`) and to the candidates
    :func:`is_runnable` passes: the axes alone let through combinations the code base refuses (a
    mixture-of-experts model under tp with ep 1, ep with both pp and tp), which ``plan: auto`` and a live
    re-plan must never choose. ``options`` go to :func:`candidates`."""
    world = cluster.devices if world is None else world
    axes = runnable_axes()
    search_axes = axes - ASKED_AXES if runnable_only else None
    priced = (evaluate(model, train, cluster, c, axes)
              for c in candidates(model, train, cluster, world, axes=search_axes, **options))
    return rank(e for e in priced if e.runnable or not runnable_only)
