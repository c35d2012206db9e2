"""Tests of the built-in corpus, TokenWindows, collate and the parquet text loader."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elastictrain.data.corpus import builtin_corpus_bytes, byte_tokens
from elastictrain.data.datasets import TokenWindows, collate, load_text_tokens
from tests.checkpoint_fixtures import s3_bucket, s3_server  # noqa: F401 - fixtures


def test_builtin_corpus_is_real_and_deterministic() -> None:
    data = builtin_corpus_bytes()
    assert len(data) > 100_000
    # the same bytes in another process with another hash seed (dict and set order differ there)
    import hashlib
    import subprocess
    import sys

    code = ("import hashlib; from elastictrain.data.corpus import builtin_corpus_bytes; "
            "print(hashlib.sha256(builtin_corpus_bytes('pydoc')).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == hashlib.sha256(data).hexdigest(), other.stderr[-2000:]
    assert b"def " in data and b"class" in data
    tokens = load_text_tokens("builtin:pydoc")
    assert tokens.dtype == torch.int64 and tokens.dim() == 1
    assert tokens.numel() == len(data)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 256


def test_unknown_corpus_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known corpora: \\['pydoc'\\]"):
        builtin_corpus_bytes("wiki")
    with pytest.raises(ValueError, match="builtin:pydoc"):
        load_text_tokens("builtin:wiki")


def test_byte_tokens() -> None:
    assert byte_tokens(b"\x00A\xff").tolist() == [0, 65, 255]
    assert byte_tokens(b"").numel() == 0
    with pytest.raises(TypeError):
        byte_tokens("text")  # type: ignore[arg-type]


def test_token_windows_shapes_and_contents() -> None:
    tokens = torch.arange(23)
    ds = TokenWindows(tokens, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    sample = ds[2]
    assert sample["input"].tolist() == [10, 11, 12, 13, 14]
    assert sample["target"].tolist() == [11, 12, 13, 14, 15]
    assert ds[np.int64(3)]["target"].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[4]
    with pytest.raises(IndexError):
        ds[-1]
    # The last full window must exactly reach the final token when it fits.
    assert TokenWindows(torch.arange(21), 5)[3]["target"][-1].item() == 20


def test_token_windows_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="corpus too short: 5 tokens.*seq_len=5 needs 6"):
        TokenWindows(torch.arange(5), 5)
    with pytest.raises(ValueError, match="1-D"):
        TokenWindows(torch.zeros(2, 10, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="integer dtype"):
        TokenWindows(torch.zeros(10), 3)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(torch.arange(10), 0)


def test_collate_stacks_and_checks_keys() -> None:
    ds = TokenWindows(torch.arange(50), 4)
    batch = collate([ds[0], ds[3], ds[7]])
    assert batch["input"].shape == (3, 4) and batch["target"].shape == (3, 4)
    assert batch["input"][1].tolist() == [12, 13, 14, 15]
    with pytest.raises(ValueError, match="at least one"):
        collate([])
    with pytest.raises(ValueError, match="keys"):
        collate([ds[0], {"input": ds[1]["input"]}])


def _write(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_parquet_round_trip_file_dir_glob_and_url(tmp_path: Path) -> None:
    _write(tmp_path / "d" / "a.parquet", pa.table({"text": ["héllo", None, "world"], "n": [1, 2, 3]}))
    _write(tmp_path / "d" / "sub" / "b.parquet", pa.table({"text": ["again"], "n": [4]}))
    one = load_text_tokens(str(tmp_path / "d" / "a.parquet"))
    assert bytes(one.to(torch.uint8).tolist()) == "héllo\nworld".encode()
    expected = "héllo\nworld\nagain".encode()
    for source in (str(tmp_path / "d"), str(tmp_path / "d") + "/**/*.parquet", f"file://{tmp_path}/d"):
        assert bytes(load_text_tokens(source).to(torch.uint8).tolist()) == expected, source


def test_parquet_via_fsspec_memory_filesystem() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/elastictrain-test/x.parquet", "wb") as handle:
        pq.write_table(pa.table({"body": pa.array(["abc", "de"], type=pa.large_string())}), handle)
    tokens = load_text_tokens("memory://elastictrain-test/x.parquet", column="body", storage_options={})
    assert bytes(tokens.to(torch.uint8).tolist()) == b"abc\nde"


def test_parquet_error_messages(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_text_tokens(str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no parquet files"):
        load_text_tokens(str(tmp_path / "empty"))
    path = tmp_path / "t.parquet"
    _write(path, pa.table({"body": ["x"], "n": [1]}))
    with pytest.raises(ValueError, match="column 'text' not found.*available columns: \\['body', 'n'\\]"):
        load_text_tokens(str(path))
    with pytest.raises(ValueError, match="column 'n'.*int64, expected a string column"):
        load_text_tokens(str(path), column="n")
    nulls = tmp_path / "nulls.parquet"
    _write(nulls, pa.table({"text": pa.array([None], type=pa.string())}))
    with pytest.raises(ValueError, match="no text found"):
        load_text_tokens(str(nulls))


def test_parquet_from_s3_through_moto(s3_server, s3_bucket):
    """The same loader reads Parquet from s3:// (a real S3 endpoint: moto's server on 127.0.0.1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    opts = s3_server.options()
    fs = s3fs.S3FileSystem(**opts)
    table = pa.table({"text": ["hello from s3", "second row"]})
    with fs.open(f"{s3_bucket}/corpus/part-0.parquet", "wb") as f:
        pq.write_table(table, f)
    tokens = load_text_tokens(f"{s3_bucket}/corpus/part-0.parquet", storage_options=opts)
    assert bytes(tokens.to(torch.uint8).tolist()) == b"hello from s3\nsecond row"


def test_worker_code_does_not_import_pyarrow() -> None:
    """pyarrow (~30 MiB resident per process) is imported by the parquet loader only: a worker's step loop,
    its data code and the built-in task leave it out (a fresh interpreter, so this test's own import of
    pyarrow does not count)."""
    import subprocess
    import sys

    code = ("import sys, elastictrain.data, elastictrain.worker.loop, elastictrain.task; "
            "from elastictrain.data.datasets import load_text_tokens; load_text_tokens('builtin:pydoc'); "
            "print('pyarrow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False", out.stdout + out.stderr
