"""The sample audit of a finished run's events: every step 1..steps ran, and saw exactly the samples the
global cursor gives it (a step redone after a restore saw the same samples both times), whatever rank
reported it. Needs the run's ``train.audit_samples``."""

from __future__ import annotations

from typing import Any


def assert_cursor_audit(run: Any, steps: int, seq_len: int, global_batch: int, seed: int = 0) -> None:
    from elastictrain.data.cursor import step_sample_ids
    from elastictrain.data.datasets import TokenWindows, load_text_tokens

    n = len(TokenWindows(load_text_tokens("builtin:pydoc"), seq_len))
    seen: dict[int, list[int]] = {}
    for e in run.of("step"):
        ids = sorted(e["sample_ids"])
        assert ids == sorted(step_sample_ids(e["step"] - 1, global_batch, seed, n).tolist()), e["step"]
        assert seen.setdefault(e["step"], ids) == ids
    assert sorted(seen) == list(range(1, steps + 1))
