"""Models: a tiny GPT whose dropout depends only on (seed, step, global sample id)."""

from elastictrain.models.gpt import (
    GPT,
    GPTConfig,
    SampleDropout,
    dropout_seed,
    param_count,
    per_sample_loss,
    sample_seed,
    sample_seeds,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "SampleDropout",
    "dropout_seed",
    "param_count",
    "per_sample_loss",
    "sample_seed",
    "sample_seeds",
]
