"""Step time of one candidate layout, split into compute, exposed communication and the pipeline bubble.

* **compute**: ``6 N`` FLOPs per token for the weights' matmuls (forward 2, backward 4) plus ``12 L h s`` for
  attention's (Narayanan et al. 2021), ``8 N`` and ``16 L h s`` with activation checkpointing (the forward
  again), for the worst pipeline stage's share of the blocks (and the output head on the last stage), one
  data-parallel rank's share of the batch, one TP rank's share of each block; at :attr:`Cluster.flops`;
* **bubble**: the pipeline stretches compute (and the TP traffic inside it) by ``1 / (1 - bubble)``
  (:func:`.pipeline.bubble`);
* **communication**, each on its link (:mod:`.comm`): TP, per block and micro-batch, two all-reduces of the
  block's activations forward and two backward (under sequence parallel an all-gather and a reduce-scatter
  each: the same bytes), two more when checkpointing recomputes the forward, none hidden; PP, a send of
  the activations and one of their gradient per micro-batch and virtual stage; FSDP, an all-gather of the
  rank's weights per micro-batch forward and again backward (when resharded), a reduce-scatter of the
  gradients per micro-batch; DDP (and HSDP across replicas), one all-reduce of the gradients with the last
  micro-batch's backward. Data-parallel traffic hides behind compute up to :attr:`Cluster.overlap` of it
  (FSDP's behind all of a step's compute, the final all-reduce behind the last backward only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastictrain.planner import comm
from elastictrain.planner.inputs import PRECISIONS, Candidate, Cluster, ModelShape, Training
from elastictrain.planner.memory import stage_params
from elastictrain.planner.pipeline import bubble as pipeline_bubble


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step: ``total = compute / (1 - bubble) + tp + pp + exposed data-parallel``."""

    compute_s: float
    bubble: float
    tp_s: float
    pp_s: float
    dp_s: float          # data-parallel traffic in all
    dp_exposed_s: float  # the part that compute does not hide

    @property
    def comm_s(self) -> float:
        return self.tp_s + self.pp_s + self.dp_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication that compute does not hide (TP's stretched by the bubble like compute)."""
        return self.tp_s / (1 - self.bubble) + self.pp_s + self.dp_exposed_s

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_s) / (1 - self.bubble) + self.pp_s + self.dp_exposed_s


def microbatches(train: Training, c: Candidate) -> int:
    """Micro-batches per step on each data-parallel rank (the pipeline's ``n_microbatches``)."""
    return max(1, train.global_batch // (c.dp * c.micro_batch))


def step_flops(model: ModelShape, train: Training, c: Candidate) -> float:
    """FLOPs of one optimizer step on the worst rank (module docstring)."""
    tokens = train.global_batch * model.seq_len / c.dp
    n = stage_params(model, c) / c.tp
    blocks = math.ceil(model.layers / c.pp)
    attn = 12 * blocks * model.hidden * model.seq_len / c.tp
    weight, attention = (8.0, 16.0 / 12) if c.activation_checkpointing else (6.0, 1.0)
    return tokens * (weight * n + attention * attn)


def step_time(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> StepTime:
    """The step time of candidate ``c`` (module docstring)."""
    m = microbatches(train, c)
    compute = step_flops(model, train, c) / cluster.flops
    links = comm.group_links(cluster, c)
    lat = cluster.latency_s
    blocks = math.ceil(model.layers / c.pp)
    act = model.seq_len * c.micro_batch * model.hidden * train.activation_bytes
    per_block = (6 if c.activation_checkpointing else 4) * comm.all_reduce_s(act, c.tp, links["tp"], lat)
    tp_s = per_block * blocks * m
    pp_s = 0.0
    if c.pp > 1:
        send = act / (c.tp if c.tp > 1 and c.sequence_parallel else 1)
        pp_s = 2 * m * c.stages_per_rank * comm.p2p_s(send, links["pp"], lat)
    n = stage_params(model, c) / c.tp
    grad_bytes = n * (4 if train.precision == "fsdp_bf16" else PRECISIONS[train.precision][1])
    fsdp = 0.0
    if c.dp_shard > 1:
        gathers = 2 if c.reshard_after_forward and c.pp == 1 else 1  # a stage keeps its weights gathered
        fsdp = m * (gathers * comm.all_gather_s(n * train.compute_param_bytes, c.dp_shard, links["dp_shard"], lat)
                    + comm.all_gather_s(grad_bytes, c.dp_shard, links["dp_shard"], lat))
    final = comm.all_reduce_s(grad_bytes / c.dp_shard, c.dp_replicate, links["dp_replicate"], lat)
    hide = cluster.overlap
    exposed = max(0.0, fsdp - hide * compute) + max(0.0, final - hide * compute / m * 2 / 3)
    return StepTime(compute, pipeline_bubble(c.schedule, c.pp, m, c.stages_per_rank), tp_s, pp_s,
                    fsdp + final, exposed)
