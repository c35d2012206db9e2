"""``elastictrain plan`` as a user runs it: the README's commands as written (real subprocesses, once), the
JSON contract, bad input as one line with exit 2, and ``--calibrate`` writing figures a job can name (the
rest in-process through click's runner: each subprocess pays torch's import)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from elastictrain.cli import main

ROOT = Path(__file__).resolve().parents[1]


def readme_plan_commands() -> list[list[str]]:
    """Every ``elastictrain plan`` line of the README's "Planning a layout" block, as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Planning a layout"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [shlex.split(line, comments=True)[2:] for line in block.splitlines()
            if shlex.split(line, comments=True)[:2] == ["elastictrain", "plan"]]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's plan commands run in order in a copy of jobs/ (no Ray address: this machine)."""
    cwd = tmp_path_factory.mktemp("readme_plan")
    shutil.copytree(ROOT / "jobs", cwd / "jobs")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    runs = []
    for args in readme_plan_commands():
        proc = subprocess.run([sys.executable, "-m", "elastictrain", "plan", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=300, env=env)
        runs.append((args, proc))
    return cwd, runs


def plan(*args: str):  # noqa: ANN201
    return CliRunner().invoke(main, ["plan", "jobs/tiny_gpt.yaml", *args], catch_exceptions=False)


def test_readme_plan_commands_are_true(readme_run):
    cwd, runs = readme_run
    assert len(runs) == 4 and "--calibrate" in runs[3][0] and "--json" in runs[1][0]
    for args, proc in runs:
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
    assert " wins: predicted " in runs[0][1].stdout and "this job's layout (ddp 2" in runs[0][1].stdout
    rows = json.loads(runs[1][1].stdout)
    assert rows and rows[0]["fits"]
    big = runs[2][1].stdout
    assert "64 node(s) x 8 GPUs" in big and "world size 512" in big and " wins: predicted " in big
    assert (cwd / "calibration.json").is_file() and "calibration written to calibration.json" in runs[3][1].stdout


def test_json_is_ranked_best_first_with_the_documented_keys(monkeypatch):
    monkeypatch.chdir(ROOT)
    out = plan("--json", "--nodes", "2", "--gpus-per-node", "4", "--set", "train.global_batch=64",
               "--set", "task.model.n_layer=4")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    for key in ("dp_replicate", "dp_shard", "tp", "pp", "memory_per_gpu_bytes", "step_time_s", "fits"):
        assert all(key in r for r in rows), key
    assert all(r["dp_replicate"] * r["dp_shard"] * r["tp"] * r["pp"] == 8 for r in rows)
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting) and len(fitting) == len(rows)
    assert {r["pp"] for r in rows} >= {1, 2, 4}  # pipelines are priced
    assert all(r["comm_cpu_s"] == 0.0 for r in rows)  # GPUs: NCCL's bytes are no host work


def test_a_model_that_does_not_fit_anywhere_is_refused_with_its_shortfall(monkeypatch):
    monkeypatch.chdir(ROOT)
    out = plan("--json", "--shape", "params=70e9", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "80")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert rows and not any(r["fits"] for r in rows)
    assert rows[0]["shortfall_bytes"] > 1e12
    assert rows[0]["shortfall_bytes"] == pytest.approx(rows[0]["memory_per_gpu_bytes"] - 80 * 2**30, abs=2)
    text = plan("--shape", "params=70e9", "--nodes", "1", "--gpus-per-node", "1").stdout
    assert "does not fit" in text and "short by" in text and "None of the" in text


