"""The publisher: put, get, destroy, invalidate, batches; its events as a subscriber sees them."""

from __future__ import annotations

import pytest

import tether


def test_put_get_destroy_invalidate_and_the_events_they_make(server):
    with server.subscriber(durable_id="watch", interests={"R": tether.all_keys()}) as sub:
        assert isinstance(sub.next(5), tether.Live)
        with server.publisher() as pub:
            assert pub.get("R", "k") is None
            pub.put("R", "k", b"\x00\x01binary")
            assert pub.get("R", "k") == b"\x00\x01binary"
            pub.put("R", "k", "text é")                    # str: sent as UTF-8
            assert pub.get("R", "k") == "text é".encode()
            pub.invalidate("R", "k")
            assert pub.get("R", "k") is None
            pub.put("R", "k", bytearray(b"again"))
            pub.destroy("R", "k")
            assert pub.get("R", "k") is None
            assert pub.publish([("put", "R", "a", b"1"), ("put", "R", "b", "2"),
                                ("destroy", "R", "a"), ("invalidate", "R", "b")]) == 4
            assert pub.get("R", "b") is None
            assert pub.server == server.addr
        got = [sub.next(5) for _ in range(9)]
    assert [(e.key, e.op, e.value) for e in got] == [
        ("k", "create", b"\x00\x01binary"),
        ("k", "update", "text é".encode()),
        ("k", "invalidate", None),
        ("k", "update", b"again"),
        ("k", "destroy", None),
        ("a", "create", b"1"),
        ("b", "create", b"2"),
        ("a", "destroy", None),
        ("b", "invalidate", None),
    ]
    assert [e.offset for e in got] == list(range(1, 10))
    assert not any(e.replayed for e in got)
    assert "Event(region='R', key='k', op='create'" in repr(got[0])


def test_a_closed_publisher_refuses_work_and_close_durable_is_an_admin_call(server):
    pub = server.publisher()
    pub.close()
    pub.close()
    with pytest.raises(tether.ClosedError, match="closed"):
        pub.put("R", "k", b"v")
    with server.subscriber(durable_id="x1", interests={"R": tether.all_keys()}) as sub:
        sub.next(5)
        with server.publisher() as admin:
            # Refused while the durable client is connected.
            with pytest.raises(tether.ServerError) as err:
                admin.close_durable("x1")
            assert isinstance(err.value, tether.TetherError) and err.value.code
    with server.publisher() as admin:
        admin.close_durable("x1")
    with server.subscriber(durable_id="x1") as sub:
        assert sub.queue_status == "new"


def test_a_publisher_moves_to_the_next_server_when_its_own_stops(make_server):
    """A rolling restart, seen from a publisher: while it publishes from a thread, its server
    stops (SIGTERM); what that server did not apply it answers ``going-away``, and the
    publisher sends it to the next server. No publish fails, and every one answered is stored
    on one of the two servers."""
    import threading
    import time
    from pathlib import Path

    a, b = make_server().start(), make_server().start()
    # Two single nodes, each with its own dev CA: the publisher trusts both.
    pem = Path(a.ca).read_bytes() + Path(b.ca).read_bytes()
    pub = tether.Publisher([a.addr, b.addr], ca_pem=pem)
    assert pub.server == a.addr
    stop, errors, answered = threading.Event(), [], []

    def run() -> None:
        n = 0
        while not stop.is_set():
            try:
                pub.put("R", f"k{n}", b"v")
            except tether.TetherError as e:
                errors.append(e)
                return
            answered.append(f"k{n}")
            n += 1

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    a.stop()
    time.sleep(0.5)
    stop.set()
    t.join(30)
    assert errors == []
    assert pub.moves == 1
    assert pub.server == b.addr
    on_b = sum(1 for k in answered if pub.get("R", k) == b"v")
    pub.close()
    a.start()
    with tether.Publisher([a.addr], ca_file=a.ca) as on_a:
        missing = [k for k in answered if on_a.get("R", k) != b"v"]
    assert on_b > 0, "publishes went on through the second server"
    # Every publish answered is on b, or (published before the stop) on a.
    assert len(missing) == on_b, (len(missing), on_b)
