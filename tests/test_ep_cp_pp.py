"""Expert parallel inside context-parallel pipeline stages (ep x cp x pp, issue 39), on 4 real gloo processes.

Each pipeline stage's expert ranks are its ``dp x cp x tp`` ranks factored as ``edp x ep``: pp2 x cp2 x ep2,
the ep group of a stage being its cp group (the two halves of the same samples exchange tokens), under ddp
stages (1f1b) and fsdp stages (gpipe; the dense part FSDP over ``dp_shard x cp``, the experts over their
one-rank edp). Through the worker's own step path (tests/test_tensor_parallel.py's ``_run``: StepRunner.attach
+ run_step, seeded init, the built-in GPT with ``task.model.moe``, AdamW, the clip, dropout on), three steps:
every step's loss and clip norm, the audited sample ids and the final gathered parameters equal one
process's, and the step events' per-expert token counts are the global batch's.

The model's ``aux_coef`` is 0.5 (tests/test_ep_cp.py's reason).

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of fp32 sums (the attention's log-sum-exp merge of the
cp key blocks, the all-to-all's grouping, the aux statistics summed over cp).

Against broken builds (run before trusting it): the stages' expert gradient scale ``1 / D`` instead of
``1 / (D x cp)`` (``stage_expert_parallel`` as main had it: a cp rank's gradient is ``cp`` times its partial,
so the experts' came out doubled): step 3's loss off by 6.4e-5 relative (AdamW's update hardly sees a
gradient scale; the clip does); the stage mesh's blocks keyed by the cp coordinate as main had them:
tests/test_ep_pp_tp.py's pure test.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_ep_cp_tp import MOE
from tests.test_ep_tp import _same_load
from tests.test_tensor_parallel import _matches, _run


def test_cp_with_pp_and_ep_is_a_valid_config() -> None:
    from elastictrain.config import build_config
    from elastictrain.parallel.dims import MeshDims
    from elastictrain.task import builtin_task
    from tests.test_tensor_parallel import _spec

    for plan in ("ddp", "fsdp"):
        builtin_task(build_config(_spec(4, MOE, plan=plan, cp=2, pp=2, ep=2)))
    dims = MeshDims(pp=2, cp=2, ep=2)  # ranks (pp, cp): a stage's ep group is its cp group
    assert [dims.ep_group_ranks(r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ref"), 1, [{"_task": MOE}])[0]


def test_pp2_cp2_ep2_ddp_and_fsdp_stages_match_one_process(tmp_path, one_process) -> None:
    layouts = [{"pp": 2, "cp": 2, "ep": 2, "_task": MOE, "_digest": True},
               {"pp": 2, "cp": 2, "ep": 2, "plan": "fsdp", "pp_schedule": "gpipe", "_task": MOE}]
    for got in _run(tmp_path, 4, layouts):
        _matches(got, one_process)
        _same_load(got, one_process)
