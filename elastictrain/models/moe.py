"""A dropless mixture-of-experts feed-forward whose per-sample math does not depend on the layout.

Routing: a linear router (``d_model -> experts``, no bias), a float32 softmax, then each token's ``top_k``
experts by a STABLE descending sort (ties go to the lower expert index, the same on every rank and at any
batch size), gates renormalised over the chosen k. Dropless: there is no capacity factor, every token slot
reaches its expert, so a token's output is a function of the token and the weights only -- never of the
batch it shares, nor of how many ranks hold the experts (elastictrain/parallel/expert.py).

The experts are stacked ``[E, ...]`` parameters (sharding the experts over an ep group slices dim 0). The
expert MLP has the shape of the model's dense MLP: ``gelu`` (GPT: ``w_out(gelu(x w_in + b_in)) + b_out``) or
``swiglu`` (Llama: ``w2(silu(x w1) * x w3)``), run as grouped GEMMs in bf16 and as a loop otherwise
(:meth:`MoEFeedForward.run_experts`).

Load balance: the sequence-wise auxiliary loss of DeepSeek-V3, a function of ONE sample, so the loss contract
(a per-sample loss independent of how the batch is split) holds. For sample ``b`` with T tokens:
``f_i = (token slots of b routed to i) / (T k)``, ``P_i = mean_t p_{t,i}``, ``aux_b = coef * E * sum_i f_i P_i``
(1 * coef when perfectly balanced; ``f`` carries no gradient, ``P`` trains the router). After each forward a
layer holds ``aux_loss`` (``[B]``, in the graph) and ``tokens_per_expert`` (``[E]`` int64, this rank's
token slots per expert, detached); :func:`moe_aux_loss` and :func:`moe_token_counts` collect them.

Split tokens (ep x tp, elastictrain/parallel/expert_tp.py): with ``token_group`` set, each rank of that group
holds a disjoint slice of every sample's positions (``x`` is ``[B, T / tp, d]``). The per-sample statistics
(slot counts and summed router probabilities) are then summed over the group before ``f`` and ``P`` are
formed, so ``aux_loss`` is the whole sample's (the same value on every rank of the group: the sum's backward
is the identity, each rank's share of ``P`` gets the gradient of the one loss) and ``tokens_per_expert`` is
the whole micro-batch's, as one process counts them. With ``cp_group`` set too (cp x tp), the group's sums
are then summed over cp as below (the sample's other positions); ``tokens_per_expert`` stays the group's.

Context parallelism (``cp_group`` set by :func:`elastictrain.parallel.context.enable_context_parallel`): a
rank holds ``T / cp`` positions of each sample, so ``f`` and ``P`` are formed from the per-expert slot
counts and router-probability sums SUMMED over the cp group (one all-reduce of ``[B, 2E]`` floats) before
the loss: ``aux_b`` is then the sample's, the same value on every cp rank. Its gradient follows the cp
rule of :func:`elastictrain.parallel.context.cp_grad_scale`: ``cp`` times this rank's partial (the
one-process gradient through its own positions), so the mean over the dp x cp ranks is one process's.
"""

from __future__ import annotations

import weakref

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

__all__ = ["MoEConfig", "MoEFeedForward", "cp_sample_stats", "moe_aux_loss", "moe_layers", "moe_token_counts"]

Activation = Literal["gelu", "swiglu"]


