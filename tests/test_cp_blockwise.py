"""Context parallel's mask-free attention (elastictrain/parallel/blockwise.py) against one process.

Pure (one process, every cp rank simulated): each rank's head-tail queries over the keys in gathered (rank)
order, as :func:`gather_sequence` hands them, through :func:`blockwise_causal_attention`; the rank outputs
are put back in global order and compared with one process's causal SDPA, and the gradients of q, k and v
(summed over the ranks by autograd, as the gather's reduce-scatter sums them onto the owner) with its
gradients; and what autograd saves (no ``T / cp x T`` tensor).

Gloo (2 and 4 real processes): ``cp_attention`` (which takes the blockwise path on CPU fp32) and the masked
path over the same gathered K/V, each rank's output and the gradients of its q, k and v through
:func:`gather_sequence`'s backward, against one process's causal SDPA of the whole sequence.

Tolerance (and why): the same softmax computed in blocks and merged by log-sum-exp: fp32 sums in another
order. Measured (2026-11-28): outputs and gradients within ~1e-6 at T 512 (|values| up to ~6; the masked
path differs from one process by up to 2.4e-6 on a gradient of 5.7). ATOL = 2e-6 plus RTOL = 1e-6.

Broken builds, each failing these tests (measured): the backward given each part's own log-sum-exp and
output instead of the merged ones (every gradient test); the diagonal block not causal (outputs); the
grouped-query gradient taken from the first repeated head instead of summed (the n_rep 2 cases).
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks

ATOL, RTOL = 2e-6, 1e-6


def _inputs(seq_len: int, n_rep: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seq_len * 10 + n_rep)
    b, hkv, d = 2, 2, 16
    q = torch.randn(b, hkv * n_rep, seq_len, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, seq_len, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, seq_len, d, generator=g, dtype=dtype)
    grad = torch.randn(b, hkv * n_rep, seq_len, d, generator=g, dtype=dtype)
    return q, k, v, grad


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, n_rep: int
               ) -> tuple[torch.Tensor, ...]:
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    kr, vr = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("seq_len,cp,n_rep", [(64, 2, 1), (64, 4, 2), (128, 2, 2), (512, 2, 1), (512, 4, 2)])
def test_blockwise_matches_one_process_outputs_and_gradients(seq_len: int, cp: int, n_rep: int) -> None:
    from elastictrain.parallel.blockwise import blockwise_causal_attention
    from elastictrain.parallel.context import cp_positions, kv_positions

    q0, k0, v0, grad = _inputs(seq_len, n_rep)
    want_out, want_dq, want_dk, want_dv = _reference(q0, k0, v0, grad, n_rep)
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    kv_pos = kv_positions(seq_len, cp)
    out = torch.empty_like(want_out)
    for rank in range(cp):
        pos = cp_positions(seq_len, cp, rank)
        part = blockwise_causal_attention(q[:, :, pos], k[:, :, kv_pos], v[:, :, kv_pos], cp, rank, n_rep=n_rep)
        part.backward(grad[:, :, pos])
        out[:, :, pos] = part.detach()
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)
    for got, want in ((q.grad, want_dq), (k.grad, want_dk), (v.grad, want_dv)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_blockwise_saves_no_sequence_squared_tensor() -> None:
    """What autograd keeps: q, the keys and values (not repeated), the output and its log-sum-exp: no
    tensor with T / cp x T elements (the masked path's bias); the output in SDPA's memory layout."""
    from elastictrain.parallel.blockwise import blockwise_causal_attention
    from elastictrain.parallel.context import cp_positions, kv_positions

    seq_len, cp = 256, 2
    q, k, v, _ = _inputs(seq_len, 2)
    kv_pos = kv_positions(seq_len, cp)
    q = q[:, :, cp_positions(seq_len, cp, 1)].requires_grad_()
    k, v = k[:, :, kv_pos].requires_grad_(), v[:, :, kv_pos].requires_grad_()
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = blockwise_causal_attention(q, k, v, cp, 1, n_rep=2)
    # laid out [B, t, H, D] like SDPA's output, so the model's transpose(1, 2).reshape is a view and the
    # output projection saves this storage, not a copy of it (measured: 1 MiB a layer at T 2048, d 256)
    assert out.transpose(1, 2).is_contiguous()
    b, hq, t, d = q.shape
    # q, K and V (kv heads, not repeated), the output, the log-sum-exp: no [.., t, T] mask or scores
    assert sorted(shapes) == sorted([(b, hq, t, d), (b, 2, seq_len, d), (b, 2, seq_len, d), (b, hq, t, d),
                                     (b, hq, t)]), shapes


def test_unsupported_inputs_fall_back() -> None:
    from elastictrain.parallel.blockwise import blockwise_supported

    q, k, v, _ = _inputs(64, 1)
    assert blockwise_supported(q, k, v)
    assert not blockwise_supported(*(x.to(torch.bfloat16) for x in (q, k, v)))
    assert not blockwise_supported(q[:, :, :31], k, v)  # odd local length: no head/tail halves


# ---------------------------------------------------------------- gloo ranks


def _rank(rank: int, cp: int, seq_len: int, n_rep: int, port: int) -> None:
    import torch.distributed as dist

    from elastictrain.parallel.context import _masked_attention, cp_attention, cp_positions, gather_sequence

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=cp, timeout=datetime.timedelta(seconds=120))
    try:
        q0, k0, v0, grad = _inputs(seq_len, n_rep)
        want_out, want_dq, want_dk, want_dv = _reference(q0, k0, v0, grad, n_rep)
        pos = cp_positions(seq_len, cp, rank)
        group = dist.group.WORLD
        got_by: dict[str, list[torch.Tensor]] = {}
        for name in ("blockwise", "masked"):
            q, k, v = (x[:, :, pos].clone().requires_grad_() for x in (q0, k0, v0))
            if name == "blockwise":
                out = cp_attention(q, k, v, pos, None, group, n_rep=n_rep)
            else:
                kg, vg = gather_sequence(k, group, dim=2), gather_sequence(v, group, dim=2)
                out = _masked_attention(q, kg, vg, pos, None, group, n_rep)
            out.backward(grad[:, :, pos])
            torch.testing.assert_close(out.detach(), want_out[:, :, pos], atol=ATOL, rtol=RTOL, msg=name)
            for what, got, want in (("q", q.grad, want_dq), ("k", k.grad, want_dk), ("v", v.grad, want_dv)):
                torch.testing.assert_close(got, want[:, :, pos], atol=ATOL, rtol=RTOL,
                                           msg=lambda m, name=name, what=what: f"{name} d{what}: {m}")
            got_by[name] = [out.detach(), q.grad, k.grad, v.grad]
        for blockwise, masked in zip(got_by["blockwise"], got_by["masked"], strict=True):
            torch.testing.assert_close(blockwise, masked, atol=ATOL, rtol=RTOL)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp,seq_len,n_rep", [(2, 256, 2), (4, 128, 1)])
def test_cp_attention_matches_masked_path_and_one_process_on_gloo(cp: int, seq_len: int, n_rep: int) -> None:
    run_ranks(_rank, (cp, seq_len, n_rep, free_port()), nprocs=cp)


def test_the_planner_prices_the_mask_only_where_the_attention_keeps_one() -> None:
    """On a CPU cluster in fp32 cp attention is blockwise (no mask): the planner's activations leave the
    ``T / C x T`` bias out there, and keep it on GPUs and on CPU in bf16 (the masked path)."""
    from elastictrain.planner.cluster import CPU_DEFAULTS, GPU_DEFAULTS
    from elastictrain.planner.inputs import Candidate, Cluster, ModelShape, Training
    from elastictrain.planner.memory import activation_bytes, cp_mask_bytes, cp_mask_held, memory

    model = ModelShape(layers=4, hidden=256, heads=4, seq_len=2048, vocab=256)
    fp32, bf16 = Training(global_batch=2, micro_batch=1), Training(global_batch=2, micro_batch=1, precision="bf16")
    cpu = Cluster(nodes=1, devices_per_node=2, device_memory=24 * 2 ** 30, **CPU_DEFAULTS)
    gpu = Cluster(nodes=1, devices_per_node=2, **GPU_DEFAULTS)
    two = Candidate(cp=2, micro_batch=1)
    assert not cp_mask_held(cpu, fp32) and cp_mask_held(cpu, bf16) and cp_mask_held(gpu, fp32)
    mask = cp_mask_bytes(model, fp32, two)
    assert mask == 1024 * 2048 * 4 and cp_mask_bytes(model, fp32, two, masked=False) == 0
    assert memory(model, fp32, gpu, two).activations == activation_bytes(model, fp32, two)
    assert memory(model, fp32, cpu, two).activations == pytest.approx(activation_bytes(model, fp32, two) - mask)
