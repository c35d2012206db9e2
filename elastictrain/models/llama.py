"""A Llama 3 decoder built in: RMSNorm, rotary embeddings (with Llama 3.1's frequency scaling), grouped-query
attention, SwiGLU, an untied or tied output head, ``scaled_dot_product_attention``.

Names and math are a contract with the Hugging Face weight mapping (its one name table): parameters are
named as torchtitan names them (``tok_embeddings``, ``layers.{i}.attention.wq`` ...); the rotary embedding
uses Hugging Face's convention (non-interleaved halves, ``x * cos + rotate_half(x) * sin``), so Hugging
Face's ``q_proj``/``k_proj`` load without a permutation; RMSNorm normalises in fp32, casts back, then
multiplies by its weight (Hugging Face's order). No dropout: ``sample_seeds`` is accepted (the task
interface passes it) and unused.

Initialisation: :meth:`Llama.init_weights` (called by the constructor) draws every Linear and Embedding weight
from ``normal(0, 0.02)`` on torch's default generator and sets the norms to 1 (an MoE layer's experts: its
``reset_parameters``), then recomputes the rotary tables. The tables are non-persistent buffers (in no state
dict): a model built on the ``meta`` device and given memory by ``to_empty`` must call
:meth:`Llama.init_weights` (or :meth:`Llama.reset_buffers` when the parameters' values come from a
checkpoint) before its first forward. The framework gives the step-0 values module by module instead, by the
same rule (:meth:`Llama.init_module`, elastictrain/parallel/init.py): each rank fills only the modules (or
tensor-parallel, FSDP or expert shards) it holds, from (seed, module name), so every layout starts from the
same values without any rank building the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastictrain.models.moe import MoEConfig, MoEFeedForward

__all__ = [
    "LLAMA_PRESETS",
    "Llama",
    "LlamaConfig",
    "LlamaStage",
    "llama_config",
    "rope_frequencies",
    "rotate_half",
]

_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

#: Named sizes: ``LlamaConfig`` keyword arguments. ``debug`` is the test size; the others are the published
#: Llama 3.2 1B and Llama 3.1 8B / 70B / 405B shapes (vocabulary 128256, rope theta 500000).
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256, max_seq_len=64),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256,
               max_seq_len=131072, tie_embeddings=True, rope_scaling={**_LLAMA31_ROPE, "factor": 32.0}),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256,
               max_seq_len=131072, rope_scaling=dict(_LLAMA31_ROPE)),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=128256,
                max_seq_len=131072, rope_scaling=dict(_LLAMA31_ROPE)),
    "405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248, vocab_size=128256,
                 max_seq_len=131072, rope_scaling=dict(_LLAMA31_ROPE)),
}


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. ``max_seq_len`` is the length of the rotary tables (the longest position a forward
    accepts); ``rope_scaling`` is Llama 3.1's (keys :data:`_ROPE_SCALING_KEYS`) or None. Raises
    ``ValueError`` naming the field, the value and the rule."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_hidden: int = 192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict[str, float] | None = field(default=None, hash=False)
    max_seq_len: int = 64
    tie_embeddings: bool = False
    moe: MoEConfig | None = None  # every moe.every-th layer's feed-forward: SwiGLU experts of ffn_hidden

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                             "pick a head count that divides dim")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: head_dim = dim / n_heads = {self.dim // self.n_heads} must be even "
                             "(rotary embeddings rotate pairs); change dim or n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig.n_heads={self.n_heads} is not divisible by n_kv_heads="
                             f"{self.n_kv_heads}; pick a kv head count that divides n_heads")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be > 0")
        if self.rope_scaling is not None:
            missing = [k for k in _ROPE_SCALING_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"LlamaConfig.rope_scaling={self.rope_scaling!r} lacks {missing}; give all of "
                                 f"{list(_ROPE_SCALING_KEYS)} (Llama 3.1 scaling) or None")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def llama_config(size: str, **overrides: Any) -> LlamaConfig:
    """The preset ``size`` of :data:`LLAMA_PRESETS` with ``overrides`` (None values ignored)."""
    if size not in LLAMA_PRESETS:
        raise ValueError(f"unknown Llama size {size!r}; one of {sorted(LLAMA_PRESETS)}")
    kwargs = dict(LLAMA_PRESETS[size])
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return LlamaConfig(**kwargs)


def rope_frequencies(head_dim: int, theta: float, scaling: dict[str, float] | None = None) -> torch.Tensor:
    """The rotary inverse frequencies ``1 / theta^(2i / head_dim)`` (fp32, ``head_dim / 2`` of them), with
    Llama 3.1's scaling when ``scaling`` is given: wavelengths longer than ``original / low_freq_factor``
    are stretched ``factor`` times, those shorter than ``original / high_freq_factor`` kept, the band
    between interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves on the last dimension (Hugging Face's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of every position below ``max_seq_len`` (fp32, ``[max_seq_len, head_dim]``), as
    non-persistent buffers. :meth:`reset` recomputes them (after ``to_empty`` of a meta-built model)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        shape = (cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        if self.cos.is_meta:  # a meta build: the tables are computed after to_empty
            return
        c = self.cfg
        inv_freq = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        freqs = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, t: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``positions`` (default ``0..t-1``), ``[t, head_dim]`` fp32."""
        if positions is None:
            if t > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {t} exceeds LlamaConfig.max_seq_len={self.cfg.max_seq_len}")
            return self.cos[:t], self.sin[:t]
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, head_dim]`` by the tables ``[T, head_dim]`` (cast to ``x``'s dtype)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to ``x``'s dtype, times ``weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query causal attention. Runs on however many heads this rank's projections hold (tensor
    parallelism splits ``wq`` and ``wk``/``wv`` by heads; ``head_dim`` and the query heads per kv head are
    fixed), so the same code runs whole or tensor-parallel. With ``cp_group`` set (context parallelism,
    :func:`elastictrain.parallel.context.enable_context_parallel`) ``x`` holds the global ``positions`` of
    each sample and the attention is :func:`~elastictrain.parallel.context.cp_attention` (the kv heads
    gathered over the group, then repeated)."""

    cp_group: Any = None

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, t, width = q.shape  # t: the whole sequence (a sequence-parallel norm gathered it)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        cos, sin = rope(t, positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cp_group is not None:
            from elastictrain.parallel.context import cp_attention

            if positions is None:
                raise ValueError("context parallel (cp_group set) needs the tokens' global positions: pass "
                                 "positions= (elastictrain.parallel.context.shard_sequence adds them to the batch)")
            y = cp_attention(q, k, v, positions, None, self.cp_group, n_rep=self.n_rep)
            return self.wo(y.transpose(1, 2).reshape(b, t, width))
        if self.n_rep > 1:  # kv head j serves query heads j*n_rep .. (j+1)*n_rep - 1
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, width))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, cfg: LlamaConfig, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (FeedForward(cfg) if moe is None
                                        else MoEFeedForward(cfg.dim, cfg.ffn_hidden, moe, "swiglu"))

    def forward(self, x: torch.Tensor, *, rope: RotaryEmbedding, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        # rope and positions by keyword: a tensor-parallel style's input hook rewrites the positional input only
        x = x + self.attention(self.attention_norm(x), rope, positions)
        return x + self.feed_forward(self.ffn_norm(x))


def _check_inputs(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be an int64 tensor of shape (B, T), got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")


class Llama(nn.Module):
    """Llama 3: token embeddings, ``n_layers`` pre-norm blocks, a final RMSNorm and the output head (the
    embedding's own Parameter when ``tie_embeddings``). Parameters are initialised from torch's default
    generator: call ``torch.manual_seed`` first for reproducible weights. The framework re-initialises them
    module by module instead (:meth:`init_module`), so that any rank can build just its own."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # torch's own initialisers draw on the default generator: undone, so that construction and a later
        # seeded init_weights (a meta build's) draw the same values
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.rope = RotaryEmbedding(cfg)
            self.layers = nn.ModuleList(TransformerBlock(cfg, cfg.moe if cfg.moe and cfg.moe.is_moe(i) else None)
                                        for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding's Parameter when ``tie_embeddings`` (a no-op otherwise). Called
        again after anything that re-registers parameters (a tensor-parallel plan distributes each module's
        weight on its own; the embedding's and the head's placements are the same, Shard(0) on the
        vocabulary)."""
        if self.cfg.tie_embeddings and hasattr(self, "tok_embeddings") and hasattr(self, "output"):
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters (not its children's) from torch's default generator, by
        :meth:`init_weights`'s rule: a Linear's or Embedding's weight ``normal(0, 0.02)``, a norm's weight 1,
        an MoE layer's stacked experts by its ``reset_parameters`` (``init_by_name`` calls it on one expert
        at a time). The per-module contract of elastictrain/parallel/init.py."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, (RMSNorm, MoEFeedForward)):
            module.reset_parameters()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every Linear and Embedding weight from ``normal(0, 0.02)``, the norms to 1, then the rotary tables
        (:meth:`reset_buffers`). The draw order is the modules' order, so a seeded call gives the same values
        as a seeded construction. Ties the head first (``to_empty`` gives each module its own tensor)."""
        self.tie_weights()
        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (RMSNorm, MoEFeedForward)):  # MoE: the experts (its router is a Linear)
                module.reset_parameters()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the non-persistent rotary tables (after ``to_empty``, whose buffers hold no values)."""
        self.rope.reset()

    def forward(self, input_ids: torch.Tensor, sample_seeds: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for ``input_ids`` ``(B, T)``. ``positions`` (``[T]``, default
        ``0..T-1``): the global positions the rotary embedding uses, required under context parallelism
        (``input_ids`` is then this rank's part of the sequence). ``sample_seeds`` is ignored (no
        dropout). Rows never interact."""
        _check_inputs(input_ids)
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, rope=self.rope, positions=positions)
        return self.output(self.norm(x))

    def tp_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """This model's tensor-parallel plan (:func:`llama_tp_plan`)."""
        return llama_tp_plan(self, sequence_parallel)


class LlamaStage(nn.Module):
    """One pipeline stage of a :class:`Llama`: the modules it owns, under the whole model's names.

    The first stage holds ``tok_embeddings``, the last ``norm`` and ``output``, each stage its range of
    ``layers`` in an ``nn.ModuleDict`` keyed by the layer's index in the whole model (``layers.3.attention.wq
    .weight`` keeps its name, so a checkpoint of any split loads under any other layout); every stage holds
    the rotary tables (buffers, no parameters). A tied model split over stages gives the first stage the
    embedding and the last the head's copy of the same weight (``build_pipeline`` keeps the two one tensor:
    elastictrain/parallel/tied.py). ``forward(x, seeds=None)``: ``x`` is the token
    ids (first stage) or the previous stage's activations; returns the logits on the last stage.
    ``positions``: as :meth:`Llama.forward`'s, required under context parallelism; ``[t]``, or ``[b, t]`` with
    one identical row per sample as a pipeline schedule hands them to every stage
    (:func:`~elastictrain.parallel.context.stage_positions`)."""

    def __init__(self, model: Llama, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = first, last
        self.rope = model.rope
        if first:
            self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm, self.output = model.norm, model.output

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        from elastictrain.parallel.context import stage_positions

        positions = stage_positions(positions)
        if self.first:
            _check_inputs(x)
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, rope=self.rope, positions=positions)
        return self.output(self.norm(x)) if self.last else x

    def reset_buffers(self) -> None:
        self.rope.reset()

    def tp_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """The tensor-parallel plan of the modules this stage holds (the whole model's, by the same names)."""
        return llama_tp_plan(self, sequence_parallel)


def llama_tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a :class:`Llama` or a :class:`LlamaStage` (the keys of the modules
    it holds), in the built-in GPT's shape (:mod:`elastictrain.models.gpt_tp`): ``wq``/``wk``/``wv`` and
    ``w1``/``w3`` column-wise (each rank holds ``n_heads / tp`` query and ``n_kv_heads / tp`` kv heads, and
    ``ffn_hidden / tp`` of the MLP), ``wo``/``w2`` row-wise; the embedding vocabulary-parallel, the head
    column-wise with its logits left sharded on the vocabulary for ``loss_parallel``. Sequence parallel:
    the norms run on the rank's slice of the positions and gather the whole sequence for the projections
    after them; the row-wise projections reduce-scatter back onto it. A mixture-of-experts layer (ep x tp)
    keeps its experts whole: :class:`~elastictrain.parallel.expert_tp.MoETokenSplit`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from elastictrain.models.gpt_tp import RowwiseParallelSync, SequenceParallelGathered

    sp, seq = sequence_parallel, Shard(1)
    plan: dict[str, Any] = {}
    if hasattr(model, "tok_embeddings"):
        # a synchronous output collective: the first block, compiled, takes this output directly (gpt_tp.py)
        plan["tok_embeddings"] = RowwiseParallelSync(input_layouts=Replicate(), output_layouts=seq if sp else Replicate())
    layer = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq if sp else Replicate()),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq if sp else Replicate()),
    }
    if sp:
        layer.update({"attention_norm": SequenceParallelGathered(), "ffn_norm": SequenceParallelGathered()})
    moe = {name for name, block in getattr(model, "layers", nn.ModuleList()).named_children()
           if isinstance(block.feed_forward, MoEFeedForward)}
    if len(getattr(model, "layers", ())) and not moe:
        plan.update({f"layers.*.{name}": style for name, style in layer.items()})
    if moe:  # ep x tp: an MoE layer's experts stay whole, it takes this rank's positions (parallel/expert_tp.py)
        from elastictrain.parallel.expert_tp import MoETokenSplit

        moe_layer = {k: v for k, v in layer.items() if not k.startswith("feed_forward.")}
        moe_layer["feed_forward"] = MoETokenSplit(sp)
        if sp:  # the norm hands over its sequence shard, not the gathered sequence
            moe_layer["ffn_norm"] = SequenceParallel(use_local_output=True)
        for name, _ in model.layers.named_children():
            styles = moe_layer if name in moe else layer
            plan.update({f"layers.{name}.{k}": style for k, style in styles.items()})
    if hasattr(model, "output"):
        if sp:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Shard(-1),
                                         use_local_output=False)
    return plan
