"""Row blocks for ``task.init_from`` under tp (elastictrain/models/hf_rows.py, issue 38): a tensor-parallel
row-wise layer (sharded on its columns) is read by each tp rank as a contiguous block of whole rows and
redistributed by one all-to-all of the tp group.

* the decision (pure): which placements get row blocks (tp's Shard(1), with FSDP's or HSDP's rows beside it),
  which keep the per-slice reader, and why; the rows each peer reads and the columns each holds (uneven
  columns, rows fewer than peers, a 3-d tensor whose rows flatten two dimensions);
* the exchange's pure halves: every peer's block packed, routed as the all-to-all routes it, unpacked: each
  peer's columns, bitwise (fp32 and bf16, 2 and 3 peers);
* 2 gloo ranks under tp2 through the worker's path (StepRunner.attach + init_from_seed) from a real S3
  endpoint (moto, counting every GET with the rank that sent it): the parameters are bitwise those of torch's
  own reader on the local copy and of the per-slice ranged reader (the present path); merging nothing, each
  rank fetched exactly the bytes it holds, its half of the rows of every matrix (the row-wise layers' too,
  one range each, where the per-slice reader asks one range per row: tests/test_s3_ranges.py), at most one
  GET per tensor; bf16 files into the fp32 model by row blocks: torch's reader's values. The counts depend
  on the plan only, never on timing.

Against the builds they guard (measured by breaking the code): each peer sent the other peer's columns in
``pack`` fails the pure exchange (a reshape error in the uneven 3-peer case, wrong bytes in the 2-peer one)
and the tp2 parameters (``layers.0.attention.wo.weight`` differs on rank 0); row blocks never applied
(``row_jobs`` returning nothing: the per-slice reader at gap 0) loads the same parameters and fails the
GET list (250 more GETs per rank: one per row of the row-wise layers); row blocks planned in the model's
dtype (fp32) rather than the files' fails the bf16 run (rank 0: a 64 x 64 slice from 8,192 bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks
from tests.test_s3_ranges import _data_gets, counting  # noqa: F401 - the counting fixture

pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------ the decision
def _plan(shape: tuple[int, ...], placements: list[Any], mesh: tuple[int, ...], coord: tuple[int, ...],
          itemsize: int = 4) -> tuple[Any, Any, str]:
    """plan_row_block for the slice torch's DTensor gives ``coord`` (its own offset rule)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from elastictrain.models.hf_rows import plan_row_block

    lengths, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
    return plan_row_block(shape, itemsize, offsets, lengths, placements, mesh, coord)


def test_which_layouts_read_row_blocks_and_why():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    block, m, why = _plan((64, 128), [Shard(1)], (2,), (1,))  # tp2 wo/w2: rows 32..63 read, columns 64..127 held
    assert m == 0 and "row blocks" in why
    assert block.read_range() == (32 * 512, 64 * 512) and block.cols == ((0, 64), (64, 64))
    assert block.send_bytes(0) == 32 * 64 * 4 and block.recv_bytes(0) == 32 * 64 * 4
    # fsdp2 x tp2 (FSDP's Shard(0) beside tp's Shard(1)): the group's rows are this dp shard's
    block, m, _ = _plan((64, 128), [Shard(0), Shard(1)], (2, 2), (1, 0))
    assert m == 1 and block.first_row == 32 and block.bounds == (0, 16, 32) and block.me == 0
    assert block.read_range() == (32 * 512, 48 * 512)
    block, m, _ = _plan((64, 128), [Replicate(), Shard(0), Shard(1)], (2, 2, 2), (1, 1, 1))  # hsdp x tp
    assert m == 2 and block.read_range() == (48 * 512, 64 * 512)
    # uneven columns (torch's chunking: 3, 3, 3, 1) and fewer rows than peers
    block, _, _ = _plan((1, 10), [Shard(1)], (4,), (3,))
    assert block.cols == ((0, 3), (3, 3), (6, 3), (9, 1)) and block.bounds == (0, 0, 0, 0, 1)
    assert block.read_range() == (0, 40) and [block.recv_bytes(j) for j in range(4)] == [0, 0, 0, 4]
    # a 3-d tensor sharded on its last dimension: rows are dims 0 and 1 flattened
    block, _, _ = _plan((4, 3, 8), [Shard(0), Shard(2)], (2, 2), (1, 1), itemsize=2)
    assert (block.first_row, block.bounds, block.row_bytes, block.inner_bytes) == (6, (0, 3, 6), 16, 2)
    for placements, mesh, coord, reason in [
        ([Shard(0)], (2,), (0,), "whole rows"),  # column-wise (wq, w1, the head): one range already
        ([Replicate()], (2,), (0,), "whole rows"),  # the norms
        ([Shard(1)], (1,), (0,), "whole rows"),  # tp of one rank
        ([Shard(1), Shard(1)], (2, 2), (0, 1), "sharded on mesh dims [0, 1]"),
        ([_StridedShard(0, split_factor=2), Shard(1)], (2, 2), (0, 0), "only Shard and Replicate"),
    ]:
        block, m, why = _plan((64, 128), placements, mesh, coord)
        assert block is None and m is None and reason in why, (placements, why)
    assert _plan((64,), [Shard(0)], (2,), (0,))[2].startswith("fewer than 2 dimensions")


