"""A GPU worker's NCCL settings (issue 36 item 5: hangs on NCCL end, the flight recorder is on), set before its
first process group by ``worker/actor.py``'s ``_nccl_environment``. Pure: it only sets environment variables
(no GPU needed to check them; what NCCL does with them needs two GPUs and has not run: docs/design.md)."""

from __future__ import annotations

import os
import tempfile


def test_async_error_handling_is_3_whatever_ray_set_and_the_flight_recorder_dumps_into_the_run_folder(
        tmp_path, monkeypatch) -> None:
    """``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 3 even where Ray set 1 (it does when unset: 1 may hang in the
    abort, 0 waits forever, and the recorder needs 3); the recorder's buffer, dump-on-timeout and dump file
    (``$TMPDIR/elastictrain-nccl/<run id>/slot<slot>-rank``, the folder made) are set unless the user set
    them. Broken on purpose (``setdefault`` for the error handling), Ray's 1 stays and this fails."""
    from elastictrain.worker.actor import _nccl_environment

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # what Ray sets when it is unset
    _nccl_environment("run-a", 3)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    folder = tmp_path / "elastictrain-nccl" / "run-a"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(folder / "slot3-rank") and folder.is_dir()
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own setting is kept
    _nccl_environment("run-a", 3)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
