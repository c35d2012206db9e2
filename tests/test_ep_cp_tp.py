"""Expert parallel with context AND tensor parallel at once (ep x cp x tp, issue 39), on 4 real gloo processes.

The expert ranks of the one pp coordinate are ``dp x cp x tp = edp x ep`` (torchtitan's rule, expert tensor
parallel degree 1): cp2 x tp2 x ep2 (each ep group is a tp group; the two cp coordinates hold the same experts,
summed over their ``edp`` replicas) under ddp with sequence parallel, and cp2 x tp2 x ep4 (one ep group over
every rank: cp and tp; the experts FSDP-sharded over their one-rank edp, the dense part over ``dp_shard x cp``)
under fsdp without sequence parallel; and the Llama (SwiGLU experts, RMSNorm, rotary positions from the global
position) under cp2 x tp2 x ep2. Through the worker's own step path (tests/test_tensor_parallel.py's
``_run``: StepRunner.attach + run_step, seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip,
dropout on), three steps: every step's loss and clip norm, the audited sample ids and the final gathered
parameters equal one process's, and the step events' per-expert token counts are the global batch's.

The model's ``aux_coef`` is 0.5 (tests/test_ep_cp.py's reason: a wrong load-balance term moves the losses and
the router's gradients far beyond the tolerance).

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of fp32 sums (tp's sharded matmuls, the attention's
log-sum-exp merge of the cp key blocks, the all-to-all's grouping, the aux statistics summed over tp then cp).

Against broken builds (run before trusting it): the load-balance statistics summed over tp but not over cp
(``MoEFeedForward._split_aux_loss`` without its ``cp_sample_stats``, what main had): step 1's loss off by
3.4e-4 relative; the expert gradient scale ``1 / dp`` instead of ``1 / (dp x cp)`` (``attach_expert_parallel``:
the experts' gradients doubled): step 3's loss off by 6e-5 relative (AdamW's update hardly sees a gradient
scale; the clip does).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_ep_tp import MOE as _MOE, assert_match_one_process, llama_of, one_process_runs
from tests.test_tensor_parallel import _run

MOE = {"model": {**_MOE["model"], "moe": {**_MOE["model"]["moe"], "aux_coef": 0.5}}}


def test_ep_groups_and_replicas_span_cp_and_tp() -> None:
    """Pure: ranks (cp, tp) 0 (0,0) 1 (0,1) 2 (1,0) 3 (1,1); expert rank = cp x tp + tp (no dp)."""
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.layout import LayoutSpec, ep_rule, is_valid, resolve, valid_ep

    two = MeshDims(cp=2, tp=2, ep=2)
    assert [two.ep_group_ranks(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # the tp groups
    assert two.expert_replica_ranks(0) == [0, 2] and two.expert_replica_ranks(3) == [1, 3]  # over cp
    four = MeshDims(cp=2, tp=2, ep=4, plan="fsdp")
    assert four.ep_group_ranks(2) == [0, 1, 2, 3] and four.expert_replica_ranks(1) == [1]
    assert ep_rule(2, 2, 2) is None and ep_rule(2, 2, 4, "fsdp") is None and ep_rule(2, 2, 2, "hsdp") is None
    assert "multiple of 2" in ep_rule(2, 2, 3)
    assert valid_ep(1, 2, 2) == [1, 2, 4]
    assert resolve(LayoutSpec("ddp", 8, 2, cp=2, tp=2, ep=4), 8).dims.ep == 4
    ok, why = is_valid(LayoutSpec("ddp", 8, 2, cp=2, tp=2, ep=8), 4)
    assert not ok and "parallel.ep=8 does not divide dp x cp x tp = 1 x 2 x 2" in why and "[1, 2, 4]" in why, why


LLAMA_MOE = llama_of(MOE)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return one_process_runs(tmp_path_factory.mktemp("ref"), MOE)


def test_cp2_tp2_with_ep2_and_ep4_match_one_process(tmp_path, one_process) -> None:
    layouts = [{"cp": 2, "tp": 2, "ep": 2, "_task": MOE, "_digest": True},
               {"cp": 2, "tp": 2, "ep": 4, "plan": "fsdp", "sequence_parallel": False, "_task": MOE},
               {"cp": 2, "tp": 2, "ep": 2, "_task": LLAMA_MOE}]
    assert_match_one_process(_run(tmp_path, 4, layouts), ["gpt", "gpt", "llama"], one_process)
