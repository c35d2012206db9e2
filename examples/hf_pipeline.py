"""What the two pipelined Hugging Face examples (``examples/pipeline_gpt2.py``, ``examples/pipeline_llama.py``)
share: a model's blocks balanced over the stages, the stages' inputs and loss, and the task around them. Each
example writes only its stage module (which blocks it holds, under which names, and its forward).

A stage module class used here takes ``(model, blocks, first, last)`` and has a static ``n_blocks(model)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastictrain import PipelineHooks, Task
from examples.hf_causal_lm import AdamW, ByteWindows, HFModel, Schedule, per_sample_loss, sample_losses


@dataclass(frozen=True)
class BalancedStages:
    """``PipelineHooks.stage_fn``: the model's blocks balanced over the stages, each built as ``stage``."""

    stage: type

    def __call__(self, model: nn.Module, stage: int, n_stages: int) -> nn.Module:
        from elastictrain.parallel.stages import block_ranges

        blocks = block_ranges(self.stage.n_blocks(model), n_stages)[stage]
        return self.stage(model, blocks, first=stage == 0, last=stage == n_stages - 1)


def stage_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (batch["input"],)


def stage_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-sample losses of ``examples.hf_causal_lm.per_sample_loss``, from the last stage's logits."""
    return sample_losses(logits, batch["target"])


def pipeline_hooks(stage: type) -> PipelineHooks:
    """The hooks of a model whose stages are ``stage`` modules (see the module's docstring)."""
    return PipelineHooks(stage_fn=BalancedStages(stage), inputs_fn=stage_inputs, loss_fn=stage_loss)


def positions(x: torch.Tensor) -> torch.Tensor:
    """The positions ``0..t-1`` (``[1, t]``) of a ``[B, t, ...]`` input: no cache, no padding."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def causal_mask(x: torch.Tensor) -> torch.Tensor:
    """The additive causal mask (``[1, 1, t, t]``, ``-inf`` above the diagonal, ``x``'s dtype) a stage
    rebuilds for eager attention over hidden states ``x`` ``[B, t, d]``: the whole model's probabilities."""
    t = x.shape[1]
    return torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]


def pipelined_task(model_type: str, cfg: dict[str, Any], hooks: PipelineHooks, name: str, seq_len: int,
                   lr: float, warmup_steps: int, total_steps: int, source: str, grad_clip: float | None) -> Task:
    """``examples.hf_causal_lm``'s task of a ``model_type`` model built from ``cfg``, pipelined by ``hooks``."""
    return Task(model_fn=HFModel(model_type, cfg, seq_len), loss_fn=per_sample_loss, optimizer_fn=AdamW(lr),
                dataset_fn=ByteWindows(source, seq_len), lr_fn=Schedule(warmup_steps, total_steps),
                grad_clip=grad_clip, name=name, pipeline=hooks)
