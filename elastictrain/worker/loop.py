"""The framework-owned step loop of one worker: one optimizer step over the global batch.

Step ``s`` (0-based) consumes the global sample positions ``[s*G, (s+1)*G)``. This rank's share is a pure
function of (step, rank, world size, micro batch) and gradient accumulation makes up the rest, so the
samples a step sees and its math do not depend on the world size. Each micro-batch loss is
``sum(per-sample loss) * W / G``: DDP's mean over ranks then yields the mean over the G samples.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastictrain.config import TrainConfig
from elastictrain.data.cursor import check_layout, rank_micro_batches
from elastictrain.models.gpt import sample_seed
from elastictrain.task import Task
from elastictrain.worker.faults import FaultInjector
from elastictrain.worker.rng import seed_micro_batch
from elastictrain.worker.step_stats import StepStats


@dataclass
class StepRecord:
    """What one completed optimizer step reports to the controller."""

    step: int                 # completed steps after this one (1-based step number)
    loss: float               # mean per-sample loss over the whole global batch
    world_size: int
    accum: int
    step_s: float             # wall time of the step on this rank
    compute_s: float          # forward (+ local backward) time: what a straggler is slow at
    finished_at: float        # time.time()
    sample_ids: list[int] = field(default_factory=list)  # only when audit is on


def _default_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class StepRunner:
    """Model, optimizer and data of one worker, and the code that runs one step on the current group."""

    def __init__(self, task: Task, train: TrainConfig, faults: FaultInjector, audit: bool = False) -> None:
        self.task = task
        self.train = train
        self.faults = faults
        self.audit = audit
        torch.manual_seed(train.seed)  # identical initial parameters on every worker
        self.model = task.model_fn()
        self.optimizer = task.optimizer_fn(self.model.parameters())
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.dataset = task.dataset_fn()
        self.dataset_len = len(self.dataset)
        self.collate = task.collate_fn or _default_collate
        self.step = 0  # completed optimizer steps
        self.ddp: DistributedDataParallel | None = None
        self.step_stats: StepStats | None = None
        self.rank = 0
        self.world_size = 1
        self.generation = 0
        self.phase = "idle"  # idle | compute | collective: tells a hung rank from its waiting peers
        self.phase_since = time.time()

    # ------------------------------------------------------------------ membership
    def attach(self, rank: int, world_size: int, generation: int) -> None:
        """Wrap the model for the current default process group. Called after every regroup."""
        check_layout(self.train.global_batch, self.train.micro_batch, world_size)
        self.rank, self.world_size, self.generation = rank, world_size, generation
        # State was just broadcast from a live peer, so skip DDP's own init broadcast.
        self.ddp = DistributedDataParallel(self.model, forward_sync_buffers=False, init_sync=False)
        self.step_stats = StepStats(self.ddp)  # (loss, stop) rides in DDP's last gradient bucket

    def detach(self) -> None:
        self.ddp = None

    def _set_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.time()

    # ------------------------------------------------------------------ one step
    def run_step(self, stop_requested: bool) -> tuple[StepRecord, bool]:
        """Run step ``self.step`` on every rank of the group. Returns the record and whether any rank asked
        to stop at this boundary. Raises if a collective fails (a peer died): the step is then discarded
        and ``self.step`` is unchanged unless the optimizer step was already applied everywhere."""
        if self.ddp is None:
            raise RuntimeError("run_step before attach(): the worker has no process group")
        s, t0 = self.step, time.perf_counter()
        number = s + 1
        g, m, w = self.train.global_batch, self.train.micro_batch, self.world_size
        micro = rank_micro_batches(s, self.rank, w, m, g, self.train.seed, self.dataset_len)
        self.faults.fire(rank=self.rank, step=number, point="before_step", generation=self.generation)
        self.ddp.train()
        loss_sum = torch.zeros((), dtype=torch.float64)
        compute_s, seen = 0.0, []
        for k, ids in enumerate(micro):
            self._set_phase("compute")
            c0 = time.perf_counter()
            batch = self.collate([self.dataset[int(i)] for i in ids])
            seeds = torch.tensor([sample_seed(self.train.seed, s, int(i)) for i in ids], dtype=torch.long)
            last = k == len(micro) - 1
            sync = contextlib.nullcontext() if last else self.ddp.no_sync()
            with sync:
                seed_micro_batch(self.train.seed, s, k * w + self.rank)  # global RNG: (seed, step, chunk)
                per_sample = self.task.loss_fn(self.ddp, batch, seeds)
                loss_sum += per_sample.detach().sum().double()
                if self.audit:
                    seen.extend(int(i) for i in ids)
                delay = self.faults.extra_delay(rank=self.rank, step=number, generation=self.generation)
                if delay:
                    time.sleep(delay)
                if k == 0:
                    self.faults.fire(rank=self.rank, step=number, point="mid_step", generation=self.generation)
                if last:  # the last backward overlaps DDP's all-reduce: not purely local work
                    compute_s += time.perf_counter() - c0
                    self._set_phase("collective")
                    # Loss and stop flag travel together inside DDP's last gradient bucket (step_stats.py):
                    # no collective of their own.
                    flag = torch.tensor(1.0 if stop_requested else 0.0, dtype=torch.float64)
                    work = self.step_stats.send(torch.stack([loss_sum, flag]))
                (per_sample.sum() * (w / g)).backward()
            if not last:
                compute_s += time.perf_counter() - c0
        # Waited for BEFORE the optimizer step: a rank that applies step s knows every rank finished its
        # backward, so "completed steps" always matches the parameters.
        stats = work.wait()
        if self.audit:  # ids as fed by every rank, so any survivor's record holds the whole step
            gathered: list[list[int]] = [[] for _ in range(w)]
            dist.all_gather_object(gathered, seen)
            seen = [i for part in gathered for i in part]
        self._set_phase("idle")
        self._apply_optimizer(s)
        self.step = number
        self.faults.fire(rank=self.rank, step=number, point="after_step", generation=self.generation)
        record = StepRecord(
            step=number, loss=float(stats[0]) / g, world_size=w, accum=len(micro),
            step_s=time.perf_counter() - t0, compute_s=compute_s, finished_at=time.time(), sample_ids=seen,
        )
        return record, bool(stats[1] > 0)

    def _apply_optimizer(self, s: int) -> None:
        if self.task.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.task.grad_clip, foreach=False)
        mult = self.task.lr_fn(s) if self.task.lr_fn else 1.0
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * mult
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_partial_step(self) -> None:
        """Drop gradients of a step that failed mid-way (no optimizer step was applied)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._set_phase("idle")

    def state_digest(self) -> dict[str, Any]:
        """Cheap fingerprint of the model for tests: parameter sums and a bitwise hash."""
        import hashlib

        h = hashlib.sha256()
        for name, t in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
        return {"step": self.step, "sha256": h.hexdigest()}
