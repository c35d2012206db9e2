"""Expert parallel under hsdp with tensor parallel or pipeline stages (ep x hsdp x tp, ep x hsdp x pp, issue
39), on 4 real gloo processes.

Under hsdp an ep group stays inside one replica (``ep`` divides ``dp_shard x cp x tp``) and the experts are
HSDP over ``(dp_replicate, efsdp)``: hsdp 2x1 x tp2 x ep2 (the ep group is a replica's tp group; the experts
replicated over the two replicas, whose HSDP all-reduce sums their gradients), and pp2 x hsdp 1x2 x ep2 (each
stage's experts over its two shard ranks: the stage mesh ``(stage, dp_replicate, efsdp, ep)``). Through the
worker's own step path (tests/test_tensor_parallel.py's ``_run``: StepRunner.attach + run_step, seeded init,
the built-in GPT with ``task.model.moe``, AdamW, the clip, dropout on), three steps: every step's loss and clip
norm, the audited sample ids and the final gathered parameters equal one process's, and the step events'
per-expert token counts are the global batch's.

The model's ``aux_coef`` is 0.5 (tests/test_ep_cp.py's reason).

Tolerance: tests/test_tensor_parallel.py's (loss and clip norm rtol 1e-5, parameters atol 1e-4 after three
AdamW steps): the same per-row math in another order of fp32 sums (reduce-scatter and all-reduce of the
gradients, tp's sharded matmuls, the all-to-all's grouping).

Against broken builds (run before trusting it): hsdp stages' experts treated as ddp's
(``stage_expert_parallel``'s FSDP flag for ``fsdp`` only, what main had: ``reduce_grads`` sums and scales
the gradients HSDP already reduced): pp2 x hsdp's step 3 loss off by 2.6e-5 relative; the experts' FSDP
divide factor left at FSDP's default (``shard_experts`` without ``set_gradient_divide_factor``): hsdp x tp's
step 3 loss off by 6.3e-5 relative (AdamW's update hardly sees a gradient scale, so the first steps' losses
move little; the clip norm moves at once).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_ep_cp_tp import MOE
from tests.test_ep_tp import _same_load
from tests.test_tensor_parallel import _matches, _run


def test_hsdp_with_tp_or_pp_and_ep_is_a_valid_config() -> None:
    from elastictrain.config import ConfigError, build_config
    from elastictrain.task import builtin_task
    from tests.test_tensor_parallel import _spec

    for parallel in ({"plan": "hsdp", "shard_size": 1, "tp": 2, "ep": 2},
                     {"plan": "hsdp", "shard_size": 2, "pp": 2, "ep": 2}):
        builtin_task(build_config(_spec(4, MOE, **parallel)))
    with pytest.raises(ConfigError, match=r"parallel\.ep=4 under hsdp must divide parallel\.shard_size=1 x tp=2 "
                                          r".*valid parallel\.ep values there: \[1, 2\]"):
        build_config(_spec(4, MOE, plan="hsdp", shard_size=1, tp=2, ep=4))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("ref"), 1, [{"_task": MOE}])[0]


def test_hsdp_x_tp_and_hsdp_x_pp_with_ep2_match_one_process(tmp_path, one_process) -> None:
    layouts = [{"plan": "hsdp", "shard_size": 1, "tp": 2, "ep": 2, "_task": MOE, "_digest": True},
               {"plan": "hsdp", "shard_size": 2, "pp": 2, "ep": 2, "_task": MOE}]
    runs = _run(tmp_path, 4, layouts)
    for got in runs:
        _matches(got, one_process)
        _same_load(got, one_process)
    assert runs[0]["tp_sharded"], "no parameter is tensor-parallel"
