"""DTensor's sharding cache is per thread, and a Ray actor runs its methods on several threads: each
thread must drop earlier generations' meshes itself (``forget_earlier_meshes_in_this_thread``).

The end-to-end failure this prevents (tests/test_peer_tier_sharded.py, elastic fsdp 4 -> 2 -> 4): a
survivor that was rank 3 of the first 4-rank mesh and is rank 1 of the regrown one loaded rank 3's rows,
because the thread running its load still held specs computed on the first, equal-looking, mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def test_each_thread_clears_its_own_sharding_cache_once_per_generation():
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from elastictrain.parallel.mesh import forget_earlier_meshes, forget_earlier_meshes_in_this_thread

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    other = ThreadPoolExecutor(max_workers=1)  # one long-lived thread, like one of a Ray actor's threads
    try:
        x = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])

        def hit(before=None) -> bool:
            """Run one DTensor op in this thread: was its sharding decision a cache hit?"""
            if before is not None:
                before()
            hits, _ = torch._C._get_DTensor_sharding_propagator_cache_stats()
            _ = x * 2
            return torch._C._get_DTensor_sharding_propagator_cache_stats()[0] > hits

        other.submit(hit).result()
        assert other.submit(hit).result()  # cached in that thread
        forget_earlier_meshes()  # what building the mesh does, in the thread that builds it...
        assert other.submit(hit).result()  # ...leaves the other thread's cache as it was
        assert not other.submit(hit, lambda: forget_earlier_meshes_in_this_thread(1)).result()
        assert other.submit(hit, lambda: forget_earlier_meshes_in_this_thread(1)).result()  # same generation
        assert not other.submit(hit, lambda: forget_earlier_meshes_in_this_thread(2)).result()  # the next
    finally:
        other.shutdown()
        dist.destroy_process_group()
