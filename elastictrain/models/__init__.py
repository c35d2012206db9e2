"""Models: a tiny GPT whose dropout depends only on (seed, step, global sample id), and Llama 3 (``llama``)."""

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
from elastictrain.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, LlamaStage

__all__ = [
    "GPT",
    "GPTConfig",
    "LLAMA_PRESETS",
    "Llama",
    "LlamaConfig",
    "LlamaStage",
    "SampleDropout",
    "dropout_seed",
    "param_count",
    "per_sample_loss",
    "sample_seed",
    "sample_seeds",
]
