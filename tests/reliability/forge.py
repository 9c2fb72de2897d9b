"""Forging frames and fds the way a hostile peer would, for the fuzzer.

A forged peer is a raw AF_UNIX SOCK_SEQPACKET socket: it can send bytes no
``wire.Connection`` would (no HELLO, oversized frames, 253 fds). The frame
formats are those of ``shmshare.wire`` ([kind, body] msgpack, HELLO first),
``shmshare.channel._protocol`` (the batch header) and ``shmshare.tensors``
(ArrayDesc exts).
"""

from __future__ import annotations

import array
import fcntl
import os
import select
import socket
import struct
import time
from typing import Any

import msgpack

from shmshare import tensors, wire

HEAD = struct.Struct("<QQqBBH")  # tensors' ArrayDesc head: segment, block, offset, ndim, ntdt, ndt
I64 = (-(1 << 63), (1 << 63) - 1)


class Peer:
    """A raw connection to a listener; ``close()`` it (the test owns the fd)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 32, 4 << 20)  # SO_SNDBUFFORCE (root)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def raw(self, data: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self.sock.sendmsg([data], anc)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the receiver dropped us already: what a hostile peer gets

    def hello(self) -> Peer:
        self.raw(msgpack.packb([0, {"version": wire.PROTOCOL_VERSION, "pid": os.getpid(),
                                    "role": "sender"}], use_bin_type=True))
        return self

    def msg(self, body: Any, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        self.raw(msgpack.packb([1, body], use_bin_type=True), fds)

    def dropped(self, timeout: float = 10.0) -> bool:
        """Wait until the receiver closed this connection (frames it sent are read and discarded)."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                break
            try:
                data, anc, _, _ = self.sock.recvmsg(1 << 18, socket.CMSG_SPACE(64 * 4))
            except ConnectionResetError:
                return True
            for level, kind, payload in anc:  # releases carry none, but never leak what arrives
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    for fd in array.array("i", payload[:len(payload) - len(payload) % 4]):
                        os.close(fd)
            if not data and not anc:
                return True
        return False

    def close(self) -> None:
        self.sock.close()


def tree(obj: Any) -> bytes:
    """Pack a batch tree (ExtType values go as they are)."""
    return msgpack.packb(obj, use_bin_type=True)


def batch(new: Any = None, tree_bytes: bytes | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"k": "m", "b": tree({}) if tree_bytes is None else tree_bytes}
    if new is not None:
        body["s"] = new
    body.update(extra)
    return body


def desc(seg: int, nbytes: int, offset: int = 0, block: int = 1) -> msgpack.ExtType:
    """A well-formed descriptor of `nbytes` uint8 at `offset` in segment `seg`."""
    return tensors.pack_desc(seg, block, offset, b"|u1", (nbytes,), (1,))


def raw_desc(seg: int, block: int, offset: int, dtype: bytes, shape: list[int],
             strides: list[int], tdt: bytes = b"", ndim: int | None = None) -> msgpack.ExtType:
    """A descriptor with any field values (clamped to what the binary layout can hold)."""
    n = len(shape) if ndim is None else ndim
    head = HEAD.pack(seg & (2**64 - 1), block & (2**64 - 1), _i64(offset), n & 0xFF,
                     len(tdt) & 0xFF, len(dtype) & 0xFFFF)
    body = b"".join(struct.pack("<q", _i64(v)) for v in [*shape, *strides])
    return msgpack.ExtType(tensors.EXT_ARRAY, head + body + tdt + dtype)


def _i64(v: int) -> int:
    return max(I64[0], min(I64[1], v))


def sealed_memfd(size: int, fill: int = 7) -> int:
    """A memfd of `size` bytes sealed against shrinking, as a well-behaved sender makes it."""
    fd = os.memfd_create("rel_fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes([fill]) * size, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def hostile_fd(kind: str, size: int) -> tuple[int, list[int]]:
    """Return (fd to send, fds to close afterwards) of one hostile kind, `size` bytes where it has a size."""
    if kind == "regular_file":
        fd = os.open(os.path.dirname(os.path.abspath(__file__)), os.O_TMPFILE | os.O_RDWR, 0o600)
        os.pwrite(fd, b"\1" * size, 0)
        return fd, [fd]
    if kind == "tmpfile_tmp":
        fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
        os.pwrite(fd, b"\1" * size, 0)
        return fd, [fd]
    if kind == "pipe":
        r, w = os.pipe()
        return r, [r, w]
    if kind == "socket":
        a, b = socket.socketpair()
        fd = a.detach()
        return fd, [fd, b.detach()]
    if kind == "eventfd":
        fd = os.eventfd(0)
        return fd, [fd]
    if kind == "dev_zero":
        fd = os.open("/dev/zero", os.O_RDWR)
        return fd, [fd]
    if kind == "directory":
        fd = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)
        return fd, [fd]
    if kind == "memfd_unsealed":
        fd = os.memfd_create("rel_fuzz", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd, [fd]
    if kind == "memfd_sealable_no_seal":
        fd = os.memfd_create("rel_fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        return fd, [fd]
    if kind == "memfd_too_small":
        fd = sealed_memfd(size // 16)
        return fd, [fd]
    if kind == "posix_unsealed":
        name = f"/dev/shm/rel_fuzz_{os.getpid()}_{time.monotonic_ns()}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(name)
        os.ftruncate(fd, size)
        return fd, [fd]
    if kind == "memfd_sealed":
        fd = sealed_memfd(size)
        return fd, [fd]
    raise ValueError(kind)


# What the refusal of each kind must name (contract: "names what the fd is").
HOSTILE_FDS = {
    "regular_file": r"regular file",
    "tmpfile_tmp": r"regular file",
    "pipe": r"pipe",
    "socket": r"socket",
    "eventfd": r"eventfd|anon",
    "dev_zero": r"character device|/dev/zero",
    "directory": r"director",
    "memfd_unsealed": r"seal",
    "memfd_sealable_no_seal": r"seal",
    "memfd_too_small": r"\d+ bytes",
    "posix_unsealed": r"trust_unsealed|unsealed",
}
SHRINKABLE = {"regular_file", "tmpfile_tmp", "memfd_unsealed", "memfd_sealable_no_seal",
              "posix_unsealed"}
