"""Expert parallel composed with tensor parallel (ep x tp, issue 39), on 2 and 4 real gloo processes.

The expert group borrows the tp ranks (``dp x tp = edp x ep``, torchtitan's expert tensor parallel degree 1):
the dense part is tensor-parallel (with and without sequence parallel), each MoE layer takes this tp rank's
slice of the positions, dispatches it to the experts over the ep group and gives back what the next tp
layer expects (elastictrain/parallel/expert_tp.py). Runs the worker's StepRunner (tests/test_tensor_parallel.py's
harness: seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip, dropout on) for three steps:
every step's loss, every step's clip norm, the audited sample ids and the final gathered parameters equal one
process's, and the step events' per-expert token counts are the global batch's (step 1's one process's):

* tp2 x ep2 on 2 ranks, sequence parallel on and off, GPT and Llama (one ep group = the tp group, no expert
  replica), and its checkpoint resumed under ddp2 x ep1 (the experts resharded by DCP);
* tp2 x dp2 x ep2 (ddp: experts replicated over the 2 data ranks, reduced by ``ExpertParallel.reduce_grads``;
  fsdp, sequence parallel on and off: FSDP-sharded over them) and tp2 x dp2 x ep4 (one ep group over all 4
  ranks) on 4 ranks.

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of sums (tp's sharded matmuls, the all-to-all's
grouping, the aux statistics summed over tp).

Pure: the ep groups and replicas over the expert ranks, recovery coverage's holder keys, ep_rule's and the
resolver's valid values, the task's refusal of MoE under tp without ep, the planner's per-rank shares.

Against broken builds (run before trusting it): every tp rank dispatching the whole replicated input (the
token split of ``MoETokenSplit`` off without sequence parallel: each expert sees every token twice, the
router and expert gradients doubled): step 2's loss differs on tp2 x ep2 (step 1's equals: the forward is
the same); the aux statistics not summed over tp (``_SumOverGroup``'s all-reduce removed: each rank's f and P
of its half of the positions): step 1's loss differs; the experts left in tp's data-parallel average
(``TensorParallelModel`` averaging every parameter over dp): tp2 x dp2 x ep2's step 2 loss differs (the
expert gradients halved); ``holder_keys`` listing every (tp, ep) pair (the filter removed): the pure
coverage tests fail (keys no rank holds); the step's token counts summed over the world without dividing
by tp: every layer's counts sum to twice the slots.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import job
from tests.test_tensor_parallel import MODEL, _matches, _resumed_matches, _run

MOE = {"model": {**MODEL, "moe": {"experts": 4, "top_k": 2, "every": 1, "aux_coef": 0.1}}}


# ------------------------------------------------------------------------------------------------ pure


def test_ep_groups_span_the_tp_ranks() -> None:
    from elastictrain.parallel.dims import MeshDims

    dims = MeshDims(dp_replicate=2, tp=2, ep=2)  # ranks (dp, tp): 0 (0,0) 1 (0,1) 2 (1,0) 3 (1,1)
    assert [dims.expert_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert dims.ep_group_ranks(1) == [0, 1] and dims.ep_group_ranks(2) == [2, 3]  # the tp group
    assert dims.expert_replica_ranks(0) == [0, 2] and dims.expert_replica_ranks(3) == [1, 3]
    assert [dims.edp_coord(r) for r in range(4)] == [0, 0, 1, 1]
    # recovery coverage: (tp, dp_shard, ep) pairs some rank holds; ep coordinate 1 sits on tp coordinate 1
    assert dims.holder_keys() == [(0, 0, 0, 0), (0, 1, 0, 1)]
    assert {dims.holder_key(r) for r in range(4)} == set(dims.holder_keys())
    four = MeshDims(dp_shard=2, tp=2, ep=4, plan="fsdp")
    assert four.ep_group_ranks(3) == [0, 1, 2, 3] and four.expert_replica_ranks(2) == [2]
    assert MeshDims(dp_replicate=4, ep=2).ep_group_ranks(1) == [0, 1]  # without tp: as before
    with pytest.raises(ValueError, match=r"MeshDims\.ep=4 must divide the expert ranks dp x tp = 2"):
        MeshDims(tp=2, ep=4)


def test_recovery_under_ep_x_tp_needs_a_survivor_of_every_tp_and_ep_coordinate() -> None:
    """tp2 x dp2 x ep2: ranks 0, 2 hold (tp 0, ep 0) and 1, 3 hold (tp 1, ep 1). Losing rank 1 leaves its
    replica 3 (a peer restore); losing 1 and 3 leaves no holder of tp 1 / ep 1."""
    from elastictrain.controller.sources import rank_sources
    from elastictrain.parallel.dims import MeshDims

    dims = MeshDims(dp_replicate=2, tp=2, ep=2)
    kept = rank_sources(dp_replicate=1, dp_shard=1, dims=dims, survivors={0: 4, 2: 4, 3: 4}, memory={},
                        durable_step=None, last_step=4)
    assert kept.chosen.kind == "peer" and kept.chosen.ranks == (0, 3), kept.reason
    lost = rank_sources(dp_replicate=1, dp_shard=1, dims=dims, survivors={0: 4, 2: 4}, memory={},
                        durable_step=None, last_step=4)
    assert lost.chosen.kind == "scratch" and "lack (tp coordinate, shard coordinate, ep coordinate) [(1, 0, 1)]" \
        in lost.reason, lost.reason


def test_ep_rule_and_resolution_name_the_valid_values() -> None:
    from elastictrain.parallel.layout import LayoutSpec, ep_rule, is_valid, resolve, valid_ep

    assert valid_ep(2, 2) == [1, 2, 4] and valid_ep(3, 2) == [1, 2, 6] and valid_ep(4, 1) == [1, 2, 4]
    assert ep_rule(1, 2, 2) is None and ep_rule(1, 2, 4, "fsdp") is None
    assert "valid parallel.ep values with tp=4: 1 or a multiple of 4" in ep_rule(1, 4, 2)
    spec = LayoutSpec("ddp", 8, 2, tp=2, ep=4)
    assert resolve(spec, 4).dims.ep == 4
    ok, why = is_valid(LayoutSpec("ddp", 6, 1, tp=2, ep=4), 6)  # dp 3 x tp 2 = 6 expert ranks
    assert not ok and "parallel.ep=4 does not divide dp x tp = 3 x 2" in why and "[1, 2, 6]" in why


@pytest.mark.parametrize("parallel, needle", [
    ({"tp": 2}, r"task\.model\.moe is set with parallel\.tp=2 and parallel\.ep=1: .*set parallel\.ep to a multiple "
                r"of parallel\.tp=2"),
    ({"tp": 2, "ep": 3}, r"parallel\.ep=3 with parallel\.tp=2: .*ep must be a multiple of tp"),
])
def test_moe_with_tp_needs_an_ep_borrowing_the_tp_ranks(parallel, needle) -> None:
    from elastictrain.config import ConfigError, build_config
    from elastictrain.task import builtin_task

    with pytest.raises(ConfigError, match=needle):
        builtin_task(build_config(job(task=MOE, workers={"min": 4, "max": 4}, parallel=parallel)))
    builtin_task(build_config(job(task=MOE, workers={"min": 4, "max": 4}, parallel={"tp": 2, "ep": 2})))


def test_planner_keeps_the_experts_whole_under_tp() -> None:
    from elastictrain.planner import Candidate, ModelShape
    from elastictrain.planner.memory import rank_params, stage_expert_params, stage_params, state_params

    moe = ModelShape(layers=4, hidden=256, heads=4, seq_len=128, vocab=1000, experts=8, top_k=2)
    c = Candidate(dp_replicate=2, tp=2, ep=2, micro_batch=2)
    experts = stage_expert_params(moe, c)
    assert rank_params(moe, c) == pytest.approx((stage_params(moe, c) - experts) / 2 + experts / 2)
    f = Candidate(dp_shard=2, tp=2, ep=2, micro_batch=2)  # fsdp, edp = 2 x 2 / 2
    dense = (stage_params(moe, f) - experts) / 2
    assert state_params(moe, f) == pytest.approx(dense / 2 + experts / 4)
    # --all-axes searches ep up to dp x tp, runnable where tp divides it; MoE under tp without ep is not
    from elastictrain.planner import GIB, Cluster, Training, rank_layouts

    cl = Cluster(nodes=1, devices_per_node=8, device_memory=80 * GIB, flops=400e12, intra_node_bw=450e9,
                 inter_node_bw=50e9)
    ranked = rank_layouts(moe, Training(global_batch=32, micro_batch=2), cl, runnable_only=False)
    assert any(e.runnable and e.candidate.tp == 2 and e.candidate.ep > e.candidate.dp for e in ranked)
    assert not any(e.runnable and e.candidate.tp > 1 and e.candidate.ep % e.candidate.tp for e in ranked)


# ------------------------------------------------------------------------------------------ gloo ranks


def llama_of(moe: dict[str, Any]) -> dict[str, Any]:
    """The debug Llama (SwiGLU experts, no dropout) with the MoE task section ``moe``."""
    return {"kind": "llama", "llama": {"size": "debug"}, **moe}


LLAMA_MOE = llama_of(MOE)


def one_process_runs(tmp: Any, moe: dict[str, Any]) -> dict[str, Any]:
    """The GPT's and the Llama's one-process runs of ``moe`` (one process start for both); also
    tests/test_ep_cp_tp.py's, with its own ``aux_coef``."""
    gpt, llama = _run(tmp, 1, [{"_task": moe}, {"_task": llama_of(moe)}])
    return {"gpt": gpt, "llama": llama}


