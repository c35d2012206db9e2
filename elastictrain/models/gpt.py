"""A tiny GPT-style decoder whose dropout is a pure function of (seed, step, global sample id).

Why: an elastic job must produce the same training trajectory whatever the world size. The data
cursor already makes *which* samples a step sees independent of the world size; this model makes
*what happens to each sample* independent of it too. Every dropout mask of row ``b`` comes from a
fresh ``torch.Generator`` seeded with ``mix(sample_seeds[b], site)``, so a sample gets the same masks
whichever rank or micro-batch position processes it. No stateful RNG and no rank enters the masks.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from elastictrain.models.moe import MoEConfig, MoEFeedForward

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTStage",
    "dropout_seed",
    "param_count",
    "per_sample_loss",
    "sample_seed",
    "sample_seeds",
]

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
# Distinguishes sample seeds from other hashes built on the same mixer (arbitrary odd constant).
_SAMPLE_DOMAIN = 0x5EED_5A3F_1E00_0001


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser: a bijective 64-bit mixer with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(*parts: int) -> int:
    """Hash a sequence of non-negative ints into 63 bits (fits int64 and torch.Generator seeds)."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ _splitmix64(part & _MASK64))
    return h & _MASK63


def _check_nonneg(name: str, value: int) -> int:
    # operator.index admits numpy / torch integer scalars (what the cursor hands out) but not floats.
    try:
        number = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        number = -1
    if number < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return number


def sample_seed(seed: int, step: int, sample_id: int) -> int:
    """The 63-bit randomness seed of one sample at one step: a pure hash of its arguments."""
    return _mix(
        _SAMPLE_DOMAIN,
        _check_nonneg("seed", seed),
        _check_nonneg("step", step),
        _check_nonneg("sample_id", sample_id),
    )


