"""The README's quickstart commands, run as written and in order (issue 8 item 2):
the quickstart, its rerun ("already finished"), the extension to 80 steps, `ckpt ls/verify/export`, and a
fresh start under a new run id. The first two run exactly as a new user types them (processes of their own,
no ``RAY_ADDRESS``): the quickstart starts a private local Ray, the rerun none ("already finished" is decided
before Ray). The later commands run their argv through click in the test's process (:func:`in_process`,
in the commands' directory): the runs on the session's local Ray, each a driver process's start cheaper (its
imports: ~5 CPU-s) and a private Ray's. The "Your own corpus" block: the prepare as typed (a process of its
own, its private Ray), the two runs through click on the session's Ray."""

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

from elastictrain.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The quickstart's `elastictrain` command (first bash block) and every `elastictrain` command of the
    block the README introduces as run by this test, in order (comments and `a && b` chains handled)."""
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    marker = text.index("tests/test_readme.py")
    follow = re.search(r"```bash\n(.*?)```", text[marker:], flags=re.S).group(1)
    out = []
    for line in (first + "\n" + follow).splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words[:1] == ["elastictrain"]:
                out.append(words[1:])
    return out


def _as_typed(args: list[str], cwd: Path) -> str:
    """``elastictrain ARGS`` as a user types it: a process of its own in ``cwd``, without ``RAY_ADDRESS`` (a run
    starts its private local Ray, as a first run does). Exit 0, no traceback; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "elastictrain", *args], cwd=cwd, text=True, capture_output=True,
                       timeout=600, env=env)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    return r.stdout


# ``Trainer.fit`` as elastictrain defines it (taken at import, before tests/conftest.py's autouse guard wraps it
# for each test): the README's jobs run with the defaults their files leave (the commands as written), not
# with the suite's BASE_JOB, so the guard for the suite's own specs (tests/base_workers.py) is not theirs.
_FIT = Trainer.fit


def in_process(args: list[str], cwd: Path) -> str:
    """``elastictrain ARGS`` through click's runner in this process, in ``cwd``: the same argv, exit code and
    output, without a process's imports (torch, Ray: ~5 CPU-s). A run connects to the Ray this process has
    (the session's: ``ray_local``), as with ``RAY_ADDRESS``; a relative path (``./checkpoints``,
    ``./prepared``, ``--run-dir``) is resolved on the driver against ``cwd``, as in a process of its own.
    Exit 0 (an exception is raised: no traceback is swallowed); its stdout."""
    from click.testing import CliRunner

    from elastictrain.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setattr(Trainer, "fit", _FIT)
        r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, (args, r.output[-2000:])
    return r.stdout


@pytest.mark.slow  # the quickstart and its rerun as typed (the quickstart on a private local Ray)
def test_readme_commands_are_true(tmp_path, ray_local):
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["run", "jobs/tiny_gpt.yaml"]] * 3 + [
        ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "export"], ["run", "jobs/tiny_gpt.yaml"]], commands
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    outputs = [_as_typed(commands[0], tmp_path)]  # the quickstart: a private local Ray
    outputs.append(_as_typed(commands[1], tmp_path))  # the rerun, as typed: no Ray at all
    for args in commands[2:]:  # the extension, `ckpt ls/verify/export`, the fresh start: in order, in process
        outputs.append(in_process(args, tmp_path))
    assert "run tiny_gpt already finished at step 60 from checkpoint" in outputs[1]
    demo = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert demo["final_step"] == 80 and demo["run_id"] == "tiny_gpt"
    assert [ln.split()[0] for ln in outputs[3].splitlines()[1:]] == ["40", "60", "80"]
    assert outputs[4].startswith("OK") and (tmp_path / "model.pt").is_file()
    assert "elastictrain: finished step 60" in outputs[-1], outputs[-1]
    fresh = sorted((tmp_path / "checkpoints").iterdir())
    assert [p.name for p in fresh][0] == "tiny_gpt" and len(fresh) == 2 and fresh[1].name.startswith("tiny_gpt-")


def _block_after(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(heading):], flags=re.S).group(1)


