"""Train your own model with elastictrain's Python API: a small MLP regressing a synthetic target on 2 workers.

Run: ``python examples/custom_task.py``. Everything given to :class:`Task` is module-level, so Ray ships it to
the workers by reference and every worker builds the same model and dataset.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from elastictrain import RunResult, Task, Trainer, build_config

N_SAMPLES, N_FEATURES, SEED = 1024, 8, 1234


class SyntheticRegression:
    """Map-style dataset: x ~ N(0, 1), y = sin(x @ w) + noise, a pure function of ``seed``."""

    def __init__(self, seed: int = SEED, n: int = N_SAMPLES) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, N_FEATURES, generator=g)
        w = torch.randn(N_FEATURES, generator=g) / N_FEATURES**0.5
        self.y = torch.sin(self.x @ w) + 0.05 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def per_sample_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], sample_seeds: torch.Tensor) -> torch.Tensor:
    # No randomness in this model, so sample_seeds is unused; the loss must stay per sample: shape [B].
    return (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


TASK = Task(model_fn=make_model, loss_fn=per_sample_loss, optimizer_fn=make_optimizer,
            dataset_fn=SyntheticRegression, grad_clip=1.0, name="mlp_regression")


def main(steps: int = 60, run_dir: str | Path | None = None, console: Any = sys.stdout,
         workers: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None) -> RunResult:
    """Train the MLP for ``steps``; ``workers`` / ``checkpoint``: keys added to those sections (e.g. a test's
    ``{"standby": False}``)."""
    config = build_config({
        "name": "custom_mlp",
        "train": {"steps": steps, "seed": 0, "global_batch": 32, "micro_batch": 8, "log_every": 10},
        "workers": {"min": 1, "max": 2, **(workers or {})},
        "checkpoint": {**(checkpoint or {})},
    })
    result = Trainer(config, TASK, run_dir=run_dir, console=console).fit()
    if console is not None:
        print(json.dumps(result.summary, indent=2, default=str), file=console)
    return result


if __name__ == "__main__":
    sys.exit(main().exit_code)
