"""The private local Ray of ``elastictrain run`` starts its worker processes with the worker actor's module
already imported (Ray's ``preload_python_modules``), so an actor placed on a pre-started process skips the
imports (torch, DTensor, FSDP: most of a worker's start). Checked in two links, no timing: ``Trainer._init_ray``
starts its private Ray with ``local_ray_system_config()``, and a worker process of a Ray started with that
system config (the session's local Ray, tests/conftest.py) has the module imported before it does any work."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import ray

from elastictrain.trainer import WORKER_PRELOAD_MODULES, Trainer, local_ray_system_config

# The probe below is shipped by value: a worker importing this test module (and what it imports) could import
# the very module it looks for.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_config_names_the_worker_actor_module() -> None:
    config = local_ray_system_config()
    assert config["preload_python_modules"] == ["elastictrain.worker.actor"]
    assert config["enable_worker_prestart"] is False


def test_trainer_starts_its_private_local_ray_with_that_config(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `elastictrain run` process
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: calls.append({"args": args, **kwargs}))
    Trainer({"name": "preload-probe"}, console=None, run_dir=tmp_path / "run")._init_ray()
    (call,) = calls
    assert call["address"] == "local" and not call["args"]
    assert call["_system_config"] == local_ray_system_config()


@ray.remote(num_cpus=0)
def _imported(names: list[str]) -> list[bool]:
    import sys

    return [n in sys.modules for n in names]


def test_local_ray_workers_have_the_worker_module_imported_before_any_work(ray_local) -> None:
    # A runtime env of its own: Ray starts a worker process for this probe alone, one that has run nothing
    # before (the session's task workers may have imported anything while working for other tests).
    fresh = {"env_vars": {"ELASTICTRAIN_PRELOAD_PROBE": uuid.uuid4().hex}}
    names = list(WORKER_PRELOAD_MODULES)
    assert ray.get(_imported.options(runtime_env=fresh).remote(names), timeout=300) == [True] * len(names)


def test_the_worker_actor_module_imports_without_garbage_collection() -> None:
    """Every worker process imports the worker actor's module (the preload above): no garbage collection
    runs during its imports (torch, DTensor, FSDP; collections there freed nothing and cost a quarter of
    their CPU: docs/perf/2026-11-28-suite-time.md), and collection is on again once it is imported. In a
    fresh interpreter a gc callback counts the collections that start while the module's imports run: after
    its first statements (``_GC_WAS_ON`` set) and before its last import (``broadcast_state``)."""
    import subprocess

    probe = ("import gc, sys\n"
             "seen = []\n"
             "def during(phase, info):\n"
             "    actor = sys.modules.get('elastictrain.worker.actor')\n"
             "    if phase == 'start' and hasattr(actor, '_GC_WAS_ON') and not hasattr(actor, 'broadcast_state'):\n"
             "        seen.append(info['generation'])\n"
             "gc.callbacks.append(during)\n"
             "import elastictrain.worker.actor\n"
             "gc.callbacks.clear()\n"
             "print(len(seen), gc.isenabled())\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "True"], out.stdout


# What a worker's start must not import: each is imported where it is used (DCP where a state is saved, loaded
# or synced; pipelining for pp > 1; the Hugging Face and Arrow stacks for those models and data; s3fs for
# s3:// paths). DTensor, FSDP2 and tensor parallel are not here: DDP's constructor imports torch._dynamo, which
# imports all three, so every worker pays for them anyway ("What a worker imports" in
# docs/perf/2026-11-28-suite-time.md).
_LAZY_AT_WORKER_START = ("torch.distributed.checkpoint", "torch.distributed.elastic",
                         "torch.distributed.pipelining", "transformers", "tokenizers", "safetensors", "pyarrow",
                         "s3fs")


def test_the_worker_actor_module_leaves_dcp_pipelining_and_hf_unimported() -> None:
    """Importing the worker actor's module (every worker process's preload) in a fresh interpreter leaves the
    heavy modules that only some runs use unimported (:data:`_LAZY_AT_WORKER_START`)."""
    import subprocess

    probe = ("import sys\n"
             "import elastictrain.worker.actor\n"
             f"print(' '.join(n for n in {_LAZY_AT_WORKER_START!r} if n in sys.modules) or 'none')\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["none"], f"imported at worker start: {out.stdout.strip()}"
