"""Module-level task parts for tests/test_parallel.py (Ray workers import them by name), and the in-process
one-worker reference its layouts are compared with."""

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


class InProcessRun:
    """The uninterrupted math of a job on one worker, trained in the test's own process: the worker's
    StepRunner on a one-rank gloo group, seeded as a worker seeds it, ``train.steps`` steps. A reference
    for runs on Ray (what a one-worker run on Ray would compute, without a worker process to start); it
    answers ``losses()`` and ``final_params()`` as :class:`tests.conftest.Run` does."""

    def __init__(self, spec: dict, task=None) -> None:
        import torch
        import torch.distributed as dist

        from elastictrain import build_config
        from elastictrain.parallel.plan import resolve, spec_from_config
        from elastictrain.task import builtin_task
        from elastictrain.worker.faults import FaultInjector
        from elastictrain.worker.loop import StepRunner

        cfg = build_config(spec)
        if cfg.workers.max != 1:
            raise ValueError("an in-process reference is a one-worker job")
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, int(cfg.workers.cpus_per_worker)))  # as a worker does
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            runner = StepRunner(task or builtin_task(cfg), cfg.train, FaultInjector(()),
                                audit=cfg.train.audit_samples, parallel=cfg.parallel)
            runner.attach(0, 1, 0, resolve(spec_from_config(cfg), 1))
            if runner.uninitialized:
                runner.init_from_seed()
            records = [runner.run_step(False)[0] for _ in range(cfg.train.steps)]
            self._losses = {i: r.loss for i, r in enumerate(records, 1)}
            self._params = runner.state.full_model_state()
        finally:
            dist.destroy_process_group()
            torch.set_num_threads(threads)

    def losses(self) -> dict[int, float]:
        return dict(self._losses)

    def final_params(self) -> dict:
        return self._params
