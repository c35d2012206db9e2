"""Context parallelism's math and models (elastictrain/parallel/context.py) on real gloo processes.

Pure: the head-tail split covers every position once and balances the causal work; a bad cp is one line
naming the valid values; a batch is sliced to a rank's positions. On 2 (cp2) and 4 (cp2 x tp2, sequence
parallel on) processes: every rank trains the built-in GPT (dropout on) or Llama for STEPS AdamW steps
both ways: whole in its own process (the reference, no collective) and context-parallel on its slice of
each sample, gradients averaged over the cp ranks as DDP/FSDP would over ``dp x cp`` (the gradient rule),
and the test compares every step's per-sample losses, the cp logits against the reference's rows, every
step's gradients (after the rule) and the final parameters.

Tolerance (and why): cp computes the same attention as one process with the keys in another order (the
gathered ranks' chunks) under an explicit mask, the loss as a sum of per-rank token sums, a parameter's
gradient as a sum over ranks: fp32 sums in another order. Measured on this machine (2026-11-28, cp2 and
cp2 x tp2, GPT and Llama): losses within 2.3e-7 relative, logits within 7.5e-8, gradients within 1.5e-7
absolute (|g| up to 0.62), parameters within 1.2e-7 absolute after 3 AdamW steps, except the GPT's key
biases (6e-6 .. 1.5e-5): a key bias adds the same q.b to every score of a query, which softmax ignores, so
its gradient is zero in exact arithmetic and rounding noise in practice, which AdamW normalises into
updates of up to lr (3e-3) whatever the layout. Their values are left out of the parameter comparison
(their gradients are compared; the key path is checked by the key weights, the logits and the losses). We
allow LOSS_RTOL = 1e-5 and GRAD_ATOL = PARAM_ATOL = 1e-6, far below what a cp bug does.

Broken builds, each failing the gloo tests (measured): positions not offset (every rank uses 0..t-1: all
4 fail), the causal mask letting a query see one key ahead (all 4), the gradient scale left at 1 instead of
cp (all 4, by the gradients: AdamW alone hides it to ~1e-6), the key/value gradient kept by the gathering
rank instead of summed to its owner (all 4), the GPT's dropout masks drawn for the local slice's shape (the
2 GPT tests).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
from typing import Any

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-6
GRAD_ATOL = 1e-6
STEPS = 3
B, T = 2, 16


# ---------------------------------------------------------------- pure


@pytest.mark.parametrize("seq_len,cp", [(16, 1), (16, 2), (16, 4), (24, 3), (64, 8)])
def test_positions_cover_every_position_once_head_tail_balanced(seq_len: int, cp: int) -> None:
    from elastictrain.parallel.context import cp_positions, kv_positions

    held = [cp_positions(seq_len, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq_len))
    assert torch.equal(kv_positions(seq_len, cp), torch.cat(held))
    # causal work of a rank: sum over its queries of (p + 1) keys; head-tail makes it equal on every rank
    work = {int((pos + 1).sum()) for pos in held}
    assert len(work) == 1, work
    if cp > 1:
        chunk = seq_len // (2 * cp)
        assert torch.equal(held[0][:chunk], torch.arange(chunk))
        assert torch.equal(held[0][chunk:], torch.arange(seq_len - chunk, seq_len))


def test_bad_cp_names_the_valid_values() -> None:
    from elastictrain.parallel.context import cp_positions, valid_cp

    with pytest.raises(ValueError) as err:
        cp_positions(24, 5, 0)
    line = str(err.value)
    assert "parallel.cp=5" in line and "seq_len=24" in line and "2*cp=10" in line
    assert str(valid_cp(24, 16)) in line and valid_cp(24) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(ValueError, match=r"cp_rank=2 must be an int in 0\.\.1"):
        cp_positions(16, 2, 2)
    with pytest.raises(ValueError, match="positive int"):
        cp_positions(16, 0, 0)


def test_shard_sequence_slices_sequence_tensors_and_adds_positions() -> None:
    from elastictrain.parallel.context import cp_positions, shard_sequence

    batch = {"input": torch.arange(2 * 16).view(2, 16), "target": torch.arange(2 * 16).view(2, 16) + 100,
             "mask": torch.ones(2, 16, 3), "weight": torch.tensor([1.0, 2.0])}
    part = shard_sequence(batch, 2, 1)
    pos = cp_positions(16, 2, 1)
    assert torch.equal(part["positions"], pos) and torch.equal(pos, torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]))
    assert torch.equal(part["input"], batch["input"][:, pos]) and torch.equal(part["target"], batch["target"][:, pos])
    assert part["mask"].shape == (2, 8, 3) and torch.equal(part["weight"], batch["weight"])
    with pytest.raises(ValueError, match="sequence lengths differ"):
        shard_sequence({"input": torch.zeros(2, 16), "target": torch.zeros(2, 8)}, 2, 0)


def test_a_model_without_the_hook_is_refused_naming_what_is_missing() -> None:
    from elastictrain.models.gpt import GPT, GPTConfig
    from elastictrain.parallel.context import context_parallel_refusal, enable_context_parallel

    assert context_parallel_refusal(GPT(GPTConfig(seq_len=16, d_model=16))) is None
    line = context_parallel_refusal(torch.nn.Linear(2, 2))
    assert line is not None and "\n" not in line
    assert "Linear" in line and "cp_group" in line and "positions" in line and "parallel.cp=1" in line
    with pytest.raises(ValueError, match="cp_group"):
        enable_context_parallel(torch.nn.Linear(2, 2), None)


# ---------------------------------------------------------------- gloo ranks


def _model(kind: str, dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from elastictrain.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, d_model=16, dropout=dropout))
    from elastictrain.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=32,
                             max_seq_len=T))


def _batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from elastictrain.models.gpt import sample_seeds

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (B, T + 1), generator=gen)
    ids = [step * B + i for i in range(B)]
    return {"input": tokens[:, :-1], "target": tokens[:, 1:]}, sample_seeds(7, step, ids)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(rank: int, world: int, kind: str, cp: int, tp: int, dropout: float, port: int, out: str) -> None:
    """One rank: the reference (whole model, this process alone) and the cp run (cp x tp mesh) for STEPS
    steps each; rank 0 saves both trajectories."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from elastictrain.models.gpt import per_sample_loss
    from elastictrain.parallel.context import cp_group_of, cp_sample_loss, enable_context_parallel, shard_sequence
    from elastictrain.parallel.tensor import average_grads, parallelize_tp, settle_grads

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        base = _model(kind, dropout)
        ref, res = copy.deepcopy(base), {"losses": [], "logits": [], "ref_losses": [], "ref_logits": [],
                                     "grads": [], "ref_grads": []}
        opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
        for step in range(STEPS):
            batch, seeds = _batch(step)
            logits = ref(batch["input"], seeds)
            loss = per_sample_loss(logits, batch["target"])
            loss.sum().backward()
            res["ref_grads"].append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
            opt.step()
            opt.zero_grad()
            res["ref_losses"].append(loss.detach())
            res["ref_logits"].append(logits.detach())
        res["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}

        mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
        model = copy.deepcopy(base)
        if tp > 1:
            parallelize_tp(model, mesh["tp"], None)  # sequence parallel on (its default)
        cp_group = mesh["cp"].get_group()
        enable_context_parallel(model, cp_group)
        assert cp_group_of(model) is cp_group and cp_group_of(base) is None
        cp_rank = mesh["cp"].get_local_rank()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
        for step in range(STEPS):
            batch, seeds = _batch(step)
            part = shard_sequence(batch, cp, cp_rank)
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                logits = model(part["input"], seeds, positions=part["positions"])
                loss = cp_sample_loss(logits, part["target"], cp_group)
                loss.sum().backward()
            settle_grads(list(model.parameters()))
            average_grads(list(model.parameters()), cp_group)  # DDP/FSDP's mean over dp x cp (dp = 1)
            res["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            res["losses"].append(loss.detach())
            res["logits"].append((part["positions"], _full(logits)))
        res["params"] = {n: _full(p) for n, p in model.named_parameters()}
        if rank == world - 1:  # cp rank 1 (and tp rank 1 under tp): the second half's positions
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, kind: str, cp: int, tp: int = 1, dropout: float = 0.0) -> dict[str, Any]:
    out = str(tmp_path / "res.pt")
    run_ranks(_train, (cp * tp, kind, cp, tp, dropout, free_port(), out), nprocs=cp * tp)
    return torch.load(out)


def _assert_same_trajectory(res: dict[str, Any]) -> None:
    for step in range(STEPS):
        got, want = res["losses"][step], res["ref_losses"][step]
        assert torch.allclose(got, want, rtol=LOSS_RTOL, atol=0), (step, got, want)
        positions, logits = res["logits"][step]
        want_logits = res["ref_logits"][step][:, positions]
        assert torch.allclose(logits, want_logits, rtol=0, atol=1e-5), (step, (logits - want_logits).abs().max())
        for name, want in res["ref_grads"][step].items():
            diff = (res["grads"][step][name] - want).abs().max().item()
            assert diff <= GRAD_ATOL, (step, name, diff)
    for name, want in res["ref_params"].items():
        if name.endswith(".k.bias"):  # zero gradient in exact arithmetic: see the module doc
            continue
        diff = (res["params"][name] - want).abs().max().item()
        assert diff <= PARAM_ATOL, (name, diff)


@pytest.mark.parametrize("kind,dropout", [("gpt", 0.1), ("llama", 0.0)])
def test_cp2_trains_the_numbers_of_one_process(tmp_path, kind: str, dropout: float) -> None:
    _assert_same_trajectory(_run(tmp_path, kind, cp=2, dropout=dropout))


@pytest.mark.parametrize("kind,dropout", [("gpt", 0.1), ("llama", 0.0)])
def test_cp2_x_tp2_sequence_parallel_trains_the_numbers_of_one_process(tmp_path, kind: str, dropout: float) -> None:
    _assert_same_trajectory(_run(tmp_path, kind, cp=2, tp=2, dropout=dropout))
