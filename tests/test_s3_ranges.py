"""Coalesced S3 range reads (elastictrain/byte_ranges.py), counted at a real moto S3 server: every GET it
answers is noted with its path, its Range header and the body bytes it sent.

* the plan (pure): pieces sorted per file, merged over gaps of at most ``gap`` bytes, each piece found again;
  a slice's byte runs (rows whole: one run; columns: one per row);
* a prepared corpus's batch (issue 37): 4 adjacent windows are one GET of their span, 5 windows scattered over
  two shards (more than 64 KiB apart, one across the shard boundary) one GET per piece; a prefetched batch
  is one ``cat_ranges`` call and ``dataset[i]`` of it reads nothing more; the tokens, in the batch's own order,
  are the local (pread) path's;
* held-out evaluation on S3 reads each micro-batch (adjacent windows) in one GET, with the numbers of the
  window-by-window local read;
* ``task.init_from`` under tp2 (issue 38) on 2 gloo ranks through the worker's step path, by the per-slice
  reader (row blocks off; they are tests/test_tp_rows.py's): with no merging the
  bytes fetched are exactly the slices the ranks hold (a row-wise layer's columns, not its rows); with the
  default 64 KiB merge they are the planned reads (held slices plus the gaps merged), fewer GETs than tensors
  read; step 1's loss is transformers' (tests/test_hf_llama.py's check) either way; a plan over several
  ``cat_ranges`` calls loads the local load's weights.

Against the builds they guard (measured by breaking the code): a window read per GET fails the adjacent
batch's count (4 GETs, not 1) and the prefetch count (10, not 7); evaluation read window by window fails its
count (32 GETs, not 8); the whole-row reader of before fails the tp2 count (42 GETs and 526,848 bytes, where
the ranks hold 428,544: twice the held bytes of every row-wise layer); a call that drops the item crossing
its budget fails the several-calls load (tok_embeddings differs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from elastictrain.byte_ranges import MERGE_GAP, WEIGHTS_MERGE_GAP, Read, plan_reads, slice_runs
from elastictrain.data.shards import Shard, manifest_json
from elastictrain.data.windows import PreparedWindows
from tests.checkpoint_fixtures import S3Server, free_port


@dataclass(frozen=True)
class Get:
    path: str
    range: str | None
    sent: int  # body bytes
    agent: str = ""  # the client's User-Agent (a test tags each rank's client: config_kwargs.user_agent_extra)

    @property
    def start(self) -> int:
        return int(self.range.removeprefix("bytes=").split("-")[0]) if self.range else 0


class CountingMoto:
    """moto's S3 server app on 127.0.0.1 (in a thread of this process) behind a WSGI wrapper that notes each
    GET it answered; ranks in other processes reach it like any endpoint."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.gets: list[Get] = []
        self._done = threading.Condition()
        self._open = 0  # GETs received whose body is not all sent yet
        app = DomainDispatcherApplication(create_backend_app)

        def counted(environ: dict, start_response: Any) -> Iterable[bytes]:
            if environ["REQUEST_METHOD"] != "GET":
                return app(environ, start_response)
            with self._done:
                self._open += 1
            return self._count(environ["PATH_INFO"], environ.get("HTTP_RANGE"), environ.get("HTTP_USER_AGENT", ""),
                               app(environ, start_response))

        self._server = make_server("127.0.0.1", free_port(), counted, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _count(self, path: str, rng: str | None, agent: str, body: Iterable[bytes]) -> Iterable[bytes]:
        sent = 0
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            with self._done:
                self.gets.append(Get(path, rng, sent, agent))
                self._open -= 1
                self._done.notify_all()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def take(self, prefix: str) -> list[Get]:
        """The GETs of objects under ``/prefix`` answered so far (and forget them). The client has its bytes
        before the server closes the response: this waits for the GETs received to be closed."""
        with self._done:
            assert self._done.wait_for(lambda: self._open == 0, timeout=60), "a GET still open after 60 s"
            mine = [g for g in self.gets if g.path.startswith(f"/{prefix}")]
            self.gets = [g for g in self.gets if not g.path.startswith(f"/{prefix}")]
        return mine

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@pytest.fixture(scope="module")
def counting() -> tuple[CountingMoto, S3Server]:
    moto = CountingMoto()
    yield moto, S3Server(moto.endpoint, moto)
    moto.stop()


# ------------------------------------------------------------------------------------------- the plan (pure)
def test_plan_merges_near_pieces_of_one_file_and_finds_each_again():
    pieces = [("b", 0, 10), ("a", 500, 600), ("a", 0, 100), ("a", 100, 150), ("a", 140, 160), ("a", 200, 210),
              ("b", 5, 5)]
    reads, where = plan_reads(pieces, gap=50)
    # a: [0,100) + touching [100,150) + overlapping [140,160) + [200,210) 40 bytes on: one read; 500 is 290 on
    assert reads == [Read("a", 0, 210), Read("a", 500, 600), Read("b", 0, 10)]
    assert where == [(2, 0), (1, 0), (0, 0), (0, 100), (0, 140), (0, 200), (-1, 0)]
    assert plan_reads(pieces, gap=0)[0] == [Read("a", 0, 160), Read("a", 200, 210), Read("a", 500, 600),
                                             Read("b", 0, 10)]
    with pytest.raises(ValueError, match="not a range"):
        plan_reads([("a", 10, 5)])


def test_slice_runs_are_rows_whole_or_one_per_row():
    assert slice_runs([6, 8], [2, 0], [3, 8], 4) == [(64, 160)]  # rows 2-4 whole: one run
    assert slice_runs([6, 8], [0, 4], [2, 4], 4) == [(16, 32), (48, 64)]  # columns 4-7 of rows 0-1
    assert slice_runs([2, 3, 4], [1, 1, 0], [1, 2, 4], 2) == [(32, 48)]  # a block of whole inner rows
    assert slice_runs([2, 3, 4], [0, 0, 1], [2, 1, 2], 1) == [(1, 3), (13, 15)]
    assert slice_runs([], [], [], 8) == [(0, 8)] and slice_runs([4, 4], [0, 0], [0, 4], 4) == []
    t = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    raw = t.numpy().tobytes()
    got = b"".join(raw[a:b] for a, b in slice_runs([6, 8], [1, 3], [4, 5], 4))
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.float32).reshape(4, 5), t[1:5, 3:8])


