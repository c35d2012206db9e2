"""Memory per device of one candidate layout: pure arithmetic on :mod:`.inputs`.

The worst rank is priced (the first pipeline stage holds the most activations in flight and the embeddings;
the last one the output head: the larger of the two is taken):

* **state** (weights, gradients, fp32 master, optimizer moments; :attr:`Training.state_bytes_per_param`)
  of the rank's stage, divided by ``tp`` (every block is split over the TP group) and by ``dp_shard``
  (FSDP/ZeRO-3 shards all of it) except a pipeline rank's FSDP gradients, which stay whole until the step's
  last backward (:func:`_grads_unsharded_in_pipeline`); the gradients only where they exist at the
  activation peak (:func:`_grads_held_at_peak`), else what they exceed the activations by (pricing them
  always over-predicted fsdp/hsdp/pp2's model bytes, as benchmarks/planner.py measures);
* **gathered weights** under FSDP at the activation peak (the start of backward, :func:`_fsdp_gathered`):
  the last block and the one prefetched, unsharded in the compute dtype, the embeddings and head (the root,
  gathered from forward to backward), all of the stage's weights when ``reshard_after_forward`` is off
  (always inside a pipeline stage), and what a block's unsharded gradient with the reduce-scatter's flat
  input exceeds the activations its backward frees by. DDP adds nothing: its buckets are the gradients
  (``gradient_as_bucket_view``, parallel/parallelize.py); except under bf16 without FSDP, whose autocast
  casts of the weights autograd keeps for each micro-batch in flight (:func:`_autocast_copies`);
* **activations** per block per micro-batch after Korthikanti et al. 2022 (arXiv:2205.05198): ``s b h (34 +
  5 a s / h)`` bytes at 2-byte activations, without the ``5 a s / h`` term under flash-style attention
  (torch's SDPA stores no score matrix); tensor parallel with sequence parallel divides it by ``tp`` except
  the gathered inputs of the column-wise linears (4 of the 34, saved whole by torch's DTensor), without it
  only the 24 of 34 inside the TP regions are split. Full activation checkpointing keeps each block's input
  (``s b h`` elements) and one block's full set while it is recomputed; selective recomputation
  (:func:`selective_block_bytes`) keeps the input and the matmul and attention outputs, and one block's
  rest while it is recomputed. A pipeline rank holds
  :func:`.pipeline.in_flight` micro-batches of its blocks; without a pipeline one micro-batch at a time;
  the logits (and their gradient) of one micro-batch in fp32 on the last stage. Context parallel (``cp =
  C``) holds ``T / C`` positions of each sample: every term above at ``s = T / C``, plus per block the
  keys and values gathered from the other cp ranks (:func:`cp_attention_bytes`), and once the causal mask
  of its queries over all keys (:func:`cp_mask_bytes`) where the attention keeps one (GPUs, and CPU below
  fp32: :func:`cp_mask_held`; CPU fp32 attends blockwise without a mask); FSDP shards the state over ``dp_shard x cp``
  (:func:`state_shards`);
* **experts** (mixture of experts, :attr:`ModelShape.experts`): the parameter counts include every expert;
  under expert parallel each rank holds ``1 / ep`` of them (weights, gradients and optimizer state:
  :func:`rank_params`), and under ep x fsdp/hsdp FSDP shards that share over the ``efsdp = dp_shard x cp / ep``
  ranks of a shard group holding the same experts: ``1 / (dp_shard x cp)`` of the experts per rank, as of
  the dense part
  (:func:`state_params`); an MoE block's MLP activations are those of ``top_k`` token slots plus the slots'
  dispatch buffers (:func:`moe_block_extra_bytes`);
* **headroom**: the runtime's own bytes (:attr:`Cluster.runtime_bytes`) and the allocator's fragmentation
  (:attr:`Cluster.fragmentation` of everything else).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastictrain.planner.inputs import OPTIMIZER_BYTES, PRECISIONS, Candidate, Cluster, ModelShape, Training
from elastictrain.planner.pipeline import in_flight


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by kind; ``total`` adds them up; ``fits``/``shortfall`` against the device."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float
    runtime: float
    fragmentation: float
    device_memory: float

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations + self.runtime
                + self.fragmentation)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    @property
    def shortfall(self) -> float:
        """Bytes missing on the device (0 when it fits)."""
        return max(0.0, self.total - self.device_memory)


def stage_params(model: ModelShape, c: Candidate) -> float:
    """Parameters of the worst pipeline stage's rank before sharding: its blocks and the embeddings or head
    (whole model without a pipeline), scaled to a published parameter count (:attr:`ModelShape.scale`). A
    tied head split from its embedding is a copy on the last stage (parallel/tied.py)."""
    if c.pp == 1:
        return model.total_params
    blocks = math.ceil(model.layers / c.pp)
    moe = model.moe_extra_params / model.moe_layers * stage_moe_layers(model, c) if model.moe_layers else 0.0
    last = model.last_stage_params + (model.vocab * model.hidden if model.tied_embeddings else 0)
    return (blocks * model.block_params + moe + max(model.first_stage_params, last)) * model.scale


def stage_moe_layers(model: ModelShape, c: Candidate) -> int:
    """The MoE layers of the pp rank that holds the most (all of them without a pipeline): its stages' blocks
    as the pipeline splits them (:func:`elastictrain.parallel.stages.block_ranges`, balanced; the stages a
    rank runs under the schedule: :func:`~elastictrain.parallel.stages.local_stages`), counting blocks
    ``every-1, 2 every-1, ...``. What one rank's experts, all-to-alls and split-size syncs scale with (ep x
    pp shards each stage's experts over that stage's own data ranks)."""
    if c.pp == 1 or not model.moe_layers:
        return model.moe_layers
    from elastictrain.parallel.stages import block_ranges, local_stages  # (pure: no torch)

    n = c.pp * c.stages_per_rank
    if model.layers < n:  # (a split the pipeline refuses: priced as an even share)
        return math.ceil(model.moe_layers / c.pp)
    ranges = block_ranges(model.layers, n)
    return max(sum(1 for v in local_stages(c.schedule, c.pp, n, r) for b in ranges[v] if (b + 1) % model.moe_every == 0)
               for r in range(c.pp))


def stage_expert_params(model: ModelShape, c: Candidate) -> float:
    """The experts among :func:`stage_params` (0 for a dense model), before expert parallel shards them: those
    of the rank's :func:`stage_moe_layers`."""
    if not model.moe_layers:
        return 0.0
    return model.expert_params / model.moe_layers * stage_moe_layers(model, c) * model.scale


