"""The per-step (loss, stop) word rides in DDP's last gradient bucket (issue 8 item 16): real 2-rank gloo,
several buckets, gradients equal to DDP without the hook and the word summed over the ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tests.checkpoint_fixtures import free_port
from tests.ranks import run_ranks


def _rank(rank: int, port: int) -> None:
    from elastictrain.worker.step_stats import StepStats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
        ref = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))
        ref.load_state_dict(model.state_dict())
        ddp, plain = DDP(model, bucket_cap_mb=0.1), DDP(ref, bucket_cap_mb=0.1)  # several buckets
        stats = StepStats(ddp)
        # The hook is installed: a silent fallback to a separate all-reduce would give the same values below.
        assert stats.carries
        for it in range(3):
            x = torch.randn(8, 300, generator=torch.Generator().manual_seed(rank * 10 + it))
            sent = stats.send(torch.tensor([float(rank + 1), float(rank == 1 and it == 2)], dtype=torch.float64))
            ddp(x).sum().backward()
            word = sent.wait()
            assert sent.carried  # the sum came out of the last bucket's all-reduce, not one of its own
            plain(x).sum().backward()
            assert torch.equal(word, torch.tensor([3.0, float(it == 2)], dtype=torch.float64)), word
            for a, b in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad)
            model.zero_grad()
            ref.zero_grad()
    finally:
        dist.destroy_process_group()


def test_word_rides_in_the_last_bucket_and_gradients_are_unchanged():
    run_ranks(_rank, (free_port(),), 2)


def _rank_without_ddp(rank: int, port: int) -> None:
    from elastictrain.worker.step_stats import StepStats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        stats = StepStats(None)
        assert not stats.carries
        sent = stats.send(torch.tensor([float(rank + 1), float(rank == 1)], dtype=torch.float64))
        # Summed over both ranks (a skipped all-reduce would leave each rank its own word).
        assert torch.equal(sent.wait(), torch.tensor([3.0, 1.0], dtype=torch.float64))
        assert not sent.carried
    finally:
        dist.destroy_process_group()


def test_without_ddp_the_word_takes_its_own_all_reduce():
    run_ranks(_rank_without_ddp, (free_port(),), 2)