# ----------------------------------------------------------------------------------- prepared windows (#37)
SEQ = 16
SHARD_TOKENS = (150_007, 70_000)  # uint16: 300 KB + 140 KB; window 9375 starts 7 tokens before the boundary


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, counting: tuple[CountingMoto, S3Server]
           ) -> tuple[Path, str, dict[str, Any]]:
    """Two training shards and a validation shard of random uint16 tokens, on disk and in a bucket of the
    counting server."""
    import s3fs

    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    (root / "validation").mkdir()
    splits: dict[str, list[Shard]] = {"train": [], "validation": []}
    for k, (split, n) in enumerate([("train", t) for t in SHARD_TOKENS] + [("validation", 3000)]):
        data = np.random.default_rng(k).integers(0, 500, n, dtype=np.uint16).astype("<u2").tobytes()
        (root / split / f"{k:05d}.bin").write_bytes(data)
        splits[split].append(Shard(f"{split}/{k:05d}.bin", n, len(data), "0" * 64))
    (root / "manifest.json").write_text(manifest_json(
        dtype="uint16", vocab_size=500, eos_id=0, tokenizer_sha256="0" * 64, text_column="text", sources=[],
        splits=splits, split_rule={"kind": "none"}, seq_len=None))
    _, server = counting
    fs = s3fs.S3FileSystem(**server.options())
    fs.mkdir("windows")
    fs.put(str(root) + "/", "windows/corpus/", recursive=True)
    return root, "s3://windows/corpus", server.options()


ADJACENT = [13, 10, 12, 11]  # tokens [160, 225): one span (neighbouring windows share a token)
SCATTERED = [7000, 0, 9375, 4000, 13000]  # >= 75,000 bytes apart; 9375 crosses into shard 1


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_a_batch_of_windows_is_one_get_per_span(corpus, counting):
    """One batch read on S3: adjacent windows one GET of their span (the tokens between them once),
    scattered ones one GET per window piece (two at the shard boundary), bytes those pieces'; the batch is
    the local path's, rows in the order asked (the sample cursor's)."""
    from elastictrain.worker.loop import _default_collate

    root, uri, opts = corpus
    moto, _ = counting
    local, remote = PreparedWindows(str(root), SEQ), PreparedWindows(uri, SEQ, storage_options=opts)
    assert not remote.local and remote.merge_gap == MERGE_GAP
    moto.take("windows")  # the manifest's read
    for ids, gets, sent in ((ADJACENT, 1, (4 * SEQ + 1) * 2), (SCATTERED, 6, 5 * (SEQ + 1) * 2)):
        got = remote.batch(ids)
        assert _same(got, local.batch(ids)) and _same(got, _default_collate([local[i] for i in ids])), ids
        seen = moto.take("windows/corpus/train")
        assert (len(seen), sum(g.sent for g in seen)) == (gets, sent), (ids, seen)
    remote.close()


