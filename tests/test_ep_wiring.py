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


@pytest.mark.parametrize("parallel, moe, needle", [
    ({"ep": 4, "plan": "hsdp", "shard_size": 2}, {"experts": 4, "top_k": 2},
     r"parallel\.ep=4 under hsdp must divide parallel\.shard_size=2 .*valid parallel\.ep values there: \[1, 2\]"),
    ({"ep": 2, "tp": 4}, {"experts": 4, "top_k": 2},
     r"parallel\.ep=2 with parallel\.tp=4: .*ep must be a multiple of tp; valid parallel\.ep values with tp=4: "
     r"1 or a multiple of 4 .*set parallel\.ep to one of them"),
    ({"ep": 2}, None, r"parallel\.ep=2 .* task\.model\.moe is unset; set task\.model\.moe"),
    ({"ep": 4}, {"experts": 6, "top_k": 2}, r"parallel\.ep=4 does not divide task\.model\.moe\.experts=6; valid "
                                            r"parallel\.ep values for it: \[1, 2, 3, 6\]"),
    ({"ep": 3}, {"experts": 6, "top_k": 2}, r"parallel\.ep=3 does not divide the data-parallel size 4 .*valid "
                                            r"parallel\.ep values there: \[1, 2, 4\]"),
])
def test_bad_ep_configs_name_the_rule_and_the_fix(parallel, moe, needle) -> None:
    from elastictrain.config import ConfigError, build_config

    task = copy.deepcopy(TASK)
    task["model"]["moe"] = moe
    with pytest.raises(ConfigError, match=needle):
        build_config(job(task=task, train=TRAIN, workers={"min": 4, "max": 4}, parallel=parallel))


@pytest.fixture(scope="module")
def one_process() -> InProcessRun:
    return InProcessRun(_spec(1))


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """``ep_run(world, plan, meta)``: the finished ``STEPS``-step ep2 run of that layout and its checkpoint root
    (a durable checkpoint every 2 steps, run id ``ep-resume``: a checkpoint changes no number), trained once
    for the module: the one-process comparison reads it, the ep1 resume continues its checkpoint (it commits
    step 6 beside the run's, which it leaves as they are)."""
    from tests.conftest import _ensure_local_ray

    done: dict[tuple[int, str, bool], tuple[Any, str]] = {}

    def get(world: int, plan: str, meta: bool = False) -> tuple[Any, str]:
        if (world, plan, meta) not in done:
            _ensure_local_ray()
            tmp = tmp_path_factory.mktemp(f"ep2-{world}-{plan}-{meta}")
            ckpt = str(tmp / "ckpt")
            spec = _spec(world, STEPS, "ep-resume", ckpt, ep=2, plan=plan, meta_init=meta)
            done[(world, plan, meta)] = run_job(tmp, spec, name="ep2"), ckpt
        return done[(world, plan, meta)]

    return get


def _audited(run, steps: int) -> None:
    """Finished, and every step 1..steps saw exactly its global-cursor samples (tests/audit.py)."""
    from tests.audit import assert_cursor_audit

    assert run.result.exit_code == 0 and run.summary["final_step"] == steps, run.summary
    assert_cursor_audit(run, steps, TASK["model"]["seq_len"], TRAIN["global_batch"])


def _token_counts(run) -> None:
    """Every step event carries each MoE layer's slots per expert, summed over the data ranks."""
    m = TASK["model"]
    slots = TRAIN["global_batch"] * m["seq_len"] * m["moe"]["top_k"]
    for e in run.of("step"):
        counts = e["tokens_per_expert"]
        assert sorted(counts) == ["blocks.0.moe"], counts
        assert all(len(c) == m["moe"]["experts"] and sum(c) == slots for c in counts.values()), counts


@pytest.mark.parametrize("world, plan, meta", [(2, "ddp", False), (2, "ddp", True), (4, "ddp", False),
                                               (4, "fsdp", False)],
                         ids=["ep2", "ep2-meta", "ep2xdp2", "fsdp4xep2"])
