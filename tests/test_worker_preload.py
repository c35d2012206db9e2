"""The private local Ray of ``elastictrain run`` starts its worker processes with the worker actor's module
already imported (Ray's ``preload_python_modules``), so an actor placed on a pre-started process skips the
imports (torch, DTensor, DCP: most of a worker's start). Checked in the worker process itself: no timing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastictrain.trainer import WORKER_PRELOAD_MODULES, local_ray_system_config

PROBE = """
import sys, ray
from elastictrain.trainer import Trainer
Trainer({"name": "preload-probe"}, console=None, run_dir=sys.argv[1])._init_ray()

@ray.remote(num_cpus=0)
def imported(names):
    import sys
    return [n in sys.modules for n in names]

print("IMPORTED", ray.get(imported.remote(list(sys.argv[2:]))))
ray.shutdown()
"""


def test_config_names_the_worker_actor_module() -> None:
    assert local_ray_system_config() == {"preload_python_modules": ["elastictrain.worker.actor"]}


def test_local_ray_workers_have_the_worker_module_imported_before_any_work(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "run"), *WORKER_PRELOAD_MODULES],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORTED [True]" in proc.stdout, proc.stdout + proc.stderr[-2000:]