def test_readme_parallel_plan_commands_are_valid_jobs() -> None:
    """The "Parallel plans" commands, as written, make valid jobs (keys, values and world sizes; cheap: no
    Ray). Each plan's training is tested elsewhere (tests/test_parallel.py and the recovery suites)."""
    from elastictrain.config import load_config

    commands = [shlex.split(line, comments=True) for line in _block_after("### Parallel plans").splitlines()]
    runs = [words[2:] for words in commands if words[:2] == ["elastictrain", "run"]]
    assert len(runs) == 3, runs
    plans = []
    for args in runs:
        overrides = [args[i + 1] for i, word in enumerate(args) if word == "--set"]
        config = load_config(ROOT / args[0], overrides)
        plans.append((config.parallel.plan, config.parallel.reshard_after_forward, config.workers.max))
    assert plans == [("fsdp", True, 2), ("fsdp", False, 2), ("hsdp", True, 4)], plans


def test_readme_runtime_env_json_sets_the_run_id() -> None:
    """The `ray job submit --runtime-env-json '...'` line of "Resubmitting continues the run" is valid JSON
    whose env_vars give the run id it promises (tests/test_job_submit.py submits jobs that way)."""
    from elastictrain.config import build_config
    from elastictrain.jobenv import resolve_run_id

    text = (ROOT / "README.md").read_text()
    (raw,) = re.findall(r"--runtime-env-json '([^']+)'", text)
    env = json.loads(raw)
    assert resolve_run_id(build_config({"name": "n"}), env["env_vars"]).stable_id == "my-run"


def test_readme_report_command(raised_run, tmp_path) -> None:
    """`elastictrain report RUN_DIR [--out FILE] [--no-png]` on a finished run: the page is written where
    --out says, one line names it (a RUN_DIR that is no run: tests/test_cli_input.py)."""
    from click.testing import CliRunner

    from elastictrain.cli import main

    out = tmp_path / "page.html"  # the argv through click in this process: a subprocess's imports less
    r = CliRunner().invoke(main, ["report", str(raised_run.dir), "--out", str(out), "--no-png"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and r.stdout.strip() == f"elastictrain: html {out}", r.output
    assert out.stat().st_size > 0 and not out.with_suffix(".png").exists()


def prepare_commands() -> list[list[str]]:
    """The `elastictrain` commands of the README's "Your own corpus" block."""
    text = (ROOT / "README.md").read_text()
    marker = text.index("test_readme_prepare_then_run")
    block = re.search(r"```bash\n(.*?)```", text[marker:], flags=re.S).group(1)
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines()
            if shlex.split(line, comments=True)[:1] == ["elastictrain"]]


@pytest.mark.slow  # a prepare on Ray Data (a private local Ray), then two runs (the session's)
def test_readme_prepare_then_run(tmp_path, ray_local):
    """The README's prepare -> run block as written: one prepare with a tokenizer trained here, then the tiny
    GPT's and the built-in Llama's jobs on it, each to its last step (on the manifest's 300 ids: a model of the
    byte vocabulary would fail at its first id past 255). The prepare as typed, a process of its own that
    starts its private local Ray: on the session's, each of its 4 tasks would start a worker process that
    preloads torch (the session's Ray preloads the worker actor's module), dearer than a Ray start. The runs
    through click in this process (:func:`in_process`), on the session's Ray, whose workers run in the pytest
    process's directory, not the commands': the jobs' relative ``task.data.source: ./prepared`` is made
    absolute on the driver (elastictrain/jobenv.py)."""
    from tests.test_prepared_data import _corpus, _tokenizer

    commands = prepare_commands()
    assert [c[:2] for c in commands] == [["data", "prepare"], ["run", "jobs/prepared_gpt.yaml"],
                                         ["run", "jobs/prepared_llama.yaml"]], commands
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    _corpus(tmp_path / "corpus")
    _tokenizer(tmp_path / "tokenizer.json")
    outputs = [_as_typed(commands[0], tmp_path)]
    outputs += [in_process(args, tmp_path) for args in commands[1:]]
    assert "elastictrain: prepared prepared/: train" in outputs[0] and "vocab 300" in outputs[0]
    assert "elastictrain: finished step 40" in outputs[1] and "elastictrain: finished step 20" in outputs[2]
    for name, last in (("prepared_gpt", 40), ("prepared_llama", 20)):
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "step"][-1] == last, run_dir
