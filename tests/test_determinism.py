"""Global randomness and dtypes of user tasks (issue 8 items 11, 12): a model with plain ``nn.Dropout``
(torch's global generator, no ``sample_seeds``) trains the same at 1 and 2 workers and stays bitwise equal
across a strict-mode replacement; a bf16 model runs end to end."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from elastictrain import Task, Trainer, build_config
from elastictrain.worker.rng import micro_batch_seed
from tests.conftest import Run, job

# the user tasks below travel to the Ray workers by value: the workers cannot import this test module
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                       torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def _loss(model: torch.nn.Module, batch: dict, _seeds: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return (model(batch["x"].to(dtype)) - batch["y"].to(dtype)).pow(2)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(128, 8, generator=g)
    return [{"x": xs[i], "y": xs[i].sum()} for i in range(128)]


def _dropout_task(dtype: torch.dtype = torch.float32) -> Task:
    return Task(model_fn=_Model(dtype), loss_fn=_loss, optimizer_fn=_sgd, dataset_fn=_data)


class _Model:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self) -> torch.nn.Module:
        return _DropoutMLP().to(self.dtype)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def _run(tmp_path, spec, name, task=None) -> Run:
    return Run(Trainer(build_config(spec), task or _dropout_task(), run_dir=tmp_path / name, console=None).fit())


def test_micro_batch_seed_is_pure():
    # the value written out: the same in every process and every run (no process state, no hash seed), and
    # a change of the derivation -- which changes every dropout mask of every resumed run -- shows here
    assert micro_batch_seed(0, 3, 5) == 1947591036852200192
    # each argument counts: another seed, step or chunk is another stream
    assert [micro_batch_seed(1, 3, 5), micro_batch_seed(0, 4, 5), micro_batch_seed(0, 3, 6)] == [
        6429895028245179728, 8952073102334564150, 4600960218297312804]
    assert len({micro_batch_seed(0, s, j) for s in range(4) for j in range(4)}) == 16


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> Run:
    """The plain-dropout task's 6 steps on 2 workers without faults: trained once for the two tests below."""
    from tests.conftest import _ensure_local_ray

    _ensure_local_ray()
    return _run(tmp_path_factory.mktemp("dropout"), job(train={"steps": 6}), "two")


def test_plain_dropout_same_at_one_and_two_workers(ray_local, two_workers):
    """Chunk j = k*W + r names the same samples at any world size, so the masks match: before the
    generators were seeded per (seed, step, chunk), 1 and 2 workers drew different masks. One worker: the
    worker's step loop on a one-rank group in this process (tests/parallel_fixtures.py InProcessRun)."""
    from tests.parallel_fixtures import InProcessRun

    one = InProcessRun(job(train={"steps": 6}, workers={"min": 1, "max": 1}), task=_dropout_task())
    two = two_workers
    assert {e["world_size"] for e in two.of("step")} == {2}
    p1, p2 = one.final_params(), two.final_params()
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-4, atol=1e-5, msg=name)


def test_plain_dropout_strict_replacement_is_bitwise(tmp_path, ray_local, two_workers):
    """A replacement worker draws what the worker it replaced would have drawn (before: it restarted the
    global generator at the seed, so its masks differed from then on). The clean run is the same job
    without the kill (strict mode changes no number of a run without failures)."""
    kill = {"rank": 1, "step": 3, "point": "mid_step", "kind": "kill"}
    spec = job(train={"steps": 6}, recovery={"mode": "strict"})
    faulty = _run(tmp_path, {**spec, "faults": [kill]}, "faulty")
    clean = two_workers
    assert faulty.result.exit_code == 0 and len(faulty.of("failure")) == 1
    assert {e["world_size"] for e in faulty.of("step")} == {2}
    assert faulty.summary["final_model_sha256"] == clean.summary["final_model_sha256"]


def test_bf16_model_end_to_end(tmp_path, ray_local):
    """Before: the final digest called ``.numpy()`` on bf16 tensors and the finished run crashed."""
    spec = job(train={"steps": 3}, checkpoint={"uri": str(tmp_path / "ck"), "every_steps": 2, "when_busy": "wait"})
    run = _run(tmp_path, spec, "bf16", task=_dropout_task(torch.bfloat16))
    assert run.result.exit_code == 0 and run.summary["final_step"] == 3
    assert run.summary["final_model_sha256"] and run.summary["checkpoints_committed"] == [2, 3]  # final step too
    assert {t.dtype for t in run.final_params().values()} == {torch.bfloat16}
