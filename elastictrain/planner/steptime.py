"""Step time of one candidate layout, split into compute, exposed communication and the pipeline bubble.

* **compute**: ``6 N`` FLOPs per token for the weights' matmuls (forward 2, backward 4) plus ``12 L h s`` for
  attention's (Narayanan et al. 2021), ``8 N`` and ``16 L h s`` with activation checkpointing (the forward
  again), for the worst pipeline stage's share of the blocks (and the output head on the last stage), one
  data-parallel rank's share of the batch, one TP rank's share of each block; at :attr:`Cluster.flops`;
* **bubble**: the pipeline stretches compute (and the TP traffic inside it) by ``1 / (1 - bubble)``
  (:func:`.pipeline.bubble`);
* **communication**, each on its link (:mod:`.comm`): TP, per block and micro-batch, two all-reduces of the
  block's activations forward and two backward (under sequence parallel an all-gather and a reduce-scatter
  each: the same bytes), two more when checkpointing recomputes the forward, none hidden; CP (``cp = C``),
  per block and micro-batch, the keys and values all-gathered forward (``2 (C-1)/C B T kv_width`` bytes,
  again when recomputed) and their gradients reduce-scattered backward (:func:`cp_bytes`), none hidden,
  and every other term at ``T / C`` positions per rank (compute, TP's and PP's activations), the
  gradients reduced over ``dp x cp`` (FSDP's shards and DDP's group: :func:`.memory.state_shards`); PP, a send of
  the activations and one of their gradient per micro-batch and virtual stage; FSDP, an all-gather of the
  rank's weights per micro-batch forward and again backward (when resharded), a reduce-scatter of the
  gradients per micro-batch; DDP (and HSDP across replicas), one all-reduce of the gradients with the last
  micro-batch's backward. Data-parallel traffic hides behind compute up to :attr:`Cluster.overlap` of it
  (FSDP's behind all of a step's compute, the final all-reduce behind the last backward only). Priced
  by their bytes here; each call also costs :attr:`Cluster.call_s` plus :attr:`Cluster.latency_s` per ring
  step, counted by :func:`collective_calls` (per block and micro-batch: TP's all-gathers and
  reduce-scatters, FSDP's per-block gathers and reductions, PP's sends, and under FSDP over TP an
  all-reduce over tp of each Partial gradient (:data:`TP_PARTIAL_GRADS`; without FSDP one flat one per
  step); per step: DDP's gradient
  buckets, HSDP's per-block all-reduces, the step loop's stop word and gradient-norm reduction). With
  gloo (``cluster.kind == "cpu"``) a reduce-scatter is an all-reduce (gloo has none of its own), and
  FSDP's copies of each unsharded buffer out of a gather and into a reduction run at about the rate gloo
  moves bytes (on GPUs they are HBM copies: left out);
* **DTensor dispatch** (TP): every op on a sharded parameter or activation goes through DTensor's
  dispatcher (sharding propagation, unwrapping to the local tensor and wrapping the result), host work that
  a plain layout does not do: :func:`dtensor_ops` per step (counted per block and micro-batch on a GPT
  block, :data:`TP_BLOCK_OPS`) at :attr:`Cluster.dtensor_op_s`. On CPU it runs on the cores that compute: all
  of it is on the critical path (and shared with the node's other ranks like compute). On GPUs the host
  queues kernels ahead of the device, so it shows only where it exceeds the device's compute
  (``max(0, dispatch - compute)``: the host becomes the bottleneck of small or narrow models, not of large
  ones); TP's collectives are priced at :attr:`Cluster.tp_call_s` per call (a redistribution as DTensor
  issues it) where calibrated, else :attr:`Cluster.call_s`;
* **FSDP's host work per parameter** (``dp_shard > 1``, plain or DTensor parameters alike): per micro-batch
  FSDP2's hooks visit every parameter tensor of the rank's units (the gather's and reduction's bookkeeping,
  the swap between sharded and unsharded parameter, each reduced gradient's sharded DTensor, the views
  into the flat buffers) and issue and wait for each unit's collectives: :func:`fsdp_param_visits` per step
  (the worst stage's parameter tensors per micro-batch, :data:`PARAM_TENSORS_PER_BLOCK`) at
  :attr:`Cluster.fsdp_param_s` (host work apart from the bytes, which the copies and collectives above
  price). Host work like DTensor's dispatch: on CPU on the critical path and shared with the node's other
  ranks like compute; on GPUs only what the two together exceed the device's compute by;
* **expert parallel** (``ep > 1``, :mod:`elastictrain.parallel.expert`): per MoE layer and micro-batch an
  all-to-all of the token slots to their experts and one back (``2 x top_k x tokens x hidden`` bytes
  forward, ``(ep-1)/ep`` of them leaving the rank), the same backward (and forward again under activation
  checkpointing), on the critical path like TP's; each forward first exchanges the per-expert counts and
  reads them on the host (the uneven split sizes): a device-to-host sync per MoE layer and forward on GPUs
  (:data:`EP_SPLIT_SYNC_S`). ep factors the data x cp x tp ranks (a cp or tp rank routes ``1 / cp`` or
  ``1 / tp`` of its samples' tokens; an ep group's link is that of ``ep`` consecutive expert ranks). DDP
  all-reduces the dense gradients over every data x cp rank; the experts' over their ``dp x cp x tp / ep``
  replicas. Under ep x fsdp each MoE layer's experts are an FSDP unit of their own over the
  ``efsdp = dp_shard x cp x tp / ep`` replicas of a shard group (gathered and reduce-scattered there,
  ``1 / ep`` of the experts' bytes; under hsdp their reduced shard is all-reduced across ``dp_replicate``
  too), its router one over the shard group, the rest of the model as under fsdp/hsdp. Under pp (ep x pp)
  all of it per stage: a rank's MoE layers are its stages'
  (:func:`~elastictrain.planner.memory.stage_moe_layers`, the worst rank's), its ep group and expert
  replicas are its stage's data ranks. Compute counts the active parameters: each token runs ``top_k``
  experts;
* **optimizer**: the step and gradient clipping over the rank's local parameters, at
  :attr:`Cluster.optimizer_s_per_param`;
* **gloo's CPU per byte** (CPU clusters only): gloo's threads copy, send, receive and reduce every byte a
  rank moves (:func:`moved_bytes`, FSDP's copies in and out of its buffers with them) on the cores the
  ranks compute on, at :attr:`Cluster.gloo_byte_s` of the process's CPU per byte (:func:`comm_cpu_s`);
  on GPUs NCCL's work is the device's and the network's (none);
* **shared cores**: where a node runs more ranks than it has cores (:meth:`Cluster.share` ``s > 1``: CPU
  processes), the step takes at least ``s`` times a rank's host work (compute, dispatch, FSDP's hooks,
  optimizer step) plus its data-parallel calls plus its bytes, these for the longer of their time at the
  bandwidth collectives get among ranks that share cores (the calibration measures it so: the other
  ranks' turns are in it, so it is counted once) and ``s`` times gloo's CPU on them (every rank's
  gloo works on the same cores; a floor that, unlike the wall-clock bandwidth, other programs' load does
  not move): the cores are the bottleneck, and a rank idle in the pipeline's bubble lends its core to
  the others instead of stretching the step.

``total = max(critical path, busy) + calls`` with ``critical path = (compute + tp + exposed dispatch + exposed
FSDP host work) / (1 - bubble) + pp + exposed data-parallel + optimizer`` and ``busy = s x (compute + dispatch +
FSDP host work + optimizer) + data-parallel calls + max(tp + pp + data-parallel bytes, s x gloo's CPU)``
only where ``s > 1`` (GPUs: the critical path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastictrain.planner import comm
from elastictrain.planner.inputs import PRECISIONS, Candidate, Cluster, ModelShape, Training
from elastictrain.planner.memory import (expert_replicas, expert_shards, rank_params, stage_expert_params, stage_moe_layers,
                                        stage_params, state_params)
from elastictrain.planner.pipeline import bubble as pipeline_bubble


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step (module docstring): :attr:`total_s`."""

    compute_s: float
    bubble: float
    tp_s: float
    pp_s: float
    dp_s: float          # data-parallel traffic in all (bytes)
    dp_exposed_s: float  # the part that compute does not hide
    optimizer_s: float = 0.0
    calls: int = 0       # collective calls per step on the worst rank
    calls_s: float = 0.0  # the fixed and per-ring-step costs of TP's, PP's and the step loop's calls (the
    # data-parallel ones are in dp_s, hidden like its bytes)
    share: float = 1.0   # ranks per core on a node (Cluster.share)
    dispatch_s: float = 0.0          # DTensor's host work per step (TP)
    dispatch_exposed_s: float = 0.0  # the part on the critical path (CPU: all; GPU: beyond compute)
    fsdp_host_s: float = 0.0          # FSDP2's host work per parameter tensor and micro-batch, per step
    fsdp_host_exposed_s: float = 0.0  # the part on the critical path (CPU: all; GPU: with the dispatch, beyond
    # compute)
    comm_cpu_s: float = 0.0  # CPU: gloo's host work moving the rank's bytes (Cluster.gloo_byte_s; 0: not priced)
    dp_calls_s: float = 0.0  # the data-parallel calls' fixed costs (in dp_s)
    ep_s: float = 0.0  # expert parallel's all-to-all bytes and split-size syncs (on the critical path, like TP's)
    cp_s: float = 0.0  # context parallel's K/V all-gathers (forward) and reduce-scatters (backward), bytes

    @property
    def comm_s(self) -> float:
        return self.tp_s + self.ep_s + self.cp_s + self.pp_s + self.dp_s + self.calls_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication that compute does not hide (TP's stretched by the bubble like compute)."""
        return (self.tp_s + self.ep_s + self.cp_s) / (1 - self.bubble) + self.pp_s + self.dp_exposed_s + self.calls_s

    @property
    def path_s(self) -> float:
        """The critical path of a rank computing on its own core or device."""
        host = self.dispatch_exposed_s + self.fsdp_host_exposed_s
        return ((self.compute_s + self.tp_s + self.ep_s + self.cp_s + host) / (1 - self.bubble) + self.pp_s + self.dp_exposed_s
                + self.optimizer_s)

    @property
    def busy_s(self) -> float:
        """What the node needs when ranks share its cores (0 when they do not): ``share x`` a rank's host
        work (compute, dispatch, FSDP's hooks, the optimizer step), plus its data-parallel calls' fixed costs,
        plus its bytes for the longer of what they take at the bandwidth a collective gets among ranks that
        share the cores (the calibration measures it so: once, the other ranks' turns are in it) and
        ``share x`` the CPU its process spends on them (:attr:`comm_cpu_s`: every rank's gloo works on the
        same cores; 0 where not priced)."""
        if self.share <= 1:
            return 0.0
        work = self.compute_s + self.dispatch_s + self.fsdp_host_s + self.optimizer_s
        wire = self.tp_s + self.ep_s + self.cp_s + self.pp_s + self.dp_s - self.dp_calls_s
        return self.share * work + self.dp_calls_s + max(wire, self.share * self.comm_cpu_s)

    @property
    def total_s(self) -> float:
        return max(self.path_s, self.busy_s) + self.calls_s


def microbatches(train: Training, c: Candidate) -> int:
    """Micro-batches per step on each data-parallel rank (the pipeline's ``n_microbatches``)."""
    return max(1, train.global_batch // (c.dp * c.micro_batch))


def step_flops(model: ModelShape, train: Training, c: Candidate) -> float:
    """FLOPs of one optimizer step on the worst rank (module docstring)."""
    tokens = train.global_batch * model.seq_len / (c.dp * c.cp)  # cp: this rank's positions of its samples
    # the active parameters: each token runs top_k of the E experts of an MoE layer
    experts = stage_expert_params(model, c)
    n = (stage_params(model, c) - experts * (1 - model.top_k / max(1, model.experts))) / c.tp
    blocks = math.ceil(model.layers / c.pp)
    attn = 12 * blocks * model.hidden * model.seq_len / c.tp
    # selective recomputation re-runs only the elementwise ops around the saved matmul and attention outputs:
    # no matmul FLOPs, priced as no recomputation
    weight, attention = (8.0, 16.0 / 12) if c.recompute == "full" else (6.0, 1.0)
    return tokens * (weight * n + attention * attn)


# DTensor ops (forward, backward) per block and micro-batch, by sequence parallel: a GPT block (q, k, v and
# attention out, MLP in and out, two norms) under torch's ColwiseParallel/RowwiseParallel/SequenceParallel,
# counted with a dispatch mode on the built-in GPT without dropout (torch 2.13; the backward's include gradient
# accumulation; dropout adds 4 and 4, left out: a few percent). They do not depend on the width: the cost
# per op is what the calibration measures (tests/test_planner_tp.py counts them again on the real model).
TP_BLOCK_OPS = {True: (26, 80), False: (24, 72)}
TP_EDGE_OPS = {True: 37, False: 30}  # per micro-batch around the blocks: embeddings, final norm, head, loss
# The same counts for the built-in Llama (ModelShape.arch "llama": RMSNorm's fp32 steps on sequence-sharded
# DTensors, SwiGLU's third matrix; no dropout), counted the same way by tests/test_planner_tp.py.
LLAMA_TP_BLOCK_OPS = {True: (42, 102), False: (28, 63)}
LLAMA_TP_EDGE_OPS = {True: 55, False: 30}


def dtensor_ops(model: ModelShape, train: Training, c: Candidate) -> float:
    """DTensor ops of one step on the worst rank (0 without TP): per micro-batch, each block's forward (twice
    with activation checkpointing) and backward, plus those around the blocks (:data:`TP_BLOCK_OPS`)."""
    if c.tp == 1:
        return 0.0
    llama = model.arch == "llama"
    forward, backward = (LLAMA_TP_BLOCK_OPS if llama else TP_BLOCK_OPS)[c.sequence_parallel]
    # selective: the recomputed forward runs the DTensor ops again (only the matmuls' results are kept)
    per_block = forward * (2 if c.recompute != "none" else 1) + backward
    blocks = math.ceil(model.layers / c.pp)
    edge = (LLAMA_TP_EDGE_OPS if llama else TP_EDGE_OPS)[c.sequence_parallel]
    return microbatches(train, c) * (blocks * per_block + edge)


# Parameter tensors of a GPT block (q, k, v and attention out, MLP in and out: weight and bias each; two norms'
# weight and bias: the shape ModelShape.block_params counts) and around the blocks (token and position
# embeddings on the first stage; the final norm's weight and bias and the output head, unless tied, on the
# last). tests/test_planner_tp.py counts them on the built-in GPT.
PARAM_TENSORS_PER_BLOCK = 16
PARAM_TENSORS_FIRST, PARAM_TENSORS_LAST = 2, 3
# The built-in Llama's: a block's 7 weights and 2 norms (no biases); the token embedding; the final norm and head.
LLAMA_PARAM_TENSORS = (9, 1, 2)


def param_tensors(model: ModelShape) -> tuple[int, int, int]:
    """(per block, first stage, last stage) parameter tensors of ``model``'s architecture (a tied head is one
    fewer on the last stage)."""
    per_block, first, last = LLAMA_PARAM_TENSORS if model.arch == "llama" else (
        PARAM_TENSORS_PER_BLOCK, PARAM_TENSORS_FIRST, PARAM_TENSORS_LAST)
    return per_block, first, last - (1 if model.tied_embeddings else 0)


def fsdp_param_visits(model: ModelShape, train: Training, c: Candidate) -> float:
    """Parameter tensors FSDP2's hooks visit in one step on the worst rank (0 without ``dp_shard > 1``): per
    micro-batch, every tensor of the worst pipeline stage (module docstring). Neither ``dp_shard`` nor
    ``tp`` divides it: every rank holds a shard of every tensor of its stage."""
    if c.dp_shard == 1:
        return 0.0
    per_block, first, last = param_tensors(model)
    edge = first + last if c.pp == 1 else max(first, last)
    tensors = math.ceil(model.layers / c.pp) * per_block  # a rank's blocks (all its stages)
    return microbatches(train, c) * (tensors + edge)


DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's bucket_cap_mb default: one all-reduce per bucket
TP_EDGE_CALLS = 6  # per micro-batch around the blocks (sequence parallel: embeddings out, final norm, head)
# Parameters replicated over tp whose gradient autograd leaves Partial (each rank's positions give a partial
# sum), (per block, around the blocks), by sequence parallel: under it the two norms' weight and bias per GPT
# block and the final norm's; without it none (tests/test_planner_tp.py counts them on the built-in GPT).
# FSDP2 over the TP model (dp_shard > 1) redistributes each to its parameter's placement before its
# reduce-scatter, per micro-batch: an all-reduce over tp per parameter, as DTensor issues it
# (torch's FSDPParam._get_grad_inner_tensor); without FSDP the step sums them in one flat all-reduce
# (elastictrain.parallel.tensor.settle_grads). Priced like TP's other calls, on the critical path (CPU: the
# calibrated tp_call_s, a call's CPU times the ranks per core; GPUs: by
# default the ring steps' latency only).
TP_PARTIAL_GRADS = {True: (4, 2), False: (0, 0)}
# Expert parallel: the host waits for each MoE layer's per-expert counts before the all-to-all of the rows
# (their split sizes; ``.tolist()`` on GPUs syncs the device): a fixed latency per MoE layer and forward.
EP_SPLIT_SYNC_S = 30e-6
EP_FORWARD_CALLS, EP_BACKWARD_CALLS = 3, 2  # counts, rows out, rows back; the rows' two again in backward
EXPERT_TENSORS = {"gpt": 4, "llama": 3}  # stacked expert parameters of one MoE layer (their replica all-reduces)
LLAMA_TP_PARTIAL_GRADS = {True: (2, 1), False: (0, 0)}  # the Llama's RMSNorms: a weight each, no bias


@dataclass(frozen=True)
class Calls:
    """Collective calls of one step on the worst rank, each as ``(what, count, ranks, ring steps per call)``;
    ``what``: ``tp``, ``ep`` (the all-to-alls), ``pp``, ``fsdp`` (gathers and reductions), ``replicate`` (DDP's
    buckets, HSDP's all-reduces) or ``step`` (the step loop's own)."""

    groups: tuple[tuple[str, float, int, int], ...]

    @property
    def count(self) -> int:
        return int(round(sum(n for _, n, size, _ in self.groups if size > 1)))

    def cost_s(self, cluster: Cluster, *what: str) -> float:
        """The calls' cost (of the kinds ``what``; all without): TP's at :attr:`Cluster.tp_call_s` where
        measured, the rest at :attr:`Cluster.call_s`."""
        tp_call = cluster.call_s if cluster.tp_call_s is None else cluster.tp_call_s
        return sum(n * ((tp_call if w == "tp" else cluster.call_s) + steps * cluster.latency_s)
                   for w, n, size, steps in self.groups if size > 1 and (not what or w in what))


def collective_calls(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> Calls:
    """Every collective call of one step on the worst rank (module docstring), with its group size and
    ring steps (all-reduce ``2 (n-1)``, all-gather and reduce-scatter ``n-1``, gloo's reduce-scatter an
    all-reduce, a send 1)."""
    m, blocks = microbatches(train, c), math.ceil(model.layers / c.pp)
    gloo = cluster.kind == "cpu"

    def ar(n: int) -> int:
        return 2 * (n - 1)

    def rs(n: int) -> int:
        return ar(n) if gloo else n - 1

    groups: list[tuple[str, float, int, int]] = []
    if c.tp > 1:
        # forward, backward (and the forward again: under selective recomputation too, whose kept matmul
        # outputs do not include the all-gathers / all-reduces between them)
        passes = 3 if c.recompute != "none" else 2
        if c.sequence_parallel:  # an all-gather and a reduce-scatter per all-reduce of the plain layout
            per = passes * 4 * blocks + TP_EDGE_CALLS
            groups += [("tp", m * per / 2, c.tp, c.tp - 1), ("tp", m * per / 2, c.tp, rs(c.tp))]
        else:
            groups.append(("tp", m * (passes * 2 * blocks + TP_EDGE_CALLS / 2), c.tp, ar(c.tp)))
        per_block, edge = (LLAMA_TP_PARTIAL_GRADS if model.arch == "llama" else TP_PARTIAL_GRADS)[c.sequence_parallel]
        if per_block or edge:  # the Partial gradients' sums (TP_PARTIAL_GRADS)
            groups.append(("tp", m * (blocks * per_block + edge) if c.dp_shard > 1 else 1.0, c.tp, ar(c.tp)))
    if c.cp > 1:  # per block: K and V gathered (forward, again when recomputed), reduce-scattered (backward)
        passes = 2 if c.recompute == "none" else 3
        groups += [("cp", m * blocks * 2 * (passes - 1), c.cp, c.cp - 1), ("cp", m * blocks * 2, c.cp, rs(c.cp)),
                   ("cp", m, c.cp, ar(c.cp))]  # and the per-sample losses' sum
    if c.pp > 1:
        groups.append(("pp", 2 * m * c.stages_per_rank, c.pp, 1))
    if c.ep > 1 and model.experts:
        moe = stage_moe_layers(model, c)
        forwards = 2 if c.recompute != "none" else 1
        groups.append(("ep", m * moe * (forwards * EP_FORWARD_CALLS + EP_BACKWARD_CALLS), c.ep, c.ep - 1))
        edp = expert_replicas(c)
        if c.tp > 1:  # ep x tp, per MoE layer: the aux statistics' and the router gradient's sums over tp;
            # without sequence parallel the tokens' gather after the layer and their gradient's before it
            groups.append(("tp", m * moe * (forwards + 1), c.tp, ar(c.tp)))
            if not c.sequence_parallel:
                groups.append(("tp", m * moe * (forwards + 1), c.tp, c.tp - 1))
        if c.dp_shard > 1:  # ep x fsdp/hsdp: per MoE layer an expert unit over efsdp, a router unit over the shards
            gathers, efsdp, shards = 2 if c.reshard_after_forward else 1, expert_shards(c), c.dp_shard * c.cp
            groups += [("fsdp", m * gathers * moe, efsdp, efsdp - 1), ("fsdp", m * moe, efsdp, rs(efsdp)),
                       ("fsdp", m * gathers * moe, shards, shards - 1), ("fsdp", m * moe, shards, rs(shards))]
            if c.dp_replicate > 1:  # hsdp: the expert unit's reduced shard all-reduced across the replicas
                groups.append(("replicate", moe, c.dp_replicate, ar(c.dp_replicate)))
        elif edp > 1:  # the experts' gradients over their replicas, one all-reduce per stacked tensor
            groups.append(("replicate", moe * EXPERT_TENSORS.get(model.arch, 4), edp, ar(edp)))
    shards = c.dp_shard * c.cp  # FSDP's group: dp_shard x cp (memory.state_shards)
    if c.dp_shard > 1:
        gathers = 2 if c.reshard_after_forward and c.pp == 1 else 1
        groups += [("fsdp", m * gathers * blocks, shards, shards - 1),
                   ("fsdp", m * (blocks + 1), shards, rs(shards))]
        if c.dp_replicate > 1:  # HSDP: each unit's reduced shard is all-reduced across the replicas
            groups.append(("replicate", blocks + 1, c.dp_replicate, ar(c.dp_replicate)))
    elif c.dp_replicate * c.cp > 1:  # DDP's group: dp_replicate x cp (the experts under ep: over their replicas, above)
        n = (stage_params(model, c) - (stage_expert_params(model, c) if c.ep > 1 else 0.0)) / c.tp * _grad_bytes(train)
        r = c.dp_replicate * c.cp
        groups.append(("replicate", math.ceil(n / DDP_BUCKET_BYTES), r, ar(r)))
    world = c.world_size
    groups.append(("step", 1.0, world, ar(world)))  # the step loop's stop word
    if model.experts:  # the step's token counts per expert (one all-reduce)
        groups.append(("step", 1.0, world, ar(world)))
    if c.dp_shard > 1 or c.tp > 1 or c.pp > 1:  # the gradient norm of sharded or staged gradients
        groups.append(("step", 1.0, world, ar(world)))
    return Calls(tuple(groups))


def _grad_bytes(train: Training) -> int:
    return 4 if train.precision == "bf16" else PRECISIONS[train.precision][1]


def moved_bytes(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> dict[str, float]:
    """Bytes one step moves on the worst rank, per group (``tp``, ``pp``, ``dp_shard``, ``dp_replicate``, ``ep``),
    as :mod:`.comm` prices them (a ring's bus bytes: ``2 (N-1)/N`` of an all-reduce's, ``(N-1)/N`` of a
    gather's; a send's once; on CPU FSDP's copies into and out of its unsharded buffers too: module
    docstring). Seconds on a link are these over its bandwidth."""
    m, blocks = microbatches(train, c), math.ceil(model.layers / c.pp)
    act = model.seq_len * c.micro_batch * model.hidden * train.activation_bytes
    moved = dict(tp=(6 if c.recompute != "none" else 4) * comm.all_reduce_s(act, c.tp, 1.0) * blocks * m / c.cp,
                 pp=0.0, dp_shard=0.0, ep=ep_bytes(model, train, c), cp=cp_bytes(model, train, cluster, c) * blocks * m)
    if c.pp > 1:
        send = act / c.cp / (c.tp if c.tp > 1 and c.sequence_parallel else 1)
        moved["pp"] = 2 * m * c.stages_per_rank * comm.p2p_s(send, 1.0)
    n = rank_params(model, c)
    experts = stage_expert_params(model, c) / c.ep if c.ep > 1 else 0.0  # reduced over replicas only
    grad_bytes = (n - experts) * _grad_bytes(train)
    reduce_scatter = comm.all_reduce_s if cluster.kind == "cpu" else comm.all_gather_s
    if c.dp_shard > 1:
        gathers = 2 if c.reshard_after_forward and c.pp == 1 else 1  # a stage keeps its weights gathered
        shards = c.dp_shard * c.cp  # dp_shard x cp (memory.state_shards)
        dense, edp = n - experts, expert_shards(c)  # ep x fsdp/hsdp: the experts' share gathered over efsdp
        moved["dp_shard"] = m * (gathers * comm.all_gather_s(dense * train.compute_param_bytes, shards, 1.0)
                                 + reduce_scatter(grad_bytes, shards, 1.0))
        if experts:
            moved["dp_shard"] += m * (gathers * comm.all_gather_s(experts * train.compute_param_bytes, edp, 1.0)
                                      + reduce_scatter(experts * _grad_bytes(train), edp, 1.0))
        if cluster.kind == "cpu":  # copy-out of each gathered block, copy-in of each reduction's input:
            # memory copies at about the rate gloo moves bytes (on GPUs HBM copies, negligible)
            moved["dp_shard"] += m * (gathers * n * train.compute_param_bytes + n * _grad_bytes(train))
    replicas = c.dp_replicate * (c.cp if c.dp_shard == 1 else 1)  # ddp's group: dp_replicate x cp
    moved["dp_replicate"] = comm.all_reduce_s(grad_bytes / (c.dp_shard * (c.cp if c.dp_shard > 1 else 1)),
                                              replicas, 1.0)
    if experts and c.dp_shard == 1:  # ddp: the experts all-reduced over their replicas (fsdp: above)
        moved["dp_replicate"] += comm.all_reduce_s(experts * _grad_bytes(train), expert_replicas(c), 1.0)
    elif experts and c.dp_replicate > 1:  # hsdp: each efsdp shard of the experts across the replicas
        moved["dp_replicate"] += comm.all_reduce_s(experts * _grad_bytes(train) / expert_shards(c),
                                                   c.dp_replicate, 1.0)
    return moved


def ep_bytes(model: ModelShape, train: Training, c: Candidate) -> float:
    """Bytes a rank's all-to-alls send in one step (0 without expert parallel): per MoE layer of its stage,
    ``2 x top_k x tokens x hidden`` activation bytes forward (dispatch and combine), the same backward and,
    under activation checkpointing, forward again; ``(ep-1)/ep`` of them leave the rank. A cp or tp rank
    routes its ``1 / cp`` or ``1 / tp`` share of its data rank's tokens; under ep x tp without sequence
    parallel the layer's output is also all-gathered over tp (forward, and its input gradient backward:
    :func:`moved_bytes`'s tp)."""
    if c.ep == 1 or not model.experts:
        return 0.0
    tokens = train.global_batch * model.seq_len / (c.dp * c.cp * c.tp)  # cp and tp ranks split the tokens
    passes = 3 if c.recompute != "none" else 2
    per_layer = passes * 2 * model.top_k * tokens * model.hidden * train.activation_bytes
    return stage_moe_layers(model, c) * per_layer * (c.ep - 1) / c.ep


def cp_bytes(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> float:
    """Bytes one block moves per micro-batch for context parallel (0 without): the keys and values
    all-gathered over the cp group, ``2 (C-1)/C B T kv_width`` activation bytes (this rank's heads under
    tp), in the forward (again when activation checkpointing recomputes it), and their gradients
    reduce-scattered in the backward (the same bytes; with gloo priced as an all-reduce, twice them)."""
    if c.cp == 1:
        return 0.0
    kv = 2 * c.micro_batch * model.seq_len * model.kv_width / c.tp * train.activation_bytes
    forwards = 1 if c.recompute == "none" else 2
    reduce_scatter = comm.all_reduce_s if cluster.kind == "cpu" else comm.all_gather_s
    return forwards * comm.all_gather_s(kv, c.cp, 1.0) + reduce_scatter(kv, c.cp, 1.0)


def comm_cpu_s(moved: dict[str, float], cluster: Cluster) -> float:
    """gloo's host work for ``moved`` bytes (:func:`moved_bytes`) on a CPU cluster: every byte a rank moves
    costs its process :attr:`Cluster.gloo_byte_s` of CPU (gloo's threads copy, send, receive and reduce it on
    the cores the ranks compute on). 0 on GPUs (NCCL's work is the device's and the network's) and where the
    figure is not known (the bandwidths price the bytes alone)."""
    if cluster.kind != "cpu" or not cluster.gloo_byte_s:
        return 0.0
    return sum(moved.values()) * cluster.gloo_byte_s


def step_time(model: ModelShape, train: Training, cluster: Cluster, c: Candidate) -> StepTime:
    """The step time of candidate ``c`` (module docstring)."""
    m = microbatches(train, c)
    compute = step_flops(model, train, c) / cluster.flops
    links = comm.group_links(cluster, c)
    moved = moved_bytes(model, train, cluster, c)
    tp_s, pp_s, cp_s = moved["tp"] / links["tp"], moved["pp"] / links["pp"], moved["cp"] / links["cp"]
    ep_s = moved["ep"] / _ep_link(cluster, c)
    if c.ep > 1 and model.experts and cluster.kind != "cpu":  # the split sizes' device-to-host sync
        ep_s += m * stage_moe_layers(model, c) * (2 if c.recompute != "none" else 1) * EP_SPLIT_SYNC_S
    fsdp, final = moved["dp_shard"] / links["dp_shard"], moved["dp_replicate"] / links["dp_replicate"]
    calls = collective_calls(model, train, cluster, c)
    # data-parallel calls overlap with compute like their bytes (FSDP's prefetch, DDP's buckets in backward)
    dp_calls = calls.cost_s(cluster, "fsdp", "replicate")
    fsdp += calls.cost_s(cluster, "fsdp")
    final += calls.cost_s(cluster, "replicate")
    hide = cluster.overlap
    exposed = max(0.0, fsdp - hide * compute) + max(0.0, final - hide * compute / m * 2 / 3)
    dispatch = dtensor_ops(model, train, c) * cluster.dtensor_op_s
    fsdp_host = fsdp_param_visits(model, train, c) * cluster.fsdp_param_s
    # CPU: the same cores run the host work and the kernels; GPU: the host runs ahead of the device
    dispatch_exposed = dispatch if cluster.kind == "cpu" else max(0.0, dispatch - compute)
    fsdp_exposed = fsdp_host if cluster.kind == "cpu" else max(0.0, dispatch + fsdp_host - compute) - dispatch_exposed
    return StepTime(compute, pipeline_bubble(c.schedule, c.pp, m, c.stages_per_rank), tp_s, pp_s,
                    fsdp + final, exposed, optimizer_s=state_params(model, c) * cluster.optimizer_s_per_param,
                    calls=calls.count, calls_s=calls.cost_s(cluster, "tp", "ep", "cp", "pp", "step"), cp_s=cp_s,
                    share=cluster.share(c.world_size), dispatch_s=dispatch, dispatch_exposed_s=dispatch_exposed,
                    fsdp_host_s=fsdp_host, fsdp_host_exposed_s=fsdp_exposed,
                    comm_cpu_s=comm_cpu_s(moved, cluster), dp_calls_s=dp_calls, ep_s=ep_s)


def _ep_link(cluster: Cluster, c: Candidate) -> float:
    """An ep group's link: ``ep`` consecutive expert ranks (data x cp x tp), the innermost such axis's
    stride apart."""
    axis = "tp" if c.tp > 1 else "cp" if c.cp > 1 else "dp_shard" if c.dp_shard > 1 else "dp_replicate"
    return comm.link_bw(cluster, c.dims.stride(axis), c.ep)
