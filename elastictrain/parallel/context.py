"""Context parallelism (``parallel.cp``): each sample's sequence split over the ranks of a cp group.

The split (pure): the sequence is cut in ``2 * cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and
``2 * cp - 1 - i`` (head-tail balance: under a causal mask every rank then attends to the same number of
key/query pairs). :func:`cp_positions` is the one place that says which global positions a rank holds;
:func:`shard_sequence` slices a batch to them and adds ``positions``.

The attention (collective): queries stay local; keys and values are all-gathered over the cp group
(:func:`gather_sequence`: forward all-gather, backward reduce-scatter, so each key's gradient is summed back
to the rank that owns it) and :func:`cp_attention` is causal by GLOBAL position: a query at position ``p``
attends to the keys at positions ``<= p``, the causal attention of one process (on CPU in fp32/fp64 without
a mask, blockwise: :mod:`elastictrain.parallel.blockwise`; elsewhere with one). Nothing in it is random
(the built-in models' dropout is on the attention's output, a function of (seed, step, sample id,
position); attention-weight dropout is not offered under cp).

The loss and gradient rules (:func:`cp_sample_loss`): a rank's cross-entropy sums over the positions it
holds; the sample's loss is the all-reduce sum over cp of those sums divided by the whole sequence's token
count, the same value on every cp rank (the loss contract and the sample audit hold as under cp1). A cp
rank's parameter gradient is a PARTIAL sum (its queries' share); the one-process gradient is the sum over
cp. The gradient of :func:`cp_sample_loss`'s result is :func:`cp_grad_scale` ``(cp) = cp`` times this
rank's partial loss, so that averaging the gradients over the ``dp x cp`` ranks (DDP's or FSDP's mean,
torchtitan's rule: FSDP shards over ``dp x cp``) gives one process's gradient, with the loop's usual
``sum * W_dp / G`` micro-batch scale (``W_dp``: the data-parallel ranks, without cp).

A model takes part through a hook: modules with a ``cp_group`` attribute (the built-in GPT's blocks and
root, the built-in Llama's attention; a mixture-of-experts layer's too, which sums its load-balance
statistics over the group, models/moe.py, and does not count as the attention hook) and a forward taking
``positions``. :func:`enable_context_parallel` sets the group on them; :func:`context_parallel_refusal`
names what a model lacks.

Wiring (what the step loop does): after the layout is applied, ``enable_context_parallel(model, cp_group)``
(``cp_group``: the mesh's ``cp`` axis group); each loaded micro-batch goes through
``shard_sequence(batch, cp, cp_rank)`` before the loss function (the per-sample seeds are unchanged); the
loss function calls ``model(inputs, seeds, positions=batch["positions"])`` and, when
:func:`cp_group_of` ``(model)`` is set, :func:`cp_sample_loss` instead of the one-process per-sample loss;
the gradients are reduced (averaged) over the ``dp x cp`` ranks; only cp coordinate 0 adds the losses to
the (loss, stop) word and the sample ids to the audit (every cp rank holds the same per-sample values).

Under pipeline parallelism (``parallel.pp > 1``) each stage's attention gathers K/V over the cp group of
ITS stage (the cp ranks of one pp coordinate), and no position crosses a stage boundary: every stage rank
loads the step's micro-batches (the last stage needs the targets anyway), so each derives its own
positions from (cp rank, cp, seq_len) through :func:`shard_sequence` -- the same three numbers the
attention's head-tail chunks (blockwise) or mask (:func:`_bias`) are built from, so they cannot disagree. The
schedule hands them to every stage as the ``positions`` keyword, expanded to one row per sample
(``[b, t]``): torch's schedule cuts every tensor keyword on dim 0 into micro-batches, which would cut a
``[t]`` tensor of positions instead. A stage takes row 0 (:func:`stage_positions`). The last stage's loss
is told the cp group (``PipelineHooks.loss_fn(output, batch, cp_group=...)``) and returns
:func:`cp_sample_loss`; :func:`pipeline_cp_refusal` names what a task's hooks lack.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from elastictrain.parallel.blockwise import blockwise_causal_attention, blockwise_supported

__all__ = [
    "cp_attention",
    "cp_grad_scale",
    "cp_group_of",
    "cp_positions",
    "cp_sample_loss",
    "context_parallel_refusal",
    "enable_context_parallel",
    "gather_sequence",
    "kv_positions",
    "pipeline_cp_refusal",
    "shard_sequence",
    "stage_positions",
    "valid_cp",
]


def valid_cp(seq_len: int, limit: int | None = None) -> list[int]:
    """The cp degrees ``seq_len`` admits (1, and every ``c`` with ``seq_len % (2 * c) == 0``), up to
    ``limit`` (default ``seq_len // 2``)."""
    top = seq_len // 2 if limit is None else limit
    return [1] + [c for c in range(2, top + 1) if seq_len % (2 * c) == 0]


def _check_split(seq_len: int, cp: int) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"parallel.cp={cp!r} must be a positive int; set parallel.cp=1 for no context parallelism")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"parallel.cp={cp}: seq_len={seq_len} is not divisible by 2*cp={2 * cp} (head-tail chunks); "
            f"valid cp for seq_len={seq_len}: {valid_cp(seq_len, limit=max(cp, 16))}, or change seq_len")