def test_ep_matches_one_process(tmp_path, ray_local, one_process, ep_run, world, plan, meta) -> None:
    """ep2 (2 workers; built whole, and on meta with ``parallel.meta_init``: each rank materializes the dense
    part and its own experts, given their step-0 values at the first sync), ep2 x dp2 (4) and fsdp4 x ep2 (4:
    experts FSDP-sharded over their 2 replicas, the rest over all 4): every step's loss, the final
    parameters, the sample audit, the token counts (and, under ep2, the report's table of them). Against
    broken builds: ep2-meta with each rank's experts seeded by their local index (rank 1's experts 2-3 given
    experts 0-1's values): the losses differ from step 1; the expert gradients not reduced (no sum over
    replicas, no 1/D): final blocks.0.moe.w_out off by 8e-5 > 1e-5 in both ddp runs (AdamW normalises most
    of a scale error away; the parameters still catch it); DDP not told to ignore the experts: the run fails
    at step 1 (DDP mixes DTensor and Tensor); under fsdp, the loop's ``reduce_grads`` also run after FSDP's
    reduce-scatter (the expert gradients reduced twice): the losses of steps 2-4 differ (step 2: 5.5853
    against 5.5807)."""
    run, _ = ep_run(world, plan, meta)  # its checkpoints (every 2 steps) change no number
    _audited(run, STEPS)
    assert run.of("step")[0]["mesh"].startswith(plan), run.of("step")[0]
    _token_counts(run)
    assert_same_numbers(run, one_process)
    if world == 2 and not meta:  # the report tables the load per expert from the same events
        _report_tables_the_load(run, tmp_path)


def _report_tables_the_load(run, tmp_path) -> None:
    """The report's load-per-expert table holds the run's summed counts (as a headless Chromium parses the
    page, where one is installed)."""
    import subprocess

    from elastictrain.report import find_chromium, write_report

    html = write_report(run.dir, png=False)["html"]
    total = [sum(c) for c in zip(*(e["tokens_per_expert"]["blocks.0.moe"] for e in run.of("step")))]
    page = html.read_text()
    if find_chromium() is not None:
        page = subprocess.run([find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                               f"--user-data-dir={tmp_path / 'profile'}", html.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120).stdout
    table = page[page.index('id="experts-blocks.0.moe"' if 'id="experts' in page else "id='experts-blocks.0.moe'"):]
    table = table[:table.index("</table>")]
    assert all(f"<td>{n}</td>" in table for n in total), (total, table)


# ------------------------------------------------------------------------------------------ gloo ranks

def _ep2_dp2_clip(rank: int, port: int) -> None:
    """The framework's wiring on 4 gloo ranks (ep2 x dp2): experts sharded and hidden from DDP, the backward
    through DDP, the expert gradients reduced, then the framework's clip (parallel/optim.py) at a max norm
    that clips: the norm and every clipped gradient equal one process's ``clip_grad_norm_``. Against broken
    builds: the expert gradients not reduced, or the clip not summing the expert shards' squared norms over
    the ep group (the DTensor grads counted as replicated): the norm differs ("Scalars are not close")."""
    import datetime
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ParallelConfig
    from elastictrain.parallel import optim
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert_wiring import attach_expert_parallel
    from elastictrain.parallel.parallelize import parallelize_ddp
    from tests.test_expert_parallel import _build, _compare_params, _data, _losses

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_replicate",))
        ref, model = _build("gpt"), _build("gpt")
        ep = attach_expert_parallel(model, MeshDims(dp_replicate=4, ep=2), torch.device("cpu"))
        assert ep is not None and ep.replica_group is not None
        ddp = parallelize_ddp(model, mesh, ParallelConfig())
        inputs, targets = _data(8)
        _losses(ref, inputs, targets).mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=False)
        mine = slice(2 * rank, 2 * rank + 2)
        # the step loop's scale: sum of this rank's per-sample losses x D / G (DDP then averages over D)
        (_losses(ddp, inputs[mine], targets[mine]).sum() * 4 / 8).backward()
        ep.reduce_grads(model)
        got = optim.clip_grad_norm(model.parameters(), 0.05, foreach=False)
        assert float(want) > 0.05, float(want)  # it clipped
        torch.testing.assert_close(got, want, atol=0, rtol=1e-5)
        _compare_params(model, ref, "grad")
    finally:
        dist.destroy_process_group()