def rank_params(model: ModelShape, c: Candidate) -> float:
    """Parameters one rank holds before data-parallel sharding: its stage's dense part over ``tp``, the
    experts over ``ep`` (expert parallel: each rank of an ep group holds ``E / ep`` whole experts of every
    layer; under ep x tp the expert group borrows the tp ranks, and no expert is split over tp)."""
    experts = stage_expert_params(model, c)
    return (stage_params(model, c) - experts) / c.tp + experts / c.ep


def state_params(model: ModelShape, c: Candidate) -> float:
    """Parameters whose state (weights, gradients, optimizer) one rank keeps between steps: :func:`rank_params`
    over the FSDP shard group (:func:`state_shards`). Under ep x fsdp/hsdp the experts' ``1 / ep`` share is
    sharded again over their ``efsdp = dp_shard x cp x tp / ep`` replicas of one shard group
    (parallel/parallelize.py ``shard_experts``; hsdp replicates that over ``dp_replicate``), so every rank
    keeps ``1 / (ep x efsdp) = 1 / (dp_shard x cp x tp)`` of the experts, as of the dense part."""
    shard = state_shards(c)
    if shard == 1 or c.ep == 1:
        return rank_params(model, c) / shard
    dense = rank_params(model, c) - stage_expert_params(model, c) / c.ep
    return dense / shard + stage_expert_params(model, c) / (c.ep * expert_shards(c))