def assert_match_one_process(runs: list[dict[str, Any]], refs: list[str], one_process: dict[str, Any]) -> None:
    """Each tensor-parallel run equals its one-process reference (``refs``: "gpt" or "llama"): every step's
    loss and clip norm, the audit, the final parameters (``_matches``) and the token counts (``_same_load``)."""
    for got, ref in zip(runs, refs, strict=True):
        assert got["tp_sharded"], "no parameter is tensor-parallel"
        _matches(got, one_process[ref])
        _same_load(got, one_process[ref])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return one_process_runs(tmp_path_factory.mktemp("ref"), MOE)


def test_tp2_ep2_with_and_without_sequence_parallel_match_one_process(tmp_path, one_process) -> None:
    """GPT and Llama (SwiGLU experts, no dropout), sequence parallel on and off. And a checkpoint of tp2 x ep2
    after two steps (DCP, by name) resumes under ddp2 with ep1 (every expert whole on each rank, no tp):
    its third step is the uninterrupted run's."""
    ckpt = str(tmp_path / "tp2ep2")
    runs = _run(tmp_path, 2, [{"tp": 2, "ep": 2, "_task": MOE},
                              {"tp": 2, "ep": 2, "sequence_parallel": False, "_task": MOE, "_digest": True},
                              {"tp": 2, "ep": 2, "_task": MOE, "_steps": 2, "_save": ckpt},
                              {"_task": MOE, "_load": ckpt, "_steps": 1},
                              {"tp": 2, "ep": 2, "_task": LLAMA_MOE},
                              {"tp": 2, "ep": 2, "sequence_parallel": False, "_task": LLAMA_MOE}])
    assert_match_one_process(runs[:2] + runs[4:], ["gpt", "gpt", "llama", "llama"], one_process)
    _resumed_matches(runs[3], one_process["gpt"], 2)


def test_tp2_by_dp2_with_ep2_and_ep4_match_one_process(tmp_path, one_process) -> None:
    layouts = [{"tp": 2, "ep": 2, "_task": MOE, "_digest": True},
               {"tp": 2, "ep": 4, "sequence_parallel": False, "_task": MOE},
               {"tp": 2, "ep": 2, "plan": "fsdp", "_task": MOE},
               {"tp": 2, "ep": 2, "plan": "fsdp", "sequence_parallel": False, "_task": MOE}]
    assert_match_one_process(_run(tmp_path, 4, layouts), ["gpt"] * len(layouts), one_process)


def _same_load(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """The step events' ``tokens_per_expert``: every layer's counts sum to global_batch x seq_len x top_k
    (each data rank's tokens once, not once per tp rank), and step 1's (the same weights) are one process's."""
    slots = 8 * MODEL["seq_len"] * 2
    assert all(sum(c) == slots for step in got["tokens_per_expert"] for c in step.values()), got["tokens_per_expert"]
    assert got["tokens_per_expert"][0] == ref["tokens_per_expert"][0]
