"""Built-in text corpus and byte-level tokens (vocabulary 256).

The corpus is real English text that ships with every CPython install (the pydoc topics), so tests and
examples train on natural text without network access or downloaded data.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BYTE_VOCAB_SIZE", "KNOWN_CORPORA", "builtin_corpus_bytes", "byte_tokens"]

BYTE_VOCAB_SIZE = 256
KNOWN_CORPORA = ("pydoc",)


def _pydoc_bytes() -> bytes:
    from pydoc_data.topics import topics

    # Sorted keys: dict order is an implementation detail and the corpus must be byte-identical everywhere.
    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def builtin_corpus_bytes(name: str = "pydoc") -> bytes:
    """The UTF-8 bytes of a built-in corpus; deterministic for a given Python version.

    Raises ValueError naming the known corpora for an unknown ``name``.
    """
    if name == "pydoc":
        return _pydoc_bytes()
    raise ValueError(f"unknown built-in corpus {name!r}; known corpora: {list(KNOWN_CORPORA)}")


def byte_tokens(data: bytes) -> torch.Tensor:
    """Byte-level tokens: a 1-D int64 tensor with one value in ``[0, 256)`` per byte of ``data``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"byte_tokens needs bytes, got {type(data).__name__}")
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
