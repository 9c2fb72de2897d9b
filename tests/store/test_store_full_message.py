"""StoreFull states the numbers plainly: the bytes asked, the store's --limit, what it holds
(and how much of that getters are viewing), what is free, and the fix in plain words -- the
figures the daemon's stats give, so they add up."""

from __future__ import annotations

import numpy as np
import pytest

from shmshare.memory._policy import format_size
from shmshare.store import Daemon, Store, StoreFull

MiB = 1 << 20


def _refused(s: Store, name: str, nbytes: int) -> str:
    with pytest.raises(StoreFull) as info:
        s.put(name, np.zeros(nbytes, np.uint8))
    return str(info.value)


@pytest.mark.daemon_args(limit=8 * MiB)
def test_store_full_says_what_was_asked_the_limit_what_is_held_and_the_fix(
        own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", np.zeros(5 * MiB, np.uint8))
        view = s.get("a")  # a getter views all of it
        text = _refused(s, "b", 4 * MiB)
        held = s.stats()["held_bytes"]
        assert "object 'b' of 4.00 MiB (4194304 bytes) needs" in text, text
        assert "--limit is 8.00 MiB (8388608 bytes)" in text, text
        assert f"it holds {format_size(held)} already, so {format_size(8 * MiB - held)} is free" \
            in text, text
        assert "1 object (5.00 MiB) by name" in text and "no deleted objects" in text, text
        assert "getters are viewing 5.00 MiB" in text, text
        assert "delete objects that are no longer needed (Store.delete)" in text, text
        assert "larger --limit" in text and "`shmshare serve --evict`" in text, text
        assert view[0] == 0


@pytest.mark.daemon_args(limit=8 * MiB)
def test_store_full_for_more_than_the_limit_says_deleting_cannot_help(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        text = _refused(s, "huge", 9 * MiB)
        assert "object 'huge' of 9.00 MiB (9437184 bytes)" in text, text
        assert "it holds 0 bytes already" in text, text
        assert "Deleting objects cannot make room" in text and "larger --limit" in text, text
        assert "--evict" not in text, text


@pytest.mark.daemon_args(limit=8 * MiB, evict=True)
def test_store_full_under_evict_says_the_views_keep_the_rest(own_daemon: Daemon) -> None:
    with Store(own_daemon.path) as s:
        s.put("a", np.zeros(3 * MiB, np.uint8))
        s.put("b", np.zeros(3 * MiB, np.uint8))
        views = [s.get("a"), s.get("b")]
        s.delete("b")  # deleted, still viewed
        text = _refused(s, "c", 4 * MiB)
        assert "1 object (3.00 MiB) by name" in text, text
        assert "1 deleted object (3.00 MiB) that getters still view" in text, text
        assert "getters are viewing 6.00 MiB" in text, text
        assert "It runs with --evict" in text and "getters hold views of the rest" in text, text
        assert "Drop those views or delete objects" in text, text
        assert all(v[0] == 0 for v in views)
