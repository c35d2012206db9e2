"""Mixture of experts and expert parallelism against one process.

Pure: config errors, dropless routing (every token reaches its k experts; the output is the dense reference
sum over the chosen experts), rank-free tie-breaking, a per-sample auxiliary loss independent of the batch.
Real gloo processes: ep2 (GPT and Llama) gives one process's per-sample losses and, after
``reduce_expert_grads``, its gradients (expert slices compared slice by slice), and its DCP state loads by
name into one process's model (GPT); ep2 x dp2 gives its per-step
losses and parameters over two SGD steps.

Tolerance: float32 with atol 1e-6 / rtol 1e-5. The layouts run the same operations on the same rows in the
same combine order; what differs is the row count of each expert matmul (one process: all of an expert's
slots; ep: the same rows, the same grouping -- but BLAS may block differently) and the order of the gradient
sums (all_reduce over ranks instead of one backward over the batch): rounding of a few ulps, 1e-7 scale.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from elastictrain.config import ConfigError, build_config
from elastictrain.models.gpt import GPT, GPTConfig
from elastictrain.models.llama import Llama, LlamaConfig
from elastictrain.models.moe import MoEConfig, MoEFeedForward, moe_aux_loss, moe_token_counts
from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks

ATOL, RTOL = 1e-6, 1e-5
_GPT = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.0,
                 moe=MoEConfig(experts=8, top_k=2, every=1, aux_coef=0.01))
_LLAMA = LlamaConfig(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=24, vocab_size=64, max_seq_len=8,
                     moe=MoEConfig(experts=8, top_k=2, every=1, aux_coef=0.01))


# ------------------------------------------------------------------------------------------------ pure


@pytest.mark.parametrize("kwargs, field", [
    (dict(experts=0, top_k=1), "experts"), (dict(experts=4, top_k=0), "top_k"), (dict(experts=4, top_k=5), "top_k"),
    (dict(experts=4, top_k=1, every=0), "every"), (dict(experts=4, top_k=1, aux_coef=-1.0), "aux_coef"),
    (dict(experts=True, top_k=1), "experts"), (dict(experts=4.0, top_k=1), "experts"),
])
def test_moe_config_names_the_field_and_the_fix(kwargs, field) -> None:
    with pytest.raises(ValueError, match=rf"task\.model\.moe\.{field}=.*; set"):
        MoEConfig(**kwargs)


def test_job_config_refuses_top_k_above_experts_and_moe_with_tp_without_ep() -> None:
    with pytest.raises(ConfigError, match=r"top_k=3 exceeds task\.model\.moe\.experts=2"):
        build_config({"task": {"model": {"moe": {"experts": 2, "top_k": 3}}}})
    from elastictrain.task import builtin_task

    cfg = build_config({"task": {"model": {"moe": {"experts": 4, "top_k": 2}}}, "parallel": {"tp": 2},
                        "workers": {"min": 2, "max": 2}})
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 and parallel\.ep=1: .*or parallel\.tp=1"):
        builtin_task(cfg)
    cfg = build_config({"task": {"model": {"dropout": 0.0, "moe": {"experts": 4, "top_k": 2}}},
                        "parallel": {"compile": True}})
    with pytest.raises(ConfigError, match=r"parallel\.compile=true.*set parallel\.compile=false"):
        builtin_task(cfg)


def _expert(layer: MoEFeedForward, e: int, x: torch.Tensor) -> torch.Tensor:
    if layer.activation == "gelu":
        return torch.nn.functional.gelu(x @ layer.w_in[e] + layer.b_in[e]) @ layer.w_out[e] + layer.b_out[e]
    return (torch.nn.functional.silu(x @ layer.w1[e]) * (x @ layer.w3[e])) @ layer.w2[e]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_dropless_every_token_reaches_its_k_experts(activation) -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 12, MoEConfig(experts=4, top_k=2), activation)
    torch.nn.init.normal_(layer.router.weight, std=2.0)  # a skewed router: some experts get most tokens
    x = torch.randn(3, 5, 8)
    out = layer(x)
    _, experts, gates = layer.route(x)
    assert int(layer.tokens_per_expert.sum()) == 3 * 5 * 2
    assert (experts[..., 0] != experts[..., 1]).all()
    ref = torch.zeros_like(x)
    for b in range(3):
        for t in range(5):
            for j in range(2):
                ref[b, t] += gates[b, t, j] * _expert(layer, int(experts[b, t, j]), x[b, t])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_every_nth_block_is_moe() -> None:
    cfg = MoEConfig(experts=4, top_k=1, every=2)
    gpt = GPT(GPTConfig(n_layer=4, d_model=16, moe=cfg))
    assert [hasattr(b, "moe") for b in gpt.blocks] == [False, True, False, True]
    llama = Llama(LlamaConfig(dim=16, n_layers=3, n_heads=2, n_kv_heads=1, moe=cfg))
    assert [isinstance(layer.feed_forward, MoEFeedForward) for layer in llama.layers] == [False, True, False]


def test_ties_go_to_the_lower_expert_index() -> None:
    layer = MoEFeedForward(8, 12, MoEConfig(experts=6, top_k=3), "gelu")
    torch.nn.init.zeros_(layer.router.weight)  # every probability equal
    _, experts, gates = layer.route(torch.randn(2, 4, 8))
    assert experts.tolist() == [[[0, 1, 2]] * 4] * 2
    torch.testing.assert_close(gates, torch.full_like(gates, 1 / 3))


def test_aux_loss_and_output_of_a_sample_do_not_depend_on_its_batch() -> None:
    torch.manual_seed(1)
    model = GPT(_GPT)
    batch = torch.randint(0, 64, (4, 8))
    logits = model(batch)
    together = moe_aux_loss(model)
    for b in range(4):
        alone = model(batch[b:b + 1])
        torch.testing.assert_close(moe_aux_loss(model), together[b:b + 1], atol=0, rtol=0)
        torch.testing.assert_close(alone, logits[b:b + 1], atol=ATOL, rtol=RTOL)
    assert together.shape == (4,) and bool((together > 0).all())
    counts = moe_token_counts(model)
    assert sorted(counts) == ["blocks.0.moe", "blocks.1.moe"]
    assert all(int(c.sum()) == 1 * 8 * 2 for c in counts.values())  # the last forward: one sample's slots


@pytest.mark.parametrize("kind", ["tiny_gpt", "llama"])
def test_the_task_loss_adds_the_aux_term_in_training_only(kind) -> None:
    from elastictrain.models.gpt import per_sample_loss
    from elastictrain.task import _gpt_loss, builtin_task

    moe = {"experts": 4, "top_k": 2, "every": 2, "aux_coef": 0.5}
    task = builtin_task(build_config({"task": {"kind": kind, "model": {"seq_len": 8, "dropout": 0.0, "moe": moe}}}))
    torch.manual_seed(2)
    model = task.model_fn()
    layers = [n for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]
    assert layers == (["blocks.1.moe"] if kind == "tiny_gpt" else ["layers.1.feed_forward"])
    assert task.loss_fn is _gpt_loss
    batch = {"input": torch.randint(0, 64, (2, 8)), "target": torch.randint(0, 64, (2, 8))}
    lm = per_sample_loss(model(batch["input"]), batch["target"])
    aux = moe_aux_loss(model)
    torch.testing.assert_close(_gpt_loss(model, batch, torch.zeros(2, dtype=torch.int64)), lm + aux)
    model.eval()
    torch.testing.assert_close(_gpt_loss(model, batch, torch.zeros(2, dtype=torch.int64)), lm)


# ------------------------------------------------------------------------------------------ gloo ranks


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(_GPT) if kind == "gpt" else Llama(_LLAMA)


def _losses(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from elastictrain.task import _gpt_loss

    return _gpt_loss(model, {"input": inputs, "target": targets}, torch.zeros(len(inputs), dtype=torch.int64))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (n, 8), generator=g), torch.randint(0, 64, (n, 8), generator=g)


def _compare_params(model, ref, what) -> None:
    from torch.distributed.tensor import DTensor

    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        a, b = (p.grad, q.grad) if what == "grad" else (p.detach(), q.detach())
        if isinstance(a, DTensor):  # this rank's experts: the reference's rows at their global index
            rows = a.to_local().shape[0]
            start = a.device_mesh.get_local_rank() * rows
            a, b = a.to_local(), b[start:start + rows]
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{what} of {n}: {m}")


def _ep2(rank: int, port: int, kind: str, ckpt: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.parallel.expert import (
        enable_expert_parallel,
        expert_parameter_names,
        reduce_expert_grads,
        step_token_counts,
    )

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        inputs, targets = _data(6)
        ref = _build(kind)
        ref_losses = _losses(ref, inputs, targets)
        ref_counts = {n: c.tolist() for n, c in moe_token_counts(ref).items()}
        ref_losses.mean().backward()
        model = _build(kind)
        enable_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
        mine = slice(3 * rank, 3 * rank + 3)
        losses = _losses(model, inputs[mine], targets[mine])
        torch.testing.assert_close(losses, ref_losses[mine], atol=ATOL, rtol=RTOL)
        sent = [c.view(2, -1).sum(dim=1).tolist() for c in moe_token_counts(model).values()]
        assert any(a != b for a, b in sent), f"even splits {sent}: the test would not see uneven all-to-alls"
        # the step's counts, over both data ranks, are the one process's (two micro-batches of one sample's
        # counts here: the rank's first sample alone, then its other two)
        micro = []
        for part in (slice(3 * rank, 3 * rank + 1), slice(3 * rank + 1, 3 * rank + 3)):
            with torch.no_grad():
                _losses(model, inputs[part], targets[part])
            micro.append(moe_token_counts(model))
        assert step_token_counts(micro, dist.group.WORLD) == ref_counts
        losses.mean().backward()
        experts = set(expert_parameter_names(model))
        for name, p in model.named_parameters():  # dense: the mean over the 2 data ranks, as DDP does
            if name not in experts:
                dist.all_reduce(p.grad)
                p.grad.div_(2)
        reduce_expert_grads(model, None, scale=1 / 2)
        _compare_params(model, ref, "grad")
        if kind == "gpt":
            _state_by_name(rank, model, ref, ckpt)
            _all_slots_to_one_rank(rank, model, ref, inputs, targets)
    finally:
        dist.destroy_process_group()


def _all_slots_to_one_rank(rank, model, ref, inputs, targets) -> None:
    """Zero routers: every token ties, so every slot goes to experts 0 and 1 (rank 0's); rank 1 receives
    no rows and sends all of its own. Losses and gradients still equal one process's."""
    import torch.distributed as dist

    from elastictrain.parallel.expert import expert_parameter_names, reduce_expert_grads

    for m in (model, ref):
        m.zero_grad()
        with torch.no_grad():
            for layer in (x for x in m.modules() if isinstance(x, MoEFeedForward)):
                layer.router.weight.zero_()
    ref_losses = _losses(ref, inputs, targets)
    ref_losses.mean().backward()
    mine = slice(3 * rank, 3 * rank + 3)
    losses = _losses(model, inputs[mine], targets[mine])
    assert all(c[2:].sum() == 0 for c in moe_token_counts(model).values())
    torch.testing.assert_close(losses, ref_losses[mine], atol=ATOL, rtol=RTOL)
    losses.mean().backward()
    experts = set(expert_parameter_names(model))
    for name, p in model.named_parameters():
        if name not in experts:
            dist.all_reduce(p.grad)
            p.grad.div_(2)
    reduce_expert_grads(model, None, scale=1 / 2)
    _compare_params(model, ref, "grad")


def _state_by_name(rank: int, model: torch.nn.Module, ref: torch.nn.Module, ckpt: str) -> None:
    """The ep2 model's state under DCP (saved by name, expert DTensors with their global offsets) loads
    into a one-process model; a meta build made expert-parallel, then given memory and a seeded init by name,
    holds this rank's slice of the whole model's values."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.parallel.expert import enable_expert_parallel
    from elastictrain.parallel.init import init_by_name

    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    dist.barrier()
    if rank == 0:
        whole = GPT(_GPT).state_dict()  # other values (a fresh build): all must be overwritten
        dcp.load(whole, checkpoint_id=ckpt, no_dist=True)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(whole[k], v, atol=0, rtol=0, msg=lambda m, k=k: f"{k} after load: {m}")
    seeded = GPT(_GPT)
    with torch.device("meta"):  # the meta build a sharded start uses: sharded before it has memory
        sharded = GPT(_GPT)
    enable_expert_parallel(sharded, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))
    sharded.to_empty(device="cpu")
    init_by_name(seeded, seeded, seed=5)
    init_by_name(sharded, sharded, seed=5)
    _compare_params(sharded, seeded, "param")


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_ep2_losses_and_gradients_equal_one_process(kind, tmp_path) -> None:
    run_ranks(_ep2, (free_port(), kind, str(tmp_path / "ckpt")), nprocs=2)


def _ep2_dp2(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from elastictrain.parallel.expert import (
        enable_expert_parallel,
        expert_parameter_names,
        full_state_dict,
        reduce_expert_grads,
    )

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "ep"))  # rank = 2 * dp + ep
        ref, model = _build("gpt"), _build("gpt")
        enable_expert_parallel(model, mesh["ep"])
        experts = set(expert_parameter_names(model))
        # SGD with momentum, not Adam: Adam divides by sqrt(v), which turns the rounding noise of a gradient
        # that is zero in exact arithmetic (the key bias: softmax ignores a per-query constant) into lr-size
        # updates, so its parameters differ by more than any fixed tolerance while the math is identical
        opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, foreach=False) for m in (ref, model)]
        for step in range(2):
            inputs, targets = _data(8 * (step + 1))
            inputs, targets = inputs[-8:], targets[-8:]
            ref_losses = _losses(ref, inputs, targets)
            ref_losses.mean().backward()
            mine = slice(2 * rank, 2 * rank + 2)
            losses = _losses(model, inputs[mine], targets[mine])
            torch.testing.assert_close(losses, ref_losses[mine], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, s=step: f"step {s} losses: {m}")
            losses.mean().backward()
            for name, p in model.named_parameters():
                if name not in experts:
                    dist.all_reduce(p.grad)
                    p.grad.div_(4)
            reduce_expert_grads(model, mesh["dp_replicate"].get_group(), scale=1 / 4)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            _compare_params(model, ref, "param")
        whole = full_state_dict(model)  # gathered over the ep group: the one-process model's state
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(whole[k], v, atol=ATOL, rtol=RTOL)
    finally:
        dist.destroy_process_group()


def test_ep2_dp2_sgd_steps_equal_one_process() -> None:
    run_ranks(_ep2_dp2, (free_port(),), nprocs=4)
