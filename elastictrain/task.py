"""What a user brings: a model factory, a per-sample loss, an optimizer factory and a dataset.

A :class:`Task` is shipped to every worker (Ray pickles it), so its callables must be importable or
picklable. The framework owns the step loop; the task only says what one forward pass means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from elastictrain.config import JobConfig

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Task:
    """A training task.

    - ``model_fn()`` builds the module (called once per worker, after the seed is set, so every worker
      builds identical initial parameters).
    - ``loss_fn(model, batch, sample_seeds)`` returns the loss of EACH sample, shape ``[B]``. ``sample_seeds``
      (``LongTensor[B]``) is derived from (seed, step, sample id): use it for any randomness (dropout) so a
      sample's math does not depend on which worker processes it.
    - ``optimizer_fn(params)`` builds the optimizer.
    - ``dataset_fn()`` returns a map-style dataset (``len`` and ``__getitem__(int) -> dict of tensors``);
      every worker must build the same dataset.
    - ``lr_fn(step)`` returns the learning-rate multiplier for a 0-based step (a pure function of step, so the
      schedule continues exactly after a resize or a resume). Default: constant 1.
    - ``parallelize_fn(model, mesh, plan)`` applies the layout for one membership generation and returns the
      module to train: ``mesh`` is the generation's DeviceMesh (axes ``dp_replicate`` and/or ``dp_shard``),
      ``plan`` the ``ParallelConfig``. Called on a freshly built model whenever the layout is sharded (FSDP2
      changes modules in place); the optimizer is built afterwards from the returned parameters. Default
      (None): :func:`elastictrain.parallel.parallelize.parallelize` -- activation checkpointing if asked,
      then DDP, or ``fully_shard`` on each repeated block (the children of a ``ModuleList`` of one class)
      and then the root. Return a DDP module, an FSDP2 module, or a plain one; the step loop adapts.
    """

    model_fn: Callable[[], torch.nn.Module]
    loss_fn: Callable[[torch.nn.Module, Batch, torch.Tensor], torch.Tensor]
    optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    dataset_fn: Callable[[], Any]
    lr_fn: Callable[[int], float] | None = None
    collate_fn: Callable[[list[Batch]], Batch] | None = None
    grad_clip: float | None = None
    name: str = "task"
    parallelize_fn: Callable[[torch.nn.Module, Any, Any], torch.nn.Module] | None = None


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------------- built-in task
# Module-level callables (not lambdas) so the task pickles by reference and builds the same on every worker.


@dataclass(frozen=True)
class _GPTModel:
    cfg: Any

    def __call__(self) -> torch.nn.Module:
        from elastictrain.models.gpt import GPT, GPTConfig

        m = self.cfg
        return GPT(GPTConfig(vocab_size=256, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                             d_model=m.d_model, dropout=m.dropout))


def _gpt_loss(model: torch.nn.Module, batch: Batch, sample_seeds: torch.Tensor) -> torch.Tensor:
    from elastictrain.models.gpt import per_sample_loss

    logits = model(batch["input"], sample_seeds=sample_seeds)
    return per_sample_loss(logits, batch["target"])


@dataclass(frozen=True)
class _AdamW:
    cfg: Any

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW over ``params``: the per-tensor loop on CPU (bitwise the same at any world size and
        layout), the fused kernel on CUDA (one launch per step instead of several per parameter)."""
        o = self.cfg
        params = list(params)
        on_cuda = bool(params) and all(p.is_cuda for p in params)
        kind = {"fused": True} if on_cuda else {"foreach": False}
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay, **kind)


@dataclass(frozen=True)
class _Corpus:
    source: str
    column: str
    storage_options: dict
    seq_len: int

    def __call__(self) -> Any:
        from elastictrain.data.datasets import TokenWindows, load_text_tokens

        tokens = load_text_tokens(self.source, column=self.column, storage_options=self.storage_options)
        return TokenWindows(tokens, self.seq_len)


@dataclass(frozen=True)
class _Schedule:
    warmup: int
    total: int

    def __call__(self, step: int) -> float:
        return warmup_cosine(step, self.warmup, self.total)


def builtin_task(config: JobConfig) -> Task:
    """The task named by ``config.task`` (today: ``tiny_gpt``, a small byte-level GPT)."""
    t = config.task
    return Task(
        model_fn=_GPTModel(t.model),
        loss_fn=_gpt_loss,
        optimizer_fn=_AdamW(t.optimizer),
        dataset_fn=_Corpus(t.data.source, t.data.column, dict(t.data.storage_options), t.model.seq_len),
        lr_fn=_Schedule(t.optimizer.warmup_steps, config.train.steps),
        grad_clip=t.optimizer.grad_clip,
        name=t.kind,
    )