@functools.lru_cache(maxsize=64)
def _positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    head, tail = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions (int64, ascending, ``seq_len / cp`` of them) cp rank ``cp_rank`` holds: chunks
    ``cp_rank`` and ``2*cp - 1 - cp_rank`` of ``2*cp``. Pure. Raises ``ValueError`` naming the valid cp
    values when ``seq_len % (2*cp) != 0`` (cp > 1), and for a rank outside ``0..cp-1``."""
    _check_split(seq_len, cp)
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank!r} must be an int in 0..{cp - 1} (parallel.cp={cp})")
    return _positions(seq_len, cp, cp_rank).clone()


def kv_positions(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of the keys :func:`gather_sequence` returns: every rank's
    :func:`cp_positions`, in rank order."""
    _check_split(seq_len, cp)
    return _kv_positions(seq_len, cp, torch.device(device or "cpu")).clone()


@functools.lru_cache(maxsize=64)
def _kv_positions(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    # cached per device: every attention layer of every forward asks (read only; no copy per layer)
    return torch.cat([_positions(seq_len, cp, r) for r in range(cp)]).to(device)


def shard_sequence(batch: dict[str, torch.Tensor], cp: int, cp_rank: int, dim: int = 1) -> dict[str, torch.Tensor]:
    """This cp rank's part of ``batch``: every tensor with at least ``dim + 1`` dimensions (inputs, targets,
    masks: ``[B, T, ...]``) sliced on ``dim`` to :func:`cp_positions`, others (per-sample values) kept;
    adds ``positions`` (``[T / cp]`` int64, the global positions, on the batch's device). All sequence
    tensors must have the same length ``T`` (``ValueError`` otherwise). ``cp == 1`` returns the batch
    with ``positions = arange(T)``."""
    lengths = {k: v.shape[dim] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > dim}
    if not lengths:
        raise ValueError(f"shard_sequence: no tensor in the batch has a sequence dimension {dim} "
                         f"(keys {sorted(batch)}); pass the batch of [B, T, ...] tensors")
    if len(set(lengths.values())) != 1:
        raise ValueError(f"shard_sequence: the batch's sequence lengths differ on dim {dim}: {lengths}; "
                         "every [B, T, ...] tensor of a sample must have the same T")
    if "positions" in batch:
        raise ValueError("shard_sequence: the batch already has 'positions' (sharded twice?)")
    seq_len = next(iter(lengths.values()))
    device = next(v.device for k, v in batch.items() if k in lengths)
    pos = cp_positions(seq_len, cp, cp_rank).to(device)
    out = {k: (v.index_select(dim, pos) if k in lengths and cp > 1 else v) for k, v in batch.items()}
    out["positions"] = pos
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather on ``dim`` over ``group`` in rank order; the backward sums every rank's gradient of each
    slice onto the slice's owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        n = dist.get_world_size(ctx.group)
        parts = [p.contiguous() for p in grad.chunk(n, dim=ctx.dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None, None


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 2) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated on ``dim`` in rank order (differentiable: the
    gradient of each rank's slice is summed over the group back onto that rank)."""
    if dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                 kv_pos: torch.Tensor | None, group: Any, *, n_rep: int = 1) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    ``q`` ``[B, Hq, t, D]``, ``k``/``v`` ``[B, Hkv, t, D]``: this rank's positions ``q_pos`` (``[t]``, global),
    any number of local heads (tensor parallelism splits them; cp does not care). K and V are gathered over
    ``group`` (:func:`gather_sequence`), then each kv head is repeated ``n_rep`` times (grouped-query attention,
    as the model does without cp), and every query at position ``p`` attends to the keys at positions ``<= p``
    (no dropout). For the head-tail layout (``kv_pos`` None) on CPU in float32/float64 that is
    :func:`~elastictrain.parallel.blockwise.blockwise_causal_attention`: per query chunk the key chunks before
    it unmasked and its own causal, merged by log-sum-exp, no mask held; elsewhere (CUDA, other dtypes, an
    explicit ``kv_pos``) ``F.scaled_dot_product_attention`` with a mask from the positions (for the
    head-tail layout one cached additive bias, :func:`_bias`). ``kv_pos``: the global positions of the
    gathered keys; None means the head-tail layout's (:func:`kv_positions` of ``t * cp``), which requires
    ``q_pos`` to be :func:`cp_positions`. Returns ``[B, Hq, t, D]``."""
    cp = dist.get_world_size(group)
    k, v = gather_sequence(k, group, dim=2), gather_sequence(v, group, dim=2)
    if kv_pos is None and cp > 1 and blockwise_supported(q, k, v):  # the head-tail layout on CPU: no mask
        _check_split(q.shape[2] * cp, cp)
        return blockwise_causal_attention(q, k, v, cp, dist.get_rank(group), n_rep=n_rep)
    return _masked_attention(q, k, v, q_pos, kv_pos, group, n_rep)


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      kv_pos: torch.Tensor | None, group: Any, n_rep: int) -> torch.Tensor:
    """:func:`cp_attention` over already gathered ``k``/``v`` with SDPA and a mask from the positions."""
    cp = dist.get_world_size(group)
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if kv_pos is None:  # the head-tail layout (q_pos: this group rank's cp_positions): its cached mask
        _check_split(q.shape[2] * cp, cp)
        mask = _bias(q.shape[2] * cp, cp, dist.get_rank(group), q.dtype, q.device)
    else:
        mask = q_pos.to(q.device)[:, None] >= kv_pos.to(q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)


@functools.lru_cache(maxsize=16)
def _bias(seq_len: int, cp: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The head-tail layout's causal mask of cp rank ``rank`` as an additive bias (0 where a query may see a
    key, -inf elsewhere; ``[T / cp, T]``), cached. SDPA turns a boolean mask into such a bias on every call
    and saves that copy for backward, one ``T / cp x T`` tensor per layer (of the order of the layer's
    gathered keys and values at long sequences: docs/perf/2026-11-28-cp.md); the cached one is shared by
    every layer and step."""
    keep = _positions(seq_len, cp, rank)[:, None] >= _kv_positions(seq_len, cp, torch.device("cpu"))[None, :]
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).to(device)


def cp_grad_scale(cp: int) -> float:
    """The factor on a cp rank's partial loss before backward: ``cp``. A cp rank's gradient is a partial
    sum (the one-process gradient is the sum over cp), and DDP/FSDP take the MEAN over the ``dp x cp``
    ranks they reduce over; times ``cp`` makes that mean the one-process gradient."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"parallel.cp={cp!r} must be a positive int")
    return float(cp)


def cp_sample_loss(logits: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
    """Per-sample mean next-token cross-entropy ``[B]`` of samples whose positions are split over ``group``.

    ``logits`` ``[B, t, V]`` and ``targets`` ``[B, t]``: this rank's positions (``t = T / cp``; a vocabulary-
    sharded DTensor under ``loss_parallel`` is fine). The VALUE is the whole sample's loss (the all-reduce
    sum over cp of each rank's token-loss sum, divided by ``T``), the same on every cp rank; the GRADIENT
    is :func:`cp_grad_scale` ``(cp)`` times this rank's partial loss (its token-loss sum / ``T``): see the
    module doc for why. One all-reduce of ``B`` floats. Without gradients (eval) only the value matters."""
    if logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"expected logits (B, t, V) and targets (B, t), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    cp = dist.get_world_size(group)
    b, t, v = logits.shape
    ce = F.cross_entropy(logits.reshape(b * t, v).float(), targets.reshape(b * t), reduction="none")
    local = ce.view(b, t).sum(dim=1)
    if isinstance(local, DTensor):  # loss_parallel's: replicated over tp
        local = local.to_local()
    partial = local / (t * cp)
    total = partial.detach().clone()
    dist.all_reduce(total, group=group)
    scaled = partial * cp_grad_scale(cp)
    return total + (scaled - scaled.detach())  # value: total (exactly); gradient: cp x partial


def stage_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[t]`` global positions a pipeline stage's ``positions`` keyword carries: the schedule passes them
    as ``[b, t]`` (one identical row per sample of the micro-batch, see the module doc), a whole-model call
    as ``[t]``; None stays None. Raises ``ValueError`` for another shape."""
    if positions is None or positions.dim() == 1:
        return positions
    if positions.dim() != 2 or positions.shape[0] < 1:
        raise ValueError(f"positions must be [t] or [b, t] (one row per sample), got {tuple(positions.shape)}")
    return positions[0]