def test_a_prefetched_batch_is_one_call_and_reads_nothing_more(corpus, counting):
    """``prefetch`` of two batches (the loop's this-and-next-step schedule): one coalesced read each (7 GETs
    in all); taking them (``batch``) and their windows one by one (``dataset[i]``: a custom collate) reads
    nothing more, and gives the local tokens. A batch no longer scheduled is dropped."""
    root, uri, opts = corpus
    moto, _ = counting
    local, remote = PreparedWindows(str(root), SEQ), PreparedWindows(uri, SEQ, storage_options=opts)
    moto.take("windows")
    remote.prefetch([ADJACENT, SCATTERED])
    for i in SCATTERED:
        assert _same(remote[i], local[i]), i
    assert _same(remote.batch(ADJACENT), local.batch(ADJACENT))
    assert len(moto.take("windows")) == 1 + 6
    remote.prefetch([SCATTERED, [5]])  # the taken ADJACENT is gone; SCATTERED is kept, [5] is new
    assert set(remote._ahead) == {tuple(SCATTERED), (5,)}
    remote.prefetch([[6]])
    assert set(remote._ahead) == {(6,)}
    remote.close()


class _PerWindow:
    """A prepared split without ``batch``: the loop reads it window by window (as before batch reads)."""

    def __init__(self, windows: PreparedWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.windows[index]


def _losses_and_evals(spec: dict, task: Any) -> list[tuple[float, float | None]]:
    """The worker's StepRunner on a one-rank gloo group in this process: (loss, eval_loss) of every step."""
    import torch.distributed as dist

    from elastictrain import build_config
    from elastictrain.parallel.layout import resolve, spec_from_config
    from elastictrain.worker.faults import FaultInjector
    from elastictrain.worker.loop import StepRunner

    cfg = build_config(spec)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        runner = StepRunner(task, cfg.train, FaultInjector(()), parallel=cfg.parallel)
        runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
        records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
        runner.close_data()
        return [(r.loss, r.eval_loss) for r in records]
    finally:
        dist.destroy_process_group()


def test_evaluation_reads_a_micro_batch_in_one_get(corpus, counting):
    """Held-out evaluation (2 steps, an evaluation after each: 4 micro-batches of 4 adjacent validation
    windows) on the S3 copy: one GET per micro-batch (8, not 32), and every step's loss and held-out loss
    exactly those of reading the local copy window by window."""
    import dataclasses

    from elastictrain import build_config
    from elastictrain.task import builtin_task
    from tests.conftest import job

    root, uri, opts = corpus
    moto, _ = counting
    spec = job(task={**job()["task"], "data": {"source": str(root)}},
               train={"steps": 2, "eval_every": 1, "eval_batches": 1}, workers={"min": 1, "max": 1, "standby": False})
    spec["task"]["model"] = {**spec["task"]["model"], "seq_len": SEQ}
    base = builtin_task(build_config(spec))
    remote = dataclasses.replace(base, eval_dataset_fn=lambda: PreparedWindows(uri, SEQ, "validation", opts))
    local = dataclasses.replace(base, eval_dataset_fn=lambda: _PerWindow(PreparedWindows(str(root), SEQ, "validation")))
    moto.take("windows")
    got = _losses_and_evals(spec, remote)
    gets = moto.take("windows/corpus/validation")
    assert got == _losses_and_evals(spec, local) and all(e is not None for _, e in got), got
    assert len(gets) == 2 * 4 and all(g.sent == (4 * SEQ + 1) * 2 for g in gets), gets


# --------------------------------------------------------------------------------------- init_from tp2 (#38)
def _tp2_loads(rank: int, world: int, gaps: dict[str, int], options: dict[str, dict], port: int, out: str
               ) -> None:
    """tests/test_hf_llama.py's rank (the worker's StepRunner, init_from_seed, one step) under tp2, once per
    source URI, the ranged reader of each URI merging over ``gaps[uri]`` bytes and reading each rank's slices
    alone (no row blocks: the fall-back path of ``models/hf_rows.py``)."""
    from elastictrain.models import hf_weights
    from tests.test_hf_llama import _first_step

    make_reader = hf_weights.make_reader

    def with_gap(uri: str, *args: Any, **kwargs: Any) -> Any:
        kwargs["row_blocks"] = None  # the per-slice reader these counts are of (row blocks: tests/test_tp_rows.py)
        return make_reader(uri, *args, merge_gap=gaps[uri], **kwargs)

    hf_weights.make_reader = with_gap
    try:
        _first_step(rank, world, [(uri, {"tp": 2}, None) for uri in gaps], options, port, out)
    finally:
        hf_weights.make_reader = make_reader


def _data_gets(gets: list[Get], source: Any) -> list[Get]:
    """The GETs of tensor bytes (not a file's 8-byte length or JSON header, nor config.json)."""
    data_start: dict[str, int] = {}
    for e in source.tensors.values():
        name = "/" + e.file
        data_start[name] = min(data_start.get(name, e.start), e.start)
    return [g for g in gets if g.path in data_start and g.start >= data_start[g.path]]


def test_tp2_init_from_s3_fetches_the_held_columns_not_the_rows(tmp_path, counting):
    """2 gloo ranks load an index-sharded Hugging Face Llama from the counting S3 under tp2, twice: merging
    nothing, the bytes fetched are exactly the slices the ranks hold (a row-wise layer's columns: per-row
    GETs); merging over 1 MiB (the default), the bytes of the planned reads (the held slices plus the gaps
    merged), fewer GETs than tensors read (this model's rows are narrow: a few long reads). Step 1's loss is
    transformers', and every rank asked the reader for exactly the slices it holds, each once."""
    import s3fs

    from elastictrain.models.hf_weights import _element_bytes, read_source
    from tests.ranks import run_ranks
    from tests.test_hf_llama import _check_against_transformers, save_hf

    moto, server = counting
    hf = save_hf(tmp_path / "src")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    fs = s3fs.S3FileSystem(**server.options())
    fs.mkdir("hfranges")
    gaps = {"s3://hfranges/exact": 0, "s3://hfranges/merged": WEIGHTS_MERGE_GAP}
    for uri in gaps:
        fs.put(str(tmp_path / "sharded") + "/", uri.removeprefix("s3://") + "/", recursive=True)
    options = {uri: server.options() for uri in gaps}
    out = str(tmp_path / "got.pt")
    moto.take("hfranges")
    run_ranks(_tp2_loads, (2, gaps, options, free_port(), out), nprocs=2)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    _check_against_transformers(got, {uri: hf for uri in gaps}, 2, options)
    gets = moto.take("hfranges")
    for i, (uri, gap) in enumerate(gaps.items()):
        source = read_source(uri, server.options())
        fetched = _data_gets([g for g in gets if g.path.startswith("/" + uri.removeprefix("s3://") + "/")], source)
        held_bytes = whole_rows = 0
        planned: list[Read] = []
        for rank in got:
            pieces = []
            for name, offsets, lengths in rank[i]["held"]:
                e = source.tensors[name]
                size = _element_bytes(e.dtype)
                held_bytes += int(np.prod(lengths)) * size
                whole_rows += int(np.prod(lengths[:1] + e.shape[1:])) * size
                pieces += [(e.file, e.start + a, e.start + b) for a, b in slice_runs(e.shape, offsets, lengths, size)]
            planned += plan_reads(pieces, gap)[0]
        sent = sum(g.sent for g in fetched)
        assert (len(fetched), sent) == (len(planned), sum(r.end - r.start for r in planned)), uri
        n_tensors = sum(len(rank[i]["held"]) for rank in got)
        if gap == 0:  # exactly what the ranks hold: a row-wise layer's columns (a GET per row), not its rows
            assert sent == held_bytes < whole_rows and len(fetched) > n_tensors, (sent, held_bytes, whole_rows)
        else:  # this small model's rows and tensors lie within 1 MiB of each other: a few long reads
            assert sent > held_bytes and len(fetched) < n_tensors, (sent, held_bytes, len(fetched), n_tensors)


def test_a_load_fetched_in_several_calls_gives_the_same_weights(tmp_path, counting, monkeypatch):
    """A rank's plan bigger than one call's budget (``_FETCH_BYTES``, set to 16 KiB here) goes out in several
    ``cat_ranges`` calls, each item whole in one of them: the loaded weights are the local load's, bitwise."""
    import s3fs

    from elastictrain.models import hf_weights
    from tests.test_hf_llama import ours_from, save_hf

    _, server = counting
    save_hf(tmp_path / "src")
    fs = s3fs.S3FileSystem(**server.options())
    fs.mkdir("hfcalls")
    fs.put(str(tmp_path / "src") + "/", "hfcalls/llama/", recursive=True)
    calls: list[int] = []
    fetch = hf_weights.fetch

    def counted(fs: Any, pieces: Any, gap: int) -> Any:
        calls.append(len(pieces))
        return fetch(fs, pieces, gap)

    monkeypatch.setattr(hf_weights, "_FETCH_BYTES", 16 << 10)
    monkeypatch.setattr(hf_weights, "fetch", counted)
    local = ours_from(tmp_path / "src")
    remote = type(local)(local.cfg)
    hf_weights.load_hf_weights(remote, "s3://hfcalls/llama", server.options(), tied=False)
    assert len(calls) > 4, calls
    for name, t in local.state_dict().items():
        assert torch.equal(t, remote.state_dict()[name]), name
