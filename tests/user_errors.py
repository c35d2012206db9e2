"""A user's task code that fails in its own way, importable by Ray workers as ``tests.user_errors`` (a test
module's own functions pickle by a name workers cannot import)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def loss_that_says_socket_timeout(model: torch.nn.Module, batch: dict, seeds: torch.Tensor) -> torch.Tensor:
    """The built-in GPT loss, except that rank 1 raises ``RuntimeError("socket timeout ...")`` every time:
    the user's own error, in a backend's words."""
    if dist.get_rank() == 1:
        raise RuntimeError("socket timeout reading my features")
    from elastictrain.task import _gpt_loss

    return _gpt_loss(model, batch, seeds)
