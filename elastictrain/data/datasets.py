"""Map-style datasets for language modelling, and the text loader behind them.

A dataset here is anything with ``__len__`` and ``__getitem__(int) -> dict[str, Tensor]``; the data
cursor (``cursor.py``) decides which indices each rank reads, so datasets never shuffle or shard.
"""

from __future__ import annotations

import operator
from typing import Any

import fsspec
import torch

from elastictrain.data.corpus import KNOWN_CORPORA, builtin_corpus_bytes, byte_tokens

__all__ = ["TokenWindows", "collate", "load_text_tokens"]

_BUILTIN_PREFIX = "builtin:"
_GLOB_CHARS = ("*", "?", "[")


class TokenWindows:
    """Non-overlapping next-token windows over a 1-D token tensor.

    Sample ``i`` is ``x = tokens[i*seq_len : i*seq_len + seq_len + 1]`` returned as
    ``{"input": x[:-1], "target": x[1:]}`` (both length ``seq_len``, views into ``tokens``).
    ``len == (len(tokens) - 1) // seq_len``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got {_describe(tokens)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"corpus too short: {tokens.numel()} tokens but one window of seq_len={seq_len} needs "
                f"{seq_len + 1}; use a shorter seq_len or a larger corpus"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # operator.index accepts numpy / torch integer scalars that the cursor hands out.
        i = operator.index(index)
        if not 0 <= i < len(self):
            # IndexError (not ValueError) keeps Python's sequence-iteration protocol working.
            raise IndexError(f"sample index {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1]
        return {"input": window[:-1], "target": window[1:]}


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of samples with identical keys into one batch dict (new leading dim)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    keys = samples[0].keys()
    for j, sample in enumerate(samples):
        if sample.keys() != keys:
            raise ValueError(f"sample {j} has keys {sorted(sample)} but sample 0 has {sorted(keys)}")
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}


def load_text_tokens(
    source: str, column: str = "text", storage_options: dict[str, Any] | None = None
) -> torch.Tensor:
    """Byte-level tokens of a text source.

    ``source`` is ``builtin:<name>`` (see ``corpus.KNOWN_CORPORA``), or a local path / fsspec URL
    (``s3://bucket/x.parquet``) of a parquet file, a directory of parquet files (searched
    recursively) or a glob. Files are read in sorted path order; the non-null values of the string
    ``column`` are UTF-8 encoded and joined with ``b"\\n"``. ``storage_options`` go to fsspec.

    Raises FileNotFoundError naming the source when nothing matches, and ValueError naming the file
    when ``column`` is missing (listing available columns) or is not a string column, or when no text
    was found.
    """
    if source.startswith(_BUILTIN_PREFIX):
        name = source[len(_BUILTIN_PREFIX) :]
        if name not in KNOWN_CORPORA:
            raise ValueError(
                f"unknown built-in corpus {source!r}; known: {[_BUILTIN_PREFIX + k for k in KNOWN_CORPORA]}"
            )
        return byte_tokens(builtin_corpus_bytes(name))
    fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
    texts = [_read_text_column(fs, file, column) for file in _parquet_files(fs, path, source)]
    data = b"\n".join(text for text in texts if text)
    if not data:
        raise ValueError(f"no text found in column {column!r} of {source!r}")
    return byte_tokens(data)


def _parquet_files(fs: fsspec.AbstractFileSystem, path: str, source: str) -> list[str]:
    if any(ch in path for ch in _GLOB_CHARS):
        files = sorted(p for p in fs.glob(path) if not fs.isdir(p))
    elif fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
    elif fs.exists(path):
        files = [path]
    else:
        raise FileNotFoundError(f"text source not found: {source!r}")
    if not files:
        raise FileNotFoundError(f"no parquet files found at {source!r}")
    return files


def _read_text_column(fs: fsspec.AbstractFileSystem, file: str, column: str) -> bytes:
    # imported here, not with the module: every worker imports this module (the data code), and pyarrow
    # costs ~30 MiB of resident memory per process that only a parquet source uses (benchmarks/parallel.py)
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(file, "rb") as handle:
        parquet = pq.ParquetFile(handle)
        schema = parquet.schema_arrow
        if column not in schema.names:
            raise ValueError(
                f"column {column!r} not found in {file!r}; available columns: {schema.names}"
            )
        kind = schema.field(column).type
        is_text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
        if not is_text:
            raise ValueError(
                f"column {column!r} in {file!r} has type {kind}, expected a string column"
            )
        values = parquet.read(columns=[column]).column(column).drop_null().to_pylist()
    return b"\n".join(value.encode("utf-8") for value in values)