def test_ep2_dp2_clip_norm_over_dense_and_sharded_expert_grads() -> None:
    from tests.checkpoint_fixtures import free_port
    from tests.ranks import run_ranks

    run_ranks(_ep2_dp2_clip, (free_port(),), nprocs=4)


@pytest.mark.parametrize("world, plan", [(2, "ddp"), pytest.param(4, "fsdp", marks=pytest.mark.slow)],
                         ids=["ep2", "fsdp4xep2"])
def test_ep2_checkpoint_resumes_under_ep1_with_the_same_numbers(tmp_path, ray_local, ep_run, world, plan) -> None:
    """ep2 (and fsdp4 x ep2: the experts' (edp, ep) shards and the dense FSDP shards, with AdamW's state) for
    4 steps with a durable checkpoint every 2 (the experts saved as DTensor shards, by name); one worker (ep1:
    whole experts, plain tensors) resumes its step-4 checkpoint to 6 steps: every step's loss and the final
    parameters of 6 uninterrupted one-process steps. Against a build that treats an ep layout as holding the
    whole state (``holds_whole_state`` ignoring ep, the whole-state guard removed): the ep2 run fails (the
    replicated broadcast restore meets DTensor experts)."""
    ep, ckpt = ep_run(world, plan)  # test_ep_matches_one_process's run of this layout (STEPS = 4)
    _audited(ep, 4)
    one = run_job(tmp_path, _spec(1, 6, "ep-resume", ckpt), name="ep1")
    assert one.result.exit_code == 0, one.summary
    (resumed,) = one.of("resumed")
    assert resumed["step"] == 4, resumed
    ref = InProcessRun(_spec(1, 6))

    class Both:  # the two runs' step events as one run's, the final parameters ep1's
        events = ep.events + one.events

        def of(self, name):
            return [e for e in self.events if e["event"] == name]

        final_params = one.final_params

    assert_same_numbers(Both(), ref)


@pytest.mark.slow
def test_ep2_dp2_rank_killed_recovers_from_its_expert_replica(tmp_path, ray_local) -> None:
    """ep2 x dp2 on 4 (ep groups {0, 1} and {2, 3}; ranks 0, 2 hold experts 0-1, ranks 1, 3 experts 2-3), the
    peer tier every step: rank 1 is SIGKILLed mid-step with no spare. Rank 3 holds rank 1's experts, so the
    survivors serve every part of the state (source peer, lost steps <= 1); the 3 left shrink to a whole
    ep group (2) and the run finishes with every step's loss (a redone one too) and the final parameters of
    the uninterrupted run, each step's samples seen once. Against a build whose holder key leaves the ep
    coordinate out (any survivor "holds everything", as under plain ddp): the recovery does not come from the
    expert replica (source ``memory``, not ``peer``)."""
    from tests.parallel_fixtures import RECOVERY_PARAM_ATOL
    from tests.test_pp_recovery import TIMEOUTS, _slow

    steps = 10
    kill = {"rank": 1, "step": 5, "point": "mid_step", "kind": "kill"}
    spec = _spec(4, steps, "ep-kill", ep=2)
    spec.update(workers={**spec["workers"], "min": 2}, faults=_slow(4) + [kill], timeouts=dict(TIMEOUTS),
                recovery={"min_workers_wait_s": 240}, checkpoint={**spec["checkpoint"], "memory_every_steps": 1})
    run = run_job(tmp_path, spec, name="ep2dp2kill")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "peer" and rec["lost_steps"] <= 1, rec
    assert "every ep coordinate's" in rec["reason"], rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[0] == (4, 2), sizes  # whole ep groups only: 3 workers run one
    _audited(run, steps)
    assert_same_numbers(run, InProcessRun(_spec(1, steps)), param_atol=RECOVERY_PARAM_ATOL)


