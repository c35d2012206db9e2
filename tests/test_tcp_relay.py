"""The tests' TCP relays (tests/tcp_relay.py) in front of a real local HTTP server: S3Gate holds the shard
reads after its count until released (what tests/test_prepared_data.py's stall test relies on) and
CuttingProxy cuts the matching request short, then stops the server (tests/test_checkpoint_s3.py)."""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.checkpoint_fixtures import CuttingProxy
from tests.s3_gate import S3Gate


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(self.path.encode())

    def do_PUT(self) -> None:  # noqa: N802
        n = int(self.headers["Content-Length"])
        self.server.bodies.append(self.rfile.read(n))  # type: ignore[attr-defined]  (short at EOF)
        self.server.put_read.set()  # type: ignore[attr-defined]
        self._answer(b"stored")

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.bodies, srv.put_read = [], threading.Event()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(10)


def _get(port: int, path: str) -> bytes:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("GET", path)
        return c.getresponse().read()
    finally:
        c.close()


def test_the_gate_holds_the_shard_reads_after_its_count_until_released(server):
    gate = S3Gate(server.server_address[1], after=1)
    try:
        assert _get(gate.port, "/a/shard_0.bin") == b"/a/shard_0.bin"
        assert _get(gate.port, "/a/index.json") == b"/a/index.json"  # not a shard read: never counted
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(_get(gate.port, "/a/shard_1.bin")))
        reader.start()
        assert gate.held.wait(60) and not got  # held: its bytes never reached the server
        gate.release()
        reader.join(60)
        assert got == [b"/a/shard_1.bin"] and gate.reads == 2
    finally:
        gate.close()


def test_the_cutting_proxy_cuts_the_matching_request_then_forwards_again(server):
    cut = threading.Event()
    proxy = CuttingProxy(server.server_address[1], rb"PUT [^ ]*\.distcp", on_cut=cut.set, body_bytes=10)
    try:
        body = b"x" * 30_000
        head = f"PUT /b/step_2/0.distcp HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as c:
            c.sendall(head + body)  # one write: the relay reads the head and the body's start together
            try:
                answer = c.recv(1024)
            except ConnectionResetError:  # closed with our bytes unread
                answer = b""
            assert answer == b""  # cut: closed without an answer
        assert cut.wait(60) and proxy.cut_head == b"PUT /b/step_2/0.distcp HTTP/1.1"
        assert server.put_read.wait(60) and server.bodies == [b"x" * 10]  # the head and 10 bytes of the body
        assert _get(proxy.port, "/after") == b"/after"
    finally:
        proxy.close()
