"""Automatic reconnection across a server restart on the same port, and the end of a
subscriber without reconnect."""

from __future__ import annotations

import time

import pytest

import tether
from conftest import free_port


def test_a_subscriber_reconnects_across_a_server_restart_and_loses_nothing(make_server, tmp_path):
    port = free_port()
    data = tmp_path / "restart"
    srv = make_server(data, f"127.0.0.1:{port}").start()
    sub = srv.subscriber(durable_id="r1", interests={"R": tether.all_keys()},
                         reconnect_delay_initial_ms=50, reconnect_delay_max_ms=300,
                         reconnect_attempt_timeout_ms=1000, reconnect_max_secs=60)
    assert isinstance(sub.next(5), tether.Live)
    with srv.publisher() as pub:
        pub.publish([("put", "R", f"k{i}", f"v{i}") for i in range(10)])
    seen = [sub.next(5) for _ in range(4)]
    srv.stop()  # SIGTERM: sessions closed, durable queues kept

    srv = make_server(data, f"127.0.0.1:{port}")
    events, kinds = list(seen), []
    restarted = False
    deadline = time.monotonic() + 60
    while len(events) < 13:
        assert time.monotonic() < deadline, (kinds, [e.key for e in events])
        ev = sub.next(timeout=0.5)
        if ev is None:
            if not restarted and "Disconnected" in kinds:
                srv.start()
                restarted = True
                with srv.publisher() as pub:
                    pub.publish([("put", "R", f"after{i}", b"x") for i in range(3)])
            continue
        kinds.append(type(ev).__name__)
        if isinstance(ev, tether.Event):
            events.append(ev)
        elif isinstance(ev, tether.Disconnected):
            assert ev.error
        elif isinstance(ev, tether.Reconnected):
            assert (ev.queue, sub.queue_status) == ("resumed", "resumed")
    assert kinds.count("Disconnected") == 1 and kinds.count("Reconnected") == 1
    assert kinds.index("Disconnected") < kinds.index("Reconnected")
    assert "Live" not in kinds  # told once per queue, not again after a lost connection
    assert [e.key for e in events] == [f"k{i}" for i in range(10)] + [f"after{i}" for i in range(3)]
    offsets = [e.offset for e in events]
    assert offsets == sorted(set(offsets))
    assert sub.reconnects == 1
    sub.close()


def test_without_reconnect_a_lost_connection_ends_the_iteration_with_an_error(make_server):
    srv = make_server().start()
    sub = srv.subscriber(durable_id="n1", interests={"R": tether.all_keys()}, reconnect=False)
    assert isinstance(sub.next(5), tether.Live)
    srv.stop()
    with pytest.raises(tether.ClosedError, match="connection was lost"):
        for _ in sub:
            pass
    assert sub.finished
    assert list(sub) == []
    sub.close()  # the end was raised already: not again


def test_a_subscriber_that_cannot_reconnect_in_time_gives_up_with_connect_error(make_server):
    srv = make_server().start()
    sub = srv.subscriber(durable_id="g1", interests={"R": tether.all_keys()},
                         reconnect_max_secs=1, reconnect_delay_initial_ms=50,
                         reconnect_delay_max_ms=200, reconnect_attempt_timeout_ms=300)
    assert isinstance(sub.next(5), tether.Live)
    srv.stop()
    assert isinstance(sub.next(10), tether.Disconnected)
    t0 = time.monotonic()
    with pytest.raises(tether.ConnectError, match="gave up reconnecting"):
        sub.next(10)
    assert time.monotonic() - t0 < 5
    assert sub.finished and sub.next(0) is None
    sub.close()  # the end was raised already: not again


def test_closing_while_reconnecting_says_the_session_was_not_closed(make_server):
    srv = make_server().start()
    sub = srv.subscriber(durable_id="c1", interests={"R": tether.all_keys()},
                         reconnect_delay_initial_ms=50, reconnect_attempt_timeout_ms=300)
    assert isinstance(sub.next(5), tether.Live)
    srv.stop()
    assert isinstance(sub.next(10), tether.Disconnected)
    t0 = time.monotonic()
    with pytest.raises(tether.ClosedError):  # not connected: the queue stays until its timeout
        sub.close()
    assert time.monotonic() - t0 < 2
    assert sub.finished and list(sub) == []
