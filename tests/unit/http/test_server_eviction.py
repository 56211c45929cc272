"""Which connection the accept loop closes for a newcomer at the connection cap (found by a hostile test:
slow senders must not lock out a fresh client; server.eviction_victim)."""

from __future__ import annotations

from trioserve.http.connection import MIN_RECEIVE_RATE, IsolatedTCPServer
from trioserve.http.server import EVICT_AFTER_S, EVICT_SLOW_AFTER_S, eviction_victim


def connection(name: str, waiting_since: float | None, received: int = 0,
               evicted: bool = False) -> IsolatedTCPServer:
    """A connection's eviction state only (no socket, no protocol)."""
    conn = IsolatedTCPServer.__new__(IsolatedTCPServer)
    conn.peer, conn.waiting_since, conn._received, conn.evicted = name, waiting_since, received, evicted
    return conn


NOW = 100.0


def test_behind_the_rate_means_fewer_bytes_than_the_rate_times_the_wait():
    assert connection("idle", NOW - 0.1).behind_receive_rate(NOW)
    assert connection("trickle", NOW - 2.0, received=101).behind_receive_rate(NOW)
    assert not connection("upload", NOW - 2.0, received=3 * MIN_RECEIVE_RATE).behind_receive_rate(NOW)
    assert not connection("answering", None).behind_receive_rate(NOW)


def test_a_slow_sender_is_evictable_after_a_quarter_second():
    slow = connection("slow", NOW - EVICT_SLOW_AFTER_S, received=101)
    assert eviction_victim([slow], NOW) is slow
    assert eviction_victim([connection("young", NOW - EVICT_SLOW_AFTER_S / 2)], NOW) is None


def test_slow_senders_go_first_then_the_longest_waiting():
    uploading = connection("uploading", NOW - 5.0, received=50 * MIN_RECEIVE_RATE)
    slow_old = connection("slow-old", NOW - 0.9, received=10)
    slow_new = connection("slow-new", NOW - 0.3, received=10)
    assert eviction_victim([uploading, slow_new, slow_old], NOW) is slow_old
    assert eviction_victim([uploading, slow_new], NOW) is slow_new
    # A client sending at a normal speed gets EVICT_AFTER_S before anyone may close it.
    fast = connection("fast", NOW - EVICT_AFTER_S / 2, received=10 * MIN_RECEIVE_RATE)
    assert eviction_victim([fast], NOW) is None
    assert eviction_victim([uploading, fast], NOW) is uploading


def test_connections_being_answered_or_already_evicted_are_never_chosen():
    answering = connection("answering", None)
    gone = connection("gone", NOW - 10.0, evicted=True)
    assert eviction_victim([answering, gone], NOW) is None
