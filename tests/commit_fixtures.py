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


FINISH_MIB = 600  # what every rank holds for a moment while the run's end reads its model's state


class AllocatingStateDict:
    """The task's model, whose ``state_dict`` also writes ``FINISH_MIB`` it frees at once (pages touched)
    once the model has trained: at the end of a run, when the final model is written (the set-up reads it
    too, with the initial values: no allocation then)."""

    def __init__(self, model_fn: Any) -> None:
        self.model_fn = model_fn

    def __call__(self) -> torch.nn.Module:
        model = self.model_fn()
        model.register_state_dict_post_hook(_allocate_once_trained)
        return model


def _allocate_once_trained(module: torch.nn.Module, state: Any, prefix: str, *_: Any) -> None:
    values = [v for v in state.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if prefix or not values:
        return
    total = float(sum(v.to_local().sum() if hasattr(v, "to_local") else v.sum() for v in values))
    first = module.__dict__.setdefault("_first_state_sum", total)  # the initial values' sum
    if total != first:
        block = torch.ones(FINISH_MIB * 1024 * 1024 // 4)
        del block
