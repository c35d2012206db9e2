"""The built-in GPT's tensor-parallel plan: torchtitan's Llama shape, for ``parallelize_module``.

Per block: ``q``/``k``/``v`` column-wise (each rank holds ``n_head / T`` heads) and ``attn_out`` row-wise;
``mlp_in`` column-wise and ``mlp_out`` row-wise: one all-reduce per half-block, or with sequence parallel
one all-gather before and one reduce-scatter after. The token embedding is vocabulary-parallel (row-wise);
the head is column-wise and its logits stay sharded on the vocabulary (a DTensor) for ``loss_parallel``,
so the full logits are never gathered. A mixture-of-experts block (ep x tp) keeps the attention's plan and
gives its MoE layer :func:`moe_block`'s: the experts are not split over tp.

Sequence parallel (``sequence_parallel=True``): the norms and dropout regions run on the rank's slice of the
positions (``Shard(1)``). The embeddings reduce-scatter onto the sequence (the learned positions are split
the same way: row-wise on their position rows, output ``Shard(0)`` of ``(T, d)``); each norm gathers the
whole sequence for the column-wise projections after it (a replicated DTensor: the backward is one
reduce-scatter); each row-wise projection reduce-scatters back onto the sequence. Between modules the
activations are plain local tensors (a block's input and output: this rank's positions), so a pipeline
stage boundary sends the local slice to the same tp coordinate of the next stage.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


class SequenceParallelGathered(SequenceParallel):
    """A norm on the sequence shard whose output is gathered to the whole sequence, as a replicated DTensor
    (what the column-wise projections after it take without another collective). Its backward sums the
    projections' partial input gradients and reduce-scatters them onto the sequence once."""

    @staticmethod
    def _prepare_output_fn(use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
        return outputs.redistribute(placements=[Replicate()])

    def __init__(self) -> None:
        super().__init__(use_local_output=False)


def moe_block(sequence_parallel: bool) -> dict[str, Any]:
    """The plan of a block whose MLP is a mixture of experts (ep x tp, elastictrain/parallel/expert_tp.py):
    the attention as in a dense block; the MoE layer takes this rank's positions (under sequence parallel the
    norm before it hands over its sequence shard, not the gathered sequence) and keeps its experts whole."""
    from elastictrain.parallel.expert_tp import MoETokenSplit

    sp, seq = sequence_parallel, Shard(1)
    plan: dict[str, Any] = {
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "attn_out": RowwiseParallel(output_layouts=seq if sp else Replicate()),
        "moe": MoETokenSplit(sp),
    }
    if sp:
        plan.update({"ln_attn": SequenceParallelGathered(), "ln_mlp": SequenceParallel(use_local_output=True),
                     "drop_attn": SequenceParallel(use_local_output=True),
                     "drop_mlp": SequenceParallel(use_local_output=True)})
    return plan


class RowwiseParallelSync(RowwiseParallel):
    """``RowwiseParallel`` whose output collective completes before its local tensor goes on (torch's
    redistributes asynchronously: ``to_local`` then returns an ``AsyncCollectiveTensor``). For a module whose
    output feeds a compiled block directly (the Llama's vocabulary-parallel embedding): torch 2.13's
    compiled backward hands that input's gradient back as a plain tensor, and the redistribute's backward
    (``NestedRedistribute.forward``, ``grad_output._local_tensor``) fails on it. The GPT adds its position
    embedding eagerly in between, which waits on the collective (a plain tensor), so its blocks never see one."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: Any) -> Any:
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


def gpt_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The plan for ``parallelize_module(model, tp_mesh, plan)`` of a :class:`~elastictrain.models.gpt.GPT`
    or of a pipeline stage of one (:class:`~elastictrain.models.gpt.GPTStage`: the keys of the modules it
    holds, by the whole model's names)."""
    sp = sequence_parallel
    seq = Shard(1)
    plan: dict[str, Any] = {}
    if hasattr(model, "tok_emb"):
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
        if sp:  # the positions' rows too: the sum of the two is this rank's positions only
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
            plan["drop_emb"] = SequenceParallel(use_local_output=True)
    block = {
        "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "attn_out": RowwiseParallel(output_layouts=seq if sp else Replicate()),
        "mlp_in": ColwiseParallel(),
        "mlp_out": RowwiseParallel(output_layouts=seq if sp else Replicate()),
    }
    if sp:
        block.update({"ln_attn": SequenceParallelGathered(), "ln_mlp": SequenceParallelGathered(),
                      "drop_attn": SequenceParallel(use_local_output=True),
                      "drop_mlp": SequenceParallel(use_local_output=True)})
    if hasattr(model, "blocks") and len(model.blocks):
        moe = {name for name, b in model.blocks.named_children() if hasattr(b, "moe")}
        if not moe:
            plan.update({f"blocks.*.{name}": style for name, style in block.items()})
        for name, b in model.blocks.named_children() if moe else ():
            plan.update({f"blocks.{name}.{k}": style for k, style in (moe_block(sp) if name in moe else block).items()})
    if hasattr(model, "head"):
        if sp:
            plan["ln_f"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1),
                                       use_local_output=False)
    return plan

