"""A TCP relay on 127.0.0.1 in front of a local server's port, the base of the tests' network faults between a
client and a real server (tests/s3_gate.py holds reads; tests/checkpoint_fixtures.py's ``CuttingProxy`` cuts
a request short). A subclass sees each chunk a client sends before it is forwarded (:meth:`TcpRelay.request`).
The relay owns its listener, its connections and its threads: :meth:`TcpRelay.close` closes and joins them."""

from __future__ import annotations

import socket
import threading
from typing import Any


class TcpRelay:
    """Listens on a free local port (:attr:`port`, :attr:`endpoint`) and relays each connection to
    ``target_port`` on 127.0.0.1. A connection accepted while nothing listens there is closed (to the client,
    a server that is down)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="tcp-relay-accept")]
        self._threads[0].start()

    def request(self, data: bytes, conn: dict[str, Any], src: socket.socket, dst: socket.socket) -> bytes | None:
        """A chunk ``data`` the client sent on the connection ``src`` -> ``dst`` (``conn``: a dict of this
        connection's own): returns what to forward, or None to stop relaying it (both ends are then shut)."""
        return data

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(("127.0.0.1", self._target), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            conn: dict[str, Any] = {}
            with self._lock:
                self._sockets += [client, server]
                for args in ((client, server, conn), (server, client, None)):
                    t = threading.Thread(target=self._pipe, args=args, daemon=True, name="tcp-relay-pipe")
                    self._threads.append(t)
                    t.start()

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: dict[str, Any] | None) -> None:
        """Relay ``src`` to ``dst``; ``conn`` is None for the server's side (forwarded as it comes)."""
        try:
            while data := src.recv(65536):
                out = data if conn is None else self.request(data, conn, src, dst)
                if out is None:
                    return
                dst.sendall(out)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Close the listener and every connection, and join the threads."""
        with self._lock:
            for s in self._sockets:
                try:  # a shutdown wakes a thread blocked in accept or recv on it (a close alone does not)
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            threads = list(self._threads)
        for t in threads:
            t.join(10)
