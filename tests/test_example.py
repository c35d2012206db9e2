"""examples/custom_task.py runs end to end on 2 workers and learns (without the standby process and the peer
tier's keeper, which the example's defaults start and its promise is not about: two process starts less,
as tests/conftest.py's BASE_JOB)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from elastictrain.events import read_events

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_task_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_task_example_learns(ray_local, tmp_path: Path) -> None:
    example = _load_example()
    result = example.main(steps=20, run_dir=tmp_path / "run", console=None, workers={"standby": False, "reuse": True},
                          checkpoint={"memory_every_steps": 0})
    assert result.ok, result.summary
    assert result.summary["final_step"] == 20
    losses = [e["loss"] for e in read_events(result.run_dir) if e["event"] == "step"]
    assert len(losses) == 20
    assert losses[-1] < 0.5 * losses[0], losses
    assert (result.run_dir / "summary.json").is_file()
    started = [e for e in read_events(result.run_dir) if e["event"] == "worker_started"]
    assert len(started) == 2 and result.summary["world_size_history"][0]["world_size"] == 2, started
