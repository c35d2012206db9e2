"""A worker's reply to ``run`` on the wire (elastictrain/worker_reply.py): what a worker packs, the controller reads
back whole, for every status, with and without an error text and a slot."""

from __future__ import annotations

import pytest

from elastictrain import worker_reply


@pytest.mark.parametrize("status", worker_reply.STATUSES)
@pytest.mark.parametrize("error", [None, "", "Connection closed by peer [127.0.0.1]:4242 \u2014 rank 3"])
@pytest.mark.parametrize("slot", [None, 0, 9999])
def test_a_packed_result_reads_back_as_the_dict_it_was(status, error, slot) -> None:
    packed = worker_reply.pack(status, 123456789012, error, slot)
    assert isinstance(packed, bytes)
    assert worker_reply.unpack(packed) == {"status": status, "step": 123456789012, "error": error, "slot": slot}


def test_an_unknown_status_is_refused_when_packed() -> None:
    with pytest.raises(KeyError):
        worker_reply.pack("finished", 1)
