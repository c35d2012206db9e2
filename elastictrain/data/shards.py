"""The prepared-token format: flat token shards plus one JSON manifest (written by ``elastictrain data prepare``).

Layout under a prepared URI (a local/Lustre directory or an fsspec URL such as ``s3://bucket/corpus``)::

    manifest.json                   written last and atomically: its presence means "complete"
    train/00000.bin ...             one shard per input file (sorted order), flat little-endian token ids
    train/00000.json ...            the shard's record (tokens, bytes, sha256, source): prepare's resume marker
    validation/00000.bin ...        the validation split (``--val-fraction`` or ``--val-source``), same format

A shard is the concatenation of its documents' token ids, each document followed by the end-of-document id,
as ``uint16`` when the vocabulary fits in 16 bits and ``uint32`` otherwise (``<u2`` / ``<u4``: no header, so a
window is one ``np.memmap`` slice on a POSIX path and one HTTP range request on S3). A split's token stream is
its shards concatenated in name order; see docs/data.md for the manifest's keys and why this format.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

FORMAT = "elastictrain.tokens"
VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")


class PreparedDataError(ValueError):
    """A prepared URI that cannot be read: no manifest, another format or version, a malformed manifest."""


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def numpy_dtype(name: str) -> Any:
    import numpy as np

    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[name])


def shard_name(split: str, index: int) -> str:
    return f"{split}/{index:05d}.bin"


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Shard:
    name: str      # relative to the prepared URI, e.g. "train/00003.bin"
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of a prepared corpus (see docs/data.md)."""

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    splits: dict[str, tuple[Shard, ...]]
    raw: dict[str, Any]

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits.get(split, ()))

    def digest(self) -> str:
        """A short hash of what defines the token streams: dtype, tokenizer and every shard's SHA-256."""
        body = {"dtype": self.dtype, "tokenizer": self.tokenizer_sha256,
                "splits": {k: [[s.name, s.tokens, s.sha256] for s in v] for k, v in sorted(self.splits.items())}}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def parse_manifest(text: str, where: str) -> Manifest:
    """Parse and check a manifest; raises PreparedDataError naming ``where`` and what is wrong."""
    try:
        raw = json.loads(text)
        if raw.get("format") != FORMAT:
            raise PreparedDataError(f"{where} is not an elastictrain token manifest (format={raw.get('format')!r})")
        if raw.get("version") != VERSION:
            raise PreparedDataError(f"{where} has format version {raw.get('version')!r}; this elastictrain reads "
                                    f"version {VERSION}: prepare the corpus again with this version")
        splits = {name: tuple(Shard(s["name"], int(s["tokens"]), int(s["bytes"]), s["sha256"])
                              for s in body["shards"]) for name, body in raw["splits"].items()}
        m = Manifest(raw["dtype"], int(raw["vocab_size"]), int(raw["eos_id"]), raw["tokenizer"]["sha256"],
                     splits, raw)
        numpy_dtype(m.dtype)
    except PreparedDataError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PreparedDataError(f"{where}: malformed manifest ({type(e).__name__}: {e}); prepare the corpus "
                                "again") from None
    return m


def manifest_json(*, dtype: str, vocab_size: int, eos_id: int, tokenizer_sha256: str, text_column: str,
                  sources: list[dict[str, Any]], splits: dict[str, list[Shard]],
                  split_rule: dict[str, Any], seq_len: int | None) -> str:
    """The manifest text: sorted keys, no timestamps or host names, so the same inputs give the same bytes."""
    body = {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "byte_order": "little",
        "vocab_size": vocab_size, "eos_id": eos_id,
        "tokenizer": {"sha256": tokenizer_sha256}, "text_column": text_column, "seq_len": seq_len,
        "sources": sources, "split": split_rule,
        "splits": {name: {"tokens": sum(s.tokens for s in shards),
                          "shards": [s.__dict__ for s in shards]} for name, shards in splits.items()},
    }
    return json.dumps(body, sort_keys=True, indent=1) + "\n"


def join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def is_prepared(source: str, storage_options: dict[str, Any] | None = None) -> bool:
    """True when ``source`` is a prepared directory (it holds ``manifest.json``); cheap (one stat)."""
    if source.startswith("builtin:"):
        return False
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
        return fs.isfile(join(path, MANIFEST))
    except (OSError, ValueError):
        return False


def read_manifest(uri: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """The manifest of the prepared corpus at ``uri``; PreparedDataError if there is none or it is malformed."""
    import fsspec

    where = join(uri, MANIFEST)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        with fs.open(join(path, MANIFEST), "rb") as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise PreparedDataError(f"no prepared corpus at {uri!r}: {where} not found (a prepare that did not finish "
                                "writes no manifest); run `elastictrain data prepare` to completion") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PreparedDataError(f"cannot read {where}: {e}") from None
    return parse_manifest(text, where)
