"""The model digest (parallel/digest.py) of a model laid out as torch lays it out, combined from every rank's
part, is the digest of the whole model held in one process.

The ranks are 4 processes on torch's ``fake`` process group: no collective carries data, and none is needed
(each rank builds the same seeded model; ``parallelize_module(src_data_rank=None)`` and ``fully_shard`` each
keep their own slice of it), so the placements are the ones tp x fsdp really produces, at the cost of a few
seconds. The digest is exact (an integer sum of element hashes): equal or not, no tolerance.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, DIM, HIDDEN = 256, 16, 64  # the shapes of tests/test_tensor_parallel.py's GPT: its digest failed there


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, HIDDEN),
                               torch.nn.Linear(HIDDEN, DIM))


def _parts(rank: int, out: str) -> None:
    """Rank ``rank`` of 4 on a (dp 2, tp 2) mesh: its digest part under tp2 x fsdp2 (FSDP2 over the tp shards:
    ``_StridedShard`` rows) and under tp2 x ddp2 (tp DTensors replicated over dp), written to ``out.rank``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from elastictrain.parallel.digest import local_part

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        dp, tp = mesh.get_coordinate()
        along = {"dp": dp == 0, "tp": tp == 0}
        plan = {"0": RowwiseParallel(), "1": ColwiseParallel(), "2": RowwiseParallel()}  # vocab-parallel embedding
        parts: dict[str, Any] = {}
        for name, fsdp in (("tp2_fsdp2", True), ("tp2_ddp2", False)):
            model = parallelize_module(_model(), mesh["tp"], plan, src_data_rank=None)
            if fsdp:
                fully_shard(model, mesh=mesh["dp_shard"])
            parts[name] = local_part(model.state_dict(), plain_primary=all(along.values()), primary_along=along)
            if fsdp:  # the case the digest once broke on: fsdp's rows of a tp shard
                assert "_StridedShard" in repr(model.state_dict()["0.weight"].placements)
        torch.save(parts, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_digest_of_tp_by_fsdp_shards_is_the_whole_models(tmp_path):
    """tp2 x fsdp2 and tp2 x ddp2 on 4 ranks: the combined parts give ``digest_of`` the whole model.

    Traced (issue 36): "size of tensor a (64) must match the size of tensor b (128)" in ``_hash_sum`` was
    tp2 x fsdp2's embedding (256 rows: 128 a tp rank, 64 an fsdp shard of those): FSDP2 places a
    ``_StridedShard`` over a tp-sharded dimension, which torch 2.13 does not call ``is_shard()``, so
    ``global_indices`` skipped it and mapped 128 rows onto a 64-row shard (fixed in 200af82 by treating a
    ``_StridedShard`` as a shard; a mismatch now raises a ValueError naming the tensor and its placements).
    Against that build (``if not p.is_shard(): continue``) this test fails on rank 0 with the ValueError
    "0.weight's local shard is (64, 16) but its placements ... map (128, 16)" (the broadcast error before
    the check)."""
    from elastictrain.parallel.digest import combine, digest_of
    from tests.ranks import run_ranks

    out = str(tmp_path / "part")
    run_ranks(_parts, (out,), nprocs=4)
    ranks = [torch.load(f"{out}.{r}") for r in range(4)]
    whole = digest_of(_model().state_dict())
    for layout in ("tp2_fsdp2", "tp2_ddp2"):
        assert combine([parts[layout] for parts in ranks]) == whole, layout
