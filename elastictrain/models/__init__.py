"""Models: a tiny GPT whose dropout depends only on (seed, step, global sample id), Llama 3 (``llama``), and
the mixture-of-experts feed-forward either can use (``moe``)."""

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
from elastictrain.models.moe import MoEConfig, MoEFeedForward

__all__ = [
    "GPT",
    "GPTConfig",
    "LLAMA_PRESETS",
    "Llama",
    "LlamaConfig",
    "LlamaStage",
    "MoEConfig",
    "MoEFeedForward",
    "SampleDropout",
    "dropout_seed",
    "param_count",
    "per_sample_loss",
    "sample_seed",
    "sample_seeds",
]
