"""A Hugging Face ``transformers`` causal LM, built from a config (no weights are downloaded), as an
elastictrain task. Used by ``jobs/hf_causal_lm.yaml``::

    task:
      kind: python
      entry: "examples.hf_causal_lm:make_task"
      args: {model_type: gpt2, model: {n_embd: 64, n_layer: 2, n_head: 2}, seq_len: 64, lr: 3.0e-3}

``transformers`` is an optional extra: ``pip install 'elastictrain[hf]'``. The data are byte-level tokens of
``builtin:pydoc`` (or any Parquet text source), so the vocabulary is 256 and nothing is fetched from a hub.
Everything handed to :class:`~elastictrain.Task` is a module-level class or function: Ray pickles it by
reference and every worker imports this module from the job's working directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from elastictrain import Task, warmup_cosine

VOCAB = 256  # byte-level tokens


@dataclass(frozen=True)
class HFModel:
    """Builds ``AutoModelForCausalLM.from_config`` with dropout off, so a sample's loss does not depend on the
    worker's random state (elastictrain's own models derive dropout from ``sample_seeds`` instead)."""

    model_type: str
    overrides: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 64

    def __call__(self) -> torch.nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        no_dropout = {k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                                       "attention_dropout", "dropout")}
        cfg = AutoConfig.for_model(self.model_type, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                                   **{**no_dropout, **self.overrides})
        for name in ("n_positions", "max_position_embeddings"):
            if hasattr(cfg, name) and getattr(cfg, name) < self.seq_len:
                setattr(cfg, name, self.seq_len)
        return AutoModelForCausalLM.from_config(cfg)


def per_sample_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], sample_seeds: torch.Tensor,
                    ) -> torch.Tensor:
    """Mean next-token cross entropy of each sample: shape ``[B]`` (``sample_seeds`` unused: no dropout)."""
    return sample_losses(model(input_ids=batch["input"]).logits, batch["target"])


def sample_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of each sample of ``logits`` ``[B, T, V]`` against ``target`` ``[B, T]``."""
    tokens = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="none")
    return tokens.view(target.shape).mean(dim=1)


@dataclass(frozen=True)
class AdamW:
    lr: float

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)


@dataclass(frozen=True)
class ByteWindows:
    source: str
    seq_len: int

    def __call__(self) -> Any:
        from elastictrain.data.datasets import TokenWindows, load_text_tokens

        return TokenWindows(load_text_tokens(self.source), self.seq_len)


@dataclass(frozen=True)
class Schedule:
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.warmup, self.total)


def make_task(model_type: str = "gpt2", model: dict[str, Any] | None = None, seq_len: int = 64,
              lr: float = 3e-3, warmup_steps: int = 10, total_steps: int = 100, source: str = "builtin:pydoc",
              grad_clip: float | None = 1.0) -> Task:
    """The task for ``task.kind: python``; ``task.args`` arrive here as keywords.

    Raises ImportError (a config error at the CLI, exit 2) when ``transformers`` is not installed.
    """
    import transformers  # noqa: F401 - fail here, on the driver, not later inside every worker

    return Task(model_fn=HFModel(model_type, dict(model or {}), seq_len), loss_fn=per_sample_loss,
                optimizer_fn=AdamW(lr), dataset_fn=ByteWindows(source, seq_len),
                lr_fn=Schedule(warmup_steps, total_steps), grad_clip=grad_clip, name=f"hf_{model_type}")
