"""Data: the pure global sample cursor, the built-in corpus and map-style datasets. Prepared corpora (docs/data.md):
``elastictrain.data.shards`` (format), ``.prepare`` (the command), ``.windows`` (``PreparedWindows``)."""

from elastictrain.data.corpus import BYTE_VOCAB_SIZE, KNOWN_CORPORA, builtin_corpus_bytes, byte_tokens
from elastictrain.data.cursor import (
    CursorError,
    CursorState,
    check_layout,
    epoch_permutation,
    eval_sample_ids,
    micro_batch_positions,
    rank_micro_batches,
    sample_ids,
    step_sample_ids,
    valid_world_sizes,
)
from elastictrain.data.datasets import TokenWindows, collate, load_text_tokens

__all__ = [
    "BYTE_VOCAB_SIZE",
    "KNOWN_CORPORA",
    "CursorError",
    "CursorState",
    "TokenWindows",
    "builtin_corpus_bytes",
    "byte_tokens",
    "check_layout",
    "collate",
    "epoch_permutation",
    "eval_sample_ids",
    "load_text_tokens",
    "micro_batch_positions",
    "rank_micro_batches",
    "sample_ids",
    "step_sample_ids",
    "valid_world_sizes",
]
