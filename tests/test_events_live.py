"""Reading events.jsonl while a run writes it (what ``BackgroundRun.wait_for``, the CLI tests and ``elastictrain
report`` on a live run do). A record is one ``write`` of a line, but a reader can see part of it: the kernel
copies a write into the file a page at a time, so a record that crosses a 4 KiB boundary is visible half
written for a moment (seen beside a writer of 1 KB records on a loaded 2-core machine). The reader must
leave such a tail for the next read, not fail on it."""

from __future__ import annotations

import json
from pathlib import Path

from elastictrain.events import EventLog, read_events


def test_a_record_still_being_written_is_not_read_yet(tmp_path: Path) -> None:
    log = EventLog(tmp_path, console=None)
    written = [log.emit("step", step=s, loss=1.0 / s) for s in (1, 2)]
    log.close()
    whole = (tmp_path / "events.jsonl").read_bytes()
    third = json.dumps({"event": "step", "time": 0.0, "step": 3, "sample_ids": list(range(300))}) + "\n"
    for cut in (1, len(third) // 2, len(third) - 1):  # what a reader may see of the third record's write
        (tmp_path / "events.jsonl").write_bytes(whole + third[:cut].encode())
        assert read_events(tmp_path) == written, cut
    (tmp_path / "events.jsonl").write_bytes(whole + third.encode())  # written out: read
    assert [e["step"] for e in read_events(tmp_path)] == [1, 2, 3]
