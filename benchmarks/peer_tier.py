"""Peer memory tier benchmark (a script, not a test): the snapshot stall per step.

    PYTHONPATH=. python benchmarks/peer_tier.py [--d-model 256 --n-layer 4] [--steps 6] [--every 1 10]

One process, the built-in GPT with AdamW (the tiny_gpt job's model unless sizes are given), its global
batch run as accumulated micro-batches on this CPU. Stall = what a rank's step thread pays per snapshot:
building the DCP state dict (``get_state_dict``) plus ``take_snapshot`` (copying its tensors to host
memory); sending to the keeper runs on a background thread and is not part of it. Reported per step at
each cadence K: stall / K next to the step time (target: <= 5% at the cadence used).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from elastictrain import build_config  # noqa: E402
from elastictrain.checkpoint import app_state  # noqa: E402
from elastictrain.checkpoint.memory_dcp import take_snapshot  # noqa: E402
from elastictrain.task import builtin_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10])
    a = ap.parse_args()
    torch.set_num_threads(1)
    config = build_config({"name": "bench", "task": {"model": {"seq_len": a.seq_len, "n_layer": a.n_layer,
                                                                "n_head": 2, "d_model": a.d_model}},
                           "train": {"steps": a.steps, "global_batch": a.global_batch, "micro_batch": a.micro_batch}})
    task = builtin_task(config)
    torch.manual_seed(0)
    model = task.model_fn()
    opt = task.optimizer_fn(model.parameters())
    data = task.dataset_fn()
    collate = task.collate_fn or (lambda xs: {k: torch.stack([x[k] for x in xs]) for k in xs[0]})
    n_params = sum(p.numel() for p in model.parameters())
    step_s, stall_s, snap = [], [], None
    for s in range(a.steps):
        t0 = time.perf_counter()
        for k in range(a.global_batch // a.micro_batch):
            ids = [(s * a.global_batch + k * a.micro_batch + i) % len(data) for i in range(a.micro_batch)]
            batch = collate([data[i] for i in ids])
            loss = task.loss_fn(model, batch, torch.zeros(len(ids), dtype=torch.long)).sum() / a.global_batch
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        # steady state as in MemoryReplicator: an earlier snapshot's host buffers are refilled
        snap = take_snapshot({**app_state(model, opt), "progress": {"step": s + 1}}, rank=0, step=s + 1, reuse=snap)
        stall_s.append(time.perf_counter() - t0)
    step, stall = statistics.median(step_s[1:]), statistics.median(stall_s[1:])
    print(f"model: {n_params / 1e6:.2f}M params, snapshot {snap.meta.nbytes / 2**20:.1f} MiB; "
          f"step {step * 1000:.1f} ms, snapshot stall {stall * 1000:.2f} ms (medians of {a.steps - 1})")
    for k in a.every:
        print(f"  memory_every_steps={k}: stall per step {stall / k * 1000:.2f} ms = {stall / k / step:.1%} of step time")


if __name__ == "__main__":
    main()
