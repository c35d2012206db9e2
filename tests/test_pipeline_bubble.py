"""The pipeline bubble (elastictrain/parallel/bubble.py): the idle share of a schedule's own timeline at unit
costs, from torch's own action lists, against the textbook formulas and a timeline worked out by hand; and
the measured idle share every step event reports. Pure: no process group."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from elastictrain.parallel.bubble import (
    BubbleError,
    Op,
    formula_bubble,
    measured_idle,
    schedule_actions,
    schedule_bubble,
    timeline,
    torch_pipeline_order,
)

GRID = [(p, m) for p in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12, 16)]


def _exact(p: int, m: int, v: int) -> Fraction:
    return Fraction(p - 1, v * m + p - 1)


def test_two_ranks_by_hand():
    """gpipe's shape on 2 ranks, m = 2, worked out on paper: rank 1 idles 1 unit at the start (waiting for
    0F0) and 2 at the end; rank 0 idles 3 units between its forwards and its first backward (1F1 ends at 3,
    1B0 at 5)."""
    line = timeline({0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]})
    assert [(str(s.op), s.start, s.end) for s in line.slots[0]] == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]
    assert [(str(s.op), s.start, s.end) for s in line.slots[1]] == [
        ("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)]
    assert (line.makespan, line.busy) == (9, 12)
    assert line.bubble == pytest.approx(1 - 12 / 18)
    assert line.rank_idle(0) == pytest.approx(3 / 9) and line.rank_idle(1) == pytest.approx(3 / 9)


def test_split_backward_by_hand():
    """I/W: a W waits only for its own I, so rank 1's weight gradients run while rank 0 computes its input
    gradients; rank 0's I1 waits for rank 1's I1 (ends at 5), not for rank 1's W."""
    line = timeline({0: ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"],
                     1: ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]})
    assert [(str(s.op), s.start) for s in line.slots[1]] == [
        ("1F0", 1), ("1I0", 2), ("1F1", 3), ("1I1", 4), ("1W0", 5), ("1W1", 6)]
    assert [(str(s.op), s.start) for s in line.slots[0]] == [
        ("0F0", 0), ("0F1", 1), ("0I0", 3), ("0W0", 4), ("0I1", 5), ("0W1", 6)]
    assert (line.makespan, line.busy) == (7, 12)
    assert line.bubble == pytest.approx(1 - 12 / 14)


def test_lists_that_cannot_finish_are_refused():
    with pytest.raises(BubbleError, match=r"rank 1 at 1B0"):
        timeline({0: ["0F0", "0B0"], 1: ["1B0", "1F0"]})  # 1B0 needs 1F0, which rank 1 runs after it
    with pytest.raises(BubbleError, match=r"rank 0 at 0W0"):
        timeline({0: ["0F0", "0B0", "0W0"]})  # a weight backward after a FULL backward: no I to wait for
    with pytest.raises(BubbleError, match=r"'0X0' is not <stage><F\|B\|I\|W><micro-batch>"):
        timeline({0: ["0X0"]})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_match_the_formula(schedule):
    for p, m in GRID:
        if schedule == "1f1b" and m < p:
            continue  # torch's Schedule1F1B refuses m < p
        line = timeline(schedule_actions(schedule, p, m, 1))
        assert Fraction(line.busy, line.makespan * p) == 1 - _exact(p, m, 1), (p, m)
        assert schedule_bubble(schedule, p, m, 1) == pytest.approx(formula_bubble(p, m))


def test_1f1b_order_is_torch_loop_and_torch_ir_elsewhere():
    """1f1b's list follows ``Schedule1F1B._step_microbatches``; torch 2.13's ``pipeline_order`` gives the same
    list on every rank but the last, where it numbers the forwards from 1 (its warm-up count is 0 there, the
    loop's is 1): taken as is, that list would wait forever for ``F0``."""
    for p, m in [(2, 4), (3, 3), (3, 8), (4, 8)]:
        ours = schedule_actions("1f1b", p, m, 1)
        torch_ir = {r: [Op(a.stage_index, a.computation_type.value, a.microbatch_index) for a in row
                        if a is not None and a.computation_type.value in "FB"]
                    for r, row in torch_pipeline_order("1f1b", p, m, 1).items()}
        for rank in range(p - 1):
            assert ours[rank] == torch_ir[rank], (p, m, rank)
        last = p - 1
        assert [o.kind for o in ours[last]] == [o.kind for o in torch_ir[last]]
        assert [o.mb for o in ours[last] if o.kind == "B"] == [o.mb for o in torch_ir[last] if o.kind == "B"]
        assert [o.mb + 1 for o in ours[last] if o.kind == "F"] == [o.mb for o in torch_ir[last] if o.kind == "F"]
        with pytest.raises(BubbleError):
            timeline(torch_ir)


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_matches_its_formula_from_one_round_up(v):
    """``(p-1)/(v*m + p-1)`` holds for m >= p. With m < p (one round of m micro-batches) no loop can start
    before micro-batch 0 has come round all p ranks, so the makespan is ``3(v*p + m - 1)`` units, not
    ``3(v*m + p - 1)``: the bubble is ``1 - v*m/(v*p + m - 1)``, above the formula by that much (e.g. p = 4,
    m = 2, v = 2: 5/9 against 3/7)."""
    for p, m in GRID:
        if m % max(1, m // p):
            continue  # torch refuses: m must be a multiple of its round count max(1, m // p)
        line = timeline(schedule_actions("interleaved_1f1b", p, m, v))
        share = Fraction(line.busy, line.makespan * p)
        if m >= p:
            assert share == 1 - _exact(p, m, v), (p, m, v)
        else:
            assert share == Fraction(v * m, v * p + m - 1), (p, m, v)
            assert 1 - share > _exact(p, m, v)


def test_looped_and_zero_bubble_schedules_shrink_the_bubble():
    """The issue's target: interleaved's timeline bubble below 1f1b's and zbv's below interleaved's at the
    same p and m (zero_bubble, the interleaved ZB1P, below interleaved too)."""
    compared = 0
    for p, m in GRID:
        if m < p or m % max(1, m // p):
            continue
        one = schedule_bubble("1f1b", p, m, 1)
        inter = schedule_bubble("interleaved_1f1b", p, m, 2)
        assert inter < one, (p, m)
        assert schedule_bubble("zbv", p, m, 2) < inter, (p, m)
        assert schedule_bubble("zero_bubble", p, m, 2) < inter, (p, m)
        compared += 1
    assert compared >= 12
    assert schedule_bubble("1f1b", 2, 8, 1) == pytest.approx(1 / 9)


def test_every_schedule_runs_each_action_once():
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2)]:
        p, m = 4, 8
        lists = schedule_actions(schedule, p, m, v)
        ops = [op for row in lists.values() for op in row]
        split = schedule in ("zero_bubble", "zbv")
        backward_units = sum(2 if op.kind == "B" else 1 for op in ops if op.kind != "F")
        assert len({(o.stage, o.kind, o.mb) for o in ops}) == len(ops), schedule
        assert sum(o.kind == "F" for o in ops) == p * v * m and backward_units == 2 * p * v * m, schedule
        assert split or all(o.kind in "FB" for o in ops), schedule


