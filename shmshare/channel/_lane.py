"""The channel's fast lane: a batch of one array, framed and read without the tree codec.

Note [Fast lane]
    Most batches of a busy channel are one array from ``empty()`` in a
    segment the receiver has mapped already. For those, the sender builds
    the frame itself -- the bytes ``Connection.send()`` would have put in
    the ring slot for ``{KIND: BATCH, TREE: <one array ext>}`` -- from a
    prefix and a layout tail kept per (dtype, shape, strides), with only the
    segment, lease and offset packed per message (:func:`frame`), and pushes
    it with ``Connection.send_now()``, which takes no wait: a full ring, a
    connection still on the socket or another thread's send sends it the
    usual way. The receiver takes a header with ``Connection.recv_now()``
    and, when its tree is exactly one array ext (:func:`one_array`), parses
    that descriptor directly instead of unpacking the tree with its hooks.

    Nothing about what crosses changes: the frame is byte for byte the
    usual one (built from ``wire.message_frame`` of the same header), so a
    receiver on the usual path reads it, and the receiver checks the
    descriptor exactly as the usual path does (``tensors.parse_desc``, then
    ``Receiver._view``'s bounds). Everything else -- several arrays, nested
    batches, tensors, segments to announce, fds, frames too large for a
    slot, another process's end -- takes the usual path.
"""

from __future__ import annotations

import struct

import msgpack

from .. import tensors, wire
from ._protocol import BATCH, KIND, TREE

__all__ = ["frame", "one_array"]

_WHERE = struct.Struct("<QQq")  # segment, block (the lease), offset: tensors' descriptor head
_MAX_LAYOUTS = 4096  # layouts kept; ever new shapes start the table over rather than grow it


def frame(segment: int, lease: int, offset: int, dtype: bytes, shape: tuple[int, ...],
          strides: tuple[int, ...]) -> bytes:
    """The message frame of a batch that is the one array described (numpy, not a tensor)."""
    key = (dtype, shape, strides)
    parts = _frames.get(key)
    if parts is None:
        parts = _frames[key] = _parts(dtype, shape, strides)
    head, tail = parts
    return head + _WHERE.pack(segment, lease, offset) + tail


def one_array(tree: bytes) -> bytes | None:
    """The descriptor of a tree that is exactly one array ext; None for any other tree."""
    n = len(tree)
    if n > 3 and tree[0] == 0xC7 and tree[2] == tensors.EXT_ARRAY and tree[1] == n - 3:
        return tree[3:]
    if n > 4 and tree[0] == 0xC8 and tree[3] == tensors.EXT_ARRAY and (tree[1] << 8 | tree[2]) == n - 4:
        return tree[4:]
    return None


def _parts(dtype: bytes, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes before the descriptor's (segment, lease, offset), and the layout after them."""
    if len(_frames) >= _MAX_LAYOUTS:
        _frames.clear()
    ext = tensors.pack_desc(0, 0, 0, dtype, shape, strides)
    whole = wire.message_frame({KIND: BATCH, TREE: msgpack.packb(ext, use_bin_type=True)})
    desc = ext.data
    assert whole.endswith(desc)  # the descriptor is the frame's last field
    return whole[:len(whole) - len(desc)], desc[_WHERE.size:]


_frames: dict[tuple[bytes, tuple[int, ...], tuple[int, ...]], tuple[bytes, bytes]] = {}
