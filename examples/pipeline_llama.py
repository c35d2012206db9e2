"""Pipelining a model elastictrain did not write: a small Hugging Face Llama (built from a config, no
weights downloaded) split into stages with :class:`elastictrain.PipelineHooks`. Used as::

    task:
      kind: python
      entry: "examples.pipeline_llama:make_task"
      args: {hidden_size: 64, num_hidden_layers: 4}
    parallel: {pp: 2, pp_schedule: 1f1b}

A stage keeps the whole model's parameter names (``model.embed_tokens.weight``, ``model.layers.3...``,
``model.norm.weight``, ``lm_head.weight``): its ``model`` child holds the stage's slice of ``layers`` in an
``nn.ModuleDict`` keyed by the layer's index, so checkpoints of any pp load under any other layout. Every
stage keeps the rotary-embedding helper (no parameters) and rebuilds the causal mask and positions, which
depend only on the sequence length. The model has no dropout (``sample_seeds`` unused). ``transformers``
is an optional extra: ``pip install 'elastictrain[hf]'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elastictrain import Task
from examples.hf_pipeline import causal_mask, pipeline_hooks, pipelined_task, positions


class LlamaStage(nn.Module):
    """Virtual stage of a ``LlamaForCausalLM``: embeddings first, ``norm`` + ``lm_head`` last, ``layers``
    in between, under the whole model's names."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        inner = nn.Module()
        if first:
            inner.embed_tokens = model.model.embed_tokens
        inner.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        inner.rotary_emb = model.model.rotary_emb
        if last:
            inner.norm = model.model.norm
            self.lm_head = model.lm_head
        self.model = inner

    @staticmethod
    def n_blocks(model: nn.Module) -> int:
        return len(model.model.layers)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ARG002
        if self.first:
            x = self.model.embed_tokens(x)
        pos = positions(x)
        rope = self.model.rotary_emb(x, position_ids=pos)
        causal = causal_mask(x)
        for layer in self.model.layers.values():
            x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=rope)
            x = x[0] if isinstance(x, tuple) else x
        return self.lm_head(self.model.norm(x)) if self.last else x


LLAMA_PIPELINE = pipeline_hooks(LlamaStage)  # the layers balanced over the stages (examples/hf_pipeline.py)


@dataclass(frozen=True)
class _Defaults:
    model: dict[str, Any] = field(default_factory=lambda: {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_implementation": "eager"})


def make_task(seq_len: int = 32, lr: float = 3e-3, warmup_steps: int = 10, total_steps: int = 100,
              source: str = "builtin:pydoc", grad_clip: float | None = 1.0, **model: Any) -> Task:
    """A small Llama as a pipelined task; ``model`` keywords override its config (``hidden_size``, ...).
    Raises ImportError (a config error at the CLI, exit 2) when ``transformers`` is not installed."""
    import transformers  # noqa: F401 - fail here, on the driver, not later inside every worker

    return pipelined_task("llama", {**_Defaults().model, **model}, LLAMA_PIPELINE, "hf_llama_pp", seq_len, lr,
                          warmup_steps, total_steps, source, grad_clip)