@dataclass(frozen=True)
class MoEConfig:
    """``experts`` per MoE layer, ``top_k`` experts per token, every ``every``-th block's MLP an MoE (blocks
    ``every-1, 2*every-1, ...``: ``every: 1`` makes all of them MoE), ``aux_coef`` the load-balancing
    loss's weight. Raises ValueError naming the field, the value, the rule and the fix."""

    experts: int
    top_k: int
    every: int = 1
    aux_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "every"):
            value = getattr(self, name)
            try:
                number = -1 if isinstance(value, bool) else operator.index(value)
            except TypeError:
                number = -1
            if number < 1:
                raise ValueError(f"task.model.moe.{name}={value!r} must be a positive int; set it to 1 or more")
        if self.top_k > self.experts:
            raise ValueError(f"task.model.moe.top_k={self.top_k} exceeds task.model.moe.experts={self.experts} "
                             f"(each token picks top_k distinct experts); set top_k to at most {self.experts}")
        coef = self.aux_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not (coef >= 0 and math.isfinite(coef)):
            raise ValueError(f"task.model.moe.aux_coef={coef!r} must be a finite number >= 0; set it to e.g. 0.01 "
                             "(0 turns the load-balancing loss off)")

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (0-based) has an MoE feed-forward."""
        return (block + 1) % self.every == 0


class MoEFeedForward(nn.Module):
    """Router + ``experts`` stacked expert MLPs (``d_model -> hidden -> d_model``), dropless top-k routing.

    ``forward(x)`` takes ``[B, T, d_model]`` and returns the same shape. Without expert parallelism every
    expert is local; :func:`elastictrain.parallel.expert.enable_expert_parallel` keeps a slice of them and
    installs a dispatcher that sends token slots to the ranks owning their experts. Either way the expert
    outputs come back in slot order and are combined as ``sum_k gate_k * y_k`` in the same order, so the
    layouts differ only by the rounding of the expert matmuls on different row counts."""

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig, activation: Activation) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"MoEFeedForward activation={activation!r}: use 'gelu' (GPT) or 'swiglu' (Llama)")
        self.cfg, self.activation = cfg, activation
        self.d_model, self.hidden = d_model, hidden
        e = cfg.experts
        self.router = nn.Linear(d_model, e, bias=False)
        if activation == "gelu":
            self.w_in = nn.Parameter(torch.empty(e, d_model, hidden))
            self.b_in = nn.Parameter(torch.empty(e, hidden))
            self.w_out = nn.Parameter(torch.empty(e, hidden, d_model))
            self.b_out = nn.Parameter(torch.empty(e, d_model))
        else:
            self.w1 = nn.Parameter(torch.empty(e, d_model, hidden))
            self.w3 = nn.Parameter(torch.empty(e, d_model, hidden))
            self.w2 = nn.Parameter(torch.empty(e, hidden, d_model))
        # Which experts this module holds: [expert_offset, expert_offset + local_experts). Changed only by
        # enable_expert_parallel, which also sets ``dispatch`` (None: every expert is local).
        self.expert_offset, self.local_experts = 0, e
        self.dispatch: Callable[[MoEFeedForward, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # the ranks that split this layer's tokens by position (ep x tp: the tp group), None: not split
        self.token_group: ProcessGroup | None = None
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.cp_group: object = None  # context parallel: the load-balance statistics are summed over it
        self.reset_parameters()

    @property
    def expert_names(self) -> tuple[str, ...]:
        """The stacked ``[E, ...]`` parameters (sharded by expert parallelism; the router is dense)."""
        return ("w_in", "b_in", "w_out", "b_out") if self.activation == "gelu" else ("w1", "w3", "w2")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The experts' own parameters: normal(0.02) weights and zero biases (the dense MLP's init). The
        ``router`` is a child ``nn.Linear``, initialised by the model's rule for linears (the per-module
        contract of elastictrain/parallel/init.py). That module calls this on a one-expert copy, once per
        expert a rank holds, each under its own seed, so the values do not depend on the ep degree."""
        for name in self.expert_names:
            p = getattr(self, name)
            if name.startswith("b_"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts on ``x`` ``[N, d]`` grouped by local expert (``counts[j]`` rows for local expert j,
        in order). In bfloat16 (FSDP's bf16 parameters, or a bf16 autocast) one grouped GEMM per expert
        matmul (``torch._grouped_mm``, :func:`grouped_mm_applies`); otherwise a loop of dense matmuls. A
        sharded expert tensor (a DTensor ``Shard(0)`` over the ep mesh) is used through its local slice."""
        w = {name: _local(getattr(self, name)) for name in self.expert_names}
        if grouped_mm_applies(x, [w[n] for n in self.expert_names if not n.startswith("b_")]):
            return self._run_grouped(x, counts, w)
        return self._run_loop(x, counts, w)

    def _run_loop(self, x: torch.Tensor, counts: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
        outs = []
        start = 0
        for j, n in enumerate(counts):
            rows = x[start:start + n]
            start += n
            if self.activation == "gelu":
                h = F.gelu(rows @ w["w_in"][j] + w["b_in"][j])
                outs.append(h @ w["w_out"][j] + w["b_out"][j])
            else:
                outs.append((F.silu(rows @ w["w1"][j]) * (rows @ w["w3"][j])) @ w["w2"][j])
        return torch.cat(outs) if outs else x.new_zeros(0, self.d_model)

    def _run_grouped(self, x: torch.Tensor, counts: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
        # What grouped_mm_applies admitted: bf16 values, or a bf16 autocast. Each matmul casts its operands
        # to bf16 as autocast's does, and the biases are added in their own dtype, as in the loop.
        bf16 = torch.bfloat16
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=x.device, dtype=torch.int32)

        def mm(a: torch.Tensor, name: str) -> torch.Tensor:
            return torch._grouped_mm(a.to(bf16), w[name].to(bf16), offs=offs)

        def bias(h: torch.Tensor, name: str) -> torch.Tensor:
            # per expert, as the loop adds it: each bias's gradient is the same row sum (an indexed add
            # would accumulate it row by row, in bf16 under FSDP's bf16 parameters)
            return torch.cat([rows + w[name][j] for j, rows in enumerate(h.split(counts))])

        if self.activation == "gelu":
            return bias(mm(F.gelu(bias(mm(x, "w_in"), "b_in")), "w_out"), "b_out")
        return mm(F.silu(mm(x, "w1")) * mm(x, "w3"), "w2")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [B, T, E] float32, experts [B, T, k] int64, gates [B, T, k] float32)``: the softmax of the
        router, each token's top-k experts (stable sort: ties to the lower index) and renormalised gates."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
        experts = order[..., : self.cfg.top_k]
        chosen = probs.gather(-1, experts)
        return probs, experts, chosen / chosen.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        k, e = self.cfg.top_k, self.cfg.experts
        probs, experts, gates = self.route(x)
        slots = experts.reshape(-1)  # slot s = token s // k, its (s % k)-th choice
        if self.token_group is not None:
            self.aux_loss = self._split_aux_loss(probs, experts)
        else:
            counts = torch.bincount(slots, minlength=e)
            self.tokens_per_expert = counts.detach()
            # Per-sample load balance: f from the counts (no gradient), P the mean router probability.
            slots_per_expert = F.one_hot(experts.reshape(b, t * k), e).sum(dim=1).float()
            if self.cp_group is None:
                f, p = slots_per_expert / (t * k), probs.mean(dim=1)
            else:  # this rank's positions only: the sample's statistics are the sums over the cp ranks
                slots_per_expert, p_sum, whole = cp_sample_stats(slots_per_expert, probs.sum(dim=1), t,
                                                                 self.cp_group)
                f, p = slots_per_expert / (whole * k), p_sum / whole
            self.aux_loss = self.cfg.aux_coef * e * (f * p).sum(dim=-1)
        tokens = x.reshape(b * t, d).repeat_interleave(k, dim=0)  # one row per slot, slot order
        if self.dispatch is None:
            y = _local_dispatch(self, tokens, slots)
        else:
            y = self.dispatch(self, tokens, slots)
        out = (y.view(b * t, k, d) * gates.reshape(b * t, k, 1).to(y.dtype)).sum(dim=1)
        return out.view(b, t, d)


    def _split_aux_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The per-sample aux loss when ``token_group`` splits each sample's positions: this rank's slot
        counts and router probability sums per (sample, expert), summed over the group in one all-reduce
        (identity backward), then ``f`` and ``P`` of the whole sample. Sets ``tokens_per_expert``."""
        b, t, e = probs.shape
        k = self.cfg.top_k
        counts = F.one_hot(experts.reshape(b, t * k), e).sum(dim=1).to(probs.dtype)  # exact below 2**24
        stats = _SumOverGroup.apply(torch.cat([counts, probs.sum(dim=1)], dim=-1), self.token_group)
        counts, psum = stats[:, :e].detach(), stats[:, e:]
        self.tokens_per_expert = counts.sum(dim=0).round().to(torch.int64)  # (the group's: not over cp)
        if self.cp_group is not None:  # cp x tp: the cp ranks hold the sample's other positions (cp's rule)
            counts, psum, _ = cp_sample_stats(counts, psum, 0, self.cp_group)
        whole = counts.sum(dim=-1, keepdim=True) / k  # each sample's positions over the group (k slots each)
        return self.cfg.aux_coef * e * (counts / (whole * k) * (psum / whole)).sum(dim=-1)


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(SUM) over ``group`` whose backward is the identity: the sum feeds a loss that every rank
    of the group computes alike (replicated), so each rank's addend gets that loss's gradient once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def cp_sample_stats(slots: torch.Tensor, p_sum: torch.Tensor, t: int, group: object
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each sample's per-expert slot counts ``slots`` ``[B, E]`` (no gradient) and router-probability sums
    ``p_sum`` ``[B, E]`` over its ``t`` local positions, summed over the context-parallel ``group``: returns
    ``(slots, p_sum, T)`` of the whole samples (``T = t x cp``), the same values on every cp rank. One
    all-reduce of both. The gradient of the returned ``p_sum`` is ``cp`` times this rank's own
    (:func:`elastictrain.parallel.context.cp_grad_scale`: every cp rank's loss holds the whole sample's term,
    and the dp x cp mean of the gradients must be one process's)."""
    import torch.distributed as dist

    from elastictrain.parallel.context import cp_grad_scale

    cp = dist.get_world_size(group)
    e = slots.shape[-1]
    total = torch.cat([slots.detach(), p_sum.detach().to(slots.dtype)], dim=-1)
    dist.all_reduce(total, group=group)
    scaled = p_sum * cp_grad_scale(cp)
    p_total = total[:, e:].to(p_sum.dtype) + (scaled - scaled.detach())  # value: the sum; gradient: cp x own
    return total[:, :e], p_total, t * cp


def grouped_mm_applies(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """PURE (of dtypes, shapes and strides): does the experts' matmul run as one ``torch._grouped_mm`` (the
    grouped GEMM; fused kernels on CUDA, a correct one on CPU) rather than a loop? Where torch has the op,
    the matmul is in bfloat16 (the values are, or a bf16 autocast is on for ``x``'s device: the op takes
    bf16 only, and a loop would round to bf16 per matmul all the same), there are rows, and every operand's
    rows are 16-byte aligned (its last dimension a multiple of 8 bf16 values), as the kernels require."""
    if not hasattr(torch, "_grouped_mm") or x.dim() != 2 or x.shape[0] == 0:
        return False
    kind = x.device.type
    autocast = torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16
    if not autocast and not (x.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in weights)):
        return False
    return all(t.shape[-1] % 8 == 0 and t.is_contiguous() for t in (x, *weights))


def _local(p: torch.Tensor) -> torch.Tensor:
    # to_local is differentiable: the gradient comes back as a DTensor with the parameter's placements
    return p.to_local() if isinstance(p, DTensor) else p


def _local_dispatch(layer: MoEFeedForward, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Every expert local: group the slots by expert (stable), run, put the outputs back in slot order."""
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=layer.cfg.experts).tolist()
    y = layer.run_experts(tokens[order], counts)
    return torch.empty_like(y).index_copy(0, order, y)


# model -> its MoE layers: the loss asks after every micro-batch's forward, and walking every module of the
# model each time cost ~2% of a tiny model's step (most models have none)
_LAYERS: weakref.WeakKeyDictionary[nn.Module, dict[str, MoEFeedForward]] = weakref.WeakKeyDictionary()


def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """The MoE layers of ``model`` by qualified name (a wrapper's prefix included), found once per model
    object (a model's modules are fixed once built; wrappers are model objects of their own)."""
    found = _LAYERS.get(model)
    if found is None:
        found = _LAYERS[model] = {name: m for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}
    return found


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum over MoE layers of the last forward's per-sample auxiliary losses (``[B]``), None without
    MoE layers. Call right after the forward whose loss it joins."""
    losses = [m.aux_loss for m in moe_layers(model).values() if m.aux_loss is not None]
    return torch.stack(losses).sum(dim=0) if losses else None


def moe_token_counts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's token slots per expert (``[E]`` int64) in this rank's last forward (a layer whose
    ``token_group`` splits the tokens: the group's, summed over it). The step's global counts are their sum
    over the data-parallel ranks (one all_reduce of the stacked tensor)."""
    return {name: m.tokens_per_expert for name, m in moe_layers(model).items() if m.tokens_per_expert is not None}
