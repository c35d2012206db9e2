"""Baseline for ``benchmarks/throughput.py``: the tiny GPT trained with hand-written torchrun DDP.

Launch: ``python -m torch.distributed.run --nproc_per_node=2 benchmarks/plain_ddp.py --steps 200 ...``

This is what a careful user would write by hand for the same job as elastictrain's built-in ``tiny_gpt``:
the same model, per-sample loss scaled by ``W / G`` (so DDP's mean over ranks is the mean over the global
batch), ``no_sync`` on accumulation micro-batches, the same AdamW settings, grad clip and LR schedule,
the same dataset and the same per-sample dropout seeds. Data selection is a plain seeded random draw of
``G`` indices per step (identical on every rank; each rank takes its slice), not elastictrain's cursor.

No collectives beyond DDP's gradient all-reduce: the logged loss is rank 0's local loss. elastictrain has
none either: its global (loss, stop flag) word rides inside DDP's last gradient bucket (a comm hook).
``--stats-allreduce`` adds the separate all-reduce elastictrain used to pay, to show its cost alone.

Rank 0 records ``time.time()`` after every optimizer step and prints ONE JSON line prefixed with
``PLAIN_DDP_RESULT `` that the parent parses (it computes the steady-state window itself, with the same
function it applies to elastictrain's events).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastictrain.data.datasets import TokenWindows, collate, load_text_tokens
from elastictrain.models.gpt import GPT, GPTConfig, per_sample_loss, sample_seed
from elastictrain.task import warmup_cosine

RESULT_PREFIX = "PLAIN_DDP_RESULT "


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stats-allreduce", action="store_true",
                   help="ablation: also all-reduce (loss, stop flag) before each optimizer step, as elastictrain does")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = _parse(argv)
    torch.set_num_threads(1)  # one intra-op thread per worker, as elastictrain with cpus_per_worker=1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g, m = a.global_batch, a.micro_batch
    if g % (world * m):
        raise SystemExit(f"global_batch={g} is not a multiple of world_size*micro_batch={world * m}")
    accum = g // (world * m)

    torch.manual_seed(a.seed)
    model = GPT(GPTConfig(vocab_size=256, seq_len=a.seq_len, n_layer=a.n_layer, n_head=a.n_head,
                          d_model=a.d_model, dropout=a.dropout))
    # gradients as views of DDP's buckets, zeroed in place: the same DDP settings as elastictrain's ddp plan
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(a.beta1, a.beta2),
                            weight_decay=a.weight_decay, foreach=False)
    dataset = TokenWindows(load_text_tokens("builtin:pydoc"), a.seq_len)
    n = len(dataset)
    picker = torch.Generator().manual_seed(a.seed)  # same stream on every rank

    times: list[float] = []
    loss = float("nan")
    ddp.train()
    for step in range(a.steps):
        ids = torch.randint(n, (g,), generator=picker).tolist()
        local = 0.0
        for k in range(accum):
            start = (k * world + rank) * m
            mine = ids[start:start + m]
            batch = collate([dataset[i] for i in mine])
            seeds = torch.tensor([sample_seed(a.seed, step, i) for i in mine], dtype=torch.long)
            sync = contextlib.nullcontext() if k == accum - 1 else ddp.no_sync()
            with sync:
                per_sample = per_sample_loss(ddp(batch["input"], sample_seeds=seeds), batch["target"])
                (per_sample.sum() * (world / g)).backward()
            local += float(per_sample.detach().sum())
        if a.stats_allreduce:  # not what a user would write: isolates the cost of elastictrain's extra collective
            stats = torch.tensor([local, 0.0], dtype=torch.float64)
            dist.all_reduce(stats)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip, foreach=False)
        for group in opt.param_groups:
            group["lr"] = a.lr * warmup_cosine(step, a.warmup_steps, a.steps)
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss = local / (accum * m)  # rank 0's local mean loss: what a user would log
        if rank == 0:
            times.append(time.time())

    if rank == 0:
        out = {"world_size": world, "steps": a.steps, "global_batch": g, "threads": torch.get_num_threads(),
               "final_local_loss": loss, "times": times, "pid": os.getpid()}
        print(RESULT_PREFIX + json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
