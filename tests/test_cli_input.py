"""Bad command-line input (issue 40 items 5 and 6): each case is one clear line naming the problem and the
fix, the documented exit code (README's Operations table), no traceback. Every case fails before Ray or
torch is needed, so each is one short ``python -m elastictrain`` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JOB = str(ROOT / "jobs" / "tiny_gpt.yaml")


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    import os

    proc = subprocess.run([sys.executable, "-m", "elastictrain", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def _one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and len(lines) == 1, output[-3000:]
    return lines[0]


def _checkpoint(root: Path) -> Path:
    from tests.checkpoint_fixtures import trained

    from elastictrain.checkpoint import CheckpointStore, CheckpointWriter, app_state
    from elastictrain.config import CheckpointConfig

    store = CheckpointStore(str(root), key=None)
    writer = CheckpointWriter(CheckpointConfig(when_busy="wait"), str(root), 0, 1, None)
    try:
        model, opt = trained()
        assert writer.save_async(1, app_state(model, opt))
        (report,) = writer.wait(30)
        store.commit(1, [report], {"world_size": 1})
    finally:
        writer.close()
    return root / "step_000000001"


def test_bad_cli_input_is_one_line_and_its_exit_code(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        # (argv, exit code, words the line must hold)
        (["run", JOB, "--set", "train.steps=[1"], 2, ["--set 'train.steps=[1'", "not valid YAML", "line 1"]),
        (["run", JOB, "--set", "train.steps"], 2, ["expected dotted.key=value"]),
        (["run", str(empty)], 2, ["empty.yaml", "the job file is empty"]),
        (["run", JOB, "--run-dir", str(a_file)], 2, ["--run-dir", "is a file, not a directory"]),
        (["report", str(tmp_path / "missing")], 2, ["missing does not exist", "--run-dir of a run"]),
        (["report", str(tmp_path)], 2, ["no events.jsonl"]),
    ]
    for argv, code, words in cases:
        rc, out = _cli(*argv)
        line = _one_line(out)
        assert rc == code and all(w in line for w in words), (argv, rc, out)


def test_ckpt_export_of_an_entry_the_checkpoint_lacks_names_the_entries(tmp_path: Path) -> None:
    step = _checkpoint(tmp_path / "ck")
    rc, out = _cli("ckpt", "export", str(step), "--key", "nope", "--out", str(tmp_path / "o.pt"))
    line = _one_line(out)
    assert rc == 2 and "no 'nope' entry" in line and "model, optim" in line, out
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("how", ["file", "set", "env"])
def test_run_id_must_be_one_path_component(tmp_path: Path, how: str) -> None:
    """``../other`` would point resume and retention (which deletes) at another run's checkpoints."""
    job = tmp_path / "job.yaml"
    job.write_text(f"name: mine\n{'run_id: ../other' if how == 'file' else ''}\n")
    # an address where nothing answers: a build that let the id through stops there, not after a run
    argv = ["run", str(job), "--run-dir", str(tmp_path / "rd"), "--ray-address", "127.0.0.1:9"] + (["--set", "run_id=../other"] if how == "set" else [])
    rc, out = _cli(*argv, env={"ELASTICTRAIN_RUN_ID": "../other"} if how == "env" else None)
    line = _one_line(out)
    assert rc == 2 and "run_id" in line and "../other" in line and "letters, digits" in line, out
    assert not (tmp_path / "rd").exists()