def pipeline_cp_refusal(hooks: Any) -> str | None:
    """None when a task's ``PipelineHooks`` can run context-parallel stages, else the one line naming what
    they lack: a ``loss_fn`` that takes the ``cp_group`` keyword (and then returns
    :func:`cp_sample_loss`'s whole-sample losses). The stage modules need the model hook of
    :func:`context_parallel_refusal` (checked when the stages are built)."""
    params = inspect.signature(hooks.loss_fn).parameters
    if "cp_group" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    name = getattr(hooks.loss_fn, "__name__", type(hooks.loss_fn).__name__)
    return (f"parallel.cp > 1 with parallel.pp > 1 needs a pipeline loss that sums each sample over the cp "
            f"ranks: Task.pipeline.loss_fn ({name}) takes no cp_group keyword; give it one and return "
            "elastictrain.parallel.context.cp_sample_loss(output, batch['target'], cp_group) when it is set "
            "(docs/design.md, 'Context parallelism'), or set parallel.cp=1")


def cp_group_of(model: nn.Module) -> Any:
    """The context-parallel group set on ``model`` by :func:`enable_context_parallel` (None when off): what a
    loss function asks to pick :func:`cp_sample_loss` over the one-process per-sample loss."""
    return next((m.cp_group for m in model.modules() if getattr(m, "cp_group", None) is not None), None)


