"""``parallel.plan: auto`` across resizes: the controller's edge to :func:`.replan.decide`.

A generation's :class:`~elastictrain.parallel.layout.Layout` in, the decision for the next world size out,
with the :class:`~elastictrain.parallel.layout.LayoutSpec` that resolves the chosen layout there (the one
resolver, parallel/layout.py, still answers "which mesh and which accumulation"). The job fixes what a
``Layout`` does not carry: the micro-batch size, activation checkpointing, FSDP's ``reshard_after_forward``
and, with ``parallel.meta_init``, layouts where no rank holds the whole model only (the same rule the
start-time choice keeps, :mod:`.job`). The cluster is the one the start-time choice priced (Ray's figures
with ``parallel.calibration``'s): a resize changes the world size, not the devices' speed or memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from elastictrain.parallel.layout import Layout, LayoutError, LayoutSpec, resolve
from elastictrain.planner import job as planner_job
from elastictrain.planner.job import candidate_of
from elastictrain.planner.inputs import Candidate, Cluster
from elastictrain.planner.replan import Replan, decide
from elastictrain.planner.search import Estimate, evaluate, rank_layouts


@dataclass(frozen=True)
class Replanned:
    """What the next generation runs: the decision (with its reason) and the spec that resolves it."""

    decision: Replan
    spec: LayoutSpec
    layout: Layout
    old: Estimate  # the running layout at its own world size

    def as_event(self) -> dict[str, Any]:
        """The fields of a ``replanned`` event (docs/events.md)."""
        e, dims = self.decision.as_event(), self.layout.dims
        mesh = {**dict(zip(dims.names, dims.shape)), **({"ep": dims.ep} if dims.ep > 1 else {})}  # ep: no mesh axis
        return {**e, "old_world_size": self.old.candidate.world_size, "old_step_s": self.old.time.total_s,
                "old_memory_bytes": int(self.old.memory.total), "mesh": mesh}


def spec_of(c: Candidate, base: LayoutSpec, sharded_only: bool = False) -> LayoutSpec:
    """The :class:`LayoutSpec` whose layout at ``c.world_size`` is ``c`` (batch sizes kept from ``base``)."""
    name = c.layout_name if c.dp > 1 else ("fsdp" if sharded_only else "ddp")
    return replace(base, plan=name, shard_size=c.dp_shard if name == "hsdp" else base.shard_size, pp=c.pp,
                   pp_schedule=c.schedule if c.pp > 1 else base.pp_schedule,
                   stages_per_rank=c.stages_per_rank if c.pp > 1 else None, tp=c.tp,
                   sequence_parallel=base.sequence_parallel if c.tp > 1 else None, cp=c.cp, ep=c.dims.ep)


class Replanner:
    """Decides the layout of each generation formed at another world size (module docstring)."""

    def __init__(self, config: Any, cluster: Cluster, shape: str | None = None) -> None:
        self.config, self.cluster = config, cluster
        self.model, self.train = planner_job.model_shape(config, shape), planner_job.training(config)
        self.sharded_only = config.parallel.meta_init
        p = config.parallel
        self.search = dict(checkpointing=(p.activation_checkpointing,), reshard_after_forward=p.reshard_after_forward,
                           sequence_parallel=p.sequence_parallel is not False)
        self._runs: dict[int, bool] = {}

    def _allowed(self, c: Candidate) -> bool:
        return not self.sharded_only or planner_job.holds_no_whole_model(c)

    def decide(self, old: Layout, spec: LayoutSpec, world: int, steps_left: int) -> Replanned | None:
        """The layout for ``world`` workers after running ``old`` (resolved from ``spec``), or None when no
        runnable layout fits there."""
        was = candidate_of(old, self.config)
        got = decide(self.model, self.train, self.cluster, was, world,
                     max(0, steps_left), allowed=self._allowed, **self.search)
        if got is None:
            return None
        new = spec_of(got.new.candidate, spec, self.sharded_only)
        try:
            layout = resolve(new, world)
        except LayoutError:  # the planner and the resolver disagree on a rule: not run (the caller keeps its spec)
            return None
        return Replanned(got, new, layout, evaluate(self.model, self.train, self.cluster, was))

    def runs_at(self, world: int) -> bool:
        """Whether some runnable layout of the job fits at ``world`` (the membership rule under ``auto``)."""
        if world not in self._runs:
            ranked = rank_layouts(self.model, self.train, self.cluster, world, **self.search) if world > 0 else []
            self._runs[world] = any(e.fits and self._allowed(e.candidate) for e in ranked)
        return self._runs[world]
