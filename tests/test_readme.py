"""The README's quickstart commands, run as written and in order (issue 8 item 2):
the quickstart, its rerun ("already finished"), the extension to 80 steps, `ckpt ls/verify/export`, and a
fresh start under a new run id (started right after the quickstart, beside the commands in between: they
do not touch its run). The first two run exactly as a new user types them (no ``RAY_ADDRESS``): the
quickstart starts a private local Ray, the rerun none ("already finished" is decided before Ray); the later
runs connect to the session's (``RAY_ADDRESS``), the commands unchanged, and `ckpt ls/verify/export` (no Ray,
no worker) run through click in the test's process. The "Your own corpus" block: the prepare on its private
Ray, the two runs on the session's."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _on_the_sessions_ray() -> dict[str, str]:
    """The environment of a command that runs on the session's local Ray (``RAY_ADDRESS``) instead of starting
    a private one: the README's commands as written, each a private Ray's start (its GCS, raylet and agents,
    ~3.5 s of CPU) cheaper. The quickstart itself still starts its own, as a user's first run does."""
    import os

    import ray

    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


@pytest.mark.slow  # the quickstart starts a private local Ray; the later runs use the session's
def test_readme_commands_are_true(tmp_path, ray_local, monkeypatch):
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["run", "jobs/tiny_gpt.yaml"]] * 3 + [
        ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "export"], ["run", "jobs/tiny_gpt.yaml"]], commands
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    session = _on_the_sessions_ray()

    def start(args: list[str], env: dict[str, str] | None = session) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "elastictrain", *args], cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    def finish(args: list[str], proc: subprocess.Popen) -> str:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (args, out[-2000:], err[-2000:])
        assert "Traceback" not in err, (args, err[-2000:])
        return out

    def in_process(args: list[str]) -> str:
        """A command that starts no Ray nor worker, run by click's runner in this process (in the commands'
        directory): the same argv and exit code, without a subprocess's imports (torch: seconds of CPU)."""
        from click.testing import CliRunner

        from elastictrain.cli import main

        monkeypatch.chdir(tmp_path)
        try:
            r = CliRunner().invoke(main, args, catch_exceptions=False)
        finally:
            monkeypatch.undo()
        assert r.exit_code == 0, (args, r.output[-2000:])
        return r.stdout

    private = {k: v for k, v in session.items() if k != "RAY_ADDRESS"}
    outputs = [finish(commands[0], start(commands[0], private))]  # the quickstart: a private local Ray
    # The fresh start (a new run id, its own run directory) touches nothing the commands between it and the
    # quickstart read or write: it runs beside them instead of after them (on the session's Ray, whose 4 CPUs
    # hold its 2 workers and the extension's).
    fresh_start = start(commands[-1])
    try:
        outputs.append(finish(commands[1], start(commands[1], private)))  # the rerun, as typed: no Ray at all
        outputs.append(finish(commands[2], start(commands[2])))  # the extension, on the session's Ray
        for args in commands[3:-1]:  # `ckpt ls/verify/export`: the same argv through click, in this process
            outputs.append(in_process(args))
    except BaseException:
        fresh_start.kill()
        fresh_start.communicate()
        raise
    outputs.append(finish(commands[-1], fresh_start))
    assert "run tiny_gpt already finished at step 60 from checkpoint" in outputs[1]
    demo = json.loads((tmp_path / "runs" / "demo" / "summary.json").read_text())
    assert demo["final_step"] == 80 and demo["run_id"] == "tiny_gpt"
    assert [ln.split()[0] for ln in outputs[3].splitlines()[1:]] == ["40", "60", "80"]
    assert outputs[4].startswith("OK") and (tmp_path / "model.pt").is_file()
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


@pytest.mark.slow  # a prepare on Ray Data (a private local Ray), then two `elastictrain run`s (the session's)
def test_readme_prepare_then_run(tmp_path, ray_local):
    """The README's prepare -> run block as written: one prepare with a tokenizer trained here, then the tiny
    GPT's and the built-in Llama's jobs on it, each to its last step (on the manifest's 300 ids: a model of the
    byte vocabulary would fail at its first id past 255). The runs on the session's Ray (``RAY_ADDRESS``),
    whose workers run in the pytest process's directory, not the commands': the jobs' relative
    ``task.data.source: ./prepared`` is made absolute on the driver (elastictrain/jobenv.py), a private Ray's
    start cheaper each. The prepare starts its private local Ray, as typed: on the session's,
    each of its 4 tasks would start a worker process that preloads torch (the session's Ray preloads the
    worker actor's module), dearer than a Ray start."""
    from tests.test_prepared_data import _corpus, _tokenizer

    commands = prepare_commands()
    assert [c[:2] for c in commands] == [["data", "prepare"], ["run", "jobs/prepared_gpt.yaml"],
                                         ["run", "jobs/prepared_llama.yaml"]], commands
    shutil.copytree(ROOT / "jobs", tmp_path / "jobs")
    _corpus(tmp_path / "corpus")
    _tokenizer(tmp_path / "tokenizer.json")
    session = _on_the_sessions_ray()
    private = {k: v for k, v in session.items() if k != "RAY_ADDRESS"}
    outputs = []
    for args in commands:
        r = subprocess.run([sys.executable, "-m", "elastictrain", *args], cwd=tmp_path, text=True,
                           capture_output=True, timeout=600, env=private if args[0] == "data" else session)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout[-2000:], r.stderr[-2000:])
        outputs.append(r.stdout)
    assert "elastictrain: prepared prepared/: train" in outputs[0] and "vocab 300" in outputs[0]
    assert "elastictrain: finished step 40" in outputs[1] and "elastictrain: finished step 20" in outputs[2]
    for name, last in (("prepared_gpt", 40), ("prepared_llama", 20)):
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "step"][-1] == last, run_dir
