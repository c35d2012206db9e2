"""The parallel switches: ``parallel.reshard_after_forward`` in one process; on real processes (Ray actors,
gloo) ``parallel.mixed_precision: bf16`` trains near the fp32 run with fp32 master state, and
``parallel.activation_checkpointing`` changes no number.

bf16 tolerance: bf16 keeps 8 significant bits, so one rounding of a value near the loss (~5.5) moves it by
at most 2^-9 relative (~2e-3). The loss is an fp32 mean over 16 x 32 token losses whose logits come from
bf16 matmuls; their rounding errors are independent and largely cancel in the mean, so the bf16 loss stays
far inside one bf16 rounding of the fp32 loss. We allow 2^-9 relative per step. A real defect is larger:
the first 6 steps lower the loss by 0.5-2.5% each, so a lost or doubled update, a gradient left in bf16 and
summed wrong, or a missing reduction leaves the band by the next step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import job, run_job

BF16_LOSS_RTOL = 2.0**-9


def _spec(plan: str, world: int, steps: int, **parallel):
    return job(train={"steps": steps, "global_batch": 16, "micro_batch": 2},
               workers={"min": world, "max": world}, parallel={"plan": plan, **parallel})


def _checkpoint_dtypes(root: Path) -> dict[str, torch.dtype]:
    """Every tensor's dtype in the newest DCP checkpoint under ``root`` (read from its .metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elastictrain.checkpoint.safe_metadata import loads_metadata

    (meta_path,) = sorted(root.rglob(".metadata"))[-1:]
    meta = loads_metadata(meta_path.read_bytes(), str(meta_path))
    return {k: v.properties.dtype for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def test_bf16_compute_with_fp32_master_parameters_and_gradients():
    """What FSDP2's policy does, seen from inside one process (gloo, world 1): the blocks' forward sees
    bf16 weights and produces bf16 activations; the sharded parameters and their gradients stay fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.parallelize import parallelize

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = parallelize(GPT(GPTConfig(seq_len=8, n_layer=1, d_model=16)),
                            init_device_mesh("cpu", (1,)), ParallelConfig(plan="fsdp", mixed_precision="bf16"))
        seen = []
        model.blocks[0].mlp_in.register_forward_hook(
            lambda mod, args, out: seen.append((mod.weight.dtype, out.dtype)))
        logits = model(torch.randint(0, 256, (2, 8)))
        logits.float().mean().backward()
        assert seen == [(torch.bfloat16, torch.bfloat16)] and logits.dtype == torch.bfloat16
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_keeps_what_backward_needs_first(reshard):
    """ZeRO-3 (``reshard_after_forward``): after forward every block's parameters are sharded again except
    the last block's and the root's, which backward starts with; ZeRO-2 keeps every block's gathered. A
    gathered FSDP2 parameter is a plain tensor on the module, a sharded one a DTensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.parallelize import parallelize

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = parallelize(GPT(GPTConfig(seq_len=8, n_layer=3, d_model=16)), init_device_mesh("cpu", (1,)),
                            ParallelConfig(plan="fsdp", reshard_after_forward=reshard))
        logits = model(torch.randint(0, 256, (2, 8)))
        gathered = [not isinstance(b.mlp_in.weight, DTensor) for b in model.blocks]
        assert gathered == ([False, False, True] if reshard else [True, True, True])
        assert not isinstance(model.head.weight, DTensor)  # the root's
        logits.mean().backward()  # backward gathers what forward freed and reshards everything
        assert all(isinstance(p, DTensor) for p in model.parameters())
    finally:
        dist.destroy_process_group()


STEPS = 6  # the fp32 fsdp run on 2 workers of this many steps: the reference of bf16, of AC under fsdp and of
# tests/test_meta_init.py (its CLEAN: keep the two specs equal, so the session trains it once)


def test_bf16_fsdp_trains_near_fp32_and_keeps_fp32_master_state(tmp_path, ray_local, clean_run):
    steps = STEPS
    ref = clean_run(_spec("fsdp", 2, steps))  # trained once for this test and the AC test below
    ckpt = {"uri": str(tmp_path / "ckpt"), "every_steps": steps}
    run = run_job(tmp_path, {**_spec("fsdp", 2, steps, mixed_precision="bf16"), "checkpoint": ckpt}, name="bf16")
    assert run.result.exit_code == 0 and ref.result.exit_code == 0
    lb, lf = run.losses(), ref.losses()
    assert sorted(lb) == list(range(1, steps + 1))
    assert lb[steps] < lb[1] - 0.1, lb  # it trains
    assert lb != lf  # bf16 is really in effect (the unit test above shows where)
    for step, loss in lf.items():
        assert abs(lb[step] - loss) <= BF16_LOSS_RTOL * abs(loss), (step, lb[step], loss)
    # master state: the exported model and every parameter and optimizer moment in the checkpoint are fp32
    assert {v.dtype for v in run.final_params().values()} == {torch.float32}
    dtypes = _checkpoint_dtypes(tmp_path / "ckpt")
    floats = {k: d for k, d in dtypes.items() if d.is_floating_point and not k.endswith(".step")}
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in floats), sorted(dtypes)
    assert set(floats.values()) == {torch.float32}, floats


@pytest.mark.parametrize("plan", ["ddp", "fsdp"])
def test_activation_checkpointing_changes_no_number(tmp_path, ray_local, clean_run, plan):
    """Recompute in backward repeats the block's forward exactly (dropout masks come from per-sample seeded
    generators, not the global RNG), so losses and the final model are bitwise those of the plain run."""
    steps = STEPS
    off = clean_run(_spec(plan, 2, steps))  # under fsdp: the bf16 test's fp32 reference
    on = run_job(tmp_path, _spec(plan, 2, steps, activation_checkpointing=True), name="on")
    assert on.result.exit_code == 0 and off.result.exit_code == 0
    assert on.losses() == off.losses() and len(on.losses()) == steps
    assert on.summary["final_model_sha256"] == off.summary["final_model_sha256"]
    pn, pf = on.final_params(), off.final_params()
    assert pn.keys() == pf.keys() and all(torch.equal(pn[k], pf[k]) for k in pf)


def test_activation_checkpointing_recomputes_each_block_in_backward():
    """The switch is really on: each repeated block runs its forward twice per step (once more in
    backward), the rest of the model once; the state-dict names are those of the plain model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.config import ParallelConfig
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.parallelize import parallelize

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain_names = set(GPT(GPTConfig(seq_len=8, n_layer=2, d_model=16)).state_dict())
        model = parallelize(GPT(GPTConfig(seq_len=8, n_layer=2, d_model=16)), init_device_mesh("cpu", (1,)),
                            ParallelConfig(plan="ddp", activation_checkpointing=True)).module
        calls = {"mlp_in": 0, "head": 0}
        for blk in model.blocks:
            blk._checkpoint_wrapped_module.mlp_in.register_forward_hook(
                lambda *_: calls.__setitem__("mlp_in", calls["mlp_in"] + 1))
        model.head.register_forward_hook(lambda *_: calls.__setitem__("head", calls["head"] + 1))
        model(torch.randint(0, 256, (2, 8))).mean().backward()
        assert calls == {"mlp_in": 4, "head": 1}  # 2 blocks x (forward + recompute)
        assert set(get_model_state_dict(model)) == plain_names
    finally:
        dist.destroy_process_group()
