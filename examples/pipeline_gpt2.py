"""Pipelining a Hugging Face GPT-2 (``GPT2LMHeadModel``, built from a config, no weights downloaded) with
:class:`elastictrain.PipelineHooks`: the hooks a user of GPT-2 passes as ``Task.pipeline``. Used as::

    task:
      kind: python
      entry: "examples.pipeline_gpt2:make_task"
      args: {n_embd: 64, n_layer: 4, n_head: 2}
    parallel: {pp: 2, pp_schedule: 1f1b}

or, for a GPT-2 task of your own, ``Task(..., pipeline=GPT2_PIPELINE)``. A stage keeps the whole model's
parameter names (``transformer.wte.weight``, ``transformer.h.3.attn.c_attn.weight``,
``transformer.ln_f.weight``, ``lm_head.weight``): its ``transformer`` child holds the stage's slice of ``h``
in an ``nn.ModuleDict`` keyed by the block's index, so a checkpoint of any pp loads under any other layout.
The first stage embeds tokens and positions (``wte`` + ``wpe``), the last applies ``ln_f`` and ``lm_head``.

GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``: under pp the two uses fall on the first and the
last stage. Nothing here handles that: the framework keeps one tensor held by both stage ranks under both
names, sums its gradient over them and counts it once in the clipping norm and the digest
(elastictrain/parallel/tied.py). Not under ``pp_schedule: zbv`` (one rank would hold both uses: refused).

Each stage builds the causal mask itself (an additive ``-inf`` mask for eager attention: the same
probabilities as the whole model's mask) and the positions ``0..t-1`` (no cache, no padding). Dropout is
off (the stages would draw it from the global generator, which a pipeline reseeds once per step: see
``PipelineHooks``), and ``attn_implementation`` is eager. ``transformers`` is an optional extra:
``pip install 'elastictrain[hf]'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elastictrain import Task
from examples.hf_pipeline import causal_mask, pipeline_hooks, pipelined_task, positions


class GPT2Stage(nn.Module):
    """Virtual stage of a ``GPT2LMHeadModel``: ``wte`` + ``wpe`` first, ``ln_f`` + ``lm_head`` last, the
    blocks ``h`` in between, under the whole model's names."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        inner = nn.Module()
        if first:
            inner.wte, inner.wpe = model.transformer.wte, model.transformer.wpe
        inner.h = nn.ModuleDict({str(i): model.transformer.h[i] for i in blocks})
        if last:
            inner.ln_f = model.transformer.ln_f
            self.lm_head = model.lm_head  # on the last stage: its weight is the tied wte (parallel/tied.py)
        self.transformer = inner

    @staticmethod
    def n_blocks(model: nn.Module) -> int:
        return len(model.transformer.h)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ARG002
        pos = positions(x)
        if self.first:
            x = self.transformer.wte(x) + self.transformer.wpe(pos)
        causal = causal_mask(x)
        for block in self.transformer.h.values():
            x = block(x, None, causal, position_ids=pos)
            x = x[0] if isinstance(x, tuple) else x
        return self.lm_head(self.transformer.ln_f(x)) if self.last else x


GPT2_PIPELINE = pipeline_hooks(GPT2Stage)  # the blocks balanced over the stages (examples/hf_pipeline.py)


@dataclass(frozen=True)
class _Defaults:
    model: dict[str, Any] = field(default_factory=lambda: {
        "n_embd": 32, "n_layer": 2, "n_head": 2, "attn_implementation": "eager"})


def make_task(seq_len: int = 32, lr: float = 3e-3, warmup_steps: int = 10, total_steps: int = 100,
              source: str = "builtin:pydoc", grad_clip: float | None = 1.0, **model: Any) -> Task:
    """A small GPT-2 (tied embeddings, as GPT-2 is) as a pipelined task; ``model`` keywords override its
    ``GPT2Config`` (``n_embd``, ``n_layer``, ...). Raises ImportError (a config error at the CLI, exit 2) when
    ``transformers`` is not installed."""
    import transformers  # noqa: F401 - fail here, on the driver, not later inside every worker

    return pipelined_task("gpt2", {**_Defaults().model, **model}, GPT2_PIPELINE, "hf_gpt2_pp", seq_len, lr,
                          warmup_steps, total_steps, source, grad_clip)