# ------------------------------------------------------------------------------- the exchange (pure halves)
@pytest.mark.parametrize("dtype,peers", [(torch.float32, 2), (torch.bfloat16, 3)])
def test_packed_blocks_routed_and_unpacked_are_each_peers_columns(dtype, peers):
    """Two tensors of one group (a 2-d one and a 3-d one sharded on its last dimension), every peer's block
    packed, routed as ``all_to_all_single`` routes (peer j receives segment j of every peer's buffer, in peer
    order), unpacked: each peer's columns of the whole tensor, bitwise."""
    from torch.distributed.tensor import Shard

    from elastictrain.models.hf_rows import pack, recv_sizes, unpack

    g = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(10, 12, generator=g).to(dtype), 1), (torch.randn(3, 4, 7, generator=g).to(dtype), 2)]
    sends, blocks = [], []
    for j in range(peers):
        mine = []
        for t, d in tensors:
            block, _, _ = _plan(tuple(t.shape), [Shard(d)], (peers,), (j,), itemsize=t.element_size())
            raw = t.contiguous().view(torch.uint8).numpy().tobytes()
            a, b = block.read_range()
            mine.append((block, memoryview(raw)[a:b]))
        buf, split = pack(mine)
        assert len(buf) == sum(split)
        sends.append(list(torch.split(buf, split)))
        blocks.append([b for b, _ in mine])
    for j in range(peers):
        got = unpack(blocks[j], torch.cat([sends[k][j] for k in range(peers)]))
        assert [sum(x) for x in [recv_sizes(blocks[j])]] == [sum(s[j].numel() for s in sends)]
        for (t, d), b, part in zip(tensors, blocks[j], got):
            off, n = b.cols[j]
            want = t.narrow(d, off, n)
            assert torch.equal(part.view(dtype).reshape(b.lengths), want), (j, tuple(t.shape))


# --------------------------------------------------------------------------- tp2 from S3, counted per rank
def _agent(rank: int, run: int) -> str:
    return f"etrank/{rank}-{run}"


def _loads(rank: int, world: int, runs: list[tuple[str, dict | None, int | None, bool]], port: int, out: str
           ) -> None:
    """One rank under tp2, per run ``(source, storage options, merge gap, row blocks on)``: the worker's
    StepRunner attached and given its step-0 values (init_from_seed: the task's init_from loader), its local
    shards kept. The rank's S3 client names it and the run in its User-Agent."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from elastictrain.config import build_config
    from elastictrain.models import hf_weights
    from tests.ranks import attached_runner, join_gloo
    from tests.test_hf_llama import _spec

    join_gloo(rank, world, port)
    make_reader = hf_weights.make_reader
    results = []
    try:
        for i, (source, options, gap, rows) in enumerate(runs):
            def reader(uri: str, *args: Any, row_blocks: Any = None, **kwargs: Any) -> Any:
                return make_reader(uri, *args, merge_gap=gap, row_blocks=row_blocks if rows else None, **kwargs)

            hf_weights.make_reader = reader
            if options is not None:
                config_kwargs = {**options.get("config_kwargs", {}), "user_agent_extra": _agent(rank, i)}
                options = {**options, "config_kwargs": config_kwargs}
            runner = attached_runner(build_config(_spec(world, source, options=options, tp=2)), rank, world)
            results.append({n: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
                            for n, t in runner.model.state_dict().items()})
        torch.save(results, f"{out}.{rank}")
    finally:
        hf_weights.make_reader = make_reader
        dist.destroy_process_group()


ROW_WISE = ("o_proj.weight", "down_proj.weight")  # tp's Shard(1): the row blocks


def _merged(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte ranges with touching ones joined (what a reader merging nothing still asks for in one GET)."""
    out: list[tuple[str, int, int]] = []
    for path, a, b in sorted(pieces):
        if out and out[-1][0] == path and out[-1][2] == a:
            out[-1] = (path, out[-1][1], b)
        else:
            out.append((path, a, b))
    return out


