"""Meta-device builds under sharded layouts (real Ray, real gloo, 2 processes): ``parallel.meta_init``
starts from exactly the seeded values, and a model rebuilt on meta after a failure gets its values from the
seeded build when nothing else holds the state."""

from __future__ import annotations

import pytest
import torch

from elastictrain import build_config
from elastictrain.config import ConfigError
from elastictrain.parallel.materialize import has_meta_params, materialize, params_on_meta
from tests.conftest import job, run_job


# the fp32 fsdp reference of tests/test_parallel_switches.py (its _spec("fsdp", 2, 6)): one clean run for both
CLEAN = job(train={"steps": 6, "global_batch": 16, "micro_batch": 2}, workers={"min": 2, "max": 2},
            parallel={"plan": "fsdp"})


def _spec(meta_init: bool = False, **sections):
    return job(train=CLEAN["train"], parallel={"plan": "fsdp", "meta_init": meta_init}, workers=CLEAN["workers"],
               **sections)


@pytest.fixture
def clean(ray_local, clean_run):
    """The fault-free fsdp run on 2 workers, trained once per session (shared with the switches' tests)."""
    return clean_run(CLEAN).summary


def test_params_on_meta_keeps_buffers_and_materialize_restores_them() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)

    with params_on_meta():
        m = M()
    assert has_meta_params(m) and m.lin.weight.is_meta and not m.mask.is_meta
    materialize(m, torch.device("cpu"))
    assert not has_meta_params(m) and torch.equal(m.mask, torch.tril(torch.ones(3, 3)))
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the block


def test_meta_init_is_rejected_with_ddp() -> None:
    with pytest.raises(ConfigError, match="parallel.meta_init=true needs a layout where no rank holds the whole model"):
        build_config(job(parallel={"plan": "ddp", "meta_init": True}))


def test_meta_init_starts_from_the_seeded_values(tmp_path, ray_local, clean) -> None:
    from elastictrain.task import builtin_task
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    config = build_config(_spec(meta_init=True))
    runner = StepRunner(builtin_task(config), config.train, FaultInjector(()), parallel=config.parallel)
    assert has_meta_params(runner.model)  # the worker's build holds no parameter memory
    run = run_job(tmp_path, _spec(meta_init=True), name="meta")
    assert run.result.exit_code == 0
    assert run.summary["final_model_sha256"] == clean["final_model_sha256"]


def test_a_rebuilt_model_restarts_from_the_seeded_values(tmp_path, ray_local, clean) -> None:
    """fsdp, no checkpoint, no peer tier: rank 1 dies, rank 0's shard alone is not a state, so the run
    restarts from step 0. The survivor's model is rebuilt on meta and the replacement's is a normal build:
    both must end up at the seeded values (rank 0 broadcasts them), so the run ends like the clean one."""
    kill = [{"rank": 1, "step": 4, "kind": "kill", "generation": 0}]
    run = run_job(tmp_path, _spec(faults=kill, recovery={"mode": "strict"},
                                  checkpoint={"memory_every_steps": 0}), name="scratch")
    assert run.result.exit_code == 0
    assert [r["source"] for r in run.of("recovered")] == ["scratch"], run.of("recovered")
    assert run.summary["final_model_sha256"] == clean["final_model_sha256"]
    # the steps reported before the kill are redone from step 0: each marked, superseding its first event
    from tests.step_checks import assert_each_step_counted_once

    redone = assert_each_step_counted_once(run)
    assert redone and redone == list(range(1, len(redone) + 1)), redone
