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
from typing import Any

import msgpack
import numpy as np

from .. import tensors, wire
from .._errors import ProtocolError
from ._protocol import BATCH, KIND, TREE

__all__ = ["HEAD", "frame", "frame_by_value", "by_value", "one_array", "desc_of", "inline_of", "header_of"]

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


def frame_by_value(dtype: bytes, arr: Any) -> bytes:
    """The message frame of a batch that is the one small numpy array `arr`, sent by value (Note
    [Inline arrays] in ``tensors.py``); its numpy dtype's descriptor bytes are `dtype`."""
    data = tensors.c_bytes(arr)
    key = (dtype, arr.shape, len(data))
    head = _by_value.get(key)
    if head is None:  # the frame less its last field, the bytes: the same for every array of the layout
        if len(_by_value) >= _MAX_LAYOUTS:
            _by_value.clear()
        ext = tensors.pack_inline(dtype, arr.shape, arr.dtype.itemsize, bytes(len(data)))
        whole = wire.message_frame({KIND: BATCH, TREE: msgpack.packb(ext, use_bin_type=True)})
        head = _by_value[key] = whole[:len(whole) - len(data)]
    return head + data


def inline_of(framed: bytes) -> bytes | None:
    """The EXT_INLINE payload of a frame that starts with HEAD and is a batch of exactly one array
    sent by value, in the short form (a tree under 256 bytes); None: any other."""
    n = len(framed)
    if n > _SHORT and framed[_BIN_LEN] == n - _BIN_LEN - 1 and framed[_EXT] == 0xC7 \
            and framed[_EXT + 1] == n - _SHORT and framed[_EXT + 2] == tensors.EXT_INLINE:
        return framed[_SHORT:]
    return None


def by_value(lay: tensors.Layout, data: bytes, writable: bool) -> Any:
    """The array a receiver hands out for an inline one: a copy of its own, read-only unless the
    receiver maps writable or it becomes a torch tensor (which must be writable)."""
    tdt = lay.torch_dtype if lay.torch_dtype is not None and tensors.torch_imported() else None
    arr = np.frombuffer(bytearray(data) if writable or tdt else data, lay.dtype).reshape(lay.shape)
    return arr if tdt is None else tensors.as_torch(arr, tdt)


def desc_of(framed: bytes) -> bytes | None:
    """The descriptor of a frame that starts with HEAD (``Connection.recv_now(HEAD)``) and is a
    batch of exactly one array in the short form (a tree under 256 bytes); None: any other."""
    n = len(framed)
    if n > _SHORT and framed[_BIN_LEN] == n - _BIN_LEN - 1 and framed[_EXT] == 0xC7 \
            and framed[_EXT + 1] == n - _SHORT and framed[_EXT + 2] == tensors.EXT_ARRAY:
        return framed[_SHORT:]
    return None


def header_of(framed: bytes) -> Any:
    """The header of a frame that starts with HEAD but is not :func:`desc_of`'s short form (a
    tree of its own shape, or bytes a peer made up): ProtocolError if it is not a header."""
    try:
        got = msgpack.unpackb(framed, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ProtocolError(f"a malformed frame of {len(framed)} bytes in the ring: {exc}") from exc
    if not (type(got) is list and len(got) == 2 and type(got[1]) is dict):
        raise ProtocolError(f"a ring frame must be [kind, header], got {got!r:.80}")
    return got[1]


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
_by_value: dict[tuple[bytes, tuple[int, ...], int], bytes] = {}  # frame_by_value's heads
# The bytes every batch of the lane starts with: [MSG, {KIND: BATCH, TREE: <bin8 ...>}]; then the
# bin's length, an ext8 header (0xC7, length, EXT_ARRAY) and the descriptor (_SHORT on).
HEAD = wire.message_frame({KIND: BATCH, TREE: b""})[:-1]  # less the empty bin's length byte
_BIN_LEN = len(HEAD)
_EXT = _BIN_LEN + 1
_SHORT = _EXT + 3
assert HEAD.endswith(b"\xc4")  # bin8