@pytest.mark.parametrize("args,needle", [
    (["--nodes", "0"], "--nodes must be positive, got 0"),
    (["--shape", "layers=two"], "--shape 'layers=two': layers='two' is not a number"),
    (["--set", "task.kind=python", "--set", "task.entry=examples.hf_causal_lm:make_task"], "brings its own model"),
    (["--calibration", "missing.json"], "calibration file missing.json not found"),
    (["--set", "parallel.plan=zero"], "parallel.plan"),
])
def test_bad_input_is_one_line_and_exit_2(monkeypatch, args, needle):
    monkeypatch.chdir(ROOT)
    out = plan(*args)
    assert out.exit_code == 2, out.output
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_calibrated_figures_are_what_the_plan_prices_with(readme_run, monkeypatch, tmp_path):
    cwd, _ = readme_run
    figures = json.loads((cwd / "calibration.json").read_text())
    assert figures["flops"] > 1e8 and figures["intra_node_bw"] > 1e6 and figures["runtime_bytes"] > 50e6
    assert figures["inter_node_bw"] is None  # one machine, no Ray: nothing across nodes to measure
    assert figures["device_memory"] is None  # CPU workers: their share of the node is the planner's to divide
    # measured with a node's workers at once: the job's block and optimizer, a call between computes
    assert figures["ranks"] == max(2, os.cpu_count()) and figures["cores_per_node"] == os.cpu_count()
    assert figures["optimizer_s_per_param"] > 0 and figures["latency_s"] > 0
    assert "call_s" in figures and (figures["call_s"] is None or figures["call_s"] > 0)  # None: lost in the load
    # tensor parallel's prices: a DTensor redistribution between computes, DTensor's dispatch per op (CPU time);
    # FSDP2's host work per parameter tensor and micro-batch (CPU time); gloo's CPU per byte moved. Each was
    # measured and says how: a mean of samples, or None only when that mean was lost in the noise of a loaded
    # machine (<= 0) -- never None for want of samples, and not all of them None
    how = figures["how"]
    for key in ("tp_call", "dtensor_op", "fsdp_param", "gloo_byte"):
        value, said = figures[f"{key}_s"], how.get(key, "")
        assert "samples within" in said, (key, value, said)
        assert (value is None and "lost in the noise" in said) or (value is not None and value > 0), (key, value, said)
    probes = [figures[k] for k in ("call_s", "tp_call_s", "dtensor_op_s", "fsdp_param_s", "gloo_byte_s")]
    assert any(v is not None for v in probes), figures
    # a job naming the file prices with it: halving the measured matmul rate doubles the compute time
    (tmp_path / "slow.json").write_text(json.dumps(dict(figures, flops=figures["flops"] / 2)))
    monkeypatch.chdir(ROOT)
    a = json.loads(plan("--json", "--set", f"parallel.calibration={cwd / 'calibration.json'}").stdout)
    b = json.loads(plan("--json", "--set", f"parallel.calibration={tmp_path / 'slow.json'}").stdout)
    assert b[0]["compute_s"] == pytest.approx(2 * a[0]["compute_s"])
    assert a[0]["memory"]["runtime"] == int(figures["runtime_bytes"])
    (tmp_path / "bad.json").write_text('{"flops": -1}')
    out = plan("--calibration", str(tmp_path / "bad.json"))
    assert out.exit_code == 2 and "not positive numbers" in out.stderr


# A described cluster: what fits then does not depend on this machine's free memory, nor on whether this
# process has a Ray up (the session's, or none: the CLI describes the cluster Ray sees when one is)
CLUSTER_2X40 = ("--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "40")


def test_a_python_task_is_planned_from_parallel_model_shape(monkeypatch):
    monkeypatch.chdir(ROOT)
    out = plan("--json", "--set", "task.kind=python", "--set", "task.entry=examples.hf_causal_lm:make_task",
               "--set", "parallel.model_shape=layers=12,hidden=768,heads=12,seq_len=1024,vocab=50257",
               "--world", "2", *CLUSTER_2X40)
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert rows[0]["fits"] and rows[0]["memory"]["params"] > 124e6 * 4 / 2 * 0.9  # GPT-2 small, fp32


def test_a_ray_address_where_nothing_answers_is_one_line_and_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "elastictrain", "plan", "jobs/tiny_gpt.yaml", "--ray-address",
                           "127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "cannot reach a Ray cluster at '127.0.0.1:1'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
