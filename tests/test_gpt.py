"""Tests of the tiny GPT: per-sample deterministic dropout, gradient equivalence, loss and config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elastictrain.models.gpt import (
    GPT,
    GPTConfig,
    SampleDropout,
    dropout_seed,
    param_count,
    per_sample_loss,
    sample_seed,
    sample_seeds,
)

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.2)


def _model(cfg: GPTConfig = CFG) -> GPT:
    torch.manual_seed(1234)
    return GPT(cfg)


def _inputs(batch: int, cfg: GPTConfig = CFG, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)


def test_sample_seeds_at_once_are_each_ids_sample_seed() -> None:
    """The vectorised seeds (what the step loop feeds the model) are the scalar hash of every id, across the
    whole id range (top bits set) and for seeds and steps whose running hash has its 64th bit set."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        seed, step = rng.randrange(2**40), rng.randrange(2**31)
        ids = [rng.randrange(2**63) for _ in range(rng.randrange(0, 9))] + [0, 2**63 - 1, 2**64 - 1]
        assert sample_seeds(seed, step, ids).tolist() == [sample_seed(seed, step, i) for i in ids]
    with pytest.raises(ValueError, match="sample_id must be a non-negative int"):
        sample_seeds(0, 0, [3, -1])


def test_sample_seed_is_pure_63_bit_and_distinct() -> None:
    a = sample_seed(1, 2, 3)
    assert a == sample_seed(1, 2, 3)
    assert 0 <= a < 2**63
    seeds = {sample_seed(s, t, i) for s in range(3) for t in range(10) for i in range(50)}
    assert len(seeds) == 3 * 10 * 50
    assert sample_seeds(1, 2, [3, 4]).tolist() == [a, sample_seed(1, 2, 4)]
    assert dropout_seed(a, 0) != dropout_seed(a, 1)
    import numpy as np

    assert sample_seed(1, 2, np.int64(3)) == a
    with pytest.raises(ValueError, match="step"):
        sample_seed(1, -1, 0)
    with pytest.raises(ValueError, match="sample_id"):
        sample_seed(1, 2, 3.0)  # type: ignore[arg-type]


def test_dropout_of_a_sample_does_not_depend_on_its_batch() -> None:
    model = _model().train()
    x = _inputs(4)
    ids = [17, 3, 42, 8]
    step = 5
    alone = model(x[2:3], sample_seeds(0, step, [ids[2]]))
    # Same sample at another position in a bigger batch (reversed order).
    batch = model(x.flip(0), sample_seeds(0, step, ids[::-1]))
    torch.testing.assert_close(alone[0], batch[1], rtol=1e-5, atol=1e-6)
    # Dropout is really active: the training output differs from the deterministic eval output.
    with torch.no_grad():
        plain = model.eval()(x[2:3])
    assert not torch.allclose(alone, plain, atol=1e-4)


def test_dropout_changes_with_step_and_sample_id() -> None:
    model = _model().train()
    x = _inputs(1)
    base = model(x, sample_seeds(0, 5, [17]))
    assert not torch.allclose(base, model(x, sample_seeds(0, 6, [17])), atol=1e-4)
    assert not torch.allclose(base, model(x, sample_seeds(0, 5, [18])), atol=1e-4)
    assert not torch.allclose(base, model(x, sample_seeds(1, 5, [17])), atol=1e-4)
    torch.testing.assert_close(base, model(x, sample_seeds(0, 5, [17])), rtol=0, atol=0)


def test_eval_mode_and_missing_seeds_are_deterministic() -> None:
    model = _model()
    x = _inputs(3)
    seeds = sample_seeds(0, 1, [0, 1, 2])
    model.eval()
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(model(x, seeds), ref, rtol=0, atol=0)
        model.train()
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


def test_dropout_global_rng_is_untouched() -> None:
    model = _model().train()
    torch.manual_seed(99)
    before = torch.get_rng_state()
    model(_inputs(2), sample_seeds(0, 0, [0, 1]))
    assert torch.equal(before, torch.get_rng_state())


def test_micro_batches_give_the_same_gradient() -> None:
    model = _model().train()
    x, y = _inputs(4, seed=1), _inputs(4, seed=2)
    seeds = sample_seeds(7, 3, [5, 9, 1, 30])

    model.zero_grad()
    per_sample_loss(model(x, seeds), y).sum().backward()
    full = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    for part in (slice(0, 2), slice(2, 4)):
        per_sample_loss(model(x[part], seeds[part]), y[part]).sum().backward()
    for name_param, g_full in zip(model.named_parameters(), full, strict=True):
        name, param = name_param
        torch.testing.assert_close(param.grad, g_full, rtol=1e-5, atol=1e-7, msg=name)


def test_sample_dropout_rate_and_scale() -> None:
    drop = SampleDropout(0.25, site=3).train()
    out = drop(torch.ones(2, 100, 100), torch.tensor([11, 12], dtype=torch.int64))
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.75))
    assert not torch.equal(kept[0], kept[1])


def test_per_sample_loss_matches_cross_entropy() -> None:
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    losses = per_sample_loss(logits, targets)
    assert losses.shape == (3,)
    for b in range(3):
        torch.testing.assert_close(losses[b], F.cross_entropy(logits[b], targets[b]))
    with pytest.raises(ValueError, match="targets"):
        per_sample_loss(logits, targets[:, :4])


def test_initial_loss_is_near_uniform_and_shapes() -> None:
    model = _model().eval()
    x = _inputs(2)
    logits = model(x)
    assert logits.shape == (2, CFG.seq_len, CFG.vocab_size)
    loss = per_sample_loss(logits, x).mean().item()
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.2
    assert model(x[:, :5]).shape == (2, 5, 256)


def test_forward_rejects_bad_inputs() -> None:
    model = _model()
    with pytest.raises(ValueError, match="exceeds GPTConfig.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="sample_seeds"):
        model(_inputs(2), torch.tensor([1], dtype=torch.int64))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 4))


def test_config_validation_and_param_count() -> None:
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    cfg = GPTConfig()
    d, v, t = cfg.d_model, cfg.vocab_size, cfg.seq_len
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = v * d + t * d + cfg.n_layer * block + 2 * d + d * v
    assert param_count(GPT(cfg)) == expected