def expert_replicas(c: Candidate) -> int:
    """``edp``: the ranks holding the same experts, ``dp x cp x tp / ep`` (the expert ranks are the data
    ranks times the cp and tp ranks, parallel/dims.py)."""
    return max(1, c.dp * c.cp * c.tp // c.ep)


def expert_shards(c: Candidate) -> int:
    """``efsdp``: the ranks of one FSDP shard group holding the same experts, ``dp_shard x cp x tp / ep``
    (under fsdp every replica; under hsdp those of one ``dp_replicate`` coordinate)."""
    return max(1, c.dp_shard * c.cp * c.tp // c.ep)


def moe_block_extra_bytes(model: ModelShape, train: Training, c: Candidate) -> float:
    """What an MoE block's activations add to a dense block's for one micro-batch: its MLP runs on ``top_k``
    slots per token (Korthikanti's 19 of the 34 ``s b h`` units are the MLP's: ``19 (k - 1)`` more), and
    the slots pass through ``6 k`` more ``s b h`` units of dispatch buffers (the repeated token rows, their
    expert order, the rows received, the outputs regrouped, sent back and put in slot order); under ep x tp
    over the tp ranks, which split the tokens. 0 if dense."""
    if not model.experts:
        return 0.0
    k = model.top_k
    split = c.tp if c.ep > 1 else 1  # ep x tp: the MoE layer runs on this tp rank's 1 / tp of the tokens
    return model.seq_len * c.micro_batch * model.hidden * (19 * (k - 1) + 6 * k) * train.activation_bytes / 2 / split


def block_activation_bytes(model: ModelShape, train: Training, c: Candidate, *, flash: bool = True) -> float:
    """Activation bytes of one block for one micro-batch on one device (module docstring)."""
    s, b, h, a = model.seq_len // c.cp, c.micro_batch, model.hidden, model.heads
    scores = 0.0 if flash else 5 * a * model.seq_len / h  # (a rank's queries score every key)
    if c.tp > 1 and c.sequence_parallel:
        # the norms' outputs are gathered to the whole sequence and saved so by the column-wise q/k/v and
        # mlp_in (torch's DTensor keeps the gathered input; Megatron re-gathers it in backward)
        per = (30 + scores) / c.tp + 4
    else:
        per = 10 + (24 + scores) / c.tp
    return s * b * h * per * train.activation_bytes / 2 + cp_attention_bytes(model, train, c)


def cp_attention_bytes(model: ModelShape, train: Training, c: Candidate) -> float:
    """What context parallelism adds to one block's activations for one micro-batch (0 without cp): the
    keys and values gathered from the other cp ranks, saved for the attention's backward (``2 (C-1)/C b T
    kv_width`` elements, this rank's heads)."""
    if c.cp == 1:
        return 0.0
    t, b = model.seq_len, c.micro_batch
    return 2 * (c.cp - 1) / c.cp * b * t * model.kv_width / c.tp * train.activation_bytes


def cp_mask_bytes(model: ModelShape, train: Training, c: Candidate, *, masked: bool = True) -> float:
    """The causal mask of this rank's ``T / C`` queries over all ``T`` keys, an additive bias in the compute
    dtype that every layer's attention saves: one cached tensor per rank (parallel/context.py's ``_bias``),
    0 without cp, and 0 where the attention needs no mask (``masked=False``: :func:`cp_mask_held`)."""
    return 0.0 if c.cp == 1 or not masked else model.seq_len // c.cp * model.seq_len * train.activation_bytes


def cp_mask_held(cluster: Cluster, train: Training) -> bool:
    """Whether cp attention keeps the head-tail mask: on GPUs (the masked SDPA path), and on CPU unless the
    compute dtype is fp32 (parallel/blockwise.py's mask-free path takes fp32/fp64 CPU tensors only)."""
    return cluster.kind != "cpu" or train.precision != "fp32"


def selective_block_bytes(model: ModelShape, train: Training, c: Candidate) -> float:
    """What selective recomputation keeps of one block for one micro-batch (parallel/speed.py's policy).

    In Korthikanti's units (``s b h`` elements at 2 bytes, i.e. ``2 s b h`` bytes each ``sbh`` below) the
    saved outputs are those of the matrix multiplies and of attention: q, k and v (3 x 2), the attention
    output (2; its log-sum-exp is per head, negligible), the attention projection (2), the MLP's first
    linear (8: 4h wide) and its second (2): 20 of the 34, plus the block's input (2) from which the
    recomputation starts. Norm outputs, the activation function's output, residual sums and dropout masks
    (the other 14) are recomputed. Under tensor parallelism every kept matmul output is split over ``tp``
    (column-wise outputs by heads or hidden units, row-wise ones reduce-scattered on the sequence with
    sequence parallel, else whole: 4 of the 20), the input too with sequence parallel."""
    s, b, h = model.seq_len // c.cp, c.micro_batch, model.hidden
    sp = c.tp > 1 and c.sequence_parallel
    kept = 2 / (c.tp if sp else 1) + (16 / c.tp + 4 / (c.tp if sp else 1))
    return s * b * h * kept * train.activation_bytes / 2 + cp_attention_bytes(model, train, c)


def activation_bytes(model: ModelShape, train: Training, c: Candidate, *, flash: bool = True,
                     cp_mask: bool = True) -> float:
    """Activations the worst rank holds at its peak (module docstring); ``cp_mask``: whether cp attention
    keeps its mask (:func:`cp_mask_held`; True, the GPU's case, when the cluster is not known)."""
    s, b, h = model.seq_len // c.cp, c.micro_batch, model.hidden
    blocks = math.ceil(model.layers / c.pp)
    full = block_activation_bytes(model, train, c, flash=flash)
    if c.recompute == "full":
        kept_input = s * b * h * train.activation_bytes / (c.tp if c.tp > 1 and c.sequence_parallel else 1)
        per_block, extra = kept_input, full
    elif c.recompute == "selective":
        # between none and full: every block keeps its matmul outputs (20 + 2 of 34), and the block being
        # recomputed in backward holds its full set again for a moment (the extra over what it keeps)
        per_block = min(full, selective_block_bytes(model, train, c))
        extra = full - per_block
    else:
        per_block, extra = full, 0.0
    moe_extra = moe_block_extra_bytes(model, train, c)
    moe_blocks = stage_moe_layers(model, c)
    if c.recompute == "none":
        per_stage = per_block * blocks + moe_extra * moe_blocks
    else:  # a recomputed MoE block holds its slots' buffers while it runs again
        per_stage, extra = per_block * blocks, extra + moe_extra
    held = in_flight(c.schedule, c.pp, _microbatches(train, c), c.stages_per_rank)
    stage = held * per_stage / c.stages_per_rank
    logits = 2 * s * b * model.vocab * 4 / c.tp
    return stage + extra + logits + cp_mask_bytes(model, train, c, masked=cp_mask)


def _fsdp_gathered(model: ModelShape, train: Training, c: Candidate, n: float) -> float:
    """FSDP's unsharded bytes at the rank's peak, which is the activation peak (the start of backward).

    Held there: the root's weights (embeddings and head, gathered from forward to backward), the last block
    (never resharded after its forward, parallel/parallelize.py) and the one prefetched for the next
    backward; all of the stage's weights when ``reshard_after_forward`` is off (always inside a pipeline
    stage). The last block's unsharded gradient and the reduce-scatter's flat input appear while its
    backward frees its own activations, so only what they exceed those by adds to the peak
    (benchmarks/planner.py: pricing the gathered weights, the all-gather outputs and the gradients all at the
    activation peak over-predicted FSDP's model bytes; docs/perf/2026-11-23-code-figures.md)."""
    _, g, _ = PRECISIONS[train.precision]
    block = model.block_params * model.scale / c.tp
    blocks = math.ceil(model.layers / c.pp)
    root = n - blocks * block
    held = n if not c.reshard_after_forward or c.pp > 1 else root + 2 * block
    freed = {"none": block_activation_bytes(model, train, c), "full": 0.0,
             "selective": selective_block_bytes(model, train, c)}[c.recompute]
    if _grads_unsharded_in_pipeline(c):
        return held * train.compute_param_bytes  # the gradients are priced whole (memory())
    return held * train.compute_param_bytes + max(0.0, 2 * block * g - freed)


def _autocast_copies(train: Training, c: Candidate, n: float) -> float:
    """bf16 without FSDP (``torch.autocast``, parallel/precision.py) at the activation peak: each
    micro-batch's forward casts the rank's weights to bf16 and autograd keeps the casts for that micro-batch's
    backward, so one bf16 copy per micro-batch in flight -- one without a pipeline, a pipeline rank's
    :func:`.pipeline.in_flight` units of one virtual stage's weights (``n / stages_per_rank``) each."""
    if c.pp == 1:
        return n * train.compute_param_bytes
    units = in_flight(c.schedule, c.pp, _microbatches(train, c), c.stages_per_rank)
    return units * n / c.stages_per_rank * train.compute_param_bytes


def _grads_held_at_peak(train: Training, c: Candidate) -> bool:
    """Whether the gradients exist at the activation peak. The step loop drops them after each step
    (``zero_grad(set_to_none=True)``) except DDP's, which are its reduction buckets
    (``grads_in_buckets``); dropped ones are there again at the peak only when an earlier micro-batch's
    backward made them: accumulation outside a pipeline, or more micro-batches than a stage holds in flight."""
    if c.dp_shard == 1 and c.tp == 1 and c.pp == 1:
        return True
    m = _microbatches(train, c)
    return m > (in_flight(c.schedule, c.pp, m, c.stages_per_rank) if c.pp > 1 else 1)


def _grads_unsharded_in_pipeline(c: Candidate) -> bool:
    """Whether a pipeline rank holds its stage's gradient unsharded: torch's ``PipelineStage`` turns FSDP's
    gradient sync off for every backward but the step's last (``set_requires_gradient_sync(False)``), so
    FSDP2 accumulates each parameter's whole gradient (in its reduce dtype) and reduce-scatters it only at
    the end of the schedule."""
    return c.pp > 1 and c.dp_shard > 1


def _microbatches(train: Training, c: Candidate) -> int:
    return max(1, train.global_batch // (c.dp * c.micro_batch))


def state_shards(c: Candidate) -> int:
    """How many ranks FSDP shards the state over: ``dp_shard x cp`` (torchtitan's rule, the cp ranks of a
    data rank join its shard group), 1 under ddp."""
    return c.dp_shard * c.cp if c.dp_shard > 1 else 1


def memory(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> Memory:
    """The worst rank's memory of candidate ``c`` (module docstring)."""
    n = rank_params(model, c)
    w, g, master = PRECISIONS[train.precision]
    shard = state_shards(c)
    kept = state_params(model, c)
    params, grads = kept * w, kept * g
    optimizer = kept * (master + OPTIMIZER_BYTES[train.optimizer])
    acts = activation_bytes(model, train, c, cp_mask=cp_mask_held(cluster, train))
    if _grads_unsharded_in_pipeline(c):
        grads = n * g  # the stage's whole gradient, in the reduce dtype, until the step's last backward
    if not _grads_held_at_peak(train, c):
        grads = max(0.0, grads - acts)  # they grow as backward frees the activations: the later peak
    if shard > 1:
        gathered = _fsdp_gathered(model, train, c, n)
    elif train.precision == "bf16":
        gathered = _autocast_copies(train, c, n)
    else:
        gathered = 0.0  # DDP's buckets ARE the gradients here (gradient_as_bucket_view)
    body = params + grads + optimizer + gathered + acts
    return Memory(params, grads, optimizer, gathered, acts, cluster.runtime_bytes, cluster.fragmentation * body,
                  cluster.device_memory)
