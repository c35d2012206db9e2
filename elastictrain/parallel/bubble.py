"""The pipeline bubble: the idle share of a schedule's own timeline, and of a measured step. Pure (no
process group, no clock).

**Timeline.** Each pipeline rank runs its ordered list of actions; an action starts as soon as the rank is
free and its inputs exist, and the bubble is ``1 - busy / (ranks * makespan)``. Actions are
``F`` (forward), ``B`` (full backward), ``I`` (backward for the input only) and ``W`` (backward for the
weights only) of (stage, micro-batch), written as torch writes them: ``"1F0"`` is stage 1's forward of
micro-batch 0. Dependencies (communication is free):

* ``F(s, i)`` after ``F(s-1, i)``;
* ``B/I(s, i)`` after ``B/I(s+1, i)`` and ``F(s, i)`` (the last stage's backward of ``i`` after its
  forward of ``i`` only);
* ``W(s, i)`` after ``I(s, i)``.

Unit costs ``F = 1, B = 2, I = 1, W = 1``: a backward computes two products per matmul where the forward
computes one (the gradient for the input and the gradient for the weight, each about a forward's work), so a
full backward is about twice a forward and its split halves are one each. These are the costs under which
the textbook formulas hold (gpipe/1f1b ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v*m+p-1)``) and under which
the zero-bubble schedules are designed (``T_F = T_B = T_W`` in arXiv:2401.10241). In the looped schedules
every virtual stage's action costs one unit: a rank's ``v`` stages together do what one stage does without
looping, so the unit is ``1/v`` of a non-looped stage's forward, and ratios between schedules at the same
``p`` and ``m`` compare the idle SHARE, which does not depend on the unit. torch's interleaved order meets
its formula for ``m >= p``; with ``m < p`` (one round of ``m`` micro-batches) a loop cannot start before
micro-batch 0 has come round all ``p`` ranks, so its bubble is ``1 - v*m/(v*p + m - 1)``, above the formula.

**Action lists.** :func:`schedule_actions` takes them from torch 2.13's own generation, without a process
group: the schedule classes are built on stand-in stages that carry only what the order generation reads
(stage index, number of stages, group size, group rank). Multi-stage schedules (interleaved_1f1b,
zero_bubble, zbv) give their compute-only ``pipeline_order`` (the runtime executes exactly that order with
communication inserted). Single-stage ones are executed by hand-written loops in ``_step_microbatches``:
gpipe's ``pipeline_order`` matches its loop and is used; 1f1b's ``pipeline_order`` in torch 2.13 labels the
last rank's micro-batches off by one (``1F1 .. 1F4`` for m = 4: its warm-up count is 0 there while the loop
warms up with one forward), so 1f1b's list is generated here from the loop itself (warm-up
``min(m, p - s)`` forwards, then one backward and one forward alternately, then the remaining backwards);
tests/test_pipeline_bubble.py cross-checks it against torch's list on every other rank, and every
schedule's list against the order in which torch calls the stages' forward/backward on a real gloo pair.

**Measured.** :func:`measured_idle` is the same share for a measured step: the part of a rank's wall time in
``schedule.step`` not spent computing, so every caller reports it alike.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
COSTS: dict[str, int] = {"F": 1, "B": 2, "I": 1, "W": 1}
_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


class BubbleError(ValueError):
    """Action lists that cannot run (an action waits forever) or a schedule this module does not know."""


@dataclass(frozen=True)
class Op:
    """One compute action: ``kind`` of micro-batch ``mb`` on stage ``stage``."""

    stage: int
    kind: str  # F, B, I or W
    mb: int

    @classmethod
    def parse(cls, text: str) -> "Op":
        """``"1F0"`` -> ``Op(stage=1, kind="F", mb=0)`` (torch's notation)."""
        match = _ACTION.match(text.strip())
        if match is None:
            raise BubbleError(f"action {text!r} is not <stage><F|B|I|W><micro-batch>, e.g. '1F0'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Slot:
    """An action placed on the timeline: it runs over ``[start, end)`` in cost units."""

    op: Op
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """Every rank's actions placed in time. ``bubble`` is the idle share over all ranks and the makespan."""

    slots: dict[int, tuple[Slot, ...]]

    @property
    def makespan(self) -> int:
        return max((s.end for row in self.slots.values() for s in row), default=0)

    @property
    def busy(self) -> int:
        return sum(s.end - s.start for row in self.slots.values() for s in row)

    @property
    def bubble(self) -> float:
        span = self.makespan * len(self.slots)
        return 1.0 - self.busy / span if span else 0.0

    def rank_idle(self, rank: int) -> float:
        """One rank's idle share of the makespan (what :func:`measured_idle` measures on that rank)."""
        span = self.makespan
        return 1.0 - sum(s.end - s.start for s in self.slots[rank]) / span if span else 0.0


def timeline(actions: Mapping[int, Sequence[Op | str]], num_stages: int | None = None) -> Timeline:
    """Place each rank's ordered actions as early as their dependencies (module docstring) allow.

    ``actions`` maps rank -> its actions in execution order (``Op`` or torch's ``"1F0"`` notation).
    ``num_stages`` defaults to the highest stage index + 1 (the last stage is the one whose backward needs
    only its own forward). Raises :class:`BubbleError` when some action can never start (a missing or
    misordered action), naming each blocked rank's next action.
    """
    ops = {rank: [a if isinstance(a, Op) else Op.parse(a) for a in row] for rank, row in actions.items()}
    for rank, row in ops.items():
        for op in row:
            if op.kind not in COSTS:
                raise BubbleError(f"rank {rank}: action kind {op.kind!r} is not one of {sorted(COSTS)}")
    last = (num_stages if num_stages is not None
            else 1 + max((op.stage for row in ops.values() for op in row), default=0)) - 1
    done: dict[tuple[int, str, int], int] = {}  # (stage, kind, mb) -> end time
    placed: dict[int, list[Slot]] = {rank: [] for rank in ops}
    free = {rank: 0 for rank in ops}
    nxt = {rank: 0 for rank in ops}
    remaining = sum(len(row) for row in ops.values())
    while remaining:
        progressed = False
        for rank in sorted(ops):
            while nxt[rank] < len(ops[rank]):
                op = ops[rank][nxt[rank]]
                ready = _ready_at(op, done, last)
                if ready is None:
                    break
                start = max(free[rank], ready)
                end = start + COSTS[op.kind]
                placed[rank].append(Slot(op, start, end))
                done[(op.stage, "B" if op.kind == "I" else op.kind, op.mb)] = end
                if op.kind == "I":
                    done[(op.stage, "I", op.mb)] = end
                free[rank], nxt[rank] = end, nxt[rank] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"rank {r} at {ops[r][nxt[r]]}" for r in sorted(ops) if nxt[r] < len(ops[r]))
            raise BubbleError(f"the action lists cannot finish: {blocked} wait for an action no rank runs first")
    return Timeline({rank: tuple(row) for rank, row in placed.items()})


def _ready_at(op: Op, done: Mapping[tuple[int, str, int], int], last: int) -> int | None:
    """When ``op``'s inputs exist, or None while one of them has not run yet. ``done`` records a backward
    (full or input-only) of (s, i) under kind "B", and an input-only one also under "I" (what W waits for)."""
    if op.kind == "F":
        deps = [] if op.stage == 0 else [(op.stage - 1, "F", op.mb)]
    elif op.kind in ("B", "I"):
        deps = [(op.stage, "F", op.mb)] + ([] if op.stage == last else [(op.stage + 1, "B", op.mb)])
    else:
        deps = [(op.stage, "I", op.mb)]
    ends = [done.get(dep) for dep in deps]
    if any(end is None for end in ends):
        return None
    return max((end for end in ends if end is not None), default=0)


def schedule_actions(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> dict[int, list[Op]]:
    """Each pipeline rank's compute actions in execution order, from torch's own generation (see the module
    docstring). Raises :class:`BubbleError` for an unknown schedule or a stage count it does not take, and
    torch's own ``ValueError`` for a micro-batch count the schedule refuses."""
    if schedule not in SCHEDULES:
        raise BubbleError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if pp < 1 or n_microbatches < 1 or stages_per_rank < 1:
        raise BubbleError(f"pp, n_microbatches and stages_per_rank must be >= 1, got {pp}, {n_microbatches}, "
                          f"{stages_per_rank}")
    looped = schedule in ("interleaved_1f1b", "zero_bubble", "zbv")
    if not looped and stages_per_rank != 1:
        raise BubbleError(f"{schedule} runs 1 stage per rank, got stages_per_rank={stages_per_rank}")
    if schedule == "zbv" and stages_per_rank != 2:
        raise BubbleError(f"zbv runs exactly 2 stages per rank, got stages_per_rank={stages_per_rank}")
    if schedule == "1f1b":
        return {rank: _one_f_one_b(rank, pp, n_microbatches) for rank in range(pp)}
    return {rank: [_op(a) for a in row if a is not None and _is_compute(a)]
            for rank, row in sorted(torch_pipeline_order(schedule, pp, n_microbatches, stages_per_rank).items())}


def torch_pipeline_order(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> dict[int, list]:
    """torch's ``pipeline_order`` (rank -> list of ``_Action | None``) for the schedule, built on stand-in
    stages (no process group, no module)."""
    from torch.distributed.pipelining import schedules as ts

    n_stages = pp * stages_per_rank

    def stand_in(stage_index: int) -> SimpleNamespace:  # what the order generation reads, nothing more
        return SimpleNamespace(stage_index=stage_index, num_stages=n_stages, group_size=pp, group_rank=0,
                               submod=None, stage_index_to_group_rank=None)

    if schedule in ("gpipe", "1f1b"):
        cls = ts.ScheduleGPipe if schedule == "gpipe" else ts.Schedule1F1B
        order = cls(stand_in(0), n_microbatches).pipeline_order  # type: ignore[arg-type]
    else:
        cls = {"interleaved_1f1b": ts.ScheduleInterleaved1F1B, "zero_bubble": ts.ScheduleInterleavedZeroBubble,
               "zbv": ts.ScheduleZBVZeroBubble}[schedule]
        stages = [stand_in(v * pp) for v in range(stages_per_rank)]  # rank 0's; every rank's order is built
        order = cls(stages, n_microbatches).pipeline_order  # type: ignore[arg-type]
    if order is None:
        raise BubbleError(f"torch's {cls.__name__} gives no pipeline_order")
    return dict(order)


def _is_compute(action: object) -> bool:
    return getattr(getattr(action, "computation_type", None), "value", None) in COSTS


def _op(action: Any) -> Op:
    return Op(int(action.stage_index), str(action.computation_type.value), int(action.microbatch_index))


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Op]:
    """Rank ``rank``'s order as torch 2.13's ``Schedule1F1B._step_microbatches`` runs it."""
    warmup = min(m, pp - rank)
    row = [Op(rank, "F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        row.append(Op(rank, "B", bwd))
        bwd += 1
        if fwd == m:
            break
        row.append(Op(rank, "F", fwd))
        fwd += 1
    row.extend(Op(rank, "B", i) for i in range(bwd, m))
    return row


@functools.lru_cache(maxsize=256)
def schedule_bubble(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """The idle share ``1 - busy / (ranks * makespan)`` of the schedule's own timeline at unit costs
    (module docstring). 0.0 without a pipeline (pp = 1). Cached: the step loop asks once per step."""
    if pp == 1:
        return 0.0
    return timeline(schedule_actions(schedule, pp, n_microbatches, stages_per_rank)).bubble


def formula_bubble(pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """The textbook idle share ``(p-1) / (v*m + p-1)`` (gpipe and 1f1b: v = 1; interleaved 1F1B: v stages
    per rank, arXiv:2104.04473)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def measured_idle(busy_s: float, wall_s: float) -> float:
    """The measured idle share of a step, clamped to [0, 1]: ``1 - busy/wall``; 0.0 for a zero-length step
    (nothing measured)."""
    if wall_s <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - busy_s / wall_s))
