"""A task part for tests/test_commit.py, in a module of its own so Ray workers import it by name."""

from __future__ import annotations

from typing import Any

import torch

ALLOC_STEP = 4  # the step (1-based) in which rank 0 holds 200 MiB more for a moment


class AllocatingLoss:
    """The GPT loss; in rank 0's first micro-batch of step ``ALLOC_STEP`` it also writes 200 MiB it frees
    at once (its pages touched, so they count in RSS)."""

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn, self.calls = loss_fn, 0

    def __call__(self, model: Any, batch: Any, seeds: Any) -> Any:
        import torch.distributed as dist

        self.calls += 1  # 2 micro-batches per step per rank (global 16, micro 4, 2 ranks)
        if dist.get_rank() == 0 and self.calls == 2 * (ALLOC_STEP - 1) + 1:
            block = torch.ones(200 * 1024 * 1024 // 4)
            del block
        return self.loss_fn(model, batch, seeds)
