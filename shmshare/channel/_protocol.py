"""The channel's messages, on top of ``wire`` frames.

Sender -> receiver, one frame per ``send``::

    {"k": "m",                      # a batch
     "s": [[id, size, expandable]], # segments new to this receiver; their fds ride along, in order
     "g": [[id, offset, nbytes]],   # expandable ranges mapped since the receiver last heard
     "d": [id, ...],                # segments the sender gave back: forget them
     "b": bytes}                    # the batch packed by tensors.Encoder: msgpack bytes, arrays
                                    # as ArrayDesc exts, unpacked only after "s"/"g"/"d" are applied

    {"k": "x"}                      # goodbye: the sender closed on purpose

Receiver -> sender::

    {"k": "r", "l": [lease, ...]}   # these arrays' last views died
    {"k": "e", "w": "why"}          # the receiver refused a batch and drops the connection
    {"k": "n", "v": value}          # a note (Receiver.tell): plain msgpack data for the sender's
                                    # program, queued until it asks (Sender.recv_note)

Segment ids are unique on the host (pid << 32 | counter); lease ids are
unique per sender. An ArrayDesc with segment 0 is an empty array with no
memory behind it.
"""

from __future__ import annotations

__all__ = ["KIND", "BATCH", "BYE", "RELEASE", "REFUSE", "NOTE", "NEW", "GROW", "DROP", "TREE", "LEASES",
           "WHY", "VALUE", "RELEASE_CHUNK", "MAX_NOTES"]

KIND, BATCH, BYE, RELEASE, REFUSE, NOTE = "k", "m", "x", "r", "e", "n"
NEW, GROW, DROP, TREE, LEASES, WHY, VALUE = "s", "g", "d", "b", "l", "w", "v"
MAX_NOTES = 65536  # notes a sender keeps unread: a receiver telling more breaks the protocol
RELEASE_CHUNK = 4096  # lease ids in one release frame: well under wire.MAX_FRAME
