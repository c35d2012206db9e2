"""Expert parallel inside tensor-parallel pipeline stages (ep x pp x tp, issue 39), on 4 real gloo processes.

Each pipeline stage's expert ranks are its ``dp x cp x tp`` ranks factored as ``edp x ep`` (torchtitan's rule,
expert tensor parallel degree 1, per stage): pp2 x tp2 x ep2, the ep group of a stage being its tp group (each
MoE layer takes this tp rank's positions: ``MoETokenSplit``), under ddp stages with sequence parallel (1f1b)
and fsdp stages without it (gpipe). Through the worker's own step path (tests/test_tensor_parallel.py's
``_run``: StepRunner.attach + run_step, seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip,
dropout on), three steps: every step's loss and clip norm, the audited sample ids and the final gathered
parameters equal one process's, and the step events' per-expert token counts (taken inside the schedule:
``StageTokenTally``) are the global batch's. The fsdp stages' checkpoint resumes under ddp4 x ep1 with the
uninterrupted numbers (the experts resharded by DCP from (stage, ep, edp) shards to whole tensors).

The model's ``aux_coef`` is 0.5 (tests/test_ep_cp.py's reason).

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of fp32 sums (tp's sharded matmuls, the all-to-all's
grouping, the aux statistics summed over tp, the stages' losses summed in the (loss, stop) word).

Against broken builds (run before trusting it): the stage mesh's blocks keyed by (pp, cp, tp) coordinates, as
main had (an ep group then appears in one block per tp coordinate): the pure test fails; the
pipeline's token counts not divided by tp (``StageTokenTally.total`` without ``copies``): every layer's
counts sum to twice the slots; the experts' gradient scale ``1 / (D x cp x tp)`` instead of ``1 / (D x cp)``
(``stage_expert_parallel``: the tp ranks' contributions averaged rather than summed): step 3's loss off by
2.6e-5 relative (AdamW's update hardly sees a gradient scale; the clip does).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_ep_cp_tp import MOE
from tests.test_ep_tp import _same_load
from tests.test_tensor_parallel import _matches, _resumed_matches, _run


def test_stage_expert_mesh_factors_each_stage_over_its_cp_and_tp_ranks() -> None:
    """Pure: every block one pp coordinate's ranks, a row an ep group, a column the expert replicas."""
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.parallel.expert_pipeline import ep_stage_mesh_blocks
    from elastictrain.parallel.expert_wiring import ep_mesh_layout

    assert ep_stage_mesh_blocks(MeshDims(pp=2, tp=2, ep=2)) == [[[0, 1]], [[2, 3]]]
    assert ep_stage_mesh_blocks(MeshDims(dp_replicate=2, pp=2, tp=2, ep=2)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    five = MeshDims(pp=2, cp=2, tp=2, ep=4)
    assert ep_stage_mesh_blocks(five) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    hsdp = MeshDims(dp_replicate=2, dp_shard=1, pp=2, tp=2, ep=2, plan="hsdp")
    assert ep_mesh_layout(hsdp) == ([[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]],
                                    ("stage", "dp_replicate", "efsdp", "ep"))
    for dims in (five, hsdp, MeshDims(dp_shard=2, pp=2, cp=2, tp=2, ep=4, plan="fsdp")):
        blocks = ep_stage_mesh_blocks(dims)
        assert sorted(r for r in _flat(blocks)) == list(range(dims.world_size))
        for stage, block in enumerate(blocks):
            assert {dims.coord(r)["pp"] for r in _flat(block)} == {stage}


def _flat(nested: Any) -> list[int]:
    return [nested] if isinstance(nested, int) else [r for part in nested for r in _flat(part)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ref"), 1, [{"_task": MOE}])[0]


def test_pp2_tp2_ep2_ddp_and_fsdp_stages_match_one_process(tmp_path, one_process) -> None:
    """And a checkpoint of the fsdp stages after two steps (DCP, by name) resumes under ddp4 with ep1 (every
    expert whole on each rank, no pipeline, no tp): its third step is the uninterrupted run's."""
    ckpt = str(tmp_path / "pp2tp2ep2")
    fsdp = {"pp": 2, "tp": 2, "ep": 2, "plan": "fsdp", "pp_schedule": "gpipe", "sequence_parallel": False,
            "_task": MOE}
    layouts = [{"pp": 2, "tp": 2, "ep": 2, "_task": MOE, "_digest": True}, fsdp,
               {**fsdp, "_steps": 2, "_save": ckpt}, {"_task": MOE, "_load": ckpt, "_steps": 1}]
    runs = _run(tmp_path, 4, layouts)
    for got in runs[:2]:
        assert got["tp_sharded"], "no parameter is tensor-parallel"
        _matches(got, one_process)
        _same_load(got, one_process)
    _resumed_matches(runs[3], one_process, 2)
