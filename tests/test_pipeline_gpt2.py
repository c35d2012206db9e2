"""A Hugging Face GPT-2 (``GPT2LMHeadModel``: ``lm_head.weight`` tied to ``transformer.wte.weight``) under pp2
through its pipeline hooks (examples/pipeline_gpt2.py) trains the numbers of one process and of ddp2, and its
checkpoint holds the tied weight once, as one process's does (issue 36 item 7).

The harness is tests/test_tensor_parallel.py's (the worker's StepRunner on real gloo ranks: every step's
loss, clipping norm and audited samples, the final parameters, the digest the ranks combine) and so is its
tolerance, for the reason tests/test_pipeline.py gives: the stages compute each sample with the operations
of one process (bitwise: the two stages' composition equals the whole model's logits exactly), only sums are
in another order (the tied gradient is the embedding's part plus the head's part summed in an all-reduce
instead of accumulated in one tensor; the clipping norm is a sum over stages; ddp2 averages over ranks):
1e-5 relative on losses and norms, 1e-4 absolute on parameters. Measured (3 steps): losses within 8.7e-8
relative, norms within 9.6e-8, parameters within 9.4e-7 absolute (pp2 and ddp2 alike). A broken build moves
them by far more (see the test's docstring).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

GPT2 = "examples.pipeline_gpt2:make_task"
FIRST, COPY = "transformer.wte.weight", "lm_head.weight"  # the tied tensor's names, the optimizer's key first


def _dcp_keys(path: str) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def _dcp_tensors(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The saved values of ``keys`` (one process, no group: DCP reads them into tensors of their shapes)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(out, checkpoint_id=path)
    return out


@pytest.mark.slow  # ~40-60 s under load: three processes import transformers
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the Hugging Face GPT-2 needs it")
def test_a_tied_hugging_face_gpt2_pp2_matches_one_process_and_ddp2(tmp_path):
    """On 2 gloo ranks: pp2 (1f1b) for 3 steps, saved, and ddp2 for 3 steps; in one process: 6 steps, 3
    steps, and 3 steps resumed from pp2's checkpoint. pp2 and ddp2 equal one process step by step (loss,
    clipping norm, audited samples) and in the final parameters; the digest the ranks combine is the
    gathered model's (each element of the tied weight counted once); ``lm_head.weight`` and
    ``transformer.wte.weight`` are one value; pp2's checkpoint holds the keys one process saves, the tied
    tensor's optimizer state once (under its first name) and one value under both names, and one process
    resuming it trains steps 4-6 of the uninterrupted run.

    Against a build that does not sum the tied gradient (parallel/tied.py ``sync_grads`` a no-op, this test
    run): each stage updates its copy with its own part of the gradient, and pp2's step-2 loss is off by
    2.4e-3 relative (5.3103 against 5.2974), 240 times the tolerance."""
    from tests.test_tensor_parallel import _matches, _run

    one_ckpt, pp_ckpt = str(tmp_path / "one"), str(tmp_path / "pp2")
    (tmp_path / "two").mkdir()
    (tmp_path / "ref").mkdir()
    pp2, ddp2 = _run(tmp_path / "two", 2, [{"_entry": GPT2, "pp": 2, "pp_schedule": "1f1b", "_save": pp_ckpt,
                                            "_digest": True},
                                           {"_entry": GPT2, "_digest": True}])
    ref6, ref3, resumed = _run(tmp_path / "ref", 1, [{"_entry": GPT2, "_steps": 6},
                                                    {"_entry": GPT2, "_save": one_ckpt},
                                                    {"_entry": GPT2, "_load": pp_ckpt}])
    _matches(pp2, ref3)
    _matches(ddp2, ref3)
    assert torch.equal(pp2["params"][COPY], pp2["params"][FIRST])  # one weight (two copies would drift apart)

    keys = _dcp_keys(pp_ckpt)
    assert keys == _dcp_keys(one_ckpt)
    assert {f"model.{FIRST}", f"model.{COPY}", f"optim.state.{FIRST}.exp_avg"} <= keys, sorted(keys)[:8]
    assert not any(k.startswith(f"optim.state.{COPY}") for k in keys)  # its optimizer state once
    saved = _dcp_tensors(pp_ckpt, [f"model.{FIRST}", f"model.{COPY}"])
    assert torch.equal(saved[f"model.{FIRST}"], saved[f"model.{COPY}"])
    assert torch.equal(saved[f"model.{FIRST}"], pp2["params"][FIRST])

    tail = {**ref6, "losses": ref6["losses"][3:], "norms": ref6["norms"][3:], "ids": ref6["ids"][3:]}
    _matches(resumed, tail)
