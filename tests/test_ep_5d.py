"""5D: data x pipeline x tensor x context x expert parallel at once (issue 39), on 8 real gloo processes.

pp2 x tp2 x cp2 with ep4: every pipeline stage's 4 ranks (cp2 x tp2, one data rank) are its expert ranks, one
ep group of 4 exchanging tokens (torchtitan's ``dp_shard x cp x tp = efsdp x ep`` per stage, expert tensor
parallel degree 1), the dense part tensor-parallel with sequence parallel inside each cp rank, K/V gathered
over cp, the stages scheduled by 1f1b. Through the worker's own step path (tests/test_tensor_parallel.py's
``_run``: StepRunner.attach + run_step, seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip,
dropout on), three steps: every step's loss and clip norm, the audited sample ids and the final gathered
parameters equal one process's, the digest the driver combines from every rank's part is the gathered
model's, and the step events' per-expert token counts are the global batch's. Its checkpoint resumes under
tp2 x dp4 x ep2 with the uninterrupted numbers. On the same 8 ranks the 4D pp2 x hsdp 2x1 x tp2 x ep2 (hsdp
stages with real replicas) trains the same numbers.

The model's ``aux_coef`` is 0.5 (tests/test_ep_cp.py's reason).

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of fp32 sums (tp's sharded matmuls, the attention's
log-sum-exp merge of the cp key blocks, the all-to-all's grouping, the aux statistics summed over tp then cp).

Against broken builds (run before trusting it): the load-balance statistics not summed over cp under tp
(``MoEFeedForward._split_aux_loss`` without ``cp_sample_stats``, what main had): step 1's loss off by 3.4e-4
relative; the stages' expert gradient scale ``1 / D`` instead of ``1 / (D x cp)`` (main's
``stage_expert_parallel``): step 3's loss off by 6.4e-5 relative; hsdp stages' experts treated as ddp's (main's
FSDP flag for ``fsdp`` only: ``reduce_grads`` on top of HSDP's reduction): the hsdp layout's step 3 loss off
by 2.6e-5 relative.

Cost: one process start of 8 ranks for the four runs; marked slow (over 20 s of wall time on the loaded
2-core machine).
"""

from __future__ import annotations

import pytest

from tests.test_ep_cp_tp import MOE
from tests.test_ep_tp import _same_load
from tests.test_tensor_parallel import _matches, _resumed_matches, _run


def test_5d_expert_groups_and_recovery_coverage() -> None:
    """Pure. pp2 x tp2 x cp2 x ep4: a stage's 4 ranks are one ep group, no rank has a replica (losing one
    leaves no peer holding its experts); with dp2 on 16 ranks the two data ranks of a stage hold the same
    experts and each other's state, so losing one rank restores from its replica (a peer)."""
    from elastictrain.controller.sources import rank_sources
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.layout import LayoutSpec, resolve

    dims = resolve(LayoutSpec("ddp", 8, 2, pp=2, tp=2, cp=2, ep=4), 8).dims
    assert [dims.ep_group_ranks(r) for r in (0, 5)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(dims.expert_replica_ranks(r) == [r] for r in range(8))
    assert len(dims.holder_keys()) == 8  # every rank holds a part of the state no other rank holds
    lost = rank_sources(dp_replicate=1, dp_shard=1, dims=dims, survivors={r: 4 for r in range(8) if r != 5},
                        memory={}, durable_step=None, last_step=4)
    assert lost.chosen.kind == "scratch", lost.reason
    sixteen = MeshDims(dp_replicate=2, pp=2, cp=2, tp=2, ep=4)  # rank 5: pp 0, replica 1, cp 0, tp 1
    assert sixteen.expert_replica_ranks(5) == [1, 5] and sixteen.ep_group_ranks(5) == [4, 5, 6, 7]
    kept = rank_sources(dp_replicate=1, dp_shard=1, dims=sixteen, survivors={r: 4 for r in range(16) if r != 5},
                        memory={}, durable_step=None, last_step=4)
    assert kept.chosen.kind == "peer" and 1 in kept.chosen.ranks, kept.reason


@pytest.mark.slow
def test_pp2_tp2_cp2_ep4_matches_one_process(tmp_path) -> None:
    """And its checkpoint after two steps (DCP, by name) resumes under tp2 x dp4 x ep2 on the same 8 ranks
    (no pipeline, no cp, the experts resharded from ep4 to ep2): its third step is the uninterrupted run's.
    And pp2 x hsdp 2x1 x tp2 x ep2 on the same ranks: each stage's experts replicated over the two hsdp
    replicas (HSDP's all-reduce sums their gradients), an ep group a replica's tp group."""
    ckpt = str(tmp_path / "5d")
    five = {"pp": 2, "tp": 2, "cp": 2, "ep": 4, "_task": MOE}
    ref = _run(tmp_path, 1, [{"_task": MOE}])[0]
    hsdp = {"pp": 2, "tp": 2, "ep": 2, "plan": "hsdp", "shard_size": 1, "_task": MOE}
    got, _, resumed, replicas = _run(tmp_path, 8, [
        {**five, "_digest": True}, {**five, "_steps": 2, "_save": ckpt},
        {"tp": 2, "ep": 2, "_task": MOE, "_load": ckpt, "_steps": 1}, hsdp])
    for run in (got, replicas):
        assert run["tp_sharded"], "no parameter is tensor-parallel"
        _matches(run, ref)
        _same_load(run, ref)
    _resumed_matches(resumed, ref, 2)