def _hooked(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "cp_group")]


def context_parallel_refusal(model: nn.Module) -> str | None:
    """None when ``model`` can run context-parallel, else the one line naming what it lacks: modules with
    a ``cp_group`` attribute (its attention, run by :func:`cp_attention` when the group is set) and a
    forward that takes ``positions`` (the global positions :func:`shard_sequence` adds)."""
    from elastictrain.models.moe import MoEFeedForward  # (its hook sums load-balance statistics: no attention)

    missing = []
    if not [m for m in _hooked(model) if not isinstance(m, MoEFeedForward)]:
        missing.append("no module with a cp_group attribute (attention that calls "
                       "elastictrain.parallel.context.cp_attention when it is set)")
    params = inspect.signature(model.forward).parameters
    if "positions" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        missing.append("a forward without a positions argument (the global positions of its tokens)")
    if not missing:
        return None
    return (f"parallel.cp > 1 needs a context-parallel model: {type(model).__name__} has "
            f"{' and '.join(missing)}; use the built-in gpt or llama, add the hook (docs/design.md, "
            "'Context parallelism'), or set parallel.cp=1")


def enable_context_parallel(model: nn.Module, group: Any) -> nn.Module:
    """Set ``cp_group = group`` on every module of ``model`` that declares one (in place; returns
    ``model``); ``group=None`` turns context parallelism off again. Call it on the parallelized model
    (after tensor parallelism and FSDP), before the first forward. Raises ``ValueError`` with
    :func:`context_parallel_refusal`'s line for a model without the hook."""
    reason = context_parallel_refusal(model)
    if reason is not None:
        raise ValueError(reason)
    for module in _hooked(model):
        module.cp_group = group
    return model
