"""Worker log lines: rank-prefixed, one line for an expected fault (no C++/Python stack wall)."""

from __future__ import annotations

import io
import logging

from elastictrain.logs import configure_worker_logging, one_line, set_worker_rank


class DistBackendError(RuntimeError):  # the name torch uses; what matters is the class name
    pass


def test_rank_prefix_and_one_line_expected_fault() -> None:
    logger = configure_worker_logging(slot=3)
    buf = io.StringIO()
    handler = logger.handlers[0]
    old_stream = handler.setStream(buf)
    try:
        set_worker_rank(1, 2, 5)
        logger.warning("step %d discarded", 7)
        wall = "Connection closed by peer\nException raised from recvBytes at gloo.cpp:123\nframe #0: ...\nframe #1: ..."
        try:
            raise DistBackendError(wall)
        except DistBackendError:
            logger.warning("collective failed", exc_info=True)
        try:
            raise ValueError("a real bug")
        except ValueError:
            logger.error("unexpected", exc_info=True)
    finally:
        handler.setStream(old_stream)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "[rank 1/2 slot 3 gen 5] WARNING elastictrain.worker: step 7 discarded"
    assert lines[1].startswith("[rank 1/2 slot 3 gen 5] WARNING elastictrain.worker: collective failed: "
                               "DistBackendError: Connection closed by peer (at test_logs.py:")
    assert not any("frame #" in ln for ln in lines)
    assert "Traceback (most recent call last):" in buf.getvalue()  # an unexpected error keeps its stack
    assert logging.getLogger("elastictrain.worker").propagate is False


def test_one_line_of_an_exception() -> None:
    assert one_line(None) == "no exception"
    assert one_line(RuntimeError("a\nb")) == "RuntimeError: a"
