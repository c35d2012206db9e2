"""The driver's TensorBoard listener (trainer._tensorboard) writes, for every step event, the scalars
``SummaryWriter.add_scalar`` wrote (train/loss unless the step was skipped, train/samples_per_s,
train/world_size) at the step's number: the same (step, tag, value) triples, read back from the event files,
now in one record per step."""

from __future__ import annotations

import struct
from pathlib import Path

from elastictrain.events import EventLog
from elastictrain.trainer import _tensorboard


def _scalars(logdir: Path) -> list[tuple[int, str, float]]:
    """Every (step, tag, value) in the event files under ``logdir`` (TFRecord framing: length, its CRC,
    the Event message, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return sorted(out)


def _steps() -> list[dict]:
    return [{"step": s, "loss": None if s == 3 else 4.0 / s, "samples_per_s": 100.0 + s, "world_size": 2 if s < 4 else 1}
            for s in range(1, 7)]


def test_each_step_writes_what_add_scalar_wrote(tmp_path: Path) -> None:
    from tensorboardX import SummaryWriter

    events = EventLog(tmp_path / "run", console=None)
    writer = _tensorboard(tmp_path / "run", events)
    events.emit("run_started", name="t")  # not a step: nothing written
    for fields in _steps():
        events.emit("step", **fields)
    writer.close()
    events.close()

    reference = SummaryWriter(str(tmp_path / "reference"))  # what the listener wrote before (three records a step)
    for f in _steps():
        if f["loss"] is not None:
            reference.add_scalar("train/loss", f["loss"], f["step"])
        reference.add_scalar("train/samples_per_s", f["samples_per_s"], f["step"])
        reference.add_scalar("train/world_size", f["world_size"], f["step"])
    reference.close()

    got, want = _scalars(tmp_path / "run" / "tensorboard"), _scalars(tmp_path / "reference")
    assert len(want) == 6 * 3 - 1 and got == want, (got, want)
