"""Module-level task parts for tests/test_parallel.py (Ray workers import them by name)."""

from __future__ import annotations


class HFGPT2:
    """A model with the shape of Hugging Face's GPT-2 (GPT2LMHeadModel, tied embeddings), tiny."""

    def __call__(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg)


def hf_loss(model, batch, sample_seeds):  # noqa: ARG001 - no dropout, so no per-sample randomness
    from elastictrain.models.gpt import per_sample_loss

    return per_sample_loss(model(input_ids=batch["input"]).logits, batch["target"])
