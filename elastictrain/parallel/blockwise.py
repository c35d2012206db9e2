"""Causal attention of a head-tail context-parallel rank without a mask: blockwise, merged by log-sum-exp.

The sequence is cut in ``2 * cp`` chunks of ``c = T / (2 cp)`` positions; cp rank ``r`` holds query chunks
``r`` (head) and ``2 cp - 1 - r`` (tail), and the keys/values :func:`~.context.gather_sequence` returns hold
every rank's two chunks in rank order. :func:`blockwise_causal_attention` puts the keys in global chunk order
and computes, for each of the rank's query chunks ``j``, two parts with torch's CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the output and its log-sum-exp):

* (A) the key chunks before ``j`` (positions ``< j c``), every key visible: no mask;
* (B) chunk ``j`` itself, square and causal (``is_causal=True``);

and merges them by their log-sum-exp (``lse = logaddexp(lse_A, lse_B)``, ``out = sum exp(lse_part - lse)
out_part``). The backward calls the kernel's backward per part with the MERGED output and log-sum-exp (the
ring-attention identity: a part's score gradient is ``P (dP - rowsum(dO * O))`` with ``P = exp(S - lse)``,
both from the whole row) and sums the parts. Saved for backward: the queries, the keys and values in global
order (not repeated for grouped-query heads), the output and the log-sum-exp; nothing of size ``T^2``, where
the masked path keeps a ``T / cp x T`` bias (docs/perf/2026-11-28-cp.md).

:func:`blockwise_supported` says when this path applies (CPU tensors of a dtype the kernel takes, an even
local length); otherwise :func:`~.context.cp_attention` uses its masked path (on CUDA always: not run here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["blockwise_causal_attention", "blockwise_supported"]

_DTYPES = (torch.float32, torch.float64)


def blockwise_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when :func:`blockwise_causal_attention` takes these tensors: plain (not DTensor) CPU tensors of
    float32 or float64 (the dtypes its equality with the masked path is tested for), 4-d, an even local
    length."""
    tensors = (q, k, v)
    return (not any(isinstance(x, DTensor) for x in tensors)
            and all(x.device.type == "cpu" and x.dtype == q.dtype and x.dim() == 4 for x in tensors)
            and q.dtype in _DTYPES and q.shape[2] % 2 == 0)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale)


def _global_order(cp: int) -> list[int]:
    """Gathered chunk index (rank order: rank r's head then tail) of each global chunk 0..2cp-1."""
    return [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    chunks = x.chunk(len(order), dim=2)
    return torch.cat([chunks[i] for i in order], dim=2)


def _unorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    chunks = x.chunk(len(order), dim=2)
    back = [None] * len(order)
    for j, i in enumerate(order):
        back[i] = chunks[j]
    return torch.cat(back, dim=2)


def _repeat(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int,
                n_rep: int) -> torch.Tensor:
        c = q.shape[2] // 2
        order = _global_order(cp)
        kg, vg = _reorder(k, order), _reorder(v, order)
        kr, vr = _repeat(kg, n_rep), _repeat(vg, n_rep)
        scale = q.shape[-1] ** -0.5
        b, h, t, d = q.shape
        # laid out [B, t, H, D] as SDPA's output is: the model's transpose(1, 2).reshape is then a view, and
        # the output projection saves this very storage instead of a copy
        merged_out = q.new_empty(b, t, h, d).transpose(1, 2)
        lses = []
        for i, j in enumerate((rank, 2 * cp - 1 - rank)):
            qi = q[:, :, i * c:(i + 1) * c]
            out, lse = _flash(qi, kr[:, :, j * c:(j + 1) * c], vr[:, :, j * c:(j + 1) * c], True, scale)
            if j > 0:  # the chunks before j: always j > 0 for the tail chunk
                out_a, lse_a = _flash(qi, kr[:, :, :j * c], vr[:, :, :j * c], False, scale)
                merged = torch.logaddexp(lse, lse_a)
                out = (out * torch.exp(lse - merged).unsqueeze(-1).to(out.dtype)
                       + out_a * torch.exp(lse_a - merged).unsqueeze(-1).to(out.dtype))
                lse = merged
            merged_out[:, :, i * c:(i + 1) * c] = out
            lses.append(lse)
        out, lse = merged_out, torch.cat(lses, dim=2)
        ctx.save_for_backward(q, kg, vg, out, lse)
        ctx.cp, ctx.rank, ctx.n_rep, ctx.scale = cp, rank, n_rep, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kg, vg, out, lse = ctx.saved_tensors
        cp, rank, n_rep, scale = ctx.cp, ctx.rank, ctx.n_rep, ctx.scale
        c = q.shape[2] // 2
        kr, vr = _repeat(kg, n_rep), _repeat(vg, n_rep)
        grad = grad.contiguous()
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(kr), torch.zeros_like(vr)
        for i, j in enumerate((rank, 2 * cp - 1 - rank)):
            rows = slice(i * c, (i + 1) * c)
            own = slice(j * c, (j + 1) * c)
            g, qi = grad[:, :, rows], q[:, :, rows]
            oi, li = out[:, :, rows], lse[:, :, rows]
            dqi, dki, dvi = _flash_backward(g, qi, kr[:, :, own], vr[:, :, own], oi, li, True, scale)
            dk[:, :, own] += dki
            dv[:, :, own] += dvi
            if j > 0:
                before = slice(0, j * c)
                dqa, dka, dva = _flash_backward(g, qi, kr[:, :, before], vr[:, :, before], oi, li, False, scale)
                dqi = dqi + dqa
                dk[:, :, before] += dka
                dv[:, :, before] += dva
            dq[:, :, rows] = dqi
        if n_rep > 1:  # kv head h served query heads h*n_rep .. (h+1)*n_rep - 1
            b, _, t, d = dk.shape
            dk = dk.view(b, -1, n_rep, t, d).sum(dim=2)
            dv = dv.view(b, -1, n_rep, t, d).sum(dim=2)
        order = _global_order(cp)
        return dq, _unorder(dk, order), _unorder(dv, order), None, None, None


def blockwise_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int, *,
                               n_rep: int = 1) -> torch.Tensor:
    """Causal attention of cp rank ``rank``'s head-tail queries over the gathered keys, without a mask.

    ``q`` ``[B, Hq, t, D]`` (this rank's positions, :func:`~.context.cp_positions`), ``k``/``v``
    ``[B, Hkv, cp * t, D]`` gathered in rank order (:func:`~.context.gather_sequence`), ``Hq = n_rep * Hkv``
    (grouped-query: kv head ``h`` serves query heads ``h * n_rep .. (h + 1) * n_rep - 1``); scale
    ``D ** -0.5``, no dropout. Returns ``[B, Hq, t, D]``, differentiable in ``q``, ``k`` and ``v``. Call it
    only where :func:`blockwise_supported` holds."""
    return _Blockwise.apply(q, k, v, cp, rank, n_rep)
