"""Expert parallel composed with tensor parallel (ep x tp, issue 39), on 2 and 4 real gloo processes.

The expert group borrows the tp ranks (``dp x tp = edp x ep``, torchtitan's expert tensor parallel degree 1):
the dense part is tensor-parallel (with and without sequence parallel), each MoE layer takes this tp rank's
slice of the positions, dispatches it to the experts over the ep group and gives back what the next tp
layer expects (elastictrain/parallel/expert_tp.py). Runs the worker's StepRunner (tests/test_tensor_parallel.py's
harness: seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip, dropout on) for three steps:
every step's loss, every step's clip norm, the audited sample ids and the final gathered parameters equal one
process's:

* tp2 x ep2 on 2 ranks, sequence parallel on and off (one ep group = the tp group, no expert replica);
* tp2 x dp2 x ep2 (ddp: experts replicated over the 2 data ranks, reduced by ``ExpertParallel.reduce_grads``;
  fsdp: FSDP-sharded over them) and tp2 x dp2 x ep4 (one ep group over all 4 ranks) on 4 ranks.

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of sums (tp's sharded matmuls, the all-to-all's
grouping, the aux statistics summed over tp).

Against broken builds (run before trusting it): every tp rank dispatching the whole replicated input (the
token split of ``MoETokenSplit`` off without sequence parallel: each expert sees every token twice, the
router and expert gradients doubled): step 2's loss differs on tp2 x ep2 (step 1's equals: the forward is
the same); the aux statistics not summed over tp (``_SumOverGroup``'s all-reduce removed: each rank's f and P
of its half of the positions): step 1's loss differs; the experts left in tp's data-parallel average
(``TensorParallelModel`` averaging every parameter over dp): tp2 x dp2 x ep2's step 2 loss differs (the
expert gradients halved).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_tensor_parallel import MODEL, _matches, _run

MOE = {"model": {**MODEL, "moe": {"experts": 4, "top_k": 2, "every": 1, "aux_coef": 0.1}}}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ref"), 1, [{"_task": MOE}])[0]


def test_tp2_ep2_with_and_without_sequence_parallel_match_one_process(tmp_path, one_process) -> None:
    runs = _run(tmp_path, 2, [{"tp": 2, "ep": 2, "_task": MOE},
                              {"tp": 2, "ep": 2, "sequence_parallel": False, "_task": MOE, "_digest": True}])
    for got in runs:
        assert got["tp_sharded"], "no parameter is tensor-parallel"
        _matches(got, one_process)


def test_tp2_by_dp2_with_ep2_and_ep4_match_one_process(tmp_path, one_process) -> None:
    layouts = [{"tp": 2, "ep": 2, "_task": MOE, "_digest": True},
               {"tp": 2, "ep": 4, "sequence_parallel": False, "_task": MOE},
               {"tp": 2, "ep": 2, "plan": "fsdp", "_task": MOE}]
    for layout, got in zip(layouts, _run(tmp_path, 4, layouts), strict=True):
        _matches(got, one_process)


LLAMA_MOE = {"kind": "llama", "llama": {"size": "debug"}, **MOE}


def test_llama_tp2_ep2_with_and_without_sequence_parallel_match_one_process(tmp_path) -> None:
    """The built-in Llama's MoE layers (SwiGLU experts, no dropout) under the same plan."""
    (tmp_path / "ref").mkdir()
    ref = _run(tmp_path / "ref", 1, [{"_task": LLAMA_MOE}])[0]
    runs = _run(tmp_path, 2, [{"tp": 2, "ep": 2, "_task": LLAMA_MOE},
                              {"tp": 2, "ep": 2, "sequence_parallel": False, "_task": LLAMA_MOE}])
    for got in runs:
        assert got["tp_sharded"], "no parameter is tensor-parallel"
        _matches(got, ref)
