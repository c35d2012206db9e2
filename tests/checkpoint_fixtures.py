"""Shared fixtures and helpers for the checkpoint tests: a real moto S3 server, tiny models, 2-rank gloo.

Import the fixtures into a test module with ``from checkpoint_fixtures import s3_server, s3_bucket``.
Credentials are dummy values passed through storage_options (never read from or written to the env).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.tcp_relay import TcpRelay

DUMMY_KEY, DUMMY_SECRET = "testing-key", "testing-secret"


@dataclass
class S3Server:
    endpoint: str
    server: Any

    def options(self, **extra: Any) -> dict[str, Any]:
        # one attempt, no s3fs retries: a stopped server must fail fast in tests
        opts = {
            "key": DUMMY_KEY,
            "secret": DUMMY_SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
            "skip_instance_cache": True,
        }
        opts.update(extra)
        return opts


# Ports a test names for a server it starts later (a rendezvous, moto, `ray start`) come from below the
# kernel's ephemeral range and above Ray's worker ports (10002-19999 by default): a port the kernel handed
# out and we closed is free for its next bind(0) -- a gloo listener, a TCPStore on port 0, a Ray agent --
# during the seconds before our server binds it (ranks start, import torch). Ports here are never handed
# out by the kernel; only another test's pick can collide (1 in ~12,000), and the pick is checked free.
_NAMED_PORTS_FROM = 20000
_HANDED_OUT: set[int] = set()  # this process's picks: two servers of one test never get the same port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A local TCP port free now, outside the range the kernel assigns on its own (see above); a port the
    kernel assigns when that range leaves no room."""
    import random

    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low - _NAMED_PORTS_FROM >= 1000 else 0):
        port = rng.randrange(_NAMED_PORTS_FROM, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(port: int) -> Any:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


@pytest.fixture(scope="module")
def s3_server() -> S3Server:
    port = free_port()
    server = start_moto(port)
    box = S3Server(f"http://127.0.0.1:{port}", server)
    yield box
    box.server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh bucket; returns its ``s3://`` URI."""
    import s3fs

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**s3_server.options()).mkdir(name)
    return f"s3://{name}"


class CuttingProxy(TcpRelay):
    """A TCP proxy on 127.0.0.1 in front of a real endpoint that cuts the connection in the middle of the
    first request whose head matches ``cut_on`` (e.g. the PUT of a ``.distcp`` data file): it forwards the
    request head and at most ``body_bytes`` of what follows, then calls ``on_cut`` (stop the server) and closes
    both ends. Afterwards it forwards as before (to whatever listens on the target by then). ``cut_head`` is
    the request line it cut, so a test can show where its fault landed."""

    def __init__(self, target_port: int, cut_on: bytes, on_cut: Any, body_bytes: int = 1024) -> None:
        import re

        self._pattern, self._on_cut, self._body_bytes = re.compile(cut_on), on_cut, body_bytes
        self.cut_head: bytes | None = None
        super().__init__(target_port)

    def request(self, data: bytes, conn: dict[str, Any], src: socket.socket, dst: socket.socket) -> bytes | None:
        match = self._pattern.search(data)
        if match is None:
            return data
        with self._lock:
            armed, self.cut_head = self.cut_head is None, self.cut_head or data[match.start():].split(b"\r\n")[0]
        if not armed:
            return data
        head_end = data.find(b"\r\n\r\n", match.start())
        end = len(data) if head_end < 0 else min(len(data), head_end + 4 + self._body_bytes)
        dst.sendall(data[:end])
        for s in (src, dst):  # the request is cut short (a shutdown: a close alone leaves the other side's
            try:              # recv holding the connection open), then the server goes away
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._on_cut()
        return None


# ------------------------------------------------------------------------------------------ tiny models


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
    return model, opt


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=99)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def same_state(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[torch.nn.Module, torch.optim.Optimizer]) -> bool:
    ma, oa = a
    mb, ob = b
    if not all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values())):
        return False
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    if sa.keys() != sb.keys():
        return False
    return all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in ("exp_avg", "exp_avg_sq", "step"))


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> Any:
    """Default gloo group on 127.0.0.1 plus a dedicated checkpoint group (both with a timeout: a bound on a
    hang, not a window; the rendezvous waits for peers whose imports may take many seconds more on a loaded
    machine, and a dead peer's closed sockets fail a collective at once)."""
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class MotoProcess:
    """moto's S3 server in a process of its own, so the test can stall it with SIGSTOP."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"

        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                self.proc.poll()
                assert self.proc.returncode is None, "moto server exited"
                time.sleep(0.1)
        raise AssertionError("moto server did not start")

    def options(self) -> dict:
        # A stalled endpoint: requests hang until read_timeout (a long one, as real clients use).
        return {"key": DUMMY_KEY, "secret": DUMMY_SECRET, "client_kwargs": {"endpoint_url": self.endpoint},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 5, "read_timeout": 60},
                "skip_instance_cache": True}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)