def test_recovery_coverage_needs_every_ep_coordinate() -> None:
    """Pure: the experts are state that ep shards (MeshDims.holder_key ends with the ep coordinate), so a
    peer restore needs a survivor of every ep coordinate; ep2 x dp2 losing rank 1 is covered by rank 3 (its
    expert replica); losing ranks 1 and 3, or rank 1 of ep2 alone, is not: the peer tier, else the checkpoint."""
    from elastictrain.controller.sources import rank_sources
    from elastictrain.parallel.dims import MeshDims

    dims = MeshDims(dp_replicate=4, ep=2)
    assert [dims.holder_key(r)[-1] for r in range(4)] == [0, 1, 0, 1] and not dims.holds_whole_state

    def decide(d, survivors, memory=None):
        return rank_sources(dp_replicate=d.dp_replicate, dp_shard=1, survivors=survivors, memory=memory or {},
                            durable_step=2, last_step=5, dims=d)

    got = decide(dims, {0: 5, 2: 5, 3: 5})
    assert (got.chosen.kind, got.chosen.ranks, got.lost_steps) == ("peer", (0, 3), 0), got.reason
    got = decide(dims, {0: 5, 2: 5}, {4: True})
    assert got.chosen.kind == "memory" and "lack (shard coordinate, ep coordinate) [(0, 1)]" in got.reason, got.reason
    got = decide(MeshDims(dp_replicate=2, ep=2), {0: 5})
    assert got.chosen.kind == "checkpoint" and got.lost_steps == 3, got.reason
    assert MeshDims(dp_replicate=4).holder_keys() == [(0, 0, 0)]  # ddp without ep: any survivor holds it all


@pytest.mark.slow
def test_fsdp4_ep2_rank_killed_recovers_from_the_peer_tier(tmp_path, ray_local) -> None:
    """fsdp4 x ep2 on 4 (experts FSDP-sharded over their 2 replicas: every rank holds a distinct part of the
    state), the peer tier every step: rank 1 is SIGKILLed mid-step with no spare. No survivor holds rank 1's
    shards, so the state comes from the peer memory tier (lost steps <= 1), the 3 left shrink to a multiple of
    ep (2: fsdp2 x ep2, edp 1) and the run finishes with every step's loss (a redone one too) and the final
    parameters of the uninterrupted one-process run, each step's samples seen once (the tier's 2-D expert
    shards resharded from 4 ranks onto 2). Against a broken build (gloo's forced SUM kept when edp is one
    rank, where torch 2.13's FSDP2 divides the expert gradients twice): the losses after the shrink differ
    (step 6: 5.22666 against 5.22506)."""
    from tests.parallel_fixtures import RECOVERY_PARAM_ATOL
    from tests.test_pp_recovery import TIMEOUTS, _slow

    steps = 8
    kill = {"rank": 1, "step": 5, "point": "mid_step", "kind": "kill"}
    spec = _spec(4, steps, "ep-fsdp-kill", ep=2, plan="fsdp")
    spec.update(workers={**spec["workers"], "min": 2}, faults=_slow(4) + [kill], timeouts=dict(TIMEOUTS),
                recovery={"min_workers_wait_s": 240}, checkpoint={**spec["checkpoint"], "memory_every_steps": 1})
    run = run_job(tmp_path, spec, name="fsdp4ep2kill")
    assert [(f["kind"], f["rank"]) for f in run.of("failure")] == [("process_died", 1)], run.of("failure")
    rec = run.of("recovered")[0]
    assert rec["source"] == "memory" and rec["lost_steps"] <= 1, rec
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in run.of("resized")]
    assert sizes[0] == (4, 2), sizes
    meshes = [e["mesh"] for e in run.of("step") if e.get("mesh")]  # (a generation's first step names it)
    assert meshes[-1].startswith("fsdp") and "dp_shard=2" in meshes[-1], meshes
    _audited(run, steps)
    assert_same_numbers(run, InProcessRun(_spec(1, steps)), param_atol=RECOVERY_PARAM_ATOL)
