"""Severing a generation's gloo connections: the abort gloo does not have.

A survivor whose step a peer's death broke must let go of its process groups at once: a live peer blocked
in a collective with it is freed only when its connections close. Destroying the groups does not do that
reliably. ``ProcessGroupGloo``'s destructor first waits for every collective already queued or running on
its worker threads, and such a collective can be waiting for a live peer that left the same collective
when it failed (e.g. a DDP bucket's ring all-reduce blocked sending to a rank whose own copy of that
bucket failed on the dead rank). Both then wait for ``timeouts.collective_s`` (seen in kill runs on the
50.7M GPT, 4 DDP ranks: docs/perf/2026-11-23-code-figures.md). ``ProcessGroupGloo.abort`` and ``shutdown`` close nothing
(torch 2.13), and the connections also stay open while any Python reference to a group lingers.

So the connections are closed under gloo: :meth:`Connections.opened_since` notes the TCP connections
this process opened while it joined a generation (its gloo groups connect every pair when they are
created), and :meth:`Connections.sever` shuts them down (``shutdown(SHUT_RDWR)`` on a duplicate of each
descriptor; gloo still owns and closes the descriptors). Gloo's event loop then sees the connection end:
every collective of this process on it fails at once (its destructor no longer waits) and so does every
peer's. Listening sockets are never touched (gloo's accept thread aborts the process on a shut-down
listener), nor connections accepted by a listener that existed before the join (Ray's, the rendezvous
store's). What is left to chance: an outgoing connection another thread of the worker opened during the
join would be severed too. The worker's other threads answer calls (inbound: kept) and the peer tier's
sender calls its keeper over the connection Ray opened at its first send, in an earlier generation.

Linux only (``/proc/self/fd``); elsewhere nothing is noted and :meth:`Connections.sever` severs nothing.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import socket

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, int]:
    """This process's socket descriptors: fd -> socket inode (empty where /proc is not there)."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return out
    for name in fds:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


def _inspect(fd: int) -> tuple[bool, tuple | None]:
    """(listening, local address) of the socket behind ``fd``, read through a duplicate."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            local = s.getsockname() if s.family in (socket.AF_INET, socket.AF_INET6) else None
            return listening, (local[:2] if local else None)
    except OSError:
        return False, None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The sockets of this process at one moment, and the addresses its listening ones listen on."""

    inodes: frozenset[int]
    listening: frozenset[tuple]

    @classmethod
    def take(cls) -> Snapshot:
        socks = _sockets()
        listening = set()
        for fd in socks:
            is_listener, local = _inspect(fd)
            if is_listener and local is not None:
                listening.add(local)
        return cls(frozenset(socks.values()), frozenset(listening))


@dataclasses.dataclass(frozen=True)
class Connections:
    """TCP connections a generation's groups opened: ``(fd, inode)`` pairs."""

    conns: tuple[tuple[int, int], ...] = ()

    @classmethod
    def opened_since(cls, before: Snapshot) -> Connections:
        """The connections this process opened since ``before``, less listening sockets and connections
        accepted by a listener that ``before`` knew (another server's clients)."""
        found = []
        for fd, inode in sorted(_sockets().items()):
            if inode in before.inodes:
                continue
            listening, local = _inspect(fd)
            if listening or local is None or local in before.listening:
                continue
            if any(local[1] == port and host in ("0.0.0.0", "::") for host, port in before.listening):
                continue  # accepted by a wildcard listener
            found.append((fd, inode))
        return cls(tuple(found))

    def sever(self) -> int:
        """Shut every still-open connection down (both directions) and return how many. A descriptor
        closed since (gloo closes a pair's on its error, the group's on destruction) or reused for another
        socket is left alone: the duplicate is checked to be the noted socket before anything is done."""
        done = 0
        for fd, inode in self.conns:
            try:
                dup = os.dup(fd)
            except OSError:  # closed
                continue
            try:
                if os.fstat(dup).st_ino != inode:  # the number now names another file
                    continue
                with socket.socket(fileno=os.dup(dup)) as s:
                    s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:  # already shut down or reset by the peer
                continue
            finally:
                os.close(dup)
        return done

    def __len__(self) -> int:
        return len(self.conns)