def sample_seeds(seed: int, step: int, sample_ids: Iterable[int]) -> torch.Tensor:
    """``sample_seed`` of each id, as the int64 tensor ``GPT.forward`` takes (on CPU): the same values,
    computed for all ids at once (uint64 arithmetic wraps like the masks of :func:`_splitmix64`), since the
    step loop asks for every micro-batch."""
    ids = np.asarray([_check_nonneg("sample_id", i) for i in sample_ids], dtype=np.uint64)
    prefix = 0  # _mix's running hash over the parts every id shares (before its final 63-bit mask)
    for part in (_SAMPLE_DOMAIN, _check_nonneg("seed", seed), _check_nonneg("step", step)):
        prefix = _splitmix64(prefix ^ _splitmix64(part & _MASK64))
    prefix = np.uint64(prefix)
    out = _splitmix64_array(prefix ^ _splitmix64_array(ids)) & np.uint64(_MASK63)
    return torch.from_numpy(out.astype(np.int64))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` of every element of a uint64 array (numpy's uint64 ops wrap modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def dropout_seed(sample_seed_value: int, site: int) -> int:
    """Seed of the mask that dropout site ``site`` draws for a sample with the given sample seed."""
    return _mix(_check_nonneg("sample_seed", sample_seed_value), _check_nonneg("site", site))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``seq_len`` is the longest input accepted (learned positions). ``moe``: every
    ``moe.every``-th block's MLP is a mixture of experts of the dense MLP's shape (None: all dense)."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    dropout: float = 0.1
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class SampleDropout(nn.Module):
    """Inverted dropout whose mask for row ``b`` is drawn from ``dropout_seed(sample_seeds[b], site)``.

    Identity in eval mode, when ``p == 0`` or when ``sample_seeds`` is None. Masks are drawn in
    float32 on the input's device, so they do not depend on the activation dtype (they do depend on
    the device type: CPU and CUDA generators produce different streams).

    ``positions`` (``[t]`` global positions of ``x``'s rows, context parallelism) and ``seq_len`` (the whole
    sequence's length): the mask of the whole ``seq_len`` sequence is drawn and its rows at ``positions``
    kept, so a position gets the same mask whichever cp rank holds it (the price: every cp rank draws the
    whole mask, as tensor-parallel ranks do under sequence parallelism).

    A DTensor input (a sequence-parallel region, where this rank holds a slice of the positions) gets the
    mask of the WHOLE sample, as a replicated DTensor that the multiplication slices to the positions this
    rank holds (a local slice, no communication): the mask stays a function of (seed, step, sample id,
    position), never of the shard's shape, the rank or the tensor-parallel degree. The price is drawing
    the whole mask on every tensor-parallel rank (a torch CPU generator cannot skip ahead in its stream).
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        self.p = p
        self.site = site

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, seq_len: int | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0 or seeds is None:
            return x
        shape = x.shape[1:] if positions is None else (seq_len, *x.shape[2:])
        masks = []
        for row_seed in seeds.tolist():
            gen = torch.Generator(device=x.device)
            gen.manual_seed(dropout_seed(row_seed, self.site))
            masks.append(torch.rand(shape, generator=gen, device=x.device) >= self.p)
        keep = torch.stack(masks)
        if positions is not None:  # the whole sequence's mask, this rank's rows
            keep = keep.index_select(1, positions.to(x.device))
        keep = keep.to(x.dtype)
        if isinstance(x, DTensor):  # global shape above; the product keeps this rank's positions
            keep = DTensor.from_local(keep, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
        return x * keep / (1.0 - self.p)


class _Block(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln(x))), then x + drop(mlp(ln(x))); with ``moe`` the MLP is a
    :class:`~elastictrain.models.moe.MoEFeedForward` of the same expert shape (attribute ``moe``).

    Queries, keys and values are three projections (``q``, ``k``, ``v``), so that tensor parallelism can
    split each column-wise by heads; the attention runs on however many heads this rank's projections
    hold (``head_dim`` is fixed), so the same code runs whole or tensor-parallel.

    Context parallelism: with ``cp_group`` set (:func:`elastictrain.parallel.context.enable_context_parallel`)
    ``x`` holds the positions ``positions`` of each sample and the attention is
    :func:`~elastictrain.parallel.context.cp_attention` (keys and values gathered over the group)."""

    cp_group: Any = None

    def __init__(self, cfg: GPTConfig, first_site: int, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop_attn = SampleDropout(cfg.dropout, first_site)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        if moe is not None:  # the experts have the dense MLP's shape (d -> 4d -> d, GELU)
            self.moe = MoEFeedForward(cfg.d_model, 4 * cfg.d_model, moe, "gelu")
        else:
            self.mlp_in = nn.Linear(cfg.d_model, 4 * cfg.d_model)
            self.mlp_out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop_mlp = SampleDropout(cfg.dropout, first_site + 1)

    def _attention(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, width = q.shape  # width: this rank's heads x head_dim (all heads without tensor parallelism)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.cp_group is not None:
            from elastictrain.parallel.context import cp_attention

            y = cp_attention(q, k, v, positions, None, self.cp_group)
        else:
            # dropout_p=0: SDPA's internal dropout uses the global RNG, which would break determinism.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.attn_out(y.transpose(1, 2).reshape(b, t, width))

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None, *, positions: torch.Tensor | None = None,
                seq_len: int | None = None) -> torch.Tensor:
        # seeds by keyword: a tensor-parallel style's input hook rewrites the positional input only.
        # positions/seq_len: None, or this rank's global positions and the whole length (context parallel)
        where = {"positions": positions, "seq_len": seq_len}
        x = x + self.drop_attn(self._attention(self.ln_attn(x), positions), seeds=seeds, **where)
        h = self.moe(self.ln_mlp(x)) if hasattr(self, "moe") else self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))
        return x + self.drop_mlp(h, seeds=seeds, **where)


class GPT(nn.Module):
    """Decoder-only LM: token + learned position embeddings, pre-LN blocks, untied output head.

    Dropout sites: 0 = embeddings, ``1 + 2*l`` / ``2 + 2*l`` = attention / MLP output of block ``l``.
    Parameters are initialised from torch's default generator: call ``torch.manual_seed`` first
    for reproducible weights. The framework re-initialises them module by module instead
    (:meth:`init_module`, elastictrain/parallel/init.py), so that any rank can build just its own.
    ``cp_group``: the context-parallel group (:mod:`elastictrain.parallel.context`), None without.
    """

    cp_group: Any = None

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop_emb = SampleDropout(cfg.dropout, 0)
        self.blocks = nn.ModuleList(_Block(cfg, 1 + 2 * layer, cfg.moe if cfg.moe and cfg.moe.is_moe(layer) else None)
                                    for layer in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor, sample_seeds: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab_size)`` for ``input_ids`` ``(B, T)`` with ``T <= cfg.seq_len``.

        ``sample_seeds`` (int64, shape ``(B,)``, see ``sample_seed``) enables dropout in training mode;
        without it the forward is deterministic. Rows never interact, so a row's output does not
        depend on the rest of the batch. ``positions`` (int64 ``[T]``): the global positions of the tokens
        (the learned position embedding's rows, the dropout masks' rows); required under context
        parallelism (``cp_group`` set: ``input_ids`` is this rank's part of a ``T * cp`` sequence),
        default ``0..T-1``.
        """
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(
                f"input_ids must be an int64 tensor of shape (B, T), got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        b, t = input_ids.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        if sample_seeds is not None and (
            sample_seeds.shape != (b,) or sample_seeds.dtype != torch.int64
        ):
            raise ValueError(
                f"sample_seeds must be an int64 tensor of shape ({b},), got {sample_seeds.dtype} "
                f"{tuple(sample_seeds.shape)}"
            )
        where = _where(positions, t, self.cp_group, input_ids.device)
        pos = torch.arange(t, device=input_ids.device) if positions is None else where["positions"]
        x = self.drop_emb(self.tok_emb(input_ids) + self.pos_emb(pos), seeds=sample_seeds, **where)
        for block in self.blocks:
            x = block(x, sample_seeds, **where)
        return self.head(self.ln_f(x))

    def tp_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """This model's tensor-parallel plan (:func:`elastictrain.models.gpt_tp.gpt_tp_plan`)."""
        from elastictrain.models.gpt_tp import gpt_tp_plan

        return gpt_tp_plan(self, sequence_parallel)

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters (not its children's) from torch's default generator:
        torch's default for its type, then GPT-2's normal(0.02) weights and zero biases of every linear and
        embedding (what the constructor gives). The per-module contract of elastictrain/parallel/init.py."""
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        _init_weights(module)


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`GPT`: the modules it owns, under the full model's names.

    Built from a (meta or seeded) GPT whose other modules are dropped: the first stage holds ``tok_emb``,
    ``pos_emb`` and ``drop_emb``, the last ``ln_f`` and ``head``, each stage its range of ``blocks`` in an
    ``nn.ModuleDict`` keyed by the block's index in the whole model, so a parameter keeps its fully
    qualified name (``blocks.3.q.weight``) and a checkpoint of any split loads under any other layout.
    ``forward(x, seeds=None)``: ``x`` is the token ids (first stage) or the previous stage's activations;
    ``seeds`` (the per-sample seeds, passed to every stage) drive dropout exactly as in the whole model.
    Returns the logits on the last stage, the activations elsewhere. ``positions``: as :meth:`GPT.forward`'s,
    required under context parallelism; ``[t]``, or ``[b, t]`` with one identical row per sample as a
    pipeline schedule hands them to every stage
    (:func:`~elastictrain.parallel.context.stage_positions`)."""

    cp_group: Any = None

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb, self.drop_emb = model.tok_emb, model.pos_emb, model.drop_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        from elastictrain.parallel.context import stage_positions

        positions = stage_positions(positions)
        # t: the cp shard's length (a later stage's x under sequence parallelism holds a tp slice of it)
        where = _where(positions, x.shape[1] if positions is None else positions.numel(), self.cp_group, x.device)
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device) if positions is None else where["positions"]
            x = self.drop_emb(self.tok_emb(x) + self.pos_emb(pos), seeds=seeds, **where)
        for block in self.blocks.values():
            x = block(x, seeds, **where)
        return self.head(self.ln_f(x)) if self.last else x

    def tp_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """The tensor-parallel plan of the modules this stage holds (the whole model's, by the same names)."""
        from elastictrain.models.gpt_tp import gpt_tp_plan

        return gpt_tp_plan(self, sequence_parallel)


def _where(positions: torch.Tensor | None, t: int, cp_group: Any, device: torch.device) -> dict[str, Any]:
    """The ``positions``/``seq_len`` keywords of the blocks and dropout: both None on the default path (no
    positions given, no cp: unchanged math); else the global positions and the whole sequence's length
    (``t`` times the cp degree)."""
    if positions is None:
        if cp_group is not None:
            raise ValueError("context parallel (cp_group set) needs the tokens' global positions: pass "
                             "positions= (elastictrain.parallel.context.shard_sequence adds them to the batch)")
        return {"positions": None, "seq_len": None}
    if positions.shape != (t,):
        raise ValueError(f"positions must be a [T] tensor of the {t} tokens' global positions, got "
                         f"{tuple(positions.shape)}")
    import torch.distributed as dist

    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    return {"positions": positions.to(device), "seq_len": t * cp}


def _init_weights(module: nn.Module) -> None:
    # GPT-2 style: small normal weights keep initial logits near uniform (loss ~ ln(vocab)).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample: shape ``(B,)`` from ``(B, T, V)`` and ``(B, T)``. A
    mixture-of-experts model's load-balancing term is added by the task (``_gpt_loss``), not here."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits (B, T, V) and targets (B, T), got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    b, t, v = logits.shape
    losses = F.cross_entropy(logits.reshape(b * t, v).float(), targets.reshape(b * t), reduction="none")
    return losses.view(b, t).mean(dim=1)


def param_count(model: nn.Module) -> int:
    """Number of distinct parameters (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters())
