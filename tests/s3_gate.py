"""A TCP relay in front of an S3 endpoint (moto's server) that stalls its reads of prepared shards from a
given one on: the clients' real requests reach the real server, except that once ``after`` GETs of ``.bin``
objects (a prepared corpus's shards, always read by range) went through, every further one is held (its
bytes not forwarded: to the client, a server that stopped answering) until :meth:`S3Gate.release`. What
the stall hits is fixed by the count of reads, not by when a test gets to stop the server: :attr:`S3Gate.held`
is set when the first read is held."""

from __future__ import annotations

import re
import socket
import threading
from typing import Any

from tests.tcp_relay import TcpRelay

_SHARD_GET = re.compile(rb"get /[^ ]*\.bin[^ ]* http/1\.1\r\n")
_TAIL = 512  # bytes kept from the previous chunk: a request line split over two chunks


class S3Gate(TcpRelay):
    """Listens on a free local port (:attr:`endpoint`) and relays each connection to ``port`` on 127.0.0.1.
    Call :meth:`close` when done: it releases what is held and closes every socket and thread it opened."""

    def __init__(self, port: int, after: int) -> None:
        self.after = after
        self.reads = 0  # shard GETs seen (held ones included)
        self.held = threading.Event()  # a ranged read is held
        self._release = threading.Event()
        super().__init__(port)

    def release(self) -> None:
        """Forward what is held, and every request from now on."""
        self._release.set()

    def request(self, data: bytes, conn: dict[str, Any], src: socket.socket, dst: socket.socket) -> bytes:
        tail = conn.get("tail", b"")
        both = (tail + data).lower()
        # a request line wholly inside the tail was counted with the previous chunk
        seen = sum(1 for m in _SHARD_GET.finditer(both) if m.end() > len(tail))
        conn["tail"] = data[-_TAIL:]
        with self._lock:
            self.reads += seen
            hold = seen and self.reads > self.after
        if hold and not self._release.is_set():
            self.held.set()
            self._release.wait()
        return data

    def close(self) -> None:
        self._release.set()
        super().close()
