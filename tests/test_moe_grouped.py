"""The experts' grouped GEMM (``torch._grouped_mm``, elastictrain/models/moe.py): taken where the matmul is
bf16 (bf16 values, as FSDP's bf16 parameters give, or a bf16 autocast) and the operands are aligned, and
equal to the loop of dense matmuls it replaces: outputs, the input's gradient and every parameter's gradient,
bit for bit on CPU (the same rounding: each matmul in bf16, the biases added per expert in their own dtype).

torch 2.13's CPU kernel of the op runs these tests; the CUDA kernels (the reason to use it) take the same
call, and are not run here (no GPU in CI)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elastictrain.models import moe as moe_module
from elastictrain.models.moe import MoEConfig, MoEFeedForward, grouped_mm_applies


class _Ops(TorchDispatchMode):
    """The aten ops a block of code ran (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _run(layer: MoEFeedForward, x: torch.Tensor, autocast: bool, grouped: bool, monkeypatch):
    """Output, input gradient, parameter gradients and the ops run, with the grouped GEMM allowed or not."""
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_mm_applies", lambda *a: False)
    else:
        monkeypatch.setattr(moe_module, "grouped_mm_applies", grouped_mm_applies)
    for p in layer.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    with _Ops() as ops, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = layer(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        (y * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), x.grad.clone(), grads, ops.seen


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("mode", ["bf16 parameters", "bf16 autocast"])
def test_grouped_gemm_is_taken_in_bf16_and_equals_the_loop(activation, mode, monkeypatch) -> None:
    torch.manual_seed(0)
    layer = MoEFeedForward(32, 64, MoEConfig(experts=4, top_k=2), activation)
    autocast = mode == "bf16 autocast"
    x = torch.randn(3, 16, 32)
    if not autocast:
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    y, gx, grads, ops = _run(layer, x, autocast, True, monkeypatch)
    y_loop, gx_loop, grads_loop, ops_loop = _run(layer, x, autocast, False, monkeypatch)
    assert "aten._grouped_mm" in ops and "aten._grouped_mm" not in ops_loop
    assert torch.equal(y, y_loop) and torch.equal(gx, gx_loop)
    assert grads.keys() == grads_loop.keys() and len(grads) == len(layer.expert_names) + 1  # + the router
    for name in grads:
        assert torch.equal(grads[name], grads_loop[name]), name


def test_fp32_runs_the_loop(monkeypatch) -> None:
    """fp32 without autocast: the loop (the op takes bf16 only; fp32 runs' numbers stay as they were)."""
    layer = MoEFeedForward(32, 64, MoEConfig(experts=4, top_k=2), "gelu")
    *_, ops = _run(layer, torch.randn(2, 8, 32), False, True, monkeypatch)
    assert "aten._grouped_mm" not in ops


def test_the_rule_admits_only_bf16_aligned_rows() -> None:
    bf, f32 = torch.bfloat16, torch.float32
    x, w = torch.ones(5, 32, dtype=bf), torch.ones(4, 32, 64, dtype=bf)
    assert grouped_mm_applies(x, [w])
    assert not grouped_mm_applies(x.float(), [w.float()])  # fp32, no autocast
    assert not grouped_mm_applies(x, [w.float()])  # mixed dtypes, no autocast
    assert not grouped_mm_applies(torch.ones(0, 32, dtype=bf), [w])  # no rows: the loop's empty result
    assert not grouped_mm_applies(torch.ones(5, 36, dtype=bf), [torch.ones(4, 36, 64, dtype=bf)])  # 72 B rows
    assert not grouped_mm_applies(x, [torch.ones(4, 64, 32, dtype=bf).transpose(1, 2)])  # not contiguous
    with torch.autocast("cpu", torch.bfloat16):
        assert grouped_mm_applies(torch.ones(5, 32, dtype=f32), [torch.ones(4, 32, 64, dtype=f32)])
    with torch.autocast("cpu", torch.float16):
        assert not grouped_mm_applies(torch.ones(5, 32, dtype=f32), [torch.ones(4, 32, 64, dtype=f32)])