def _got(gets: list[Any]) -> list[tuple[str, int, int]]:
    ranges = [(g.path.lstrip("/"), g.start, g.start + g.sent) for g in gets]
    return sorted(ranges)


def test_tp2_reads_row_blocks_one_get_per_tensor_and_its_share(tmp_path, counting):
    """A Hugging Face Llama (save_pretrained, index-sharded in 100 KB files) on the counting S3, loaded under
    tp2 on 2 gloo ranks: by row blocks (merging nothing, then over the default 1 MiB), by the per-slice ranged
    reader (the default 1 MiB), and from the local copy by torch's reader: every rank's shards bitwise equal
    in all four; a bf16 copy (the files' dtype is not the model's fp32) by row blocks: torch's reader's
    values of it. Row blocks, merging nothing: each rank's data GETs are exactly its half of the rows of every
    matrix (the row-wise layers' too: one range, not one per row) and the norms whole, touching ranges joined:
    at most one GET per tensor, bytes exactly the bytes it holds."""
    import s3fs

    from elastictrain.models.hf_weights import read_source
    from tests.test_hf_llama import save_hf

    moto, server = counting
    hf = save_hf(tmp_path / "src")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))  # Llama 3.1's own files: bf16
    fs = s3fs.S3FileSystem(**server.options())
    fs.mkdir("tprows")
    fs.put(str(tmp_path / "sharded") + "/", "tprows/llama/", recursive=True)
    fs.put(str(tmp_path / "bf16") + "/", "tprows/bf16/", recursive=True)
    uri, opts = "s3://tprows/llama", server.options()
    source = read_source(uri, opts)
    runs = [(str(tmp_path / "src"), None, None, False), (uri, opts, 0, True), (uri, opts, None, False),
            (uri, opts, None, True), (str(tmp_path / "bf16"), None, None, False), ("s3://tprows/bf16", opts, 0, True)]
    out = str(tmp_path / "got.pt")
    moto.take("tprows")
    run_ranks(_loads, (2, runs, free_port(), out), nprocs=2)
    got = [torch.load(f"{out}.{r}") for r in range(2)]  # got[rank][run]: name -> local shard
    gets = _data_gets(moto.take("tprows/llama/"), source)
    for i, ref in ((1, 0), (2, 0), (3, 0), (5, 4)):  # fp32 files; bf16 files into the fp32 model
        for r in range(2):
            assert got[r][i].keys() == got[r][ref].keys()
            for n, t in got[r][ref].items():
                assert torch.equal(got[r][i][n], t), (runs[i], r, n)
    assert not torch.equal(got[0][4]["layers.0.attention.wo.weight"], got[0][0]["layers.0.attention.wo.weight"])
    for r in range(2):
        rows, rest = [], []  # tp2: every matrix's half of the rows, a norm whole
        for name, e in source.tensors.items():
            half = (e.end - e.start) // 2 if len(e.shape) == 2 else e.end - e.start
            start = e.start + r * half if len(e.shape) == 2 else e.start
            (rows if name.endswith(ROW_WISE) else rest).append((e.file, start, start + half))
        mine = [g for g in gets if _agent(r, 1) in g.agent]
        held = sum(t.numel() * t.element_size() for t in got[r][0].values())
        assert _got(mine) == sorted(_merged(rows) + _merged(rest)), r  # row blocks: a call of their own
        assert len(mine) <= len(source.tensors) and sum(g.sent for g in mine) == held, (r, len(mine), held)
