"""The lease table: one word of shared memory per handle, claimed by compare-and-swap.

Note [Claims without a round trip]
    A handle pickled by the owner names a slot of its lease table and the
    slot's generation. The owner writes the slot PENDING when it pickles;
    the process that unpickles the handle swaps it to CLAIMED with its own
    pid in one ``cas64`` on its mapping of the table. That is the whole
    claim: no message to the owner, whose serving thread may be waiting for
    the GIL behind a busy main thread for milliseconds. The swap is what
    makes an unpickle of the same bytes a second time (in any process) a
    clear error rather than a second view of a block the first one may
    already have given back: only one swap from PENDING can win. The owner
    reads the table to know which handles are still unclaimed (what it
    waits for at exit, Note [Exit linger]), but every peer maps the table
    read-write, so a word never decides that a block is free: that is the
    claim maps' job (Note [The owner's record of claims] in ``_claims.py``).
    A slot goes back to FREE when it is given back; its generation, kept by
    the owner, then moves on, so a stale handle's swap fails.

A word: generation (32 bits) | state (2 bits) | claimer pid (30 bits); 0 is FREE.
"""

from __future__ import annotations

import hashlib
import struct

from .. import _native
from ..segment import Flags, Segment

__all__ = ["LeaseTable", "SLOTS", "PENDING", "CLAIMED", "word", "describe", "sign", "Signer"]

SLOTS = 1 << 17  # handles one process can have out at once (1 MiB of table); past it: by value
PENDING, CLAIMED = 1, 2
_PID_BITS = 30
_PID_MASK = (1 << _PID_BITS) - 1


def word(gen: int, state: int, pid: int = 0) -> int:
    return (gen << 32) | (state << _PID_BITS) | (pid & _PID_MASK)


def describe(value: int) -> tuple[int, int, int]:
    """(generation, state, pid) of a table word."""
    return value >> 32, (value >> _PID_BITS) & 3, value & _PID_MASK


class LeaseTable:
    """The owner's table: slots handed out and given back; its fd goes to each peer once."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.segment = Segment.create(slots * 8, Flags.SHAREDMEM | Flags.KEEPFD)
        self.buffer = self.segment.buffer
        self.words = self.buffer.cast("Q")  # indexing gives a Python int (faster than numpy's)
        self.gens = [0] * slots  # our own record of each slot's generation (the words are shared)
        self._free: list[int] = []
        self._next = 0
        self.slots = slots
        self.used = 0

    @property
    def fd(self) -> int:
        fd = self.segment.fd
        assert fd is not None
        return fd

    def take(self) -> tuple[int, int] | None:
        """A fresh (slot, generation), written PENDING; None when every slot is out."""
        if self._free:
            slot = self._free.pop()
        elif self._next < self.slots:
            slot = self._next
            self._next += 1
        else:
            return None
        gen = (self.gens[slot] + 1) & 0xFFFFFFFF or 1
        self.gens[slot] = gen
        self.words[slot] = word(gen, PENDING)  # a FREE slot is nobody else's to touch
        self.used += 1
        return slot, gen

    def give_back(self, slot: int, gen: int) -> bool:
        """Free a slot whose lease came back (or was never sent); False if it is not (slot, gen)."""
        if not 0 <= slot < self._next or self.gens[slot] != gen:
            return False
        # our record decides, not the word: a peer may have written anything there
        self.words[slot] = 0
        self._free.append(slot)
        self.used -= 1
        return True

    def state(self, slot: int) -> tuple[int, int, int]:
        return describe(self.words[slot])

    def claimed(self, slot: int, gen: int) -> bool:
        """Whether the word of `slot` says CLAIMED at generation `gen` (by anyone)."""
        return self.words[slot] >> _PID_BITS == (gen << 2) | CLAIMED

    def close(self) -> None:
        self.words.release()
        self.buffer.release()
        self.segment.close()


def claim(buffer: memoryview, slot: int, gen: int, pid: int) -> int:
    """Swap a slot PENDING -> CLAIMED by `pid`; return the word found (== PENDING word on success)."""
    return _native.cas64(buffer, slot, word(gen, PENDING), word(gen, CLAIMED, pid))


_FIELDS = struct.Struct("<7q?").pack
_blake2b = hashlib.blake2b


def sign(secret: bytes, seg_id: int, size: int, start: int, span: int, lo: int, slot: int, gen: int,
         external: bool) -> bytes:
    """A handle's signature, keyed by its owner's secret: what says where its bytes are (the
    segment, its size, the extent, the slot) cannot be altered on the way. 0.9 us."""
    try:
        data = _FIELDS(seg_id, size, start, span, lo, slot, gen, external)
    except struct.error:
        return b""  # no owner signs numbers that do not fit: matches no signature
    return _blake2b(data, key=secret, digest_size=8).digest()


class Signer:
    """:func:`sign` with one key, for every handle of one owner: the key's block is hashed once
    (a keyed blake2b's first compression), and each handle's fields take one more."""

    __slots__ = ("_keyed",)

    def __init__(self, secret: bytes) -> None:
        self._keyed = _blake2b(key=secret, digest_size=8)

    def __call__(self, seg_id: int, size: int, start: int, span: int, lo: int, slot: int, gen: int,
                 external: bool) -> bytes:
        try:
            data = _FIELDS(seg_id, size, start, span, lo, slot, gen, external)
        except struct.error:
            return b""  # as sign(): matches no signature
        h = self._keyed.copy()
        h.update(data)
        return h.digest()
