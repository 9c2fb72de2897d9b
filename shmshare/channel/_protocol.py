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

Segment ids are unique on the host (pid << 32 | counter); lease ids are
unique per sender. An ArrayDesc with segment 0 is an empty array with no
memory behind it.
"""

from __future__ import annotations

__all__ = ["KIND", "BATCH", "BYE", "RELEASE", "REFUSE", "NEW", "GROW", "DROP", "TREE", "LEASES",
           "WHY", "RELEASE_CHUNK"]

KIND, BATCH, BYE, RELEASE, REFUSE = "k", "m", "x", "r", "e"
NEW, GROW, DROP, TREE, LEASES, WHY = "s", "g", "d", "b", "l", "w"
RELEASE_CHUNK = 4096  # lease ids in one release frame: well under wire.MAX_FRAME