def test_bad_arguments_name_what_is_valid():
    with pytest.raises(BubbleError, match=r"unknown pipeline schedule 'dualpipe'; valid: gpipe, 1f1b, "
                                          r"interleaved_1f1b, zero_bubble, zbv"):
        schedule_bubble("dualpipe", 2, 8, 1)
    with pytest.raises(BubbleError, match=r"zbv runs exactly 2 stages per rank"):
        schedule_bubble("zbv", 2, 8, 3)
    with pytest.raises(BubbleError, match=r"1f1b runs 1 stage per rank"):
        schedule_bubble("1f1b", 2, 8, 2)
    assert schedule_bubble("1f1b", 1, 8, 1) == 0.0


def test_measured_idle_is_clamped():
    assert measured_idle(0.9, 1.0) == pytest.approx(0.1)
    assert measured_idle(1.2, 1.0) == 0.0  # timer granularity: busy a hair above wall
    assert measured_idle(-1.0, 1.0) == 1.0
    assert measured_idle(0.5, 0.0) == 0.0


def _record_orders(rank: int, world: int, port: int, m: int, out: str) -> None:
    """One rank: each schedule of torch 2.13 run for real on a gloo pair, tiny Linear stages whose
    forward / backward / weight-backward calls are recorded in the order the schedule makes them."""
    import datetime
    import os

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    class Recording(PipelineStage):
        log: list[tuple[int, str, int]]

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            self.log.append((self.stage_index, "F", fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            self.log.append((self.stage_index, "B" if full_backward else "I", bwd_chunk_id))
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            self.log.append((self.stage_index, "W", bwd_chunk_id))
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        classes = {"gpipe": ts.ScheduleGPipe, "1f1b": ts.Schedule1F1B, "interleaved_1f1b": ts.ScheduleInterleaved1F1B,
                   "zero_bubble": ts.ScheduleInterleavedZeroBubble, "zbv": ts.ScheduleZBVZeroBubble}
        orders: dict[str, list[tuple[int, str, int]]] = {}
        for name, cls in classes.items():
            v = 1 if name in ("gpipe", "1f1b") else 2
            n = world * v
            indices = [rank, n - 1 - rank] if name == "zbv" else [rank + k * world for k in range(v)]
            log: list[tuple[int, str, int]] = []
            stages = []
            for index in indices:
                stage = Recording(nn.Linear(4, 4), index, n, torch.device("cpu"))
                stage.log = log
                stages.append(stage)
            loss = lambda output, target: ((output - target) ** 2).sum()  # noqa: E731
            schedule = cls(stages[0] if v == 1 else stages, m, loss_fn=loss, scale_grads=False)
            x = torch.randn(m * 2, 4)
            first = any(s.is_first for s in stages)
            last = any(s.is_last for s in stages)
            schedule.step(*((x,) if first else ()), target=torch.zeros(m * 2, 4) if last else None)
            log.clear()  # the first step also infers shapes; the second is the steady state
            schedule.step(*((x,) if first else ()), target=torch.zeros(m * 2, 4) if last else None)
            orders[name] = list(log)
        torch.save(orders, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_action_lists_are_the_order_torch_runs(tmp_path):
    """The lists the timeline is computed from are the order in which torch 2.13 actually calls each
    stage's forward, backward and weight backward (2 gloo ranks, every schedule, m = 4)."""
    import socket

    from tests.ranks import run_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m, out = 4, str(tmp_path / "orders")
    run_ranks(_record_orders, (2, port, m, out), nprocs=2)
    ran = {rank: torch.load(f"{out}.{rank}") for rank in (0, 1)}
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"):
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        ours = schedule_actions(schedule, 2, m, v)
        for rank in (0, 1):
            assert [str(op) for op in ours[rank]] == [f"{s}{k}{i}" for s, k, i in ran[rank][schedule]], (schedule, rank)
