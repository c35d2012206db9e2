"""What the planner's cost model takes: the model's shape, the training settings, the cluster, and one
candidate layout. Frozen dataclasses, checked on construction (:class:`PlannerInputError` names the field,
the value and the fix). Pure: nothing here imports torch or Ray.

Units: bytes, seconds, FLOP/s, bytes/s. Bandwidths are per device: ``intra_node_bw`` is what one device
moves to its node peers (NVLink, or shared memory between CPU processes), ``inter_node_bw`` what one device
moves to another node (its share of the node's network cards).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastictrain.parallel.dims import MeshDims

GB = 1e9
GIB = 1 << 30


class PlannerInputError(ValueError):
    """An input the cost model cannot use; the message names the field, the value and the fix."""


def _positive(owner: str, **values: float | int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise PlannerInputError(f"{owner}.{name} must be a positive number, got {value!r}")


ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` with ``heads`` attention heads, an MLP
    of ``ffn_mult * hidden`` (or ``ffn_hidden``), sequences of ``seq_len`` tokens and a ``vocab``-entry
    embedding (and an untied output head). ``params`` overrides the parameter count derived from the shape
    (a published count).

    ``arch``: ``gpt`` (the built-in GPT's block: biases, layer norms, a two-matrix MLP, learned positions) or
    ``llama`` (no biases, RMSNorm weights only, SwiGLU's three matrices, rotary positions, ``kv_heads``
    key/value heads of ``hidden / heads`` each: grouped-query attention)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_mult: float = 4.0
    tied_embeddings: bool = False
    params: int | None = None
    arch: str = "gpt"
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    experts: int = 0  # mixture of experts (task.model.moe): experts per MoE layer; 0: every MLP dense
    top_k: int = 1  # experts per token
    moe_every: int = 1  # every moe_every-th block's MLP is an MoE

    def __post_init__(self) -> None:
        _positive("model", layers=self.layers, hidden=self.hidden, heads=self.heads, seq_len=self.seq_len,
                  vocab=self.vocab, ffn_mult=self.ffn_mult)
        if self.params is not None:
            _positive("model", params=self.params)
        if self.arch not in ARCHS:
            raise PlannerInputError(f"model.arch={self.arch!r} is not one of {list(ARCHS)}")
        for name in ("kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _positive("model", **{name: getattr(self, name)})
        if self.experts:
            _positive("model", experts=self.experts, top_k=self.top_k, moe_every=self.moe_every)
            if self.top_k > self.experts:
                raise PlannerInputError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}")

    @property
    def ffn(self) -> float:
        """The MLP's hidden width."""
        return self.ffn_hidden if self.ffn_hidden is not None else self.ffn_mult * self.hidden

    @property
    def kv_width(self) -> float:
        """The width of the keys (and of the values): ``kv_heads`` heads of ``hidden / heads``."""
        return (self.kv_heads or self.heads) * self.hidden / self.heads

    @property
    def block_params(self) -> float:
        """One block. GPT: attention (4 h^2 + 4 h), MLP (2 F h + F + h), two layer norms (4 h). Llama: query and
        output (2 h^2), keys and values (2 h kv), SwiGLU (3 F h), two RMSNorms (2 h)."""
        h, f = self.hidden, self.ffn
        if self.arch == "llama":
            return 2 * h * h + 2 * h * self.kv_width + 3 * f * h + 2 * h
        return 4 * h * h + 4 * h + 2 * f * h + f + h + 4 * h

    @property
    def mlp_params(self) -> float:
        """One dense MLP (= one expert): GPT ``2 F h + F + h``, Llama's SwiGLU ``3 F h``."""
        h, f = self.hidden, self.ffn
        return 3 * f * h if self.arch == "llama" else 2 * f * h + f + h

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (blocks ``every-1, 2 every-1, ...``)."""
        return self.layers // self.moe_every if self.experts else 0

    @property
    def expert_params(self) -> float:
        """Every expert of every MoE layer (shape-derived; :attr:`scale` applies): what ``ep`` shards."""
        return self.moe_layers * self.experts * self.mlp_params

    @property
    def moe_extra_params(self) -> float:
        """What the MoE layers add to :attr:`block_params` (which counts one dense MLP per block): the other
        ``E - 1`` experts and the router (``h x E``) of each MoE layer."""
        return self.moe_layers * ((self.experts - 1) * self.mlp_params + self.hidden * self.experts)

    @property
    def first_stage_params(self) -> float:
        """Around the blocks on the first stage: the token embedding (and the GPT's learned positions)."""
        return self.vocab * self.hidden + (0 if self.arch == "llama" else self.seq_len * self.hidden)

    @property
    def last_stage_params(self) -> float:
        """Around the blocks on the last stage: the final norm and the output head unless tied."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (1 if self.arch == "llama" else 2) * self.hidden + head

    @property
    def embedding_params(self) -> float:
        """Everything outside the blocks: the embeddings, the final norm, and the output head unless tied."""
        return self.first_stage_params + self.last_stage_params

    @property
    def total_params(self) -> float:
        if self.params is not None:
            return float(self.params)
        return self.layers * self.block_params + self.embedding_params + self.moe_extra_params

    @property
    def scale(self) -> float:
        """``params / shape-derived count``: a published count scales every per-layer figure alike."""
        derived = self.layers * self.block_params + self.embedding_params + self.moe_extra_params
        return self.total_params / derived

    @classmethod
    def from_params(cls, params: float, *, layers: int = 1, hidden: int = 1, heads: int = 1, seq_len: int = 1,
                    vocab: int = 1) -> "ModelShape":
        """A model known by its parameter count only (the memory of weights, gradients and optimizer state
        needs nothing else; activations and TP traffic then use the shape given, 1 by default)."""
        return cls(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab, params=int(params))


# Bytes per parameter: the weights the step computes with, the gradients, an fp32 master copy (0 when the
# weights are fp32 already) and the optimizer's state (Adam: two fp32 moments).
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 0),            # fp32 weights and gradients
    "mixed": (2, 2, 4),           # bf16/fp16 weights and gradients, fp32 master (Megatron, DeepSpeed)
    # parallel.mixed_precision=bf16: fp32 weights, gradients and optimizer state, bf16 compute copies of the
    # weights (FSDP2's policy on sharded layouts, torch.autocast's casts elsewhere; planner/memory.py)
    "bf16": (4, 4, 0),
}
OPTIMIZER_BYTES = {"adam": 8, "sgd_momentum": 4, "sgd": 0}


@dataclass(frozen=True)
class Training:
    """The step: ``global_batch`` samples of ``micro_batch`` per forward/backward, the precision preset
    (:data:`PRECISIONS`), the optimizer (:data:`OPTIMIZER_BYTES`), and ``activation_bytes`` per activation
    element (2 for bf16 compute, 4 for fp32)."""

    global_batch: int
    micro_batch: int
    precision: str = "fp32"
    optimizer: str = "adam"
    activation_bytes: int = 4

    def __post_init__(self) -> None:
        _positive("train", global_batch=self.global_batch, micro_batch=self.micro_batch,
                  activation_bytes=self.activation_bytes)
        if self.precision not in PRECISIONS:
            raise PlannerInputError(f"precision={self.precision!r} is not one of {sorted(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise PlannerInputError(f"optimizer={self.optimizer!r} is not one of {sorted(OPTIMIZER_BYTES)}")

    @property
    def compute_param_bytes(self) -> int:
        """Bytes of a weight as the step computes with it (bf16 copies under bf16)."""
        return 2 if self.precision in ("mixed", "bf16") else 4

    @property
    def state_bytes_per_param(self) -> int:
        """Weights + gradients + master + optimizer state: 16 for mixed-precision (and fp32) Adam."""
        w, g, master = PRECISIONS[self.precision]
        return w + g + master + OPTIMIZER_BYTES[self.optimizer]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of ``device_memory`` bytes and ``flops`` FLOP/s each (at the
    step's precision, as achieved by a real matmul); bandwidths in bytes/s per device (module docstring).
    ``runtime_bytes`` is what a process holds before the model (CUDA context, allocator pools, or torch's own
    resident memory on CPU); ``fragmentation`` the share of the rest lost to the allocator; ``overlap`` the
    share of compute that communication can hide behind (GPUs run collectives on their own engines: 0.8;
    CPU processes share their cores between both: low); ``latency_s`` the cost of each step of a ring (a
    collective of ``n`` ranks pays ``n-1`` or ``2 (n-1)``); ``call_s`` the fixed cost of one collective call
    as a job makes it (the framework's dispatch, the backend's start, and where ranks share cores the wait
    for the peers to be scheduled: ms with gloo on an oversubscribed CPU, ~0 on GPUs);
    ``tp_call_s`` the same for a tensor-parallel collective as DTensor issues it (a redistribution: its
    Python work, a functional collective, its wait; None: ``call_s``); ``dtensor_op_s`` the host time
    DTensor's dispatch adds to each op on a sharded tensor (sharding propagation, wrapping and unwrapping:
    CPU work on the host, which a GPU's kernels hide only up to their own time, :mod:`.steptime`);
    ``fsdp_param_s`` the host time FSDP2 adds per parameter tensor and micro-batch (its hooks' bookkeeping and
    its collectives' issue, apart from the bytes: :mod:`.steptime`), hidden on GPUs like the dispatch;
    ``gloo_byte_s`` on CPU the CPU time a rank's process (gloo's threads included) spends per byte it moves
    in a collective, host work that ranks sharing cores share out like compute (None: the bytes are priced
    at the bandwidths only; ignored on GPUs);
    ``optimizer_s_per_param`` the optimizer step's (and gradient clipping's) time per local parameter;
    ``cores_per_node`` what a node's ranks compute on, in ranks' worth (CPU cores over the threads of one
    worker; None: each device computes on its own, as GPUs do): when a node runs more ranks than that, they
    share it and the step takes at least their summed work over the cores (:func:`share`)."""

    nodes: int
    devices_per_node: int
    device_memory: float
    flops: float
    intra_node_bw: float
    inter_node_bw: float
    runtime_bytes: float = 1.0 * GIB
    fragmentation: float = 0.10
    latency_s: float = 20e-6
    overlap: float = 0.8
    call_s: float = 0.0
    tp_call_s: float | None = None
    dtensor_op_s: float = 0.0
    fsdp_param_s: float = 0.0
    gloo_byte_s: float | None = None
    optimizer_s_per_param: float = 0.0
    cores_per_node: float | None = None
    device_known: bool = True  # False: a GPU of a type the device table does not know (memory is a default)
    kind: str = "gpu"
    source: str = "given"  # where the figures come from (flags, Ray, this machine, a calibration file)

    def __post_init__(self) -> None:
        _positive("cluster", nodes=self.nodes, devices_per_node=self.devices_per_node,
                  device_memory=self.device_memory, flops=self.flops, intra_node_bw=self.intra_node_bw,
                  inter_node_bw=self.inter_node_bw)
        if self.cores_per_node is not None:
            _positive("cluster", cores_per_node=self.cores_per_node)
        for name in ("latency_s", "call_s", "tp_call_s", "dtensor_op_s", "fsdp_param_s", "gloo_byte_s",
                     "optimizer_s_per_param"):
            value = getattr(self, name)
            if value is None and name in ("tp_call_s", "gloo_byte_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise PlannerInputError(f"cluster.{name} must be a number >= 0, got {value!r}")
        if not 0 <= self.overlap <= 1:
            raise PlannerInputError(f"cluster.overlap must be in [0, 1], got {self.overlap!r}")
        if not 0 <= self.fragmentation < 1:
            raise PlannerInputError(f"cluster.fragmentation must be in [0, 1), got {self.fragmentation!r}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def share(self, world: int) -> float:
        """How many ranks take turns on each core of a node when ``world`` ranks run (ranks fill a node
        before the next): ``ranks on a node / cores_per_node``, at least 1 (no sharing: GPUs, or as many
        cores as ranks)."""
        if self.cores_per_node is None:
            return 1.0
        return max(1.0, min(world, self.devices_per_node) / self.cores_per_node)


@dataclass(frozen=True, init=False)
class Candidate:
    """One layout: its mesh (:class:`~elastictrain.parallel.dims.MeshDims`, ``pp x dp_replicate x dp_shard x
    cp x tp``, tp innermost: a TP group is consecutive ranks), the pipeline schedule and its virtual stages
    per rank, the micro-batch size and activation checkpointing. ``sequence_parallel`` applies when
    ``tp > 1``. Built from ``dims`` or from the axis sizes (``Candidate(dp_replicate=2, tp=2)``); the axis
    sizes read through to ``dims``."""

    dims: MeshDims
    schedule: str
    stages_per_rank: int
    micro_batch: int
    activation_checkpointing: bool | str  # False / True (= "full") / "full" / "selective"
    sequence_parallel: bool
    reshard_after_forward: bool

    def __init__(self, dims: MeshDims | None = None, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1,
                 pp: int = 1, cp: int = 1, ep: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
                 micro_batch: int = 1, activation_checkpointing: bool | str = False,
                 sequence_parallel: bool = True, reshard_after_forward: bool = True) -> None:
        if dims is not None:  # the planner names a layout by its sizes: the plan follows dp_shard (equality)
            dp_replicate, dp_shard, tp, pp, cp, ep = (dims.size(n) for n in ("dp_replicate", "dp_shard", "tp", "pp",
                                                                             "cp", "ep"))
        _positive("candidate", dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep,
                  stages_per_rank=stages_per_rank, micro_batch=micro_batch)
        plan = "ddp" if dp_shard == 1 else "fsdp" if dp_replicate == 1 else "hsdp"
        try:
            dims = MeshDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep, plan=plan)
        except ValueError as e:
            raise PlannerInputError(f"candidate: {e}") from None
        for name, value in (("dims", dims), ("schedule", schedule), ("stages_per_rank", stages_per_rank),
                            ("micro_batch", micro_batch), ("activation_checkpointing", activation_checkpointing),
                            ("sequence_parallel", sequence_parallel),
                            ("reshard_after_forward", reshard_after_forward)):
            object.__setattr__(self, name, value)

    def with_dims(self, **sizes: int) -> Candidate:
        """This candidate with some axis sizes changed (the plan name follows ``dp_shard``)."""
        now = {n: self.dims.size(n) for n in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")}
        return Candidate(**{**now, **sizes}, schedule=self.schedule, stages_per_rank=self.stages_per_rank,
                         micro_batch=self.micro_batch, activation_checkpointing=self.activation_checkpointing,
                         sequence_parallel=self.sequence_parallel, reshard_after_forward=self.reshard_after_forward)

    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.dims.dp_shard

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def recompute(self) -> str:
        """Activation checkpointing as one name: ``none``, ``full`` (true) or ``selective``."""
        ac = self.activation_checkpointing
        return "selective" if ac == "selective" else "full" if ac else "none"

    @property
    def layout_name(self) -> str:
        """The data-parallel layout's name as ``parallel.plan`` spells it."""
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"

    def describe(self) -> str:
        parts = [self.layout_name if self.dp > 1 else "single"]
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts[0] += f" {self.dp_replicate}x{self.dp_shard}"
        elif self.dp > 1:
            parts[0] += f" {self.dp}"
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"pp {self.pp} {self.schedule}{v}")
        parts.append(f"mb {self.micro_batch}")
        if self.recompute != "none":
            parts.append("ac" if self.recompute == "full" else "sac")
        return ", ".join(parts)
